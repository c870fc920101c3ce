"""Single-controller plumbing: a resource pool of device slots and the group of fused workers on it.

Remote calls are written at the call site as ``lambda w: w.some_method.remote(...)``, so every call into
a worker can be found with grep; this module only decides *which* workers get *which* shard:

    group.run_all(lambda w: w.update_weights.remote())                       # every rank, same args
    group.run_rank0(lambda w: w.master_address.remote())                     # rank 0 only
    group.run_split(lambda w, shard: w.rollout_generate.remote(shard, s), batch)  # DP split, gather
    group.queue_all(lambda w: w.offload_ref.remote())                        # ordered, not waited for

Several groups may share one pool (one worker of each per slot, e.g. the reference apart from the fused
actor/rollout worker); each group is its own torch.distributed world.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fusedrl.batch import RolloutBatch, gather_from_ranks, split_for_ranks


class WorkerDiedError(RuntimeError):
    """A fused worker's process died or raised; the group has been stopped."""


@dataclass
class ResourcePool:
    """``nnodes x slots_per_node`` device slots as one Ray placement group.

    A slot is a GPU where GPUs exist and one CPU core otherwise (``trainer.n_gpus_per_node`` then counts
    CPU slots). ``cpus_per_slot`` CPUs go with each slot for the worker's host-side work.
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
        bundle: dict[str, float] = {"CPU": self.cpus_per_slot}
        if self.use_gpu:
            bundle["GPU"] = 1.0
        pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            raise RuntimeError(
                f"Ray could not reserve {self.world_size} slots of {bundle} within {timeout_s:.0f}s "
                f"(cluster has {ray.cluster_resources()}). Lower trainer.n_gpus_per_node / trainer.nnodes."
            )
        self.pg = pg
        return pg

    def release(self) -> None:
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


class WorkerGroup:
    """The fused workers of one resource pool, rank-ordered."""

    def __init__(
        self,
        worker_cls: type,
        pool: ResourcePool,
        config: dict[str, Any],
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
        pg = pool.pg if pool.pg is not None else pool.create()
        remote_cls: Any = ray.remote(worker_cls)
        share = 0.0 if share_slots else 1.0
        self.workers: list[Any] = [
            remote_cls.options(
                num_cpus=pool.cpus_per_slot * share,
                num_gpus=(1 if pool.use_gpu else 0) * share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank
                ),
                name=None,
            ).remote(config, rank=rank, world_size=pool.world_size, **role_kw)
            for rank in range(pool.world_size)
        ]
        self._queued: list[ray.ObjectRef] = []

    @classmethod
    def start(
        cls,
        worker_cls: type,
        pool: ResourcePool,
        config: dict[str, Any],
        init: Callable[[Any, str, int], ray.ObjectRef],
        *,
        roles: Sequence[str] | None = None,
        share_slots: bool = False,
    ) -> WorkerGroup:
        """Spawn the workers, get the torch.distributed rendezvous from rank 0, then run ``init`` (the
        worker's collective set-up, e.g. ``lambda w, addr, port: w.init_roles.remote(addr, port)``) on all."""
        group = cls(worker_cls, pool, config, roles=roles, share_slots=share_slots)
        addr, port = group.run_rank0(lambda w: w.master_address.remote())
        group.run_all(lambda w: init(w, addr, port))
        return group

    @property
    def world_size(self) -> int:
        return len(self.workers)

    # ------------------------------------------------------------------ calls
    def run_all(self, call: Callable[[Any], ray.ObjectRef]) -> list[Any]:
        """Call every rank with the same arguments; results in rank order."""
        return self._get([call(w) for w in self.workers])

    def run_rank0(self, call: Callable[[Any], ray.ObjectRef]) -> Any:
        """Call rank 0 only; its result."""
        return self._get([call(self.workers[0])])[0]

    def queue_all(self, call: Callable[[Any], ray.ObjectRef]) -> None:
        """Call every rank without waiting for the answer (memory moves between phases).

        Ray runs one caller's calls to an actor in submission order, so a queued call has happened before
        any later call to the same worker starts; its errors surface, failing fast, at the next call that
        waits (`run_all`, `run_split`, ...). Costs no round trip.
        """
        self._queued.extend(call(w) for w in self.workers)

    def _get(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """Results of one call per rank, failing fast.

        Ranks run collectives together, so when one dies the others block in an all-gather until the
        process-group timeout. Instead of ``ray.get`` on all (which would wait for them), results are
        taken as they complete; the first failure stops every worker and raises `WorkerDiedError`.
        """
        queued, self._queued = self._queued, []
        if queued:
            self._get(queued)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
                rank = refs.index(done[0]) % len(self.workers) if len(refs) % len(self.workers) == 0 else 0
                died = isinstance(err, ray.exceptions.RayActorError)
                what = "died" if died else "raised an error"
                self.shutdown()
                raise WorkerDiedError(
                    f"fused worker rank {rank} (roles: {self.role_names}) {what}; all workers were stopped.\n"
                    f"Cause: {str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__}\n"
                    "To continue, rerun the same command: with trainer.resume_mode=auto the run resumes from the "
                    "last complete checkpoint in trainer.default_local_dir (set trainer.save_freq to have one)."
                ) from err
        return ray.get(list(refs))

    def run_split(
        self, call: Callable[[Any, RolloutBatch], ray.ObjectRef], batch: RolloutBatch, *, replicas: int = 1
    ) -> list[Any]:
        """Split ``batch`` by DP rank (padding to a multiple of the number of shards), call each rank on its
        shard, and return the per-shard results with the padding still in (see `gather_batches`,
        `gather_tensors`).

        ``replicas`` > 1 gives consecutive groups of that many ranks the same shard (the ranks of one
        tensor-parallel rollout engine must all see the same requests); their results are identical, and
        the group's first rank's result is returned, so there are ``world_size / replicas`` results.
        """
        if self.world_size % replicas:
            raise ValueError(f"replicas={replicas} does not divide the world size {self.world_size}")
        shards, _ = split_for_ranks(batch, self.world_size // replicas)
        results = self.run_shards(call, [shards[r // replicas] for r in range(self.world_size)])
        return results[::replicas]

    def run_shards(self, call: Callable[[Any, Any], ray.ObjectRef], shards: Sequence[Any]) -> list[Any]:
        """Call rank ``r`` with ``shards[r]`` (one per rank, already split); results in rank order."""
        if len(shards) != self.world_size:
            raise ValueError(f"{len(shards)} shards for {self.world_size} workers")
        return self._get([call(w, shard) for w, shard in zip(self.workers, shards)])

    @staticmethod
    def split_pad(batch: RolloutBatch, num_shards: int) -> int:
        return (-batch.num_samples) % num_shards

    def gather_batches(self, shards: Sequence[RolloutBatch], batch: RolloutBatch) -> RolloutBatch:
        """Per-shard batch results back into one batch in the original row order."""
        return gather_from_ranks(shards, self.split_pad(batch, len(shards)))

    def gather_tensors(self, parts: Sequence[torch.Tensor], batch: RolloutBatch) -> torch.Tensor:
        """Per-shard ``[b, ...]`` tensors back into ``[B, ...]`` in the original row order."""
        full = torch.cat(list(parts), dim=0)
        pad = self.split_pad(batch, len(parts))
        return full if pad == 0 else full[: full.shape[0] - pad]

    def shutdown(self) -> None:
        for w in self.workers:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(w)
        self.workers.clear()
        self._queued.clear()
        self.pool.release()
