"""Moving training state out of the way of the rollout engine, and measuring memory per phase.

A fused worker holds the policy's FSDP2 shards, its AdamW state, the reference and the critic, and a
vLLM engine, on one device. They do not all need to be resident at once: during rollout only the engine's
weights and KV cache are used, during the update only the training state. `Offloader` moves one model's
parameter shards and its optimizer state to host memory and back:

* parameters go through ``nn.Module._apply``, which FSDP2 overrides to re-register its sharded
  parameters after the move (the DTensor placements are kept; only the local shard changes device);
* on CUDA, device-to-host copies use ``non_blocking=True``: PyTorch then allocates the host tensor in
  pinned (page-locked) memory, so the host-to-device copy back is asynchronous and at full bandwidth.
  Each device-to-host copy is waited for before the host copy is used (FSDP2 reads it to re-pad uneven
  shards); host-to-device copies are stream-ordered and need no wait;
* gradients are freed (``set_to_none``) before parameters leave the device: they are not needed until
  the next backward and would otherwise stay resident through the rollout.

On CPU the same calls run (so the order of the choreography is the same and is tested) but a move from
the CPU to the CPU returns the tensor itself: nothing is copied.

Every move is idempotent and recorded in ``events`` (``"actor.offload_params"`` ...) only when it
happened, so a test can read the choreography of a step back in order.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fusedrl.workers.fsdp import device_type

_GB = 1e9


def _move(t: torch.Tensor, device: str) -> torch.Tensor:
    out = t.to(device, non_blocking=True)
    if device == "cpu" and t.device.type == "cuda":
        # The host copy is read right away by FSDP2 when it re-pads an uneven shard: wait for it.
        torch.cuda.current_stream().synchronize()
    return out


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterable[tuple[dict[str, Any], str]]:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield state, key


def move_params(model: nn.Module, device: str) -> None:
    """Move every parameter and buffer (FSDP2 shards included) to ``device``."""
    model._apply(lambda t: _move(t, device))


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: str) -> None:
    """Move every tensor of the optimizer's state (AdamW moments; its ``step`` counters stay on the CPU
    unless the optimizer keeps them on the device) to ``device``."""
    for state, key in _state_tensors(optimizer):
        value = state[key]
        if key == "step" and value.device.type == "cpu" and value.dim() == 0:
            continue  # AdamW's default: a CPU scalar, never on the device
        state[key] = _move(value, device)


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by this rank: the local shard of a DTensor, the tensor itself otherwise."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [state[key] for state, key in _state_tensors(optimizer)]


class Offloader:
    """Where one role's training state lives, and the moves between device and host.

    ``param_offload`` / ``optimizer_offload`` come from the role's ``fsdp_config``; with both false
    every method is a no-op and records nothing.
    """

    def __init__(
        self,
        name: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        param_offload: bool,
        optimizer_offload: bool,
        events: list[str],
    ) -> None:
        self.name = name
        self.model = model
        self.optimizer = optimizer
        self.param_offload = bool(param_offload)
        self.optimizer_offload = bool(optimizer_offload) and optimizer is not None
        self.events = events
        self.device = device_type()
        self.params_on_device = True
        self.optimizer_on_device = True

    @classmethod
    def from_fsdp_config(
        cls,
        name: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        fsdp_cfg: dict[str, Any] | None,
        events: list[str],
    ) -> Offloader:
        """The role's ``fsdp_config.param_offload`` / ``optimizer_offload`` switches (absent: off)."""
        fsdp_cfg = fsdp_cfg or {}
        return cls(
            name,
            model,
            optimizer,
            param_offload=bool(fsdp_cfg.get("param_offload")),
            optimizer_offload=bool(fsdp_cfg.get("optimizer_offload")),
            events=events,
        )

    def offload_params(self) -> None:
        if not self.param_offload or not self.params_on_device:
            return
        self.model.zero_grad(set_to_none=True)
        move_params(self.model, "cpu")
        self.params_on_device = False
        self.events.append(f"{self.name}.offload_params")

    def load_params(self) -> None:
        if self.params_on_device:
            return
        move_params(self.model, self.device)
        self.params_on_device = True
        self.events.append(f"{self.name}.load_params")

    def offload_optimizer(self) -> None:
        if not self.optimizer_offload or not self.optimizer_on_device:
            return
        assert self.optimizer is not None
        move_optimizer_state(self.optimizer, "cpu")
        self.optimizer_on_device = False
        self.events.append(f"{self.name}.offload_optimizer")

    def load_optimizer(self) -> None:
        if self.optimizer_on_device:
            return
        assert self.optimizer is not None
        move_optimizer_state(self.optimizer, self.device)
        self.optimizer_on_device = True
        self.events.append(f"{self.name}.load_optimizer")

    def offload_all(self) -> None:
        self.offload_optimizer()
        self.offload_params()

    def load_all(self) -> None:
        self.load_params()
        self.load_optimizer()

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Everything on the device inside the block (checkpoints, export), then back where it was."""
        params_were, optimizer_was = self.params_on_device, self.optimizer_on_device
        self.load_all()
        try:
            yield
        finally:
            if not optimizer_was:
                self.offload_optimizer()
            if not params_were:
                self.offload_params()

    def training_state_bytes(self) -> int:
        """Bytes of this rank's parameter shards, gradients and optimizer state, wherever they are."""
        tensors: list[torch.Tensor] = list(self.model.parameters())
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.optimizer is not None:
            tensors += optimizer_state_tensors(self.optimizer)
        return local_bytes(tensors)


# ---------------------------------------------------------------------- the CUDA caching allocator
def empty_cache() -> None:
    """Return cached, unused device blocks to the driver (so vLLM can take them). No-op on CPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def set_expandable_segments(enabled: bool) -> None:
    """Turn PyTorch's expandable segments on (training: less fragmentation) or off (rollout).

    vLLM's sleep mode releases memory through its own allocator pool, which cannot unmap memory that
    PyTorch's allocator mapped as expandable segments; with them on during rollout, ``sleep`` frees
    nothing (and vLLM refuses to build its sleep-mode pool). Only segments created after the switch
    change kind, which is why the switch happens right after ``empty_cache``. No-op on CPU.
    """
    if torch.cuda.is_available():
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{enabled}")


# ---------------------------------------------------------------------- telemetry
def rss_gb() -> float:
    """Resident set size of this process (host memory actually in use), in GB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / _GB


def peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GB  # KiB on Linux


def memory_metrics(phase: str) -> dict[str, float]:
    """``memory/*_after_<phase>``: host RSS always; device allocated / reserved when there is a GPU."""
    out = {f"memory/cpu_rss_gb_after_{phase}": rss_gb()}
    if torch.cuda.is_available():
        out[f"memory/allocated_gb_after_{phase}"] = torch.cuda.memory_allocated() / _GB
        out[f"memory/reserved_gb_after_{phase}"] = torch.cuda.memory_reserved() / _GB
    return out
