"""Expert parallelism (`fusedrl.workers.expert_parallel`): EP=2 gives EP=1's losses and gradients.

Two spawned processes join a real gloo group (pytest's own process never joins one). Both load the tiny
random Qwen3-MoE (2 layers, 8 experts, top-2) in float32 from the same folder; rank ``r`` takes its own batch
of 2 x 10 tokens. EP=1 is the plain model on both batches (the data-parallel mean of the two losses); EP=2
swaps every experts module for `ExpertParallelExperts` (rank 0 holds experts 0-3, rank 1 experts 4-7), each
rank computes its own batch's loss and backpropagates it, and the other parameters' gradients are averaged
over the group as FSDP2 would. Checked with the model's own routing and with routing forced (by
`fusedrl.workers.routing_replay`) so that every token of both ranks goes to rank 0's experts: rank 1 then
sends everything away and computes its experts on no rows.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from support import free_port

# Both sides run the same float32 ops on the same rows; only the order of a token's top-2 sum differs (summed
# per token here, accumulated expert by expert in transformers) and the matmul shapes (rows from two ranks
# per expert call), so CPU kernels may round differently: relative error ~1e-7 per op, compounded through 2
# layers and a 512-token softmax. Losses (~6): atol 5e-6, ten float32 steps at 6 (seen: 0 or one step,
# 4.8e-7). Gradients: 1e-5 of the largest entry of each parameter (seen: 4.3e-7). An expert sent to the wrong
# rank, a dropped or doubled gradient or a missing 1/ep average moves values by > 1e-2 of the largest entry
# (without the average the expert gradients are twice EP=1's).
LOSS_ATOL = 5e-6
GRAD_RTOL = 1e-5
TOKENS = (2, 10)


def _batch(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 + rank)
    return torch.randint(3, 400, TOKENS, generator=gen)  # [2, 10]


def _forced(model) -> torch.Tensor:
    """Expert ids [tokens, layers, 2] that send token ``t`` to experts ``t % 4`` and ``(t + 1) % 4``."""
    n = TOKENS[0] * TOKENS[1]
    t = torch.arange(n)
    ids = torch.stack([t % 4, (t + 1) % 4], dim=-1)  # [T, 2]
    return ids[:, None, :].expand(n, model.config.num_hidden_layers, 2).contiguous()


def _loss(model, ids: torch.Tensor, forced: bool) -> torch.Tensor:
    from fusedrl.workers.routing_replay import replay_routing

    if not forced:
        return model(input_ids=ids, labels=ids).loss
    with replay_routing(model, _forced(model)):
        return model(input_ids=ids, labels=ids).loss


def _full_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _run(rank: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from fusedrl.workers.expert_parallel import ExpertParallelExperts, shard_experts
    from fusedrl.workers.fsdp import stream_full_tensors

    results: dict = {}
    for forced in (False, True):
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        losses = [_loss(ref, _batch(r), forced) for r in range(2)]
        (sum(losses) / 2).backward()  # EP=1: the data-parallel mean over the two ranks' batches
        ep1 = {"losses": [float(x) for x in losses], "grads": _full_grads(ref)}
        original = {n: t.clone() for n, t in ref.state_dict().items()}

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        replaced = shard_experts(model)
        loss = _loss(model, _batch(rank), forced)
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            if isinstance(g, torch.distributed.tensor.DTensor):
                grads[name] = g.to_local().clone()  # this rank's experts, already the group's average
            else:
                g = g.clone()
                dist.all_reduce(g)
                grads[name] = g / 2  # FSDP2's average over the data-parallel group
        streamed = dict(stream_full_tensors(model))
        modules = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
        results["forced" if forced else "own"] = {
            "ep1": ep1,
            "loss": float(loss),
            "grads": grads,
            "replaced": replaced,
            "dispatch": [m.last_dispatch for m in modules],
            "stream_equal": sorted(streamed) == sorted(original)
            and all(torch.equal(streamed[n], original[n]) for n in original),
        }
    torch.save(results, Path(out) / f"rank{rank}.pt")


def _fsdp_step(
    model_dir: str, rank: int, expert_parallel: bool, param_dtype: torch.dtype | None = None
) -> dict:
    """One clipped SGD step of FSDP2 on this rank's batch: with the experts spread over FSDP2's own mesh
    (`shard_experts` before `apply_fsdp2`), or FSDP2 alone; ``param_dtype``: FSDP2's mixed precision. Returns
    the loss, the clipped norm, the full gradients and the full parameters after the step."""
    from transformers import AutoModelForCausalLM

    from fusedrl.workers.expert_parallel import ExpertParallelExperts, shard_experts
    from fusedrl.workers.fsdp import apply_fsdp2, build_mesh

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = build_mesh()
    if expert_parallel:
        shard_experts(model, mesh)
    apply_fsdp2(model, mesh, param_dtype=param_dtype)
    loss = _loss(model, _batch(rank), forced=False)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    dispatch = [m.last_dispatch for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    return {"loss": float(loss), "norm": float(norm), "grads": grads, "params": params, "dispatch": dispatch}


def _resume(model_dir: str, rank: int, *, ep: bool, load: str | None, save: str | None) -> dict:
    """FSDP2 (with expert parallelism when ``ep``) and SGD with momentum: either one step then saved to
    ``save`` (`save_fsdp_state`), or loaded from ``load``; then one more step. Returns the full parameters
    when saved or loaded, and after the last step."""
    from transformers import AutoModelForCausalLM

    from fusedrl.workers.checkpoint_io import load_fsdp_state, save_fsdp_state
    from fusedrl.workers.expert_parallel import shard_experts
    from fusedrl.workers.fsdp import apply_fsdp2, build_mesh

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = build_mesh()
    if ep:
        shard_experts(model, mesh)
    apply_fsdp2(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(ids: torch.Tensor) -> None:
        _loss(model, ids, forced=False).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if load is not None:
        load_fsdp_state(model, opt, load)
    else:
        step(_batch(rank))
    if save is not None:
        save_fsdp_state(model, opt, save)
    full = lambda: {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # noqa: E731
    state = full()
    step(_batch(rank + 2))
    return {"state": state, "next": full()}


def _run_checkpoints(rank: int, out: str, model_dir: str) -> dict:
    """Checkpoints cross layouts: plain FSDP2's loads into FSDP2 + EP and the reverse, and the next step
    continues as the saving run does."""
    results = {}
    for name, saver_ep in (("fsdp_to_ep", False), ("ep_to_fsdp", True)):
        prefix = str(Path(out) / f"{name}_rank{rank}")
        saved = _resume(model_dir, rank, ep=saver_ep, load=None, save=prefix)
        loaded = _resume(model_dir, rank, ep=not saver_ep, load=prefix, save=None)
        results[name] = {"saved": saved, "loaded": loaded}
    return results


def _offload_steps(model_dir: str, rank: int, offload: bool) -> dict:
    """FSDP2 + EP and AdamW: a step, then (``offload``) every parameter and moment moved into host buffers
    and back, as `fusedrl.workers.memory.Offloader` does on a GPU (its CPU packing), then a second step.
    Returns whether every local tensor (expert shards included) lay in the host buffers, and the parameters
    after the second step."""
    from transformers import AutoModelForCausalLM

    from fusedrl.workers.expert_parallel import shard_experts
    from fusedrl.workers.fsdp import apply_fsdp2, build_mesh
    from fusedrl.workers.memory import Offloader

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = build_mesh()
    shard_experts(model, mesh)
    apply_fsdp2(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(ids: torch.Tensor) -> None:
        _loss(model, ids, forced=False).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(_batch(rank))
    in_buffers = None
    if offload:
        mem = Offloader("actor", model, opt, param_offload=True, optimizer_offload=True, events=[])
        mem.use_host_buffers = True
        mem.offload_all()
        bases = {mem._param_host.storage.data_ptr(), mem._optim_host.storage.data_ptr()}
        local = [p.to_local() for p in model.parameters()]
        moments = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
        in_buffers = all(
            (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr() in bases
            for t in [*local, *moments]
        )
        mem.load_all()
    step(_batch(rank + 2))
    return {
        "in_buffers": in_buffers,
        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
    }


def _run_fsdp(rank: int, model_dir: str, out: str) -> None:
    results = {"ep2": _fsdp_step(model_dir, rank, True), "ep1": _fsdp_step(model_dir, rank, False)}
    results["offload"] = {o: _offload_steps(model_dir, rank, o) for o in (True, False)}
    for name, ep in (("bf16_ep2", True), ("bf16_ep1", False)):
        results[name] = _fsdp_step(model_dir, rank, ep, torch.bfloat16)
    results["checkpoints"] = _run_checkpoints(rank, out, model_dir)
    torch.save(results, Path(out) / f"fsdp_rank{rank}.pt")


def _entry(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _run(rank, model_dir, out)
        _run_fsdp(rank, model_dir, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from fusedrl.utils.tiny_moe import build_tiny_moe_model

    model_dir = build_tiny_moe_model(str(tmp_path_factory.mktemp("tiny_moe")), seed=0)
    out = tmp_path_factory.mktemp("expert_parallel")
    mp.spawn(_entry, args=(2, free_port(), model_dir, str(out)), nprocs=2, join=True)
    return [
        {**torch.load(out / f"rank{r}.pt", weights_only=False), **torch.load(out / f"fsdp_rank{r}.pt")}
        for r in range(2)
    ]


@pytest.mark.parametrize("routing", ["own", "forced"])
def test_ep2_losses_equal_ep1(ranks, routing):
    for rank, result in enumerate(ranks):
        r = result[routing]
        assert r["replaced"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert abs(r["loss"] - r["ep1"]["losses"][rank]) <= LOSS_ATOL, (rank, r["loss"], r["ep1"]["losses"])


@pytest.mark.parametrize("routing", ["own", "forced"])
def test_ep2_gradients_equal_ep1_expert_router_and_attention(ranks, routing):
    for rank, result in enumerate(ranks):
        r = result[routing]
        ref = r["ep1"]["grads"]
        assert r["grads"].keys() == ref.keys()
        for name, want in ref.items():
            got = r["grads"][name]
            if "experts" in name:
                assert got.shape[0] == want.shape[0] // 2, name  # this rank holds half the experts
                want = want[rank * 4 : (rank + 1) * 4]
            scale = float(want.abs().max())
            if routing == "forced" and "experts" in name and rank == 1:
                assert scale == 0.0 and torch.all(got == 0), name  # no token reached experts 4-7
                continue
            assert scale > 0, name  # a real gradient
            err = float((got - want).abs().max())
            assert err <= GRAD_RTOL * scale, (rank, name, err, scale)


def test_tokens_cross_ranks(ranks):
    """The comparison exercises the exchange: with the model's routing each rank sends rows to the other;
    forced onto experts 0-3, rank 1 sends all of its rows to rank 0 and none to itself."""
    rows = TOKENS[0] * TOKENS[1] * 2  # tokens x top-2
    for rank in range(2):
        for sent in ranks[rank]["own"]["dispatch"]:
            assert sum(sent) == rows and sent[1 - rank] > 0
        for sent in ranks[rank]["forced"]["dispatch"]:
            assert sent == [rows, 0]


def test_the_weight_stream_sees_the_full_experts(ranks):
    """`stream_full_tensors` gathers the sharded experts back to the checkpoint's full tensors."""
    for result in ranks:
        assert result["own"]["stream_equal"] and result["forced"]["stream_equal"]


EP_KEY = "actor_rollout_ref.{}.fsdp_config.turbo_config.distributed.expert_parallel_size"


def test_verl_expert_parallel_keys_of_actor_and_ref_load_others_only_at_1():
    """verl's FSDP-turbo expert-parallel sizes of the actor and the reference are fusedrl's keys (any size
    loads; `validate` checks it); the critic's and the rollout's load at 1 only, other sizes are problems
    naming the key and the fix, reported with the others before Ray starts."""
    from fusedrl.config import ConfigError, load_config

    own = [EP_KEY.format("actor"), EP_KEY.format("ref")]
    cfg = load_config([f"{k}=2" for k in own], validate_config=False)
    assert cfg.actor_rollout_ref.actor.fsdp_config.turbo_config.distributed.expert_parallel_size == 2
    assert cfg.actor_rollout_ref.ref.fsdp_config.turbo_config.distributed.expert_parallel_size == 2
    others = [
        "critic.fsdp.turbo_config.distributed.expert_parallel_size",
        "actor_rollout_ref.rollout.expert_parallel_size",
    ]
    load_config([f"{k}=1" for k in others], validate_config=False)
    with pytest.raises(ConfigError) as err:
        load_config([f"{k}=8" for k in others], validate_config=False)
    problems = err.value.problems
    assert [p.split("`")[1] for p in problems] == others
    assert all("Drop the key or set 1" in p for p in problems)


def _model(tmp_path: Path, **config) -> str:
    folder = tmp_path / ("moe" if config else "dense")
    folder.mkdir()
    (folder / "config.json").write_text(__import__("json").dumps({"model_type": "qwen3_moe", **config}))
    return str(folder)


def _problems(tmp_path: Path, model: str, *overrides: str) -> list[str]:
    from fusedrl.config import ConfigError, load_config

    data = tmp_path / "train.parquet"
    data.touch()
    try:
        load_config([f"data.train_files={data}", f"actor_rollout_ref.model.path={model}", *overrides])
    except ConfigError as e:
        return [p for p in e.problems if "turbo_config.distributed.expert_parallel_size`=" in p]
    return []


OFFLOAD_KEYS = ("param_offload", "optimizer_offload")


def test_expert_parallel_size_is_checked_before_ray_starts(tmp_path):
    """EP=2 over the 2 workers of an 8-expert model is accepted, for the actor and the reference; a size that
    does not divide the experts or the workers, a group smaller than the workers, a dense model and the
    features it has not run with are each a problem naming the key and the fix."""
    moe, dense = _model(tmp_path, num_experts=8), _model(tmp_path)
    actor, ref = EP_KEY.format("actor"), EP_KEY.format("ref")
    assert _problems(tmp_path, moe, f"{actor}=2", f"{ref}=2", "trainer.n_gpus_per_node=2") == []

    def one(model: str, *overrides: str) -> str:
        found = _problems(tmp_path, model, "trainer.n_gpus_per_node=2", *overrides)
        assert len(found) == 1, found
        return found[0]

    assert "no experts (a dense model)" in one(dense, f"{actor}=2")
    three = _problems(tmp_path, moe, f"{ref}=3", "trainer.n_gpus_per_node=2")
    assert any("does not divide the model's 8 experts" in p for p in three)
    assert any("does not divide the actor's data-parallel size (2 workers)" in p for p in three)
    assert all(p.startswith(f"`{ref}`=3") for p in three)
    assert "smaller than the actor's 4 workers" in one(moe, f"{actor}=2", "trainer.n_gpus_per_node=4")
    for override, named in (
        ("actor_rollout_ref.model.lora_rank=8", "lora_rank"),
        ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "ulysses_sequence_parallel_size"),
        ("actor_rollout_ref.model.compile_layers=true", "compile_layers"),
        ("actor_rollout_ref.rollout.name=hf", "rollout.name"),
    ):
        problem = one(moe, f"{actor}=2", override)
        assert problem.startswith(f"`{actor}`=2") and named in problem, (override, problem)
    # verl's offload keys run with expert parallelism (tests/integration/test_moe_expert_parallel.py).
    offload = [f"actor_rollout_ref.{r}.fsdp_config.{k}=true" for r in ("actor", "ref") for k in OFFLOAD_KEYS]
    assert _problems(tmp_path, moe, f"{actor}=2", f"{ref}=2", "trainer.n_gpus_per_node=2", *offload) == []


def test_inside_fsdp2_a_clipped_step_equals_fsdp2_alone(ranks):
    """Experts spread over FSDP2's own mesh and left alone by `apply_fsdp2`: the loss, the clipped gradient norm
    (one norm over the experts' and FSDP2's DTensors), every full gradient and every parameter after an SGD
    step equal plain FSDP2's (which gathers the experts like any weight)."""
    for rank, result in enumerate(ranks):
        ep2, ep1 = result["ep2"], result["ep1"]
        assert len(ep2["dispatch"]) == 2 and all(sent[1 - rank] > 0 for sent in ep2["dispatch"])
        assert ep1["dispatch"] == []
        assert abs(ep2["loss"] - ep1["loss"]) <= LOSS_ATOL
        assert ep1["norm"] > 0.5  # the clip bites
        assert abs(ep2["norm"] - ep1["norm"]) <= GRAD_RTOL * ep1["norm"]
        for key in ("grads", "params"):
            assert ep2[key].keys() == ep1[key].keys()
            for name, want in ep1[key].items():
                scale = float(want.abs().max())
                assert scale > 0, (key, name)
                assert float((ep2[key][name] - want).abs().max()) <= GRAD_RTOL * scale, (rank, key, name)


def test_under_bf16_mixed_precision_fsdp2_with_ep_matches_fsdp2_alone(ranks):
    """FSDP2 casts the parameters it holds to bf16 for the forward; the expert-parallel experts, which it
    ignores, are cast by their own forward: the same bf16 computation. Both sides round in bf16 (8 bits of
    mantissa), in a different order only where the top-2 outputs are summed: loss and clipped norm within
    1e-2 relative, each gradient's direction within cosine 0.9999 (seen: equal loss and norm, cosine >= 0.999996)."""
    for result in ranks:
        ep2, ep1 = result["bf16_ep2"], result["bf16_ep1"]
        assert abs(ep2["loss"] - ep1["loss"]) <= 1e-2 * abs(ep1["loss"])
        assert abs(ep2["norm"] - ep1["norm"]) <= 1e-2 * ep1["norm"]
        for name, want in ep1["grads"].items():
            got = ep2["grads"][name]
            cos = torch.nn.functional.cosine_similarity(got.flatten().float(), want.flatten().float(), dim=0)
            assert float(cos) >= 0.9999, (name, float(cos))


def test_offload_moves_the_expert_shards_and_training_continues_exactly(ranks):
    """verl's param / optimizer offload with EP: every local tensor, the expert shards and their AdamW moments
    included, lies in the host buffers while offloaded (the GPU path's packing, run on CPU), and the step after
    reloading gives bit for bit the parameters of a run that never offloaded."""
    for rank, result in enumerate(ranks):
        on, off = result["offload"][True], result["offload"][False]
        assert on["in_buffers"] is True, rank
        assert any("mlp.experts" in n for n in on["params"])
        for name, want in off["params"].items():
            assert torch.equal(on["params"][name], want), (rank, name)


@pytest.mark.parametrize("direction", ["fsdp_to_ep", "ep_to_fsdp"])
def test_checkpoints_load_across_plain_fsdp2_and_expert_parallel(ranks, direction):
    """The experts lie as FSDP2 shards them, so a checkpoint of either layout (`save_fsdp_state`: local shards,
    momentum included) loads into the other bit for bit, and the next step equals the saving run's."""
    for rank, result in enumerate(ranks):
        saved, loaded = result["checkpoints"][direction]["saved"], result["checkpoints"][direction]["loaded"]
        for name, want in saved["state"].items():
            assert torch.equal(loaded["state"][name], want), (rank, name)
        for name, want in saved["next"].items():
            moved = float((want - saved["state"][name]).abs().max())
            assert moved > 0, name  # the step changed it
            # the step's gradients agree within GRAD_RTOL; the sum with the weights rounds to a float32 step
            tol = GRAD_RTOL * moved + 4 * torch.finfo(torch.float32).eps * float(want.abs().max())
            assert float((loaded["next"][name] - want).abs().max()) <= tol, (rank, name)
