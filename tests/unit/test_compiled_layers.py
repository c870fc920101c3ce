"""``model.compile_layers``: torch.compile of each FSDP2-wrapped decoder layer for the training passes.

The compiled actor, reference and critic must compute what the eager ones compute: the same log-probs (up to
Inductor's reordering of float sums) and the same update (one large Adam step from the same weights lands
on the same parameters, within float noise). They must really be compiled (dynamo counts graphs), and
batches of different lengths must reuse one dynamic graph after the first shape instead of compiling one
graph per length; token-budget micro-batches (dynamic batch size) run compiled too.
Real gloo process group, real Inductor (the C++ compiler the machine has).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from support import free_port, local_params, padded_batch, single_rank_group

TP, TR = 24, 20
LR = 1e-2


def _configs(model_dir: str, compiled: bool, checkpointing: bool, packed: bool = False):
    from fusedrl.config import role_configs_from_overrides

    actor = "actor_rollout_ref.actor"
    cfg = role_configs_from_overrides(
        [
            "data.train_files=unused",
            f"actor_rollout_ref.model.path={model_dir}",
            f"actor_rollout_ref.model.compile_layers={compiled}",
            f"actor_rollout_ref.model.enable_gradient_checkpointing={checkpointing}",
            f"actor_rollout_ref.model.use_remove_padding={packed}",
            "actor_rollout_ref.rollout.n=2",
            f"{actor}.ppo_mini_batch_size=4",  # the whole 8-row batch in one optimizer step
            f"{actor}.ppo_micro_batch_size_per_gpu=4",
            f"{actor}.ppo_epochs=1",
            f"{actor}.use_kl_loss=true",
            f"{actor}.kl_loss_coef=0.1",
            f"{actor}.entropy_coeff=0.01",
            f"{actor}.optim.lr={LR}",
            f"{actor}.optim.weight_decay=0.0",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            # float32 training, as the compiled-vs-eager tolerances assume (auto: bf16 on native-bf16 CPUs)
            f"{actor}.fsdp_config.param_dtype=null",
            "actor_rollout_ref.ref.fsdp_config.param_dtype=null",
            "critic.model.fsdp_config.param_dtype=null",
        ],
    )
    return cfg.model, cfg.actor, cfg.ref, cfg.critic


def _batch(seed: int, response_lens: list[int]):
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = [int(x) for x in torch.randint(3, TP + 1, (8,), generator=gen)]
    prompt_lens[0] = prompt_lens[4] = TP  # each 4-row micro-batch keeps all TP prompt columns
    batch = padded_batch(prompt_lens, response_lens, tp=TP, tr=TR, gen=gen)
    batch.advantages = torch.randn(8, TR, generator=gen) * batch.response_mask  # [B, Tr]
    return batch


def _packed_widths(batches: list) -> set[int]:
    """The packed lengths of the 4-row micro-batches of ``batches``."""
    from fusedrl.workers.packing import pack_batch

    return {pack_batch(b[start : start + 4]).input_ids.shape[1] for b in batches for start in (0, 4)}


def _worker(rank: int, port: int, model_dir: str, out_dir: str, packed: bool) -> None:
    from torch._dynamo.utils import counters

    with single_rank_group(port):
        from fusedrl.workers.actor import ActorRole, RefRole
        from fusedrl.workers.layer_compile import RowMajorGradLinear, has_compiled_layers

        result: dict = {}
        cases = (
            (1, [20, 9, 4, 3, 17, 11, 2, 6]),
            (2, [18, 3, 8, 12, 5, 19, 7, 14]),
            (3, [17, 1, 2, 3, 20, 9, 9, 9]),
        )
        result["packed_widths"] = len(_packed_widths([_batch(seed, lens) for seed, lens in cases]))
        for checkpointing in (False, True):
            roles = {}
            for compiled in (False, True):
                model_cfg, actor_cfg, ref_cfg, _ = _configs(model_dir, compiled, checkpointing, packed)
                torch.manual_seed(0)
                roles[compiled] = (ActorRole(model_cfg, actor_cfg, rollout_n=2), RefRole(model_cfg, ref_cfg))
            before = local_params(roles[False][0].model)
            out: dict = {"marked": [has_compiled_layers(roles[c][0].model) for c in (False, True)]}
            out["row_major_linears"] = [
                sum(isinstance(m, RowMajorGradLinear) for m in roles[c][0].model.modules())
                for c in (False, True)
            ]
            graphs_before = counters["stats"]["unique_graphs"]
            lp_diffs, ref_diffs = [], []
            # Three batches whose micro-batches need 17-20 response columns: four different widths (packed:
            # see `_packed_widths`), and for each role one static graph and one dynamic graph.
            for seed, lens in cases:
                batch = _batch(seed, lens)
                lps = {}
                for compiled, (actor, ref) in roles.items():
                    lp = actor.compute_log_prob(batch, temperature=0.8, micro_batch_size=4)  # [B, Tr]
                    rp = ref.compute_log_prob(batch, temperature=0.8)  # [B, Tr]
                    lps[compiled] = (lp, rp)
                mask = batch.response_mask.bool()
                lp_diffs.append(float((lps[True][0] - lps[False][0])[mask].abs().max()))
                ref_diffs.append(float((lps[True][1] - lps[False][1])[mask].abs().max()))
            out["graphs"] = counters["stats"]["unique_graphs"] - graphs_before
            out["log_prob_diff"], out["ref_diff"] = max(lp_diffs), max(ref_diffs)
            # token-budget micro-batches (dynamic batch size): 1-3 rows each, through the same graphs
            batch = _batch(7, [20, 9, 4, 3, 17, 11, 2, 6])
            budget = {
                c: roles[c][0].compute_log_prob(batch, temperature=0.8, micro_batch_size=4, max_token_len=90)
                for c in (False, True)
            }
            mask = batch.response_mask.bool()
            out["budget_diff"] = float((budget[True] - budget[False])[mask].abs().max())
            out["graphs_after_budget"] = counters["stats"]["unique_graphs"] - graphs_before

            batch = _batch(4, [20, 9, 4, 17, 2, 11, 20, 6])
            batch.old_log_probs = roles[False][0].compute_log_prob(batch, temperature=0.8, micro_batch_size=4)
            batch.ref_log_probs = roles[False][1].compute_log_prob(batch, temperature=0.8)
            metrics = {c: roles[c][0].update(batch.clone(), temperature=0.8) for c in (False, True)}
            p_eager, p_comp = local_params(roles[False][0].model), local_params(roles[True][0].model)
            # Adam's first step moves each parameter by ~lr x sign(grad): an element whose gradient is float
            # noise may move either way in either route, so the update is compared as a whole.
            step = torch.cat([(p_eager[n] - before[n]).flatten() for n in p_eager])
            gap = torch.cat([(p_comp[n] - p_eager[n]).flatten() for n in p_eager])
            out["update_rel_diff"] = float(gap.norm() / step.norm())
            out["max_param_change"] = float(step.abs().max())
            out["grad_norm"] = [metrics[c]["actor/grad_norm"] for c in (False, True)]
            out["pg_loss"] = [metrics[c]["actor/pg_loss"] for c in (False, True)]
            result[str(checkpointing)] = out
        # The HF rollout generates with the actor's module: its decoding steps (a new KV-cache length each)
        # run eager instead of compiling a graph per step; only its scoring pass may compile.
        from fusedrl.workers.rollout.base import SamplingConfig
        from fusedrl.workers.rollout.hf_rollout import HFRollout

        actor = roles[True][0]
        rollout = HFRollout(actor.model, max_response_length=TR, eos_token_id=1, pad_token_id=0)
        graphs_before = counters["stats"]["unique_graphs"]
        prompts = _batch(6, [1] * 8)
        out = rollout.generate(prompts, SamplingConfig(max_tokens=12, temperature=1.0))
        result["hf_rollout"] = {
            "graphs": counters["stats"]["unique_graphs"] - graphs_before,
            "max_len": int(out.response_mask.sum(1).max()),
        }

        # The critic follows actor_rollout_ref.model.compile_layers: its values (full padded width, no trim)
        from fusedrl.workers.critic import CriticRole

        values = {}
        for compiled in (False, True):
            critic_cfg = _configs(model_dir, compiled, False, packed)[3]
            torch.manual_seed(0)  # the value head starts from the same random draw
            critic = CriticRole(critic_cfg, rollout_n=2)
            batch = _batch(5, [20, 9, 4, 17, 2, 11, 20, 6])
            values[compiled] = (critic.compute_values(batch), has_compiled_layers(critic.model))
        mask = batch.response_mask.bool()
        result["critic"] = {
            "marked": [values[c][1] for c in (False, True)],
            "value_diff": float((values[True][0] - values[False][0])[mask].abs().max()),
            "value_scale": float(values[False][0][mask].abs().max()),
        }
        Path(out_dir, "result.json").write_text(json.dumps(result))


@pytest.mark.parametrize(
    "packed",
    [
        pytest.param(False, marks=pytest.mark.slow),
        True,
    ],  # padded: slow (CI budget, ~80 s); packed is auto's path
    ids=["padded", "packed"],
)
def test_compiled_layers_match_eager(tiny_model_dir, tmp_path, packed):
    mp.spawn(_worker, args=(free_port(), tiny_model_dir, str(tmp_path), packed), nprocs=1, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    # Four widths or more (padded: four trimmed windows; packed: see `_packed_widths`): static shapes would
    # compile a graph for each, per role. Automatic dynamic shapes compile the first shape and then one
    # dynamic graph per role (the actor's and the reference's layers may be guarded apart).
    assert result.pop("packed_widths") >= 4
    hf = result.pop("hf_rollout")
    # Its scoring pass (eval mode, a new width) may compile 1-2 graphs; compiling each decoding step made
    # 26 here (measured without the eager stance).
    assert hf["max_len"] > 3 and hf["graphs"] <= 2, hf
    critic = result.pop("critic")
    assert critic["marked"] == [False, True], critic
    assert critic["value_diff"] < 1e-4 * max(1.0, critic["value_scale"]), critic
    for checkpointing, r in result.items():
        assert r["marked"] == [False, True], (checkpointing, r)
        # compiled on CPU, every decoder layer's linears take the row-major weight gradient (a no-op in
        # float32, which this test runs: the eager/compiled agreement below covers the swap too)
        eager_swapped, compiled_swapped = r["row_major_linears"]
        assert eager_swapped == 0 and compiled_swapped >= 4 * 2, (checkpointing, r)
        assert 1 <= r["graphs"] <= 4, (checkpointing, r)
        # token-budget micro-batches: new row counts and widths; at most two more graphs (the row count
        # becomes symbolic; PyTorch specialises a size of 1), the eager numbers
        assert r["graphs_after_budget"] - r["graphs"] <= 2, (checkpointing, r)
        assert r["budget_diff"] < 1e-4, (checkpointing, r)
        assert r["log_prob_diff"] < 1e-4, (checkpointing, r)
        assert r["ref_diff"] < 1e-4, (checkpointing, r)
        assert r["max_param_change"] > 0.5 * LR, (checkpointing, r)  # a real Adam step
        assert r["update_rel_diff"] < 1e-3, (checkpointing, r)
        g_eager, g_comp = r["grad_norm"]
        assert abs(g_eager - g_comp) <= 1e-4 * abs(g_eager), (checkpointing, r)
        l_eager, l_comp = r["pg_loss"]
        assert abs(l_eager - l_comp) <= 1e-5 + 1e-4 * abs(l_eager), (checkpointing, r)


def test_compile_layers_refuses_lora_and_takes_token_budgets(tiny_model_dir, arithmetic_data):
    from fusedrl.config import ConfigError, load_config

    train, _ = arithmetic_data
    with pytest.raises(ConfigError) as err:
        load_config(
            [
                f"data.train_files={train}",
                f"actor_rollout_ref.model.path={tiny_model_dir}",
                "actor_rollout_ref.model.compile_layers=true",
                "actor_rollout_ref.model.use_remove_padding=true",
                "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "actor_rollout_ref.model.lora_rank=4",
            ]
        )
    text = str(err.value)
    assert "`actor_rollout_ref.model.compile_layers`=true with `actor_rollout_ref.model.lora_rank`" in text, (
        text
    )
    assert "use_dynamic_bsz" not in text and "use_remove_padding" not in text, text
    # without LoRA the same settings load
    cfg = load_config(
        [
            f"data.train_files={train}",
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "actor_rollout_ref.model.compile_layers=true",
            "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
        ]
    )
    assert cfg.actor_rollout_ref.model.compile_layers and cfg.actor_rollout_ref.actor.use_dynamic_bsz


def test_no_compiler_leaves_layers_eager(monkeypatch, caplog):
    from torch import nn

    from fusedrl.workers.layer_compile import compile_layers, has_compiled_layers

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(2, 2)])

    model = nn.Module()
    model.model = Inner()
    forward = model.model.layers[0].forward
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    with caplog.at_level("WARNING"):
        assert compile_layers(model) is False
    assert "'no-such-c++-compiler' is not on PATH" in caplog.text
    assert not has_compiled_layers(model)
    assert model.model.layers[0].forward == forward  # untouched


_PGO_RUN = """
import sys, torch
from fusedrl.workers.layer_compile import remember_dynamic_shapes
job = remember_dynamic_shapes(sys.argv[1], packed=True, sp=1)
f = torch.compile(lambda x: (x * 2).sum(), backend="eager")
for n in map(int, sys.argv[2].split(",")):
    f(torch.ones(n))
from torch._dynamo.utils import counters
print(job, counters["stats"]["unique_graphs"])
"""


def test_a_second_run_of_the_same_work_compiles_dynamic_at_once(tmp_path):
    """`remember_dynamic_shapes` names the compile job after the model and layout, so dynamo's record of the
    sizes that changed outlives the process: a second run compiles one dynamic graph where the first compiled
    a static one, then a dynamic one; a model of other sizes does not inherit the record."""
    import os
    import subprocess
    import sys

    def model(name: str, hidden: int) -> str:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"hidden_size": hidden}))
        return str(d)

    a, b = model("a", 64), model("b", 128)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TORCH_COMPILE_JOB_ID", None)

    def run(path: str, sizes: str) -> tuple[str, int]:
        out = subprocess.run(
            [sys.executable, "-c", _PGO_RUN, path, sizes], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        return out[-2], int(out[-1])

    job_a, first = run(a, "3,5")
    assert first == 2  # static at the first call, dynamic at the second size
    assert run(a, "7,9") == (job_a, 1)  # the record of run 1: dynamic from the first call
    job_b, other = run(b, "7,9")
    assert job_b != job_a and other == 2


def test_remember_dynamic_shapes_keeps_a_job_name_the_user_set(tmp_path):
    from fusedrl.workers.layer_compile import remember_dynamic_shapes

    config = torch.compiler.config
    with config.patch(job_id="mine"):  # (a config module: monkeypatch would delete the entry on undo)
        assert remember_dynamic_shapes(str(tmp_path), packed=False) == "mine"
    with config.patch(job_id=None):
        named = remember_dynamic_shapes(str(tmp_path), packed=False)
        assert named.startswith("fusedrl-") and config.job_id == named
    with config.patch(job_id=None):
        assert remember_dynamic_shapes(str(tmp_path), packed=True) != named
    assert config.job_id is None


_CACHED_RUN = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from torch._dynamo.utils import counters
from fusedrl.workers.fsdp import resolve_attn_implementation
from fusedrl.workers.layer_compile import compile_layers, remember_dynamic_shapes
remember_dynamic_shapes(sys.argv[1], packed=False)
torch.set_num_threads(1)
attn = resolve_attn_implementation("auto")  # the roles' CPU attention (its scores are a custom op)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, attn_implementation=attn)
assert compile_layers(model)
ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
model(input_ids=ids).logits.float().sum().backward()  # the grad graph (bf16: row-major weight grads)
with torch.no_grad():
    model(input_ids=ids)  # the no-grad graph
print(json.dumps({k: dict(counters[k]) for k in ("aot_autograd", "inductor", "stats")}))
"""


@pytest.mark.slow  # ~40-90 s: two processes compile a bf16 decoder layer, the first one cold
def test_a_second_process_loads_the_compiled_layers_from_the_cache(tiny_model_dir, tmp_path):
    """A second process compiling the same layers loads both graphs (grad and no-grad) from AOTAutograd's
    and Inductor's caches: no graph bypasses AOTAutograd's cache (an ``autograd.Function`` in the layer, the
    row-major linear's or the CPU attention's scores, did, and its grad graph was traced and lowered again
    in every run) and Inductor generates no code."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TORCH_COMPILE_JOB_ID", None)

    def run() -> dict:
        out = subprocess.run(
            [sys.executable, "-c", _CACHED_RUN, tiny_model_dir], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["aot_autograd"].get("autograd_cache_bypass", 0) == 0, first
    assert first["aot_autograd"].get("autograd_cache_saved", 0) >= 2, first  # grad and no-grad graphs
    graphs = second["aot_autograd"]["total"]
    assert graphs >= 2 and second["aot_autograd"].get("autograd_cache_hit", 0) == graphs, second
    assert "autograd_cache_miss" not in second["aot_autograd"], second
    assert "autograd_cache_bypass" not in second["aot_autograd"], second
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= graphs, second
    assert "fxgraph_cache_miss" not in second["inductor"], second
