"""FSDP2 for the fused worker's models: build, shard, and stream full tensors out of the shards.

Sharding follows the usual FSDP2 recipe, as a short ordered series of steps: every decoder layer is its
own ``fully_shard`` unit (so only one layer is gathered at a time in forward/backward), then the root
module takes the embeddings, the final norm and the LM head.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeGuard, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from fusedrl.workers.expert_parallel import fsdp_ignored_params, shard_experts
from fusedrl.workers.model_layers import decoder_layers
from fusedrl.workers.shm_collectives import ShmCollectives, for_group, install_on_fsdp

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def to_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh() -> DeviceMesh:
    """A 1-D data-parallel mesh over the whole (already initialised) default process group."""
    return init_device_mesh(device_type(), (dist.get_world_size(),), mesh_dim_names=("dp",))


def resolve_attn_implementation(name: str | None, *, packed: bool = False) -> str:
    """``auto``: FlashAttention-2 on CUDA when ``flash-attn`` is installed, PyTorch SDPA otherwise; on a
    CPU-only machine fusedrl's CPU variant of SDPA (`fusedrl.workers.cpu_attention`: short half-precision
    attention as two matmuls, packed rows one sequence at a time). ``packed``: the role packs rows
    (``model.use_remove_padding``); on CUDA with SDPA that costs time, and one warning says so."""
    resolved = _attn_implementation(name)
    if packed and resolved == "sdpa" and torch.cuda.is_available():
        _warn_packed_sdpa_on_cuda()
    return resolved


def _attn_implementation(name: str | None) -> str:
    import importlib.util

    has_flash = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None
    if name in (None, "auto"):
        if has_flash:
            return "flash_attention_2"
        if not torch.cuda.is_available():
            from fusedrl.workers.cpu_attention import register

            return register()
        return "sdpa"
    if name == "flash_attention_2" and not has_flash:
        raise RuntimeError(
            "model.attn_implementation=flash_attention_2 needs a CUDA device and the flash-attn package "
            "(pip install flash-attn); use `auto` or `sdpa` here."
        )
    return name


@functools.cache
def _warn_packed_sdpa_on_cuda() -> None:
    """Once per process: packed rows under SDPA on CUDA attend through a dense block-diagonal mask over
    the whole packed row (Transformers builds it from the restarting positions), so they cost more than padded
    rows. Measured on an H200, 0.36B model, one run (benchmarks/results_archive/2026-12.md, "GPU, second
    lending"): update 2.87 s packed vs 1.79 s padded, old log-prob 0.67 vs 0.23 s."""
    logging.getLogger("fusedrl").warning(
        "model.use_remove_padding=true on CUDA without flash-attn: packed rows run PyTorch SDPA with a "
        "dense mask over each packed row, slower than padded rows (on an H200 the actor update took 1.6x "
        "as long). Install flash-attn (pip install flash-attn) or set model.use_remove_padding=false."
    )


def load_causal_lm(path: str, dtype: str, attn_implementation: str = "sdpa") -> nn.Module:
    """Load a Hugging Face causal LM on CPU in ``dtype`` (the *master* dtype of training)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=to_dtype(dtype), attn_implementation=attn_implementation
    )
    model.config.use_cache = False  # training forwards never use the KV cache
    return model


def apply_fsdp2(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2: one unit per decoder layer, then the root. Units reshard
    after forward (memory first); `gathered_for_pass` keeps them gathered for a whole pass where that pays.
    Experts already spread by `fusedrl.workers.expert_parallel.shard_experts` are left to it."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp,
            reshard_after_forward=True,
            ignored_params=fsdp_ignored_params(layer) or None,
        )
    # A PEFT model's root unit is the wrapped model: its own forward runs under generate() too (PEFT's
    # generate skips the wrapper's forward), and the wrapper forwards FSDP's methods to it.
    root = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    fully_shard(
        root,
        mesh=mesh,
        mp_policy=mp,
        reshard_after_forward=True,
        ignored_params=fsdp_ignored_params(root) or None,
    )
    # CPU ranks on one host gather and reduce through shared memory instead of gloo's TCP loopback.
    install_on_fsdp(fsdp_units(model))
    return model


# On CPU, keep every FSDP2 unit gathered for a whole pass (see `gathered_for_pass`). A module-level switch
# so that benchmarks can measure the per-micro-batch regather it replaces.
GATHER_ONCE_PER_PASS = True


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """The ``fully_shard`` units inside ``model`` (decoder layers and the root), outermost first."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def keeps_gathered(model: nn.Module) -> bool:
    """Whether `gathered_for_pass` keeps ``model``'s parameters gathered: on CPU, for a sharded model.

    On CPU memory is plentiful and every gloo all-gather is a synchronous round trip that the compute
    cannot hide, so gathering each layer once per pass instead of once per micro-batch forward (and again
    for its backward) is pure gain. On GPU the default stays: NCCL gathers overlap compute, and a
    resident full model would cost the memory FSDP exists to save.
    """
    return GATHER_ONCE_PER_PASS and not torch.cuda.is_available() and bool(fsdp_units(model))


@contextmanager
def gathered_for_pass(model: nn.Module) -> Iterator[None]:
    """Inside: FSDP2 units gathered by the first forward stay gathered through every later forward and
    backward (no reshard after forward or backward); on exit all units are resharded and set back to
    resharding, so the optimizer and the weight stream see the sharded parameters again. Gradient
    reduction is untouched (see `fusedrl.workers.optim_step.defer_grad_sync`). A no-op where
    `keeps_gathered` is false. Not reentrant: callers wrap one pass."""
    units = fsdp_units(model) if keeps_gathered(model) else []
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(True, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
        for unit in units:
            unit.reshard()


def shard_for_training(
    model: nn.Module,
    *,
    gradient_checkpointing: bool,
    param_dtype: str | None,
    compile_layers: bool = False,
    expert_parallel_size: int = 1,
) -> nn.Module:
    """The one wrap of every role's model: non-reentrant gradient checkpointing (a role's
    ``model.enable_gradient_checkpointing``), onto the worker's device, then FSDP2 with the role's
    ``fsdp_config.param_dtype`` mixed precision (gradients reduced in float32), then, with
    ``model.compile_layers``, torch.compile of each decoder layer (`fusedrl.workers.layer_compile`).
    ``expert_parallel_size`` > 1 (``fsdp_config.turbo_config.distributed.expert_parallel_size``, equal to the
    data-parallel size: checked before Ray starts): the experts are spread over FSDP2's own mesh first
    (`fusedrl.workers.expert_parallel.shard_experts`), where FSDP2 would have sharded them, and FSDP2 leaves
    them alone."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    model.to(device_type())
    mesh = build_mesh()
    if expert_parallel_size > 1:
        if expert_parallel_size != mesh.size():
            raise ValueError(
                f"expert_parallel_size={expert_parallel_size}: only the whole data-parallel group "
                f"({mesh.size()} ranks) is supported"
            )
        if compile_layers:
            raise ValueError(
                "expert parallelism with compiled decoder layers has not been run: "
                "set actor_rollout_ref.model.compile_layers=false"
            )
        shard_experts(model, mesh)
    model = apply_fsdp2(model, mesh, param_dtype=to_dtype(param_dtype) if param_dtype else None)
    if compile_layers:
        from fusedrl.workers.layer_compile import compile_layers as compile_decoder_layers

        compile_decoder_layers(model)
    return model


def build_adamw(model: nn.Module, optim_cfg: Any, lr: float | None = None) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters from an ``optim`` config section (a
    `fusedrl.role_config.OptimConfig` / ``SFTOptimConfig``; ``lr`` overrides ``optim_cfg.lr``, for
    schedules that start elsewhere)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params,
        lr=float(optim_cfg.lr if lr is None else lr),
        betas=(float(optim_cfg.betas[0]), float(optim_cfg.betas[1])),
        weight_decay=float(optim_cfg.weight_decay),
        # One fused kernel per parameter instead of torch's multi-tensor loop of separate ops: on CPU
        # 3.7x faster (12.3M parameters, one thread: 10 vs 38 ms a step); the same update up to rounding.
        fused=_fused_adamw_ok(params) or None,
    )


def _fused_adamw_ok(params: Sequence[torch.Tensor]) -> bool:
    """torch's fused AdamW takes floating parameters on CPU or CUDA."""
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


@dataclass
class StreamStats:
    """Bookkeeping of one weight stream: how many full tensors were alive at once, at most.

    ``peak_live_bytes`` counts the gathered tensors (and layer buffers, ``largest_buffer_bytes``) the
    stream created that were still referenced by anyone (us or the engine's loader) when the next one was
    created. With one rank and no dtype change no tensor is created (the shard *is* the full tensor) and it
    stays 0.
    """

    num_tensors: int = 0
    total_bytes: int = 0
    largest_bytes: int = 0
    peak_live_bytes: int = 0
    largest_buffer_bytes: int = 0
    _live: dict[int, int] = field(default_factory=dict)

    def record(self, full: torch.Tensor, is_new: bool) -> None:
        """Count one streamed tensor; track it while alive when the stream created it (``is_new``)."""
        nbytes = full.numel() * full.element_size()
        self.num_tensors += 1
        self.total_bytes += nbytes
        self.largest_bytes = max(self.largest_bytes, nbytes)
        if is_new:
            self._track(full)

    def record_buffer(self, buffer: torch.Tensor) -> None:
        """Track a buffer the stream gathered several tensors into (one decoder layer), while alive."""
        self.largest_buffer_bytes = max(self.largest_buffer_bytes, buffer.numel() * buffer.element_size())
        self._track(buffer)

    def _track(self, t: torch.Tensor) -> None:
        key = id(t)
        self._live[key] = t.numel() * t.element_size()
        weakref.finalize(t, self._live.pop, key, None)
        self.peak_live_bytes = max(self.peak_live_bytes, sum(self._live.values()))


def gather_full(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, bool]:
    """``(full tensor, whether it is a new tensor)`` of a state-dict entry. Collective for a DTensor
    sharded over several ranks (an all-gather); with one rank the shard is the whole tensor and our own
    storage is returned. ``dtype``: cast floating tensors to it first, the shard before the gather (half
    the bytes on the wire for bf16; rounding is per element, so the result equals casting afterwards)."""
    cast_to = _cast(tensor, dtype)
    recast = cast_to is not tensor
    tensor = cast_to  # a DTensor stays a DTensor: only the local shard is cast
    if not isinstance(tensor, DTensor):
        return tensor, recast
    if tensor.device_mesh.size() == 1:
        return tensor.to_local(), recast
    shm = _dim0_shm(tensor)
    if shm is not None:
        _, (full,) = _gather_dim0(shm, [tensor])
        return full(), True
    return tensor.full_tensor(), True


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` in ``dtype`` when it is floating and of another dtype; else ``tensor`` itself."""
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor


def _is_dim0(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """A CPU DTensor sharded on dim 0 of a 1-D mesh (FSDP2's layout): what the shared-memory gather takes."""
    return (
        isinstance(tensor, DTensor)
        and tensor.device.type == "cpu"
        and tensor.device_mesh.ndim == 1
        and tuple(tensor.placements) == (Shard(0),)
    )


def _dim0_shm(tensor: torch.Tensor) -> ShmCollectives | None:
    """The shared-memory collectives of ``tensor``'s mesh when it is `_is_dim0` and the mesh's ranks share a
    host (`fusedrl.workers.shm_collectives.for_group`); else None."""
    return for_group(tensor.device_mesh.get_group()) if _is_dim0(tensor) else None


def _gather_dim0(
    shm: ShmCollectives, tensors: Sequence[DTensor]
) -> tuple[torch.Tensor, list[Callable[[], torch.Tensor]]]:
    """``full_tensor()`` of dim-0-sharded DTensors of one dtype with one all-gather through shared memory.

    FSDP2 shards like ``torch.chunk``: rank r holds rows ``[r * c, (r + 1) * c)`` of ``c = ceil(rows / W)``,
    the last ranks fewer or none. Every rank lays its shards end to end, each padded to ``c`` rows. Returns
    the gathered buffer (``[W, per-rank elements]``) and one function per tensor that gives its full tensor
    when called (a view of the buffer for a single tensor, whose padded layout is the full tensor's; else
    a copy out of it); the functions hold the buffer."""
    world, rank = shm.world, shm.rank
    sizes = [-(-t.shape[0] // world) * math.prod(t.shape[1:]) for t in tensors]  # per rank, padded
    per_rank = sum(sizes)
    out = torch.empty(world * per_rank, dtype=tensors[0].dtype)
    mine = out[rank * per_rank : (rank + 1) * per_rank]
    offset = 0
    for t, size in zip(tensors, sizes):
        local = t.to_local().reshape(-1)
        mine[offset : offset + local.numel()].copy_(local)
        offset += size
    shm.all_gather(out, mine)
    by_rank = out.view(world, per_rank)

    def full(t: DTensor, offset: int, size: int) -> Callable[[], torch.Tensor]:
        rows, rest = t.shape[0], t.shape[1:]

        def copy_out() -> torch.Tensor:
            if size == per_rank:  # the only tensor: the buffer is its padded full tensor
                return by_rank.view(-1, *rest)[:rows]
            return torch.cat([by_rank[r, offset : offset + size] for r in range(world)]).view(-1, *rest)[
                :rows
            ]

        return copy_out

    fulls, offset = [], 0
    for t, size in zip(tensors, sizes):
        fulls.append(full(t, offset, size))
        offset += size
    return by_rank, fulls


def stream_full_tensors(
    model: nn.Module, stats: StreamStats | None = None, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every parameter and persistent buffer, one at a time;
    floating tensors in ``dtype`` when given (the receiving engine's: see `gather_full`).

    Collective: every rank must consume the whole iterator in the same order, because gathering a
    ``DTensor`` is an all-gather. The gathered tensor is handed to the caller and dropped here, so with
    a consumer that copies and forgets, no second copy of the model ever exists. On CPU ranks that share
    a host, the tensors of one decoder layer are gathered together, in one collective through shared
    memory (`layer_groups`): then at most one layer's tensors plus the one being consumed are alive.
    Elsewhere each tensor is gathered on its own and about one tensor is alive at a time.
    """
    for group in layer_groups(model.state_dict().items()):
        shm = _shm_for_group(group, dtype)
        if shm is not None and len(group) > 1:
            shards = [cast(DTensor, _cast(t, dtype)) for _, t in group]  # `_shm_for_group`: all DTensors
            buffer, fulls = _gather_dim0(shm, shards)
            if stats is not None:  # the whole layer, gathered, is alive until its last tensor is out
                stats.record_buffer(buffer)
            del buffer
            for name, _ in group:
                copy_out = fulls.pop(0)
                tensor = copy_out()
                del copy_out  # the last one holds the buffer: it goes before the next layer is gathered
                if stats is not None:
                    stats.record(tensor, True)
                yield name, tensor
                del tensor
            continue
        for name, tensor in group:
            full, is_new = gather_full(tensor, dtype)
            if stats is not None:
                stats.record(full, is_new)
            # state_dict() tensors are already detached; yield the very object we track, so the
            # bookkeeping sees exactly when the consumer lets go of it.
            yield name, full
            del full


_LAYER = re.compile(r"^(.*?\.\d+)\.")


def layer_groups(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive state-dict entries grouped by the decoder layer they belong to (the name up to its
    first numeric component, ``model.layers.3``); an entry outside any layer is a group of its own."""
    group: list[tuple[str, torch.Tensor]] = []
    key: str | None = None
    for name, tensor in items:
        m = _LAYER.match(name)
        k = m.group(1) if m else None
        if group and (k is None or k != key):
            yield group
            group = []
        group.append((name, tensor))
        key = k
    if group:
        yield group


def _shm_for_group(group: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> ShmCollectives | None:
    """The shared-memory collectives when every tensor of ``group`` is `_is_dim0` on one mesh of several
    ranks and all have one dtype after the cast to ``dtype``; else None."""
    first = group[0][1]
    if not _is_dim0(first) or first.device_mesh.size() == 1:
        return None
    mesh = first.device_mesh
    if not all(_is_dim0(t) and t.device_mesh == mesh for _, t in group):
        return None
    if len({dtype if dtype is not None and t.is_floating_point() else t.dtype for _, t in group}) != 1:
        return None
    return _dim0_shm(first)
