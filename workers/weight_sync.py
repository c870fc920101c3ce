"""Weight sync between processes: the actor's ranks broadcast the policy to rollout ranks on another pool.

Where the rollout shares the actor's worker, the weights reach the engine by reference
(`WeightSyncEndpoint.update_weights`, the worker's ``update_weights``). Where it lives in other processes
(``trainer.placement``), a collective group made only for the sync joins the training rank 0 (the root)
and every rollout rank: gloo on CPU, NCCL on GPU. It is a process group of its own (not the default one,
which each worker group already uses for FSDP2 or for the engine's tensor parallelism), rendezvousing on
a TCP store served by the root.

A sync, on both sides at once (the driver submits both, `fusedrl.controller.weight_sync`):

    training ranks   every rank gathers each full tensor from its FSDP2 shards (collective, as in the
                     in-process stream); rank 0 packs them into buckets of ``weight_sync_bucket_mb`` and
                     broadcasts each bucket when it is full
    rollout ranks    receive each bucket and hand its tensors, as views, to the engine's in-place reload
                     (`third_party.vllm`: the same adapter as in-process, so the model's own loaders do the
                     q/k/v fusion and the tensor-parallel slicing of each rank)

Both sides know the bucket layout in advance: the driver gives every member the same manifest (name,
shape, dtype of each tensor, in the stream's order) and bucket size once, when the group is made, and
`bucket_plan` cuts it the same way everywhere. Only bytes cross the wire.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fusedrl.workers.fsdp import StreamStats, device_type
from fusedrl.workers.memory import memory_metrics

ALIGN = 16  # byte offset of every tensor in a bucket: any dtype may view it
SYNC_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class Entry:
    """One tensor of a bucket: where its bytes are and how to read them."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."))
    assert isinstance(value, torch.dtype), name
    return value


def bucket_plan(manifest: list[tuple[str, list[int], str]], bucket_bytes: int) -> list[list[Entry]]:
    """``manifest`` (name, shape, dtype per tensor, stream order) cut into buckets of at most
    ``bucket_bytes`` (a larger tensor gets a bucket of its own), each tensor at an `ALIGN`-ed offset."""
    buckets: list[list[Entry]] = []
    current: list[Entry] = []
    used = 0
    for name, shape, dtype_name in manifest:
        dtype = _dtype(dtype_name)
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        offset = -(-used // ALIGN) * ALIGN
        if current and offset + nbytes > bucket_bytes:
            buckets.append(current)
            current, offset = [], 0
        current.append(Entry(name, tuple(int(s) for s in shape), dtype, offset, nbytes))
        used = offset + nbytes
    if current:
        buckets.append(current)
    return buckets


def bucket_size(bucket: list[Entry]) -> int:
    return bucket[-1].offset + bucket[-1].nbytes


def make_sync_group(addr: str, port: int, rank: int, size: int) -> Any:
    """The sync's own process group (rank 0 serves the store): gloo on CPU, NCCL on GPU. Collective
    over its ``size`` members."""
    store = dist.TCPStore(addr, port, size, is_master=rank == 0, timeout=SYNC_TIMEOUT)
    prefixed = dist.PrefixStore("fusedrl-weight-sync", store)
    if device_type() == "cuda":
        nccl: Any = dist.ProcessGroupNCCL  # absent from CPU builds of torch
        return nccl(prefixed, rank, size, nccl.Options())
    return dist.ProcessGroupGloo(prefixed, rank, size, SYNC_TIMEOUT)


def _broadcast(group: Any, buffer: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buffer], opts).wait()


class WeightSyncEndpoint:
    """The worker's side of the weight sync, in process (`update_weights`) and across pools, an object the
    worker holds (`WorkerDict.weight_sync`, whose remote methods of the same names delegate here): the
    worker's ``rank``, its ``events`` list and engine ``phase`` (`workers.phase.EnginePhase`), and its
    ``actor`` / ``rollout`` once they are built."""

    def __init__(self, *, rank: int = 0, events: Any = None, phase: Any = None) -> None:
        self.rank = rank
        self.events: Any = [] if events is None else events
        self.phase = phase
        self.actor: Any = None
        self.rollout: Any = None
        self._sync_group: Any = None
        self._sync_plan: list[list[Entry]] | None = None
        self._sync_dtype: torch.dtype | None = None

    def update_weights(self, reset_prefix_cache: bool, *, shares_actor_module: bool) -> dict[str, float]:
        """Stream the actor's FSDP2 shards, one full tensor at a time, into the rollout engine of this worker
        in place (both must be here: `WorkerDict.update_weights` checks).

        Collective across ranks (each gather of a layer or a tensor is an all-gather). The actor's
        parameters must be on the device and the engine's weights awake. No-op for an engine that runs on
        the actor's own module (``shares_actor_module``: the HF rollout)."""
        if shares_actor_module:
            self.phase.streamed(full=True)  # the engine runs on the actor's own module
            return {"timing_s/sync_weights_inner": 0.0, **memory_metrics("sync")}
        t0 = time.perf_counter()
        stats = StreamStats()
        # LoRA: the engine keeps the base weights and gets only the merged adapted modules, unless a
        # level-2 sleep discarded its weights (then everything, adapted modules merged).
        full = not self.actor.lora or self.rollout.weights_discarded
        self.rollout.update_weights(
            self.actor.stream_weights(stats, full=full, dtype=self.rollout.param_dtype()),
            reset_prefix_cache=reset_prefix_cache,
            partial=not full,
        )
        self.phase.streamed(full=full)
        self.events.append("rollout.update_weights" if full else "rollout.update_weights(lora_modules)")
        return {
            "timing_s/sync_weights_inner": time.perf_counter() - t0,
            "sync/num_tensors": float(stats.num_tensors),
            "sync/total_mb": stats.total_bytes / 1e6,
            "sync/largest_tensor_mb": stats.largest_bytes / 1e6,
            "sync/largest_layer_buffer_mb": stats.largest_buffer_bytes / 1e6,
            "sync/peak_live_gathered_mb": stats.peak_live_bytes / 1e6,
            **memory_metrics("sync"),
        }

    def weight_manifest(self, wire_dtype: str | None = None) -> list[tuple[str, list[int], str]]:
        """Name, full shape and dtype of every tensor the actor streams, in stream order (no gather).
        ``wire_dtype`` (the engines' parameter dtype): floating tensors travel in it, cast on the training
        ranks before they are gathered, as the in-process stream does (float32 master weights to bf16
        engines: half the bytes on the gathers, the wire and the buckets)."""
        if self.actor is None:
            raise RuntimeError("weight_manifest: this worker holds no actor")
        return [
            (n, list(t.shape), wire_dtype if wire_dtype and t.is_floating_point() else str(t.dtype))
            for n, t in self.actor.model.state_dict().items()
        ]

    def rollout_param_dtype(self) -> str:
        """The engine's parameter dtype (``torch.bfloat16`` ...), for the cross-pool manifest."""
        if self.rollout is None:
            raise RuntimeError("rollout_param_dtype: this worker holds no rollout")
        return str(self.rollout.param_dtype())

    def weight_sync_address(self, multi_node: bool) -> tuple[str, int]:
        """Where the sync group's store will listen (this worker serves it as the group's rank 0)."""
        from fusedrl.workers.distributed import _free_port

        if not multi_node:
            return "127.0.0.1", _free_port()
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def join_weight_sync(
        self,
        addr: str,
        port: int,
        sync_rank: int,
        sync_size: int,
        manifest: list[tuple[str, list[int], str]],
        bucket_bytes: int,
        wire_dtype: str | None = None,
    ) -> None:
        """Join the sync group as ``sync_rank`` of ``sync_size`` (0: the training rank 0, the root) and
        keep the bucket layout. Collective over the group."""
        self._sync_group = make_sync_group(addr, port, sync_rank, sync_size)
        self._sync_plan = bucket_plan(manifest, bucket_bytes)
        self._sync_dtype = _dtype(wire_dtype) if wire_dtype else None

    def _plan(self) -> list[list[Entry]]:
        if self._sync_plan is None:
            raise RuntimeError("no weight-sync layout: the driver calls join_weight_sync first")
        return self._sync_plan

    def send_weights(self) -> dict[str, float]:
        """Training side of a sync: every actor rank gathers each full tensor (collective); rank 0 packs
        and broadcasts the buckets. The actor's parameters must be on the device."""
        if self.actor is None:
            raise RuntimeError("send_weights: this worker holds no actor")
        t0 = time.perf_counter()
        stats = StreamStats()
        stream = self.actor.stream_weights(stats, dtype=self._sync_dtype)
        sent, wire_s, buckets = 0, 0.0, 0
        for bucket in self._plan():
            root = self.rank == 0
            buffer = (
                torch.empty(bucket_size(bucket), dtype=torch.uint8, device=device_type()) if root else None
            )
            for entry in bucket:
                name, tensor = next(stream)
                if name != entry.name or tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
                    raise RuntimeError(
                        f"weight stream out of step with the sync layout: got {name} {tuple(tensor.shape)} "
                        f"{tensor.dtype}, expected {entry.name} {entry.shape} {entry.dtype}"
                    )
                if buffer is not None:
                    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                    buffer[entry.offset : entry.offset + entry.nbytes].copy_(flat)
                del tensor
            if buffer is not None:
                w0 = time.perf_counter()
                _broadcast(self._sync_group, buffer)
                wire_s += time.perf_counter() - w0
                sent += buffer.numel()
                buckets += 1
        if next(stream, None) is not None:
            raise RuntimeError("weight stream has tensors the sync layout does not know")
        self.events.append("weights.broadcast")
        return {
            "timing_s/sync_weights_inner": time.perf_counter() - t0,
            "sync/broadcast_s": wire_s,
            "sync/num_tensors": float(stats.num_tensors),
            "sync/total_mb": stats.total_bytes / 1e6,
            "sync/broadcast_mb": sent / 1e6,
            "sync/num_buckets": float(buckets),
            "sync/largest_tensor_mb": stats.largest_bytes / 1e6,
            "sync/largest_layer_buffer_mb": stats.largest_buffer_bytes / 1e6,
            "sync/peak_live_gathered_mb": stats.peak_live_bytes / 1e6,
        }

    def _received(self, wire: list[float]) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self._plan():
            buffer = torch.empty(bucket_size(bucket), dtype=torch.uint8, device=device_type())
            t0 = time.perf_counter()
            _broadcast(self._sync_group, buffer)
            wire[0] += time.perf_counter() - t0
            for entry in bucket:
                raw = buffer[entry.offset : entry.offset + entry.nbytes]
                # A view of the bucket: the engine's loader copies it into its own parameters.
                yield entry.name, raw.view(entry.dtype).view(entry.shape)

    def receive_weights(
        self, reset_prefix_cache: bool = True, version: int | None = None
    ) -> dict[str, float]:
        """Rollout side of a sync: receive every bucket and load it into the engine in place (its weights
        must be awake); ``version``: the actor's policy version being sent (`EnginePhase.engine_version`)."""
        if self.rollout is None:
            raise RuntimeError("receive_weights: this worker holds no rollout")
        t0 = time.perf_counter()
        wire = [0.0]
        received = self._received(wire)
        self.rollout.update_weights(received, reset_prefix_cache=reset_prefix_cache)
        # The broadcast is collective: every bucket must be received even if a loader stopped early.
        for _ in received:
            pass
        self.phase.streamed(full=True, version=version)
        self.events.append("rollout.update_weights")
        return {"sync/receive_s": time.perf_counter() - t0, "sync/receive_wire_s": wire[0]}
