"""Compiled decoder layers for the training passes (``model.compile_layers``).

Each decoder layer's ``forward`` is replaced by ``torch.compile(forward, dynamic=False)`` after FSDP2 has
wrapped the layer, so FSDP2's gather/reshard hooks stay outside the compiled code (they run around the
module call; only the layer's own arithmetic is compiled). One compiled graph serves every layer of the
model: the layers' parameters are graph inputs, not constants.

Why static shapes, and what that asks of the callers: a graph compiled for one ``[rows, columns]`` runs
the fused kernels Inductor generated for exactly that shape (measured in the GRPO step on an AMX Xeon:
the reference pass 25% and the update 15-20% faster than eager; on an AVX-512 BF16 EPYC the update ~15%,
the reference about the same; ``dynamic=True`` was slower than eager). A new shape costs a
compile (seconds), so the padded forwards keep the number of shapes small: `bucketed_window` widens the
trimmed padding window to one of a few widths per doubling (padding columns are masked, so results do
not change), packed rows (``use_remove_padding``) are widened the same way with filler tokens and carry
their attention layout (`fusedrl.workers.packing.pack_batch`), and micro-batches have a fixed row count.
Token-budget micro-batches (``use_dynamic_bsz``) change their row count every micro-batch;
`fusedrl.config` refuses them with this key, as it refuses LoRA and Ulysses.

On CPU Inductor needs a C++ compiler; without one the layers stay eager and one line says so.

Weight gradients of half-precision linears on CPU (`RowMajorGradLinear`). Autograd computes a linear's
weight gradient as ``mm(g.t(), x)``: the output gradient ``g`` read transposed. PyTorch's oneDNN AMX GEMM
runs that product at about half the speed of the same product with a row-major first operand (one thread,
``[1408, 2048] x [2048, 512]`` bf16: 7.3 vs 3.4 ms). Inside a compiled layer the linears compute it from
``g`` transposed into a row-major buffer, which Inductor writes in the kernel that produces ``g`` (the
backward of SiLU, of the rotary embedding, ...): a decoder layer's bf16 forward + backward of 2048 tokens
took 83 instead of 99 ms (benchmarks/RESULTS.md, 2026-12-03 evening). The product goes through a custom op
(`row_major_mm`) because Inductor otherwise drops the transposed copy as a layout change it may choose
freely. Float32 (MKL reads either layout at full speed), eager layers (the copy is a separate pass that
costs what it saves) and GPUs keep PyTorch's own linear.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from fusedrl.utils.hardware import missing_cxx
from fusedrl.workers.fsdp import decoder_layers

logger = logging.getLogger(__name__)

# Padded forwards of a compiled model span one of a few widths per doubling (`bucket_width`): a multiple of
# 8 columns up to 127, of 16 up to 255, of 32 up to 511, ...: at most 1/8 more columns than the batch needs.
MIN_STEP = 8
# Compiled graphs kept per code object before dynamo falls back to eager for new shapes: (grad / no-grad)
# x (full / last micro-batch) x the width buckets of a run's sequence lengths, with room to spare.
RECOMPILE_LIMIT = 128
_MARK = "_fusedrl_compiled_layers"


def compile_layers(model: nn.Module) -> bool:
    """Compile every decoder layer's forward of an FSDP2-wrapped ``model`` in place; returns whether it did
    (False, with one warning, where the CPU has no C++ compiler for Inductor)."""
    if not torch.cuda.is_available():
        cxx = missing_cxx()
        if cxx is not None:
            logger.warning(
                "model.compile_layers=true compiles the decoder layers with torch.compile, which needs a C++ "
                "compiler on CPU, and %r is not on PATH: the layers run eager. Install g++ (or set CXX), or "
                "set model.compile_layers=false",
                cxx,
            )
            return False
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(int(dynamo.recompile_limit), RECOMPILE_LIMIT)
    dynamo.accumulated_recompile_limit = max(int(dynamo.accumulated_recompile_limit), 4 * RECOMPILE_LIMIT)
    for layer in decoder_layers(model):
        if not torch.cuda.is_available():
            use_row_major_weight_grads(layer)
        layer.forward = torch.compile(layer.forward, dynamic=False)  # type: ignore[method-assign]
    setattr(model, _MARK, True)
    return True


_EXACT_STRIDES = getattr(torch.Tag, "needs_exact_strides", torch.Tag.needs_fixed_stride_order)


@torch.library.custom_op("fusedrl::row_major_mm", mutates_args=(), tags=(_EXACT_STRIDES,))
def row_major_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``, with ``a`` and ``b`` in the strides the caller made (Inductor may not re-lay them out)."""
    return torch.mm(a, b)


@row_major_mm.register_fake
def _row_major_mm_shape(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


class _RowMajorGradLinearFn(torch.autograd.Function):
    """``F.linear`` whose weight gradient is ``row_major_mm(g.t().contiguous(), x)`` (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])  # [tokens, out]
        grad_x = (g @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = (
            row_major_mm(g.t().contiguous(), x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        )
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class RowMajorGradLinear(nn.Linear):
    """An ``nn.Linear`` whose half-precision CPU weight gradient reads a row-major output gradient (module
    docstring); any other dtype or device runs ``nn.Linear``'s own forward. `use_row_major_weight_grads`
    turns a layer's linears into it (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and torch.is_grad_enabled():
            return _RowMajorGradLinearFn.apply(x, self.weight, self.bias)
        return super().forward(x)


def use_row_major_weight_grads(module: nn.Module) -> int:
    """Make every plain ``nn.Linear`` under ``module`` a `RowMajorGradLinear` (by class: one compiled graph
    still serves every layer); returns how many."""
    count = 0
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.__class__ = RowMajorGradLinear
            count += 1
    return count


def has_compiled_layers(model: nn.Module) -> bool:
    """Whether `compile_layers` compiled ``model``'s layers (its padded forwards then use `bucketed_window`)."""
    return bool(getattr(model, _MARK, False))


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def bucket_width(width: int) -> int:
    """The smallest bucket >= ``width``: a multiple of ``max(MIN_STEP, 2**(bits(width) - 4))``."""
    return _round_up(width, max(MIN_STEP, 1 << max(width.bit_length() - 4, 0)))


def bucketed_window(first: int, last: int, prompt_len: int, resp_len: int) -> tuple[int, int]:
    """Widen a padded forward's window ``[first, prompt_len + last)`` (prompt columns from ``first``,
    ``last`` response columns) to a `bucket_width` where the batch's columns allow.

    ``last`` grows first (up to ``resp_len``) to a multiple of ``MIN_STEP``, so the LM head's
    ``logits_to_keep`` varies little too; then ``first`` moves left (down to 0). Every added column is
    padding in every row (the caller trimmed exactly those), so the result is the same up to rounding."""
    last = min(_round_up(last, MIN_STEP), resp_len)
    width = prompt_len - first + last
    first = max(prompt_len + last - bucket_width(width), 0)
    return first, last
