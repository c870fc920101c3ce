"""Compiled decoder layers for the training passes (``model.compile_layers``).

Each decoder layer's ``forward`` is replaced by ``torch.compile(forward)`` after FSDP2 has wrapped the
layer, so FSDP2's gather/reshard hooks stay outside the compiled code (they run around the module call;
only the layer's own arithmetic is compiled). One compiled graph serves every layer of the model: the
layers' parameters are graph inputs, not constants.

Shapes. The first call compiles for its exact shapes. The first call with a different token count
recompiles once with dynamo's automatic dynamic shapes: the sizes that changed (tokens of a packed row,
rows and columns of a padded batch, sequences and the longest one in an attention layout) become symbolic,
the rest (hidden, head and MLP sizes) stay constants, and that graph serves every later shape. A run thus
compiles twice per graph (grad / no-grad) and never pads a batch to fit a compiled shape. Measured on an
AVX-512 BF16 EPYC (benchmarks/results_archive/2026-12.md, 2026-12-04): the dynamic graph runs a layer's packed
bf16 forward + backward in the same time per token as the static one, and the GRPO step lost the 2-6 s a new
width cost when every shape was compiled (widths bucketed, up to 1/8 padding). ``dynamic=True`` is not used:
it makes the rotary embedding's head dimension symbolic too, and the attention's copies then run as scalar
loops (reference pass 2.2x slower). Packed rows carry their attention layout as tensors
(`fusedrl.workers.packing.pack_batch` with ``layout=True``) so that no sequence boundary is read as a
Python number inside the compiled code.

A second run of the same work starts warm. Inductor's cache (per instruction set,
`fusedrl.utils.hardware.isolate_inductor_cache`) keeps the compiled kernels; dynamo's profile of which sizes
changed (its profile-guided dynamic shapes, kept on disk only for a named job) is kept under a job name made
from the model's config and the layout of the passes (`remember_dynamic_shapes`), so the second run compiles
each graph once, dynamic from its first call, instead of static then dynamic. AOTAutograd's cache then gives
each graph its joint graph and Inductor's cache its kernels; dynamo still traces each graph in every process
(its own cache of traced frames, ``caching_precompile``, crashed on these layers in torch 2.13: a recompile
after loading it fails on a name already in scope).

On CPU Inductor needs a C++ compiler; without one the layers stay eager and one line says so.

Weight gradients of half-precision linears on CPU (`RowMajorGradLinear`). Autograd computes a linear's weight
gradient as ``mm(g.t(), x)``: the output gradient ``g`` read transposed. PyTorch's oneDNN AMX GEMM runs that
product at about half the speed of the same product with a row-major first operand (one thread, ``[1408, 2048]
x [2048, 512]`` bf16: 7.3 vs 3.4 ms). Inside a compiled layer the linears compute it from ``g`` transposed
into a row-major buffer, which Inductor writes in the kernel that produces ``g`` (the backward of SiLU, of the
rotary embedding, ...): a decoder layer's bf16 forward + backward of 2048 tokens took 83 instead of 99 ms
(benchmarks/results_archive/2026-12.md, 2026-12-03 evening). The product goes through a custom op
(`row_major_mm`) because Inductor otherwise drops the transposed copy as a layout change it may choose freely;
the linear itself is a custom op with its own autograd formula (`row_major_linear`), as an
``autograd.Function`` would keep the graph out of AOTAutograd's cache. Float32 (MKL reads either layout at
full speed), eager layers (the copy is a separate pass that costs what it saves) and GPUs keep PyTorch's own
linear.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import torch
from torch import nn

from fusedrl.utils.hardware import isolate_inductor_cache, missing_cxx
from fusedrl.workers.model_layers import decoder_layers

logger = logging.getLogger(__name__)

# Compiled graphs kept per code object before dynamo falls back to eager: the roles sharing the layer class
# (actor, reference, critic) x (grad / no-grad) x (the first, static shape + the dynamic one, + a
# specialised one-row batch), with room to spare.
RECOMPILE_LIMIT = 64
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
        isolate_inductor_cache()
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(int(dynamo.recompile_limit), RECOMPILE_LIMIT)
    dynamo.accumulated_recompile_limit = max(int(dynamo.accumulated_recompile_limit), 4 * RECOMPILE_LIMIT)
    for layer in decoder_layers(model):
        if not torch.cuda.is_available():
            use_row_major_weight_grads(layer)
        layer.forward = torch.compile(layer.forward)  # type: ignore[method-assign]
    setattr(model, _MARK, True)
    return True


def remember_dynamic_shapes(model_path: str, **layout: object) -> str | None:
    """Name this process's compile job after the work, so dynamo keeps its record of which input sizes
    change between calls across runs (``torch.compiler.config.job_id``; without a name it keeps none) and a
    later run of the same work compiles the dynamic graph at its first call. The name hashes the model's
    ``config.json`` (a model of other sizes must not inherit a dimension marked dynamic) and ``layout`` (what
    shapes the passes: packed rows, Ulysses size, world size). A name the user set
    (``TORCH_COMPILE_JOB_ID``) is kept. Call before anything in the process compiles (the engine compiles at
    its start). Returns the name in use."""
    config = torch.compiler.config
    if config.job_id is not None:
        return config.job_id
    try:
        with open(os.path.join(model_path, "config.json"), "rb") as f:
            model_key = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        model_key = model_path
    key = json.dumps({"model": model_key, "torch": torch.__version__, **layout}, sort_keys=True, default=str)
    config.job_id = "fusedrl-" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return config.job_id


_EXACT_STRIDES = getattr(torch.Tag, "needs_exact_strides", torch.Tag.needs_fixed_stride_order)


@torch.library.custom_op("fusedrl::row_major_mm", mutates_args=(), tags=(_EXACT_STRIDES,))
def row_major_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``, with ``a`` and ``b`` in the strides the caller made (Inductor may not re-lay them out)."""
    return torch.mm(a, b)


@row_major_mm.register_fake
def _row_major_mm_shape(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("fusedrl::row_major_linear", mutates_args=())
def row_major_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` whose weight gradient is ``row_major_mm(g.t().contiguous(), x)`` (module docstring). A
    custom op with its own autograd formula rather than an ``autograd.Function``: dynamo records the latter as
    a higher-order op that AOTAutograd's cache refuses (the compiled layer's grad graph was then traced anew
    in every process), while a custom op's graph is cached like any other."""
    return torch.nn.functional.linear(x, weight, bias)


@row_major_linear.register_fake
def _row_major_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _row_major_linear_setup(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _row_major_linear_backward(ctx, grad: torch.Tensor):
    x, weight = ctx.saved_tensors
    g = grad.reshape(-1, grad.shape[-1])  # [tokens, out]
    grad_x = (g @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
    grad_w = row_major_mm(g.t().contiguous(), x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
    grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


row_major_linear.register_autograd(_row_major_linear_backward, setup_context=_row_major_linear_setup)


class RowMajorGradLinear(nn.Linear):
    """An ``nn.Linear`` whose half-precision CPU weight gradient reads a row-major output gradient (module
    docstring); any other dtype or device runs ``nn.Linear``'s own forward. `use_row_major_weight_grads`
    turns a layer's linears into it (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and torch.is_grad_enabled():
            return row_major_linear(x, self.weight, self.bias)
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
    """Whether `compile_layers` compiled ``model``'s layers (its packed rows then carry their attention
    layout as tensors)."""
    return bool(getattr(model, _MARK, False))
