"""Exactly-sized page-locked host memory for offloaded training state.

``tensor.to("cpu", non_blocking=True)`` takes its pinned host block from PyTorch's caching host allocator,
which rounds every request up to a power of two and keeps the blocks after the tensors are gone: a role's
offloaded state can then hold up to about twice its size in page-locked RAM, for the rest of the process.

`HostBuffer` instead allocates one ordinary host tensor of exactly the summed size of the tensors it will
hold (each slot aligned to `ALIGN` bytes) and page-locks it with ``cudaHostRegister``, so copies to and from
the device are asynchronous at full bandwidth and ``host_bytes / offloaded_bytes`` stays within the
alignment slack of 1. `release` unregisters and frees it. On CPU (``pin=False``) the same layout is used
without page-locking, which is how the packing is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

ALIGN = 256  # bytes; keeps every slot aligned for any dtype and for vectorised copies


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard, the tensor itself otherwise."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # type: ignore[attr-defined]


class HostBuffer:
    """One host allocation with a slot per tensor, keyed by the tensor object's identity.

    ``tensors``: the tensors that will be copied in (parameters, buffers, optimizer moments; DTensors
    count by their local shard). ``pin``: page-lock the allocation (CUDA only). Once the move that fills
    it is done, `seal` drops the buffer's references to those tensors: a device tensor replaced by its host
    copy must be freed then, not when the buffer is (holding them kept every offloaded AdamW moment on the
    GPU: seen on an H200, 2026-12-04). Weak references would not do: FSDP2 moves parameters with
    ``torch.utils.swap_tensors``, which refuses a tensor that has one.
    """

    def __init__(self, tensors: Iterable[torch.Tensor], *, pin: bool) -> None:
        self._slots: dict[int, tuple[int, torch.Tensor]] = {}  # id -> (byte offset, the tensor)
        offset = 0
        for t in tensors:
            if id(t) in self._slots:
                continue  # a tied parameter is stored once
            self._slots[id(t)] = (offset, t)
            local = _local(t)
            offset += _align(local.numel() * local.element_size())
        # The host allocator aligns to 64 bytes only: allocate one slot of slack and start on a boundary.
        self.storage: torch.Tensor | None = torch.empty(offset + ALIGN, dtype=torch.uint8)
        self.nbytes = self.storage.numel()
        start = -self.storage.data_ptr() % ALIGN
        self._slab = self.storage[start : start + offset]
        self.pinned = False
        if pin and offset > 0:
            err = torch.cuda.cudart().cudaHostRegister(self.storage.data_ptr(), self.storage.numel(), 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {offset} bytes failed with CUDA error {int(err)}")
            self.pinned = True

    def seal(self) -> None:
        """Every slot is filled: forget the tensors they were filled from (`copy_in` refuses from now on)."""
        self._slots.clear()

    def __contains__(self, t: object) -> bool:
        return id(t) in self._slots and self._slots[id(t)][1] is t

    def copy_in(self, t: torch.Tensor) -> torch.Tensor:
        """Copy ``t`` (device or host) into its slot; return the host copy, a DTensor if ``t`` is one.

        The copy is issued non-blocking; the caller waits for the stream before reading the result.
        """
        if self.storage is None:
            raise RuntimeError("HostBuffer.copy_in after release()")
        if id(t) not in self._slots:
            raise RuntimeError("HostBuffer.copy_in of a tensor it has no slot for (or after seal())")
        offset, _ = self._slots[id(t)]
        local = _local(t)
        nbytes = local.numel() * local.element_size()
        view = self._slab[offset : offset + nbytes].view(local.dtype).view(local.shape)
        view.copy_(local, non_blocking=True)
        if local is t:
            return view
        from torch.distributed.tensor import DTensor

        # Same sharding spec, the local shard now in host memory (what DTensor.to("cpu") would give).
        return DTensor(view, t._spec, requires_grad=t.requires_grad)  # type: ignore[attr-defined]

    def release(self) -> None:
        """Unregister and free the allocation. Nothing may still refer to its slots."""
        if self.storage is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.storage.data_ptr())
            self.pinned = False
        self.storage = None
        del self._slab
