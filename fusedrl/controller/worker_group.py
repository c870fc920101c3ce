"""Single-controller plumbing: a resource pool of device slots and the group of fused workers on it.

Remote calls are written at the call site as ``lambda w: w.some_method.remote(...)``, so every call into
a worker can be found with grep; this module only decides *which* workers get *which* shard:

    group.run_all(lambda w: w.update_weights.remote())                       # every rank, same args
    group.run_rank0(lambda w: w.master_address.remote())                     # rank 0 only
    group.run_split(lambda w, shard: w.rollout_generate.remote(shard, s), batch)  # DP split, gather

Every call waits for its answers, except the memory moves between phases (`WorkerGroup.send_all`: load,
offload, wake, sleep; no answer) of a run whose roles all share one group: those are kept on the driver and
travel with the rank's next call (`fusedrl.workers.carried_moves`: the worker runs them, in the order sent,
before the call; a worker class that cannot carry them gets them as calls of their own, answered by the next
wait). One caller's calls to an actor run in the order they were sent (a Ray actor with one thread for its
default concurrency group; the health methods run on a thread of their own), so a worker still moves its
memory before the call after the move, and a round trip per move is saved (a GRPO step waited on 20 calls, 11
of them moves). With several groups every call waits: a move on one group must not overlap another group's
phase on the same devices.

Several groups may share one pool (one worker of each per slot, e.g. the reference apart from the fused
actor/rollout worker); each group is its own torch.distributed world.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fusedrl.batch import RolloutBatch, gather_from_ranks, split_for_ranks
from fusedrl.controller.health import kill_pids, memory_diagnosis, resume_hint, wait_pids_gone
from fusedrl.controller.preemption import Preempted, PreemptionGuard
from fusedrl.ragged import RaggedRows
from fusedrl.resident import ResidentShard
from fusedrl.rollout_request import RequestShard, RolloutRequest, expand_answer
from fusedrl.workers.carried_moves import Move, MoveCarrier

HEALTH_GROUP = "health"  # the workers' concurrency group for health_report / dump_stacks (workers/health.py)
POLL_S = 1.0  # how often a remote wait wakes up to check the watchdog and the preemption deadline
REPORT_EVERY_S = 2.0  # how often busy workers are asked for their memory figures
STACK_TIMEOUT_S = 15.0  # how long a hung worker gets to hand over its stacks


class WorkerDiedError(RuntimeError):
    """A fused worker's process died or raised; the group has been stopped."""


class WorkerTimeoutError(WorkerDiedError):
    """A fused worker did not answer a call within ``trainer.step_timeout_s``; the group has been stopped."""


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors a call's argument or answer holds (a batch's fields, tuples, lists, dicts of them)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, RolloutBatch):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, ResidentShard):  # only what is sent crosses; the rows' keys are plain ints
        obj = obj.sent
    if isinstance(obj, RaggedRows):  # a field and its mask as one tensor (lengths + tokens)
        return [obj.packed]
    if isinstance(obj, RequestShard):  # the seeds are plain ints; the prompts one ragged tensor
        obj = [obj.prompts, obj.fields]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_in(item)]
    return []


def _split(batch: RolloutBatch | RolloutRequest, n_shards: int) -> list[Any]:
    """`split_for_ranks`' shards of a batch, or a generation request's (`RolloutRequest.shards_for`)."""
    return (
        batch.shards_for(n_shards)
        if isinstance(batch, RolloutRequest)
        else split_for_ranks(batch, n_shards)[0]
    )


@dataclass
class TensorTraffic:
    """Tensors that crossed Ray between the driver and a group's workers, either way. ``crossings``: one per
    tensor field per call (a batch's ``responses`` sent to every rank of one call is one crossing, answers
    likewise); ``by_call``: the same by worker method, ``"<method> out"`` / ``"<method> back"``; ``bytes``:
    what every rank's shards and answers held; ``storage_bytes``: what pickling them writes (a tensor that is a
    slice of a larger one pickles that one's whole storage: more than ``bytes`` means a call sent or answered
    rows it did not need). Tests and benchmarks read it."""

    crossings: int = 0
    bytes: int = 0
    storage_bytes: int = 0
    by_call: dict[str, int] = field(default_factory=dict)

    def add(self, per_rank: Sequence[Any], call: str) -> None:
        """Count one call's arguments (or answers), ``per_rank[r]`` being rank ``r``'s (the most any rank got:
        a rank whose answer could not be packed, `fusedrl.ragged`, sends one tensor more)."""
        count = max((len(tensors_in(p)) for p in per_rank), default=0)
        if count:
            self.crossings += count
            self.by_call[call] = self.by_call.get(call, 0) + count
            tensors = [t for p in per_rank for t in tensors_in(p)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            self.storage_bytes += sum(t.untyped_storage().nbytes() for t in tensors)


class CallRecorder:
    """Stands in for a worker handle in a call-site lambda and remembers which method it called. ``carried``:
    that rank's memory moves still to send (`WorkerGroup.send_all`); the call takes them along
    (`fusedrl.workers.carried_moves`) and the list is emptied."""

    def __init__(self, handle: Any, carried: list[Move] | None = None) -> None:
        self._handle = handle
        self._carried = carried
        self.method = "?"

    def __getattr__(self, name: str) -> Any:
        self.method = name
        if not self._carried:
            return getattr(self._handle, name)
        moves = list(self._carried)
        self._carried.clear()
        return _Carrying(self._handle, moves, name)


@dataclass
class _Carrying:
    """``handle.<method>`` with moves to run first: ``.remote`` sends one `MoveCarrier.after_moves` call."""

    handle: Any
    moves: list[Move]
    method: str

    def remote(self, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        return self.handle.after_moves.remote(self.moves, self.method, args, kwargs)


class _MoveRecorder:
    """Stands in for a worker handle in a `send_all` lambda: ``w.<method>.remote(...)`` records a `Move`."""

    def __init__(self, into: list[Move]) -> None:
        self._into = into

    def __getattr__(self, name: str) -> Any:
        into = self._into

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> None:
                into.append(Move(name, args, kwargs))

        return _Method


@dataclass
class Submitted:
    """Calls sent to every rank of a group whose answers are not awaited yet (`WorkerGroup.submit_split`)."""

    refs: list[ray.ObjectRef]
    phase: str
    replicas: int = 1

    def done(self) -> bool:
        """Whether every rank has answered (without waiting)."""
        ready, _ = ray.wait(list(self.refs), num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)


@dataclass
class ResourcePool:
    """``nnodes x slots_per_node`` device slots as one Ray placement group.

    A slot is a GPU where GPUs exist and a share of the CPU cores otherwise (``trainer.n_gpus_per_node``
    then counts CPU slots; `cpus_for_cpu_slots` sizes the share). ``cpus_per_slot`` CPUs go with each slot;
    Ray sets the worker's ``OMP_NUM_THREADS`` (hence its torch threads) to that number.
    """

    slots_per_node: int
    nnodes: int = 1
    use_gpu: bool = False
    cpus_per_slot: float = 1.0
    pg: PlacementGroup | None = None

    @property
    def world_size(self) -> int:
        return self.slots_per_node * self.nnodes

    def create(self, timeout_s: float = 120.0) -> PlacementGroup:
        """Reserve the slots. One node: one bundle per slot, packed. Several nodes: one bundle per node
        holding that node's slots, each on a different Ray node (STRICT_SPREAD); rank ``r`` runs in bundle
        `bundle_of` ``(r)``, so ranks are ordered by node (node 0 holds ranks 0..slots_per_node-1)."""
        bundle: dict[str, float] = {"CPU": self.cpus_per_slot}
        if self.use_gpu:
            bundle["GPU"] = 1.0
        if self.nnodes == 1:
            bundles, strategy = [dict(bundle) for _ in range(self.world_size)], "PACK"
        else:
            per_node = {k: v * self.slots_per_node for k, v in bundle.items()}
            bundles, strategy = [dict(per_node) for _ in range(self.nnodes)], "STRICT_SPREAD"
        pg = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            where = "" if self.nnodes == 1 else f" on {self.nnodes} different Ray nodes"
            raise RuntimeError(
                f"Ray could not reserve {self.world_size} slots of {bundle}{where} within {timeout_s:.0f}s "
                f"(cluster has {ray.cluster_resources()}, {len(ray.nodes())} node(s)). Lower "
                "trainer.n_gpus_per_node / trainer.nnodes (or the pool's, under trainer.placement.pools)."
            )
        self.pg = pg
        return pg

    def bundle_of(self, rank: int) -> int:
        """The placement-group bundle of ``rank`` (see `create`)."""
        return rank if self.nnodes == 1 else rank // self.slots_per_node

    def release(self) -> None:
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def cpus_for_cpu_slots(world_size: int) -> int:
    """CPUs per fused worker on a machine without GPUs: the CPUs Ray has free now, shared evenly by the
    ``world_size`` slots (at least 1). One worker on a 2-core box then trains on 2 threads, not 1."""
    from fusedrl.utils.hardware import cpus_per_cpu_slot

    return cpus_per_cpu_slot(world_size, int(ray.available_resources().get("CPU", 1)))


class WorkerGroup:
    """The fused workers of one resource pool, rank-ordered."""

    def __init__(
        self,
        worker_cls: type,
        pool: ResourcePool,
        config: Any,
        *,
        roles: Sequence[str] | None = None,
        share_slots: bool = False,
    ) -> None:
        """One ``worker_cls(config, rank=, world_size=[, roles=])`` per slot of ``pool`` (``roles``: what a
        fused worker holds; None for single-purpose workers). With ``share_slots`` the workers take no
        CPU/GPU of their own: they join the slots of a group already on the pool."""
        self.pool = pool
        self.roles = tuple(roles) if roles is not None else (worker_cls.__name__,)
        self.role_names = ", ".join(self.roles)
        role_kw = {} if roles is None else {"roles": self.roles}
        share = 0.0 if share_slots else 1.0
        trainer = config.trainer
        timeout = getattr(trainer, "step_timeout_s", None)  # SFT's trainer section has no watchdog key
        # Watchdog per remote call (off when null / 0); set-up calls (init_roles) are exempt, see `start`.
        self.step_timeout_s: float | None = float(timeout) if timeout else None
        self.ckpt_root: str | None = trainer.default_local_dir
        self.preemption: PreemptionGuard | None = None
        self.monitored = hasattr(worker_cls, "health_report")
        self.reports: dict[int, dict[str, Any]] = {}  # rank -> its last `health_report`
        self._report_refs: dict[int, ray.ObjectRef] = {}
        self._last_poll = 0.0
        self.traffic = TensorTraffic()
        # `send_all` leaves its calls unawaited only where this is the run's one group (`RoleGroups`).
        self.defer_moves = False
        self._unawaited: list[tuple[ray.ObjectRef, int, str]] = []  # (answer, rank, method) of sent moves
        # Deferred moves travel with each rank's next call where the worker class can carry them.
        self.carries = issubclass(worker_cls, MoveCarrier)
        self.calls = 0  # calls and moves sent to this group so far
        self._carried: list[list[Move]] = [[] for _ in range(pool.world_size)]
        pg = pool.pg if pool.pg is not None else pool.create()
        # The health methods run on a thread of their own, so a busy or hung worker still answers them.
        remote_cls: Any = (
            ray.remote(concurrency_groups={HEALTH_GROUP: 1})(worker_cls)  # type: ignore[call-overload]
            if self.monitored
            else ray.remote(worker_cls)
        )
        self.workers: list[Any] = [
            remote_cls.options(
                num_cpus=pool.cpus_per_slot * share,
                num_gpus=(1 if pool.use_gpu else 0) * share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=pool.bundle_of(rank)
                ),
                name=None,
            ).remote(config, rank=rank, world_size=pool.world_size, **role_kw)
            for rank in range(pool.world_size)
        ]

    @classmethod
    def start(
        cls,
        worker_cls: type,
        pool: ResourcePool,
        config: Any,
        init: Callable[[Any, str, int], ray.ObjectRef],
        *,
        roles: Sequence[str] | None = None,
        share_slots: bool = False,
    ) -> WorkerGroup:
        """Spawn the workers, get the torch.distributed rendezvous from rank 0, then run ``init`` (the
        worker's collective set-up, e.g. ``lambda w, addr, port: w.init_roles.remote(addr, port)``) on all."""
        group = cls(worker_cls, pool, config, roles=roles, share_slots=share_slots)
        timeout, group.step_timeout_s = group.step_timeout_s, None  # loading models is not a step phase
        addr, port = group.run_rank0(lambda w: w.master_address.remote())
        group.run_all(lambda w: init(w, addr, port))
        group.step_timeout_s = timeout
        group.poll_health(wait_s=30.0)  # pids and a first memory figure for every rank
        return group

    @property
    def world_size(self) -> int:
        return len(self.workers)

    # ------------------------------------------------------------------ calls
    def _recorders(self) -> list[CallRecorder]:
        """One `CallRecorder` per rank, each with the moves its rank has yet to be sent (a call is counted)."""
        self.calls += 1
        return [CallRecorder(w, carried) for w, carried in zip(self.workers, self._carried, strict=True)]

    def run_all(self, call: Callable[[Any], ray.ObjectRef]) -> list[Any]:
        """Call every rank with the same arguments; results in rank order."""
        recorders = self._recorders()
        refs = [call(r) for r in recorders]
        return self._get(refs, list(range(len(refs))), recorders[0].method if recorders else "?")

    def send_all(self, call: Callable[[Any], ray.ObjectRef]) -> None:
        """`run_all` of a memory move (a call answering None) that is not awaited where `defer_moves`: the
        workers run it before any later call of this group, whose wait also reports the move's failure."""
        if not self.defer_moves:
            self.run_all(call)
            return
        if self.carries:
            self.calls += 1  # (sent as calls, they are counted where they are sent)
            for carried in self._carried:
                call(_MoveRecorder(carried))
            return
        sent = self.submit_all(call)
        self._unawaited += [(ref, rank, sent.phase) for rank, ref in enumerate(sent.refs)]

    def run_rank0(self, call: Callable[[Any], ray.ObjectRef]) -> Any:
        """Call rank 0 only; its result."""
        recorder = self._recorders()[0]
        ref = call(recorder)
        return self._get([ref], [0], recorder.method)[0]

    def _get(self, refs: list[ray.ObjectRef], ranks: list[int], phase: str) -> list[Any]:
        """Results of one call per rank (``ranks[i]`` answers ``refs[i]``; ``phase``: the method), failing fast.

        Ranks run collectives together, so when one dies the others block in an all-gather until the
        process-group timeout. Instead of ``ray.get`` on all (which would wait for them), results are
        taken as they complete; the first failure stops every worker and raises `WorkerDiedError` (with
        whether it was killed for memory, and its last reported RSS). While waiting, the workers' memory
        figures are polled, the preemption deadline is checked and, after ``trainer.step_timeout_s``
        without every answer, the silent ranks are named with their stacks (`WorkerTimeoutError`).
        """
        start = time.monotonic()
        # The moves sent before (`send_all`) are awaited with this call, each named in a failure.
        sent, self._unawaited = self._unawaited, []
        every = [*sent, *((ref, rank, phase) for ref, rank in zip(refs, ranks, strict=True))]
        whose = {ref: (rank, method) for ref, rank, method in every}
        pending = [ref for ref, _, _ in every]
        self._check_preemption(phase)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
            if done:
                try:
                    ray.get(done[0])
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
                    self._died(*whose[done[0]], err)
                continue
            self.poll_health()
            self._check_preemption(phase)
            waited = time.monotonic() - start
            if self.step_timeout_s is not None and waited > self.step_timeout_s:
                self._timed_out(sorted({whose[r][0] for r in pending}), whose[pending[0]][1], waited)
        results = ray.get(list(refs))
        self.traffic.add(results, f"{phase} back")
        return results

    def _check_preemption(self, phase: str) -> None:
        """After a SIGTERM whose time budget ran out: stop the workers and raise `Preempted`."""
        if self.preemption is not None:
            try:
                self.preemption.check_deadline(f"`{phase}`")
            except Preempted:
                self.shutdown()
                raise

    def _died(self, rank: int, phase: str, err: Exception) -> None:
        died = isinstance(err, ray.exceptions.RayActorError)
        what = "died" if died else "raised an error"
        memory = f"\n{memory_diagnosis(err, self.reports.get(rank))}" if died else ""
        self.shutdown()
        cause = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise WorkerDiedError(
            f"fused worker rank {rank} (roles: {self.role_names}) {what} in `{phase}`; all workers were "
            f"stopped.\nCause: {cause}{memory}\n{resume_hint(self.ckpt_root)}"
        ) from err

    def _timed_out(self, silent: list[int], phase: str, waited: float) -> None:
        stacks = self._stacks(silent)
        answered = sorted(set(range(self.world_size)) - set(silent))
        lines = [
            f"fused worker rank(s) {', '.join(map(str, silent))} (roles: {self.role_names}) did not answer "
            f"`{phase}` within trainer.step_timeout_s={self.step_timeout_s:g} (waited {waited:.0f} s; ranks that "
            f"answered: {answered or 'none'}). All workers were stopped.",
        ]
        for rank in silent:
            lines.append(f"--- rank {rank} ({phase}) stack:\n{stacks[rank]}")
        lines.append(resume_hint(self.ckpt_root))
        self.shutdown()
        raise WorkerTimeoutError("\n".join(lines))

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """Each rank's own Python stacks, asked for through Ray (the health thread answers while it hangs)."""
        if not self.monitored:
            return {r: "(this worker class reports no stacks)" for r in ranks}
        refs = {r: self.workers[r].dump_stacks.remote() for r in ranks}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=STACK_TIMEOUT_S)
        out = {}
        for rank, ref in refs.items():
            try:
                out[rank] = ray.get(ref) if ref in ready else None
            except ray.exceptions.RayError as err:
                out[rank] = f"(unavailable: {type(err).__name__})"
            if out[rank] is None:
                report = self.reports.get(rank, {})
                out[rank] = (
                    f"(no answer within {STACK_TIMEOUT_S:g} s: it may hold the GIL in native code; "
                    f"`py-spy dump --pid {report.get('pid', '?')}` on {report.get('node', 'its node')} shows it)"
                )
        return out

    def poll_health(self, wait_s: float = 0.0) -> None:
        """Ask every rank for its `health_report` (at most every `REPORT_EVERY_S`) and keep the answers that
        arrived; ``wait_s`` > 0 waits that long for all of them."""
        if not self.monitored:
            return
        now = time.monotonic()
        if wait_s <= 0 and now - self._last_poll < REPORT_EVERY_S:
            return
        self._last_poll = now
        for rank, w in enumerate(self.workers):
            if rank not in self._report_refs:
                self._report_refs[rank] = w.health_report.remote()
        by_ref = {ref: rank for rank, ref in self._report_refs.items()}
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=wait_s)
        for ref in ready:
            rank = by_ref[ref]
            del self._report_refs[rank]
            with contextlib.suppress(ray.exceptions.RayError):  # a dead worker answers nothing new
                self.reports[rank] = ray.get(ref)

    def kill_local_processes(self) -> None:
        """SIGKILL this node's worker processes by pid (no Ray round trip: the second-signal path)."""
        here = socket.gethostname()
        kill_pids([int(r["pid"]) for r in self.reports.values() if r.get("node") == here])

    def run_split(
        self,
        call: Callable[[Any, Any], ray.ObjectRef],
        batch: RolloutBatch | RolloutRequest,
        *,
        replicas: int = 1,
    ) -> list[Any]:
        """Split ``batch`` by DP rank (padding to a multiple of the number of shards), call each rank on its
        shard, and return the per-shard results with the padding still in (see `gather_batches`,
        `gather_tensors`). A generation call's `RolloutRequest` is cut the same way (`RolloutRequest.shards_for`).

        ``replicas`` > 1 gives consecutive groups of that many ranks the same shard (the ranks of one
        tensor-parallel rollout engine must all see the same requests); their results are identical, and
        the group's first rank's result is returned, so there are ``world_size / replicas`` results.
        """
        if self.world_size % replicas:
            raise ValueError(f"replicas={replicas} does not divide the world size {self.world_size}")
        shards = _split(batch, self.world_size // replicas)
        results = self.run_shards(call, [shards[r // replicas] for r in range(self.world_size)])
        return results[::replicas]

    def submit_split(
        self,
        call: Callable[[Any, Any], ray.ObjectRef],
        batch: RolloutBatch | RolloutRequest,
        *,
        replicas: int = 1,
    ) -> Submitted:
        """`run_split` without waiting: the calls are sent and run while the driver does other work;
        `wait` gives the same results. Calls sent later to the same workers run after these (Ray keeps
        one caller's calls to an actor in order)."""
        if self.world_size % replicas:
            raise ValueError(f"replicas={replicas} does not divide the world size {self.world_size}")
        shards = _split(batch, self.world_size // replicas)
        recorders = self._recorders()
        refs = [call(w, shards[r // replicas]) for r, w in enumerate(recorders)]
        phase = recorders[0].method if recorders else "?"
        self.traffic.add([shards[r // replicas] for r in range(self.world_size)], f"{phase} out")
        return Submitted(refs=refs, phase=phase, replicas=replicas)

    def submit_all(self, call: Callable[[Any], ray.ObjectRef]) -> Submitted:
        """`run_all` without waiting (see `submit_split`)."""
        recorders = self._recorders()
        refs = [call(r) for r in recorders]
        return Submitted(refs=refs, phase=recorders[0].method if recorders else "?")

    def wait(self, submitted: Submitted) -> list[Any]:
        """The results of submitted calls, failing fast as `run_all` does (one per engine with replicas)."""
        results = self._get(submitted.refs, list(range(len(submitted.refs))), submitted.phase)
        return results[:: submitted.replicas]

    def send_shards(
        self, call: Callable[[Any, Any], ray.ObjectRef], ranks: Sequence[int], shards: Sequence[Any]
    ) -> list[ray.ObjectRef]:
        """Call rank ``ranks[i]`` with ``shards[i]`` without waiting; the answers' references (a later call
        may pass them to other ranks). The group's next wait also answers for these calls."""
        recorders = self._recorders()
        refs = [call(recorders[rank], shard) for rank, shard in zip(ranks, shards, strict=True)]
        method = recorders[ranks[0]].method if ranks else "?"
        self.traffic.add(list(shards), f"{method} out")
        self._unawaited += [(ref, rank, method) for ref, rank in zip(refs, ranks, strict=True)]
        return refs

    def run_shards(self, call: Callable[[Any, Any], ray.ObjectRef], shards: Sequence[Any]) -> list[Any]:
        """Call rank ``r`` with ``shards[r]`` (one per rank, already split); results in rank order."""
        if len(shards) != self.world_size:
            raise ValueError(f"{len(shards)} shards for {self.world_size} workers")
        recorders = self._recorders()
        refs = [call(w, shard) for w, shard in zip(recorders, shards)]
        phase = recorders[0].method if recorders else "?"
        self.traffic.add(shards, f"{phase} out")
        return self._get(refs, list(range(len(refs))), phase)

    @staticmethod
    def split_pad(batch: RolloutBatch | RolloutRequest, num_shards: int) -> int:
        return (-batch.num_samples) % num_shards

    def gather_batches(self, shards: Sequence[RolloutBatch], batch: RolloutBatch) -> RolloutBatch:
        """Per-shard batch results back into one batch in the original row order."""
        return gather_from_ranks(shards, self.split_pad(batch, len(shards)))

    def gather_fields(
        self, parts: Sequence[dict[str, Any]], batch: RolloutBatch | RolloutRequest
    ) -> dict[str, torch.Tensor]:
        """Per-shard ``{field: [b, ...]}`` answers back into ``{field: [B, ...]}`` in the original row order
        (a field that crossed packed with its mask, `fusedrl.rollout_request.wire_answer`, unpacked first)."""
        full = [expand_answer(p) for p in parts]
        return {name: self.gather_tensors([p[name] for p in full], batch) for name in full[0]}

    def gather_tensors(
        self, parts: Sequence[torch.Tensor], batch: RolloutBatch | RolloutRequest
    ) -> torch.Tensor:
        """Per-shard ``[b, ...]`` tensors back into ``[B, ...]`` in the original row order."""
        full = torch.cat(list(parts), dim=0)
        pad = self.split_pad(batch, len(parts))
        return full if pad == 0 else full[: full.shape[0] - pad]

    def shutdown(self) -> None:
        """Kill every worker and wait (briefly) until this node's worker processes are gone, so none is
        still writing (e.g. into a checkpoint folder the caller is about to remove)."""
        for w in self.workers:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(w)
        here = socket.gethostname()
        wait_pids_gone(
            [int(r["pid"]) for r in self.reports.values() if r.get("node") == here], timeout_s=10.0
        )
        self.workers.clear()
        self._report_refs.clear()
        self._unawaited.clear()
        self.pool.release()
