"""The driver's side of the cross-pool weight sync (the workers' side: `fusedrl.workers.weight_sync`).

When the rollout runs on a pool of its own (``trainer.placement``), `BroadcastRoute` makes one collective
group of the training rank 0 and every rollout rank, and each sync calls both sides at once: the training
ranks gather and broadcast, the rollout ranks receive and load. Both calls are collective across pools, so
both are submitted before either is awaited.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ray

from fusedrl.controller.worker_group import CallRecorder, WorkerGroup
from fusedrl.metrics import Metrics, mean_over_ranks

Call = Callable[[Any], ray.ObjectRef]


def run_together(parts: Sequence[tuple[WorkerGroup, Sequence[int], Call]]) -> list[list[Any]]:
    """Call ``ranks`` of each group (``call`` per rank), every call submitted before any is awaited (the
    calls are one collective); each group's answers in rank order, failing fast as `WorkerGroup.run_all`."""
    submitted = []
    for group, ranks, call in parts:
        method: list[str] = []

        def named(
            rank: int, group: WorkerGroup = group, call: Call = call, method: list[str] = method
        ) -> ray.ObjectRef:
            recorder = CallRecorder(group.workers[rank], group._carried[rank])  # with the rank's unsent moves
            ref = call(recorder)
            method.append(recorder.method)
            return ref

        refs = [named(r) for r in ranks]
        submitted.append((group, list(ranks), refs, method[0] if method else "?"))
    # Same failure handling as a group's own calls (a dead rank stops its group, a silent one is named).
    return [group._get(refs, ranks, phase) for group, ranks, refs, phase in submitted]


class BroadcastRoute:
    """Actor -> rollout weights over a collective group of the training rank 0 (the root) and every rollout
    rank, in buckets of ``bucket_mb``; ``multi_node``: the store listens on the node's address, not loopback."""

    def __init__(self, actor: WorkerGroup, rollout: WorkerGroup, bucket_mb: float, multi_node: bool) -> None:
        self.actor, self.rollout = actor, rollout
        self.bucket_bytes = max(1, int(float(bucket_mb) * (1 << 20)))
        self.multi_node = multi_node
        self.size = 1 + rollout.world_size

    def connect(self) -> None:
        """Make the sync group and give every member the tensor manifest and bucket size (collective)."""
        # Tensors travel in the engines' dtype (cast before the gather), not in the master weights'.
        wire = self.rollout.run_rank0(lambda w: w.rollout_param_dtype.remote())
        manifest = self.actor.run_rank0(lambda w: w.weight_manifest.remote(wire))
        addr, port = self.actor.run_rank0(lambda w: w.weight_sync_address.remote(self.multi_node))
        size, bucket = self.size, self.bucket_bytes

        def join(rank: int) -> Call:
            return lambda w: w.join_weight_sync.remote(addr, port, rank, size, manifest, bucket, wire)

        run_together(
            [
                (self.actor, [0], join(0)),
                *[(self.rollout, [r], join(1 + r)) for r in range(self.rollout.world_size)],
            ]
        )

    def sync(self, version: int | None = None) -> Metrics:
        """One sync of the actor's policy ``version``: the training ranks gather and broadcast, the rollout
        ranks receive and load (their engines awake) and record the version. Metrics: the root's (time,
        bytes, buckets) and the rollout rank 0's receive time."""
        receive = lambda w: w.receive_weights.remote(version=version)  # noqa: E731
        sent, received = run_together(
            [
                (self.actor, range(self.actor.world_size), lambda w: w.send_weights.remote()),
                (self.rollout, range(self.rollout.world_size), receive),
            ]
        )
        metrics = dict(sent[0])  # the root: the only rank that broadcasts
        metrics.update(mean_over_ranks(received))
        metrics["sync/cross_pool"] = 1.0
        return metrics
