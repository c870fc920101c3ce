"""Moving training state out of the way of the rollout engine, and measuring memory per phase.

A fused worker holds the policy's FSDP2 shards, its AdamW state, the reference and the critic, and a
vLLM engine, on one device. They do not all need to be resident at once: during rollout only the engine's
weights and KV cache are used, during the update only the training state. `Offloader` moves one model's
parameter shards and its optimizer state to host memory and back:

* parameters go through ``nn.Module._apply``, which FSDP2 overrides to re-register its sharded
  parameters after the move (the DTensor placements are kept; only the local shard changes device);
* on CUDA, each offload copies into one exactly-sized page-locked `HostBuffer` per role and kind
  (parameters, optimizer state), not into the caching host allocator's power-of-two blocks, which it would
  keep for the rest of the process; the buffer is freed once the state is back on the device. Copies are
  issued non-blocking and waited for once per move (FSDP2 reads the host copy to re-pad uneven shards;
  the buffer must not be freed under a copy in flight);
* gradients are freed (``set_to_none``) before parameters leave the device: they are not needed until
  the next backward and would otherwise stay resident through the rollout.

On CPU the same calls run (so the order of the choreography is the same and is tested) but a move from
the CPU to the CPU returns the tensor itself: nothing is copied.

Every move is idempotent and recorded in ``events`` (``"actor.offload_params"`` ...) only when it
happened, so a test can read the choreography of a step back in order.

PyTorch's allocator settings (``PYTORCH_CUDA_ALLOC_CONF``) are never written here. vLLM's sleep-mode pool
(``CuMemAllocator.use_memory_pool`` in vLLM 0.32) already switches ``expandable_segments`` off around its
own allocations and writes the user's whole settings string back afterwards, so a toggle of ours would be
redundant (and a bare ``expandable_segments:X`` write resets every other option the user set).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fusedrl.workers.fsdp import device_type
from fusedrl.workers.host_buffer import HostBuffer

_GB = 1e9


def _move(t: torch.Tensor, device: str, host: HostBuffer | None = None) -> torch.Tensor:
    out = host.copy_in(t) if host is not None and t in host else t.to(device, non_blocking=True)
    if device == "cpu" and t.device.type == "cuda":
        # The host copy is read right away by FSDP2 when it re-pads an uneven shard: wait for it.
        torch.cuda.current_stream().synchronize()
    return out


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterable[tuple[dict[str, Any], str]]:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield state, key


def _moving_state_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[dict[str, Any], str]]:
    """The ``(state, key)`` of every optimizer state tensor that moves with an offload: all but the 0-d
    ``step`` counters of param groups that are neither fused nor capturable, which live on the host. (torch's
    fused AdamW keeps ``step`` on the parameter's device and refuses a host one; seen on an H200, 2026-12-04,
    when a reload left the offloaded counter on the CPU.)"""
    host_steps: set[int] = set()
    for group in optimizer.param_groups:
        if not (group.get("fused") or group.get("capturable")):
            host_steps.update(id(optimizer.state[p]) for p in group["params"] if p in optimizer.state)
    return [
        (state, key)
        for state, key in _state_tensors(optimizer)
        if not (key == "step" and id(state) in host_steps and state[key].dim() == 0)
    ]


def move_params(model: nn.Module, device: str, host: HostBuffer | None = None) -> None:
    """Move every parameter and buffer (FSDP2 shards included) to ``device``; with ``host``, into its
    slots (an offload to exactly-sized host memory)."""
    model._apply(lambda t: _move(t, device, host))
    _wait(device, host)


def move_optimizer_state(
    optimizer: torch.optim.Optimizer, device: str, host: HostBuffer | None = None
) -> None:
    """Move every tensor of the optimizer's state (AdamW moments; its ``step`` counters stay on the CPU
    unless the optimizer keeps them on the device) to ``device`` (with ``host``: into its slots)."""
    for state, key in _moving_state_tensors(optimizer):
        state[key] = _move(state[key], device, host)
    _wait(device, host)


def _wait(device: str, host: HostBuffer | None) -> None:
    # Host-to-device copies out of a HostBuffer may still be in flight: wait before the buffer is freed.
    if device == "cuda":
        torch.cuda.current_stream().synchronize()
    if host is not None:
        host.seal()  # the moved-out device tensors are freed now


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
        # Exactly-sized page-locked host memory while the state is offloaded (CUDA; None on CPU, where a
        # move to the host copies nothing). `use_host_buffers` lets a CPU test exercise the packing.
        self.use_host_buffers = self.device == "cuda"
        self._param_host: HostBuffer | None = None
        self._optim_host: HostBuffer | None = None
        self._state_bytes = {"params": 0, "optimizer": 0}  # offloaded now, per kind
        self.offloaded_bytes = 0  # most state bytes offloaded at once
        self.peak_host_bytes = 0  # most host-buffer bytes held at once

    def offload_params(self) -> None:
        if not self.param_offload or not self.params_on_device:
            return
        self.model.zero_grad(set_to_none=True)
        tensors = [*self.model.parameters(), *self.model.buffers()]
        self._param_host = self._host_buffer(tensors)
        move_params(self.model, "cpu", self._param_host)
        self._record_offload("params", tensors)
        self.params_on_device = False
        self.events.append(f"{self.name}.offload_params")

    def load_params(self) -> None:
        if self.params_on_device:
            return
        move_params(self.model, self.device)
        self._release(self._param_host)
        self._param_host = None
        self._state_bytes["params"] = 0
        self.params_on_device = True
        self.events.append(f"{self.name}.load_params")

    def offload_optimizer(self) -> None:
        if not self.optimizer_offload or not self.optimizer_on_device:
            return
        assert self.optimizer is not None
        tensors = [state[key] for state, key in _moving_state_tensors(self.optimizer)]
        self._optim_host = self._host_buffer(tensors)
        move_optimizer_state(self.optimizer, "cpu", self._optim_host)
        self._record_offload("optimizer", tensors)
        self.optimizer_on_device = False
        self.events.append(f"{self.name}.offload_optimizer")

    def load_optimizer(self) -> None:
        if self.optimizer_on_device:
            return
        assert self.optimizer is not None
        move_optimizer_state(self.optimizer, self.device)
        self._release(self._optim_host)
        self._optim_host = None
        self._state_bytes["optimizer"] = 0
        self.optimizer_on_device = True
        self.events.append(f"{self.name}.load_optimizer")

    # ------------------------------------------------------------------ host memory
    def _host_buffer(self, tensors: list[torch.Tensor]) -> HostBuffer | None:
        if not self.use_host_buffers:
            return None
        return HostBuffer(tensors, pin=self.device == "cuda")

    def _release(self, host: HostBuffer | None) -> None:
        """The state is back on the device: nothing refers to the host copy any more; free it. (On CPU the
        state stays in the buffer's memory: dropping our reference is all there is to do.)"""
        if host is not None and self.device != "cpu":
            host.release()

    def _record_offload(self, kind: str, tensors: list[torch.Tensor]) -> None:
        self._state_bytes[kind] = local_bytes({id(t): t for t in tensors}.values())
        self.offloaded_bytes = max(self.offloaded_bytes, sum(self._state_bytes.values()))
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes())

    def host_bytes(self) -> int:
        """Bytes of host buffers this role holds now."""
        return sum(h.nbytes for h in (self._param_host, self._optim_host) if h is not None)

    def host_metrics(self) -> dict[str, float]:
        """``memory/<role>_host_bytes_per_offloaded_byte``: host memory taken per byte of offloaded state
        (1.0 plus alignment slack; absent on CPU, where offloading copies nothing)."""
        if self.offloaded_bytes == 0 or self.peak_host_bytes == 0:
            return {}
        return {
            f"memory/{self.name}_offloaded_gb": self.offloaded_bytes / _GB,
            f"memory/{self.name}_host_bytes_per_offloaded_byte": self.peak_host_bytes / self.offloaded_bytes,
        }

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
def role_offloaders(
    cfg: Any, events: Any, *, actor: Any, ref: Any, critic: Any, keep_actor_params: bool
) -> tuple[Offloader | None, Offloader | None, Offloader | None]:
    """The offloaders of a worker's actor, reference (one with a model of its own) and critic, per their
    ``fsdp_config`` offload flags (``cfg``: the typed role configs), recording into ``events``.
    ``keep_actor_params``: an engine on the actor's own module generates with its parameters, so they stay
    (validated at start-up)."""
    actor_mem = ref_mem = critic_mem = None
    if actor is not None:
        fsdp = cfg.actor.fsdp_config
        actor_mem = Offloader(
            "actor",
            actor.model,
            actor.optimizer,
            param_offload=fsdp.param_offload,
            optimizer_offload=fsdp.optimizer_offload,
            events=events,
        )
        actor_mem.param_offload &= not keep_actor_params
    if ref is not None:
        ref_mem = Offloader(
            "ref",
            ref.model,
            None,
            param_offload=cfg.ref.fsdp_config.param_offload,
            optimizer_offload=False,  # a frozen model has no optimizer
            events=events,
        )
    if critic is not None:
        critic_fsdp = cfg.critic.model.fsdp_config
        critic_mem = Offloader(
            "critic",
            critic.model,
            critic.optimizer,
            param_offload=critic_fsdp.param_offload,
            optimizer_offload=critic_fsdp.optimizer_offload,
            events=events,
        )
    return actor_mem, ref_mem, critic_mem


def empty_cache() -> None:
    """Return cached, unused device blocks to the driver (so vLLM can take them). No-op on CPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def allocator_settings() -> str:
    """The CUDA caching allocator's settings string now in effect ("" on CPU or when unreadable)."""
    if not torch.cuda.is_available():
        return ""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return str(getter())
    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


# ---------------------------------------------------------------------- telemetry
def rss_gb() -> float:
    """Resident set size of this process (host memory actually in use), in GB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / _GB


def peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GB  # KiB on Linux


def device_free_total() -> tuple[int, int] | None:
    """``(free, total)`` bytes of the current CUDA device as the driver sees it; None without CUDA.

    Unlike ``memory_allocated`` / ``memory_reserved`` (PyTorch's own bookkeeping, which keeps counting
    vLLM's pool after ``sleep`` because its tensors stay allocated while their memory is unmapped), this
    shows what sleep and offload really gave back to the device.
    """
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


def memory_metrics(phase: str) -> dict[str, float]:
    """``memory/*_after_<phase>``: host RSS always; on a GPU also PyTorch's allocated / reserved and the
    device's free / total memory (``mem_get_info``)."""
    out = {f"memory/cpu_rss_gb_after_{phase}": rss_gb()}
    free_total = device_free_total()
    if free_total is not None:
        out[f"memory/allocated_gb_after_{phase}"] = torch.cuda.memory_allocated() / _GB
        out[f"memory/reserved_gb_after_{phase}"] = torch.cuda.memory_reserved() / _GB
        out[f"memory/device_free_gb_after_{phase}"] = free_total[0] / _GB
        out[f"memory/device_total_gb_after_{phase}"] = free_total[1] / _GB
    return out
