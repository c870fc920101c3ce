"""Shared-memory collectives for CPU ranks on one host (`fusedrl.workers.shm_collectives`).

Two spawned gloo ranks compare every shared-memory result with gloo's own collective on the same inputs:
all-gathers and reduce-scatters (sum and mean) in float32 and bfloat16, sizes that grow the segment,
back-to-back calls with the ranks out of step (the double buffer), the weight stream's dim-0 gather of
unevenly sharded DTensors, and one actor update with FSDP2 routed through shared memory or through gloo
(the same parameters, bit for bit). The fallbacks are checked too: switched off by the environment, and a
``/dev/shm`` that cannot hold the segment (one warning, gloo's results).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from support import free_port, gloo_rank, padded_batch


@contextlib.contextmanager
def _full_tmpfs(records: list[str]):
    """Inside the block ``/dev/shm`` is full (``posix_fallocate`` fails); the collectives' warnings, then
    and later, go to ``records``."""
    from fusedrl.workers import shm_collectives as sc

    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    sc.logger.addHandler(handler)
    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    os.posix_fallocate = full
    try:
        yield
    finally:
        os.posix_fallocate = real


def _spawn(body, tmp_path: Path, *args) -> list[dict]:
    mp.spawn(gloo_rank, args=(2, free_port(), body, (str(tmp_path), *args)), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


# ------------------------------------------------------------------------------------------ collectives
def _collectives(rank: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from fusedrl.workers import shm_collectives as sc
    from fusedrl.workers.fsdp import build_mesh, gather_full

    shm = sc.for_group(dist.group.WORLD)
    res: dict = {"active": shm is not None, "left_in_shm": [], "mismatch": []}
    res["shm_barrier"] = shm._flags is not None
    # Rank 0 reads late after every barrier: with one buffer instead of two, rank 1 would already be
    # writing its next call's data over what rank 0 is about to read.
    real_barrier = shm.barrier

    def late_barrier():
        real_barrier()
        if rank == 0:
            time.sleep(0.01)

    shm.barrier = late_barrier
    gen = torch.Generator().manual_seed(100 + rank)
    # Sizes grow (new segments) and shrink (reuse). The shared-memory calls run back to back, with nothing
    # else synchronising the ranks in between; gloo's results on the same inputs are computed afterwards.
    cases = []
    for numel, dtype in [
        (6, torch.float32),
        (1000, torch.bfloat16),
        (3 << 18, torch.float32),
        (10, torch.bfloat16),
    ] * 2:
        full = torch.randn(2 * numel, generator=gen).to(dtype)
        shard = torch.randn(numel, generator=gen).to(dtype)
        gathered = torch.empty(2 * numel, dtype=dtype)
        shm.all_gather(gathered, shard)
        reduced = {}
        for average in (False, True):
            reduced[average] = torch.empty(numel, dtype=dtype)
            shm.reduce_scatter(reduced[average], full, average=average)
        res["left_in_shm"] += [n for n in os.listdir("/dev/shm") if n.startswith("fusedrl-coll-")]
        cases.append((numel, dtype, full, shard, gathered, reduced))
    del shm.barrier  # the class's again
    for numel, dtype, full, shard, gathered, reduced in cases:
        theirs = torch.empty(2 * numel, dtype=dtype)
        dist.all_gather_single(theirs, shard)
        if not torch.equal(gathered, theirs):
            res["mismatch"].append(("all_gather", numel, str(dtype)))
        for average in (False, True):
            theirs = torch.empty(numel, dtype=dtype)
            op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
            dist.reduce_scatter_single(theirs, full.clone(), op=op)
            if not torch.equal(reduced[average], theirs):
                res["mismatch"].append(("reduce_scatter", average, numel, str(dtype)))
    res["generations"] = shm.generation
    # the weight stream's gather of FSDP2-style dim-0 shards, rows not divisible by the ranks
    mesh = build_mesh()
    for shape in [(5, 3), (1, 4), (7,), (4, 2, 2)]:
        whole = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)
        dt = distribute_tensor(whole, mesh, [Shard(0)])
        got, is_new = gather_full(dt, torch.bfloat16)
        if not (is_new and got.is_contiguous() and torch.equal(got, whole.to(torch.bfloat16))):
            res["mismatch"].append(("gather_full", shape))
        if tuple(got.shape) != shape:
            res["mismatch"].append(("gather_full shape", shape, tuple(got.shape)))
    _grouped_stream(mesh, res)
    torch.save(res, Path(out) / f"rank{rank}.pt")


def _grouped_stream(mesh, res: dict) -> None:
    """The weight stream gathers a decoder layer's tensors in one collective: the same full tensors as
    ``DTensor.full_tensor()`` one by one, rows not divisible by the ranks included, cast or not."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import fusedrl.workers.fsdp as fsdp

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 5)  # 5 rows over 2 ranks: 3 + 2
            self.norm = nn.Parameter(torch.randn(3))  # 3 rows: 2 + 1
            self.gate = nn.Parameter(torch.randn(1, 2))  # 1 row: one rank holds nothing

    torch.manual_seed(0)  # the same model on both ranks
    model = nn.Module()
    model.embed = nn.Embedding(7, 4)
    model.layers = nn.ModuleList([Layer(), Layer()])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls = []
    real = fsdp._gather_dim0

    def counted(shm, tensors):  # the gathers of several tensors at once (a single one is gather_full's)
        if len(tensors) > 1:
            calls.append(len(tensors))
        return real(shm, tensors)

    fsdp._gather_dim0 = counted
    try:
        for dtype in (None, torch.bfloat16):
            want = {n: t.full_tensor() for n, t in model.state_dict().items()}
            want = {n: t if dtype is None else t.to(dtype) for n, t in want.items()}
            got = {n: t.clone() for n, t in fsdp.stream_full_tensors(model, dtype=dtype)}
            if list(got) != list(want):
                res["mismatch"].append(("stream names", list(got)))
            for n, t in want.items():
                if n in got and not (got[n].dtype == t.dtype and torch.equal(got[n], t)):
                    res["mismatch"].append(("stream", n, str(dtype)))
    finally:
        fsdp._gather_dim0 = real
    res["grouped_gathers"] = calls  # one per layer per stream


@pytest.mark.timeout(300)
def test_shared_memory_collectives_equal_gloo(tmp_path):
    for r in _spawn(_collectives, tmp_path):
        assert r["active"], "two ranks on one host must get the shared-memory path"
        assert r["shm_barrier"], "and the shared-memory barrier (x86)"
        assert r["mismatch"] == []
        assert r["left_in_shm"] == []  # every segment's name is unlinked once all ranks mapped it
        assert r["generations"] >= 2  # the segment grew at least once
        assert r["grouped_gathers"] == [4, 4, 4, 4]  # each layer's 4 tensors in one gather, 2 streams


# ------------------------------------------------------------------------------------------- the barrier
def _out_of_step(rank: int, out: str) -> None:
    """Many small gathers and reduce-scatters back to back, each rank pausing at random (0-300 us) before
    its calls: every result must still be the right one (a barrier that let a rank through early, or a
    count read before the data, would show here as another call's or a half-written value)."""
    import torch.distributed as dist

    from fusedrl.workers import shm_collectives as sc

    shm = sc.for_group(dist.group.WORLD)
    rng = torch.Generator().manual_seed(rank)
    wrong = []
    for i in range(600):
        if torch.rand((), generator=rng) < 0.5:
            time.sleep(float(torch.rand((), generator=rng)) * 3e-4)
        numel = 1 + i % 7 if i % 50 else 50_000  # now and then a copy large enough for streaming stores
        gathered = torch.empty(2 * numel, dtype=torch.float64)
        shm.all_gather(gathered, torch.full((numel,), float(1000 * i + rank), dtype=torch.float64))
        want = torch.cat([torch.full((numel,), float(1000 * i + r), dtype=torch.float64) for r in range(2)])
        if not torch.equal(gathered, want):
            wrong.append(("all_gather", i))
        summed = torch.empty(numel, dtype=torch.float64)
        shm.reduce_scatter(
            summed, torch.full((2 * numel,), float(i + rank), dtype=torch.float64), average=False
        )
        if not torch.equal(summed, torch.full((numel,), float(2 * i + 1), dtype=torch.float64)):
            wrong.append(("reduce_scatter", i))
    torch.save(
        {"wrong": wrong, "arrivals": shm.arrivals, "shm_barrier": shm._flags is not None},
        Path(out) / f"rank{rank}.pt",
    )


@pytest.mark.timeout(300)
def test_the_shared_memory_barrier_keeps_ranks_in_step(tmp_path):
    for r in _spawn(_out_of_step, tmp_path):
        assert r["shm_barrier"] and r["wrong"] == []
        assert r["arrivals"] == 1200  # one barrier per collective


def _peer_exits(rank: int, out: str, stuck: bool) -> None:
    """Rank 1 exits (or, ``stuck``, sleeps past a 1 s timeout) instead of reaching the barrier; rank 0's
    barrier must raise, naming it, instead of waiting forever."""
    import torch.distributed as dist

    from fusedrl.workers import shm_collectives as sc

    shm = sc.for_group(dist.group.WORLD)
    shm.barrier()  # both arrive once
    if rank == 1:
        if stuck:
            time.sleep(4)
        os._exit(0)  # gone: no barrier, no clean-up
    sc.BARRIER_TIMEOUT_S = 1.0
    started = time.monotonic()
    try:
        shm.barrier()
        res = {"raised": None}
    except (sc.PeerGone, sc.BarrierTimeout) as exc:
        res = {"raised": type(exc).__name__, "message": str(exc)}
    res["seconds"] = time.monotonic() - started
    torch.save(res, Path(out) / f"rank{rank}.pt")
    os._exit(0)  # the group has lost a rank: leave without destroying it


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stuck", [False, True])
def test_the_shared_memory_barrier_names_a_rank_that_died_or_hangs(tmp_path, stuck):
    mp.spawn(gloo_rank, args=(2, free_port(), _peer_exits, (str(tmp_path), stuck)), nprocs=2, join=True)
    r = torch.load(tmp_path / "rank0.pt", weights_only=False)
    if stuck:
        assert r["raised"] == "BarrierTimeout" and "ranks [1] did not reach" in r["message"]
        assert 1.0 <= r["seconds"] < 3.5
    else:
        assert r["raised"] == "PeerGone" and "rank 1 (pid" in r["message"] and "exited" in r["message"]
        assert r["seconds"] < 3.0


def _no_flags(rank: int, out: str) -> None:
    """Where the barrier's segment cannot be made, one warning and gloo's barrier: the same results."""
    import torch.distributed as dist

    from fusedrl.workers import shm_collectives as sc

    records: list[str] = []
    sc._BY_GROUP.clear()
    with _full_tmpfs(records):
        shm = sc.for_group(dist.group.WORLD)
    gathered = torch.empty(4)
    shm.all_gather(gathered, torch.full((2,), float(rank + 1)))
    torch.save(
        {"flags": shm._flags, "gathered": gathered.tolist(), "calls": shm.calls, "warnings": records},
        Path(out) / f"rank{rank}.pt",
    )


@pytest.mark.timeout(300)
def test_the_barrier_falls_back_to_gloo(tmp_path):
    for r in _spawn(_no_flags, tmp_path):
        assert r["flags"] is None and r["calls"] == 1  # the collective itself still went through memory
        assert r["gathered"] == [1.0, 1.0, 2.0, 2.0]
        assert (
            len(r["warnings"]) == 1
            and "barrier off" in r["warnings"][0]
            and "No space left" in r["warnings"][0]
        )


# -------------------------------------------------------------------------------------------- fallbacks
def _fallbacks(rank: int, out: str) -> None:
    import torch.distributed as dist

    from fusedrl.workers import shm_collectives as sc

    res: dict = {}
    os.environ[sc.ENV] = "0"
    sc._BY_GROUP.clear()
    res["off_by_env"] = sc.for_group(dist.group.WORLD) is None
    os.environ[sc.ENV] = "1"
    sc._BY_GROUP.clear()
    shm = sc.for_group(dist.group.WORLD)
    records: list[str] = []
    with _full_tmpfs(records):
        shard = torch.full((3,), float(rank + 1))
        ours = torch.empty(6)
        shm.all_gather(ours, shard)  # falls back to gloo
        res["fallback_gather"] = ours.tolist()
        summed = torch.empty(2)
        shm.reduce_scatter(summed, torch.arange(4.0) * (rank + 1), average=False)
        res["fallback_scatter"] = summed.tolist()
    res["warnings"] = records
    torch.save(res, Path(out) / f"rank{rank}.pt")


@pytest.mark.timeout(300)
def test_fallbacks_to_gloo(tmp_path):
    ranks = _spawn(_fallbacks, tmp_path)
    for rank, r in enumerate(ranks):
        assert r["off_by_env"]
        assert r["fallback_gather"] == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
        # chunk `rank` of arange(4) * 1 + arange(4) * 2 = 3 * arange(4)
        assert r["fallback_scatter"] == [3.0 * (2 * rank), 3.0 * (2 * rank + 1)]
        assert len(r["warnings"]) == 1 and "No space left" in r["warnings"][0] and "gloo" in r["warnings"][0]


# ---------------------------------------------------------------------------------------- FSDP2 update
PROMPT_LENS = [8, 3, 5, 2, 7, 4, 6, 1]
RESPONSE_LENS = [6, 2, 4, 6, 3, 5, 1, 2]


def _update(rank: int, out: str, model_dir: str) -> None:
    from fusedrl.config import role_configs_from_overrides
    from fusedrl.workers import shm_collectives as sc
    from fusedrl.workers.actor import ActorRole

    gen = torch.Generator().manual_seed(5)
    full = padded_batch(PROMPT_LENS, RESPONSE_LENS, tp=8, tr=6, gen=gen)
    full.advantages = torch.randn(8, 1, generator=gen).expand(-1, 6) * full.response_mask
    shard = full[torch.arange(rank * 4, rank * 4 + 4)]
    res: dict = {}
    for use_shm in (False, True):
        os.environ[sc.ENV] = "1" if use_shm else "0"
        sc._BY_GROUP.clear()
        cfg = role_configs_from_overrides(
            [
                "data.train_files=unused",
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.rollout.dtype=float32",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.actor.optim.lr=1e-3",
            ]
        )
        actor = ActorRole(cfg.model, cfg.actor, rollout_n=2)
        lp = actor.compute_log_prob(shard, temperature=0.7, micro_batch_size=2)
        train = shard.clone()
        train.old_log_probs = lp
        metrics = actor.update(train, temperature=0.7)
        shm = next(iter(sc._BY_GROUP.values()), None)
        res[use_shm] = {
            "log_probs": lp,
            "grad_norm": metrics["actor/grad_norm"],
            "params": {n: p.full_tensor().clone() for n, p in actor.model.named_parameters()},
            "shm_calls": shm.calls if shm is not None else 0,
        }
        del actor
    torch.save(res, Path(out) / f"rank{rank}.pt")


@pytest.mark.timeout(300)
def test_fsdp_update_through_shared_memory_equals_gloo(tiny_model_dir, tmp_path):
    for r in _spawn(_update, tmp_path, tiny_model_dir):
        gloo, shm = r[False], r[True]
        assert gloo["shm_calls"] == 0 and shm["shm_calls"] > 0
        assert torch.equal(shm["log_probs"], gloo["log_probs"])
        assert shm["grad_norm"] == gloo["grad_norm"]
        for name, value in gloo["params"].items():
            assert torch.equal(shm["params"][name], value), name
