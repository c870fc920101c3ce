"""`RowMajorGradLinear`: the compiled layers' half-precision linears on CPU compute their weight gradient
from a row-major copy of the output gradient (`fusedrl.workers.layer_compile`, module docstring).

The gradients must be the linear's gradients: checked against float64 arithmetic on the same bf16 inputs,
eager and compiled, with and without bias, on 3-D activations as a decoder layer feeds them; the compiled
backward must really call the row-major product (profiler), and its graph must be one AOTAutograd's cache
keeps (a later process then loads it instead of tracing it again); any other dtype must run ``nn.Linear`` itself,
bit for bit; and swapping a decoder layer's linears keeps its parameters and state dict.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fusedrl.workers.layer_compile import RowMajorGradLinear, use_row_major_weight_grads


def _pair(bias: bool, dtype: torch.dtype) -> tuple[nn.Linear, RowMajorGradLinear]:
    torch.manual_seed(0)
    plain = nn.Linear(48, 40, bias=bias).to(dtype)
    swapped = nn.Linear(48, 40, bias=bias).to(dtype)
    swapped.load_state_dict(plain.state_dict())
    assert use_row_major_weight_grads(swapped) == 1
    assert isinstance(swapped, RowMajorGradLinear)
    return plain, swapped


def _grads(module: nn.Module, x: torch.Tensor, go: torch.Tensor, compiled: bool) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    xs = x.clone().requires_grad_()
    fn = torch.compile(module, dynamic=False) if compiled else module
    out = fn(xs)
    out.backward(go)
    grads = [out.detach(), xs.grad, module.weight.grad]
    if module.bias is not None:
        grads.append(module.bias.grad)
    return grads


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_bf16_gradients_are_the_linears(bias, compiled):
    plain, swapped = _pair(bias, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 37, 48, generator=g).to(torch.bfloat16)  # [batch, tokens, in]: a layer's activations
    go = torch.randn(3, 37, 40, generator=g).to(torch.bfloat16)
    got = _grads(swapped, x, go, compiled)
    # float64 from the very same bf16 values: y = x W^T + b, dx = g W, dW = g^T x, db = sum g
    w, x64, g64 = swapped.weight.detach().double(), x.double().reshape(-1, 48), go.double().reshape(-1, 40)
    want = [x64 @ w.T, g64 @ w, g64.T @ x64]
    if bias:
        want[0] = want[0] + swapped.bias.detach().double()
        want.append(g64.sum(0))
    want[0] = want[0].view(3, 37, 40)
    want[1] = want[1].view(3, 37, 48)
    names = ("out", "grad_x", "grad_w", "grad_b")[: len(got)]
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape, name
        err = float((a.double() - b).abs().max())
        assert err <= 1e-2 * float(b.abs().max()), (name, err)  # bf16 keeps 8 bits: 2^-8 of the scale
    # and what nn.Linear computes, up to the order of the float32 sums
    for name, a, b in zip(names, got, _grads(plain, x, go, compiled), strict=True):
        assert float((a.float() - b.float()).abs().max()) <= 1e-2 * float(b.float().abs().max()), name


def test_compiled_backward_calls_the_row_major_product():
    from torch._dynamo.utils import counters

    _, swapped = _pair(True, torch.bfloat16)
    x = torch.randn(2, 33, 48).to(torch.bfloat16).requires_grad_()
    fn = torch.compile(swapped, dynamic=False)
    before = dict(counters["aot_autograd"])
    fn(x).sum().backward()  # compile outside the profile
    compiled = {k: v - before.get(k, 0) for k, v in counters["aot_autograd"].items()}
    # an autograd.Function would be a higher-order op here, which AOTAutograd's cache bypasses
    assert compiled.get("autograd_cache_bypass", 0) == 0 and compiled.get("total") == 1, compiled
    with torch.profiler.profile() as prof:
        fn(x).sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert "fusedrl::row_major_mm" in names, sorted(names)


def test_float32_and_no_grad_run_nn_linear_itself():
    plain, swapped = _pair(True, torch.float32)
    x = torch.randn(4, 9, 48)
    go = torch.randn(4, 9, 40)
    for a, b in zip(_grads(swapped, x, go, False), _grads(plain, x, go, False), strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        xb = x.to(torch.bfloat16)
        assert torch.equal(swapped.to(torch.bfloat16)(xb), plain.to(torch.bfloat16)(xb))


def test_swapping_a_decoder_layer_keeps_its_parameters(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from fusedrl.workers.model_layers import decoder_layers

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    layer = decoder_layers(model)[0]
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    linears = [m for m in layer.modules() if type(m) is nn.Linear]
    assert use_row_major_weight_grads(layer) == len(linears) >= 4  # attention projections and the MLP
    after = layer.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert use_row_major_weight_grads(layer) == 0  # already swapped: nothing left to do


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_compiled_bf16_decoder_layer_gradients(tiny_model_dir):
    """A whole decoder layer, compiled in bf16 as the training passes run it: Inductor writes the
    transposed output gradients inside its fused backward kernels (SiLU, rotary); every parameter's
    gradient stays the plain layer's up to the order of its float32 sums."""
    from transformers import AutoModelForCausalLM

    from fusedrl.workers.cpu_attention import register
    from fusedrl.workers.model_layers import decoder_layers

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.bfloat16, attn_implementation=register()
    )
    rotary = model.model.rotary_emb
    hidden = model.config.hidden_size
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 21, hidden, generator=g).to(torch.bfloat16)
    go = torch.randn(4, 21, hidden, generator=g).to(torch.bfloat16)
    pos = torch.arange(21)[None].expand(4, 21)
    cos_sin = rotary(x, pos)
    grads = {}
    plain_layer = decoder_layers(model)[0]
    for swapped in (False, True):
        layer = copy.deepcopy(plain_layer)  # the same weights, compiled and differentiated on their own
        if swapped:
            assert use_row_major_weight_grads(layer) >= 4
        fn = torch.compile(
            lambda h, layer=layer: layer(
                h, position_embeddings=cos_sin, attention_mask=None, position_ids=pos
            ),
            dynamic=False,
        )
        xs = x.clone().requires_grad_()
        out = fn(xs)
        (out[0] if isinstance(out, tuple) else out).backward(go)
        grads[swapped] = {"input": xs.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    assert grads[True].keys() == grads[False].keys()
    for name, want in grads[False].items():
        got = grads[True][name]
        assert got is not None and want is not None and float(want.float().norm()) > 0, name
        rel = float((got.float() - want.float()).norm() / want.float().norm())
        assert rel < 1e-3, (name, rel)  # measured: 0 to 6e-6 (the same products, summed in another order)
