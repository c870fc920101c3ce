"""The CPU attention of training forwards (`fusedrl.workers.cpu_attention`): short bf16 sequences run as
two matmuls, everything else as SDPA, with the same results."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import fusedrl.workers.cpu_attention as cpu_attention
from fusedrl.workers.fsdp import resolve_attn_implementation


def _qkv(b: int, h: int, kvh: int, t: int, d: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, t, d, generator=g).to(dtype) for n in (h, kvh, kvh))
    return [x.requires_grad_() for x in (q, k, v)]


def _padding_mask(b: int, t: int) -> torch.Tensor:
    """[b, 1, t, t] boolean causal mask with rows 0 and 1 left-padded by 3 and 5 positions."""
    keep = torch.ones(b, t, dtype=torch.bool)
    keep[0, :3] = False
    keep[1, :5] = False
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return (causal[None] & keep[:, None, :])[:, None]


@pytest.mark.parametrize("mask_kind", ["padding", "additive", "causal_none"])
def test_matmul_attention_equals_sdpa_in_float32(mask_kind):
    q, k, v = _qkv(3, 4, 2, 12, 8, torch.float32)
    if mask_kind == "causal_none":
        mask, ref_kwargs = None, {"is_causal": True}
    else:
        boolean = _padding_mask(3, 12)
        boolean[:, :, :, 0] = True  # no fully masked row: SDPA would give NaN there
        mask = boolean if mask_kind == "padding" else torch.zeros(boolean.shape).masked_fill(~boolean, -1e9)
        ref_kwargs = {"attn_mask": mask}
    out = cpu_attention.matmul_attention(q, k, v, mask, scaling=8**-0.5, causal=True)  # [b, h, q, d]
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **ref_kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_are_finite():
    """A left-padding query sees no key: a uniform average of the values, not NaN, and finite gradients."""
    q, k, v = _qkv(2, 4, 2, 10, 8, torch.bfloat16)
    out = cpu_attention.matmul_attention(q, k, v, _padding_mask(2, 10), scaling=8**-0.5, causal=True)
    assert torch.isfinite(out.float()).all()
    # row 1, query 2 is padding (5 padded positions): the mean of its group's values over all 10 keys
    expected = v[1].float().mean(dim=1).repeat_interleave(2, dim=0)  # [h, d]
    torch.testing.assert_close(out[1, :, 2].float(), expected, rtol=0.02, atol=0.02)
    out.float().sum().backward()
    assert all(torch.isfinite(x.grad.float()).all() for x in (q, k, v))


def test_compiled_scores_keep_the_grad_graph_cacheable():
    """Compiled, the attention's forward + backward is one graph AOTAutograd's cache keeps (a later process
    loads it instead of tracing it again): its scores are a custom op with an autograd formula, where an
    ``autograd.Function`` (a higher-order op to dynamo) made the cache bypass the layer's grad graph."""
    from torch._dynamo.utils import counters

    q, k, v = _qkv(2, 4, 2, 10, 8, torch.bfloat16)
    fn = torch.compile(
        lambda q, k, v: cpu_attention.matmul_attention(q, k, v, None, scaling=0.3, causal=True)
    )
    before = dict(counters["aot_autograd"])
    fn(q, k, v).float().sum().backward()
    compiled = {key: n - before.get(key, 0) for key, n in counters["aot_autograd"].items()}
    assert compiled.get("autograd_cache_bypass", 0) == 0 and compiled.get("total") == 1, compiled
    assert all(torch.isfinite(x.grad.float()).all() for x in (q, k, v))


def test_the_path_depends_on_device_dtype_length_and_dropout():
    q = torch.zeros(1, 4, 8, 16, dtype=torch.bfloat16)
    short, long_ = (
        torch.zeros(1, 2, 255, 16, dtype=torch.bfloat16),
        torch.zeros(1, 2, 256, 16, dtype=torch.bfloat16),
    )
    assert cpu_attention.takes_matmul_path(q, short, 0.0)
    assert not cpu_attention.takes_matmul_path(q, long_, 0.0)
    assert not cpu_attention.takes_matmul_path(q, short, 0.1)
    assert not cpu_attention.takes_matmul_path(q.float(), short.float(), 0.0)
    assert cpu_attention.takes_matmul_path(q.half(), short.half(), 0.0)


def test_auto_selects_it_on_cpu_and_sdpa_stays_sdpa():
    if torch.cuda.is_available():
        pytest.skip("the CPU attention is chosen on CPU-only machines")
    assert resolve_attn_implementation("auto") == cpu_attention.NAME
    assert resolve_attn_implementation("sdpa") == "sdpa"


def test_packed_rows_under_sdpa_on_cuda_warn_once(monkeypatch, caplog):
    """CUDA without flash-attn (faked: no GPU here): packed rows get SDPA and one warning that names
    the key and the fix; padded rows get no warning."""
    import importlib.util

    from fusedrl.workers import fsdp

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real_find_spec(n, *a)
    )
    fsdp._warn_packed_sdpa_on_cuda.cache_clear()
    with caplog.at_level("WARNING", logger="fusedrl"):
        assert resolve_attn_implementation("auto") == "sdpa"
        assert not caplog.records
        assert resolve_attn_implementation("auto", packed=True) == "sdpa"
        assert resolve_attn_implementation("sdpa", packed=True) == "sdpa"
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "model.use_remove_padding" in msg and "flash-attn" in msg


def _left_padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (4, 40), generator=g)
    mask = torch.ones(4, 40, dtype=torch.long)
    mask[0, :7] = 0
    mask[2, :19] = 0
    return ids, mask


def _logits_and_grads(path: str, impl: str, dtype: torch.dtype):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=impl)
    ids, mask = _left_padded_batch(model.config.vocab_size)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits.float()
    (logits.log_softmax(-1) * mask[..., None]).sum().backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    return logits, mask.bool(), grads


def test_model_in_bf16_matches_sdpa_and_takes_the_matmul_path(tiny_model_dir, monkeypatch):
    calls = []
    real = cpu_attention.matmul_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_attention, "matmul_attention", counted)
    name = cpu_attention.register()
    logits, real_tokens, grads = _logits_and_grads(tiny_model_dir, name, torch.bfloat16)
    assert len(calls) == 2  # one per decoder layer of the tiny model: the matmul path ran
    ref_logits, _, ref_grads = _logits_and_grads(tiny_model_dir, "sdpa", torch.bfloat16)
    # bf16 rounding differs between the kernels; the real tokens agree to bf16 precision
    torch.testing.assert_close(logits[real_tokens], ref_logits[real_tokens], rtol=0.02, atol=0.02)
    for name_, grad in grads.items():
        assert torch.isfinite(grad).all(), name_
        rel = (grad - ref_grads[name_]).norm() / ref_grads[name_].norm().clamp(min=1e-12)
        assert rel < 0.03, (name_, float(rel))


def test_model_in_float32_is_exactly_sdpa(tiny_model_dir):
    name = cpu_attention.register()
    logits, _, grads = _logits_and_grads(tiny_model_dir, name, torch.float32)
    ref_logits, _, ref_grads = _logits_and_grads(tiny_model_dir, "sdpa", torch.float32)
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_saved_config_does_not_name_it(tiny_model_dir, tmp_path):
    """A checkpoint or export written from a model loaded with it loads anywhere (vLLM reads config.json)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=cpu_attention.register())
    model.save_pretrained(str(tmp_path))
    with open(os.path.join(tmp_path, "config.json")) as f:
        config = json.load(f)
    assert cpu_attention.NAME not in json.dumps(config)


@pytest.mark.parametrize("padded", [False, True])
def test_cached_decode_step_equals_full_forward(tiny_model_dir, padded):
    """The HF rollout decodes with a KV cache: one query against more keys (mask aligned to the last key)."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.bfloat16, attn_implementation=cpu_attention.register()
    )
    ids, mask = _left_padded_batch(model.config.vocab_size)
    if not padded:
        mask = torch.ones_like(mask)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1].float()
        prefix = model(
            input_ids=ids[:, :-1],
            attention_mask=mask[:, :-1],
            position_ids=position_ids[:, :-1],
            use_cache=True,
        )
        step = (
            model(
                input_ids=ids[:, -1:],
                attention_mask=mask,
                position_ids=position_ids[:, -1:],
                past_key_values=prefix.past_key_values,
                use_cache=True,
            )
            .logits[:, -1]
            .float()
        )
    torch.testing.assert_close(step, full, rtol=0.02, atol=0.02)


@pytest.mark.parametrize(
    ("dtype", "lengths"),
    [
        (torch.float32, [5, 9, 4]),  # short: one padded batch of the three sequences
        (torch.bfloat16, [5, 9, 4]),
        (torch.float32, [260, 9, 4]),  # one sequence >= MATMUL_BELOW: one sequence at a time
        (torch.bfloat16, [260, 9, 4]),
    ],
)
def test_packed_row_equals_block_diagonal_sdpa(dtype, lengths):
    """Three sequences end to end (positions restarting): per-sequence causal attention = SDPA with the
    block-diagonal causal mask Transformers would build, values and gradients."""
    n = sum(lengths)
    q, k, v = _qkv(1, 4, 2, n, 8, dtype)
    position_ids = torch.cat([torch.arange(n_) for n_ in lengths])[None]  # [1, N]
    bounds = cpu_attention.packed_segments(position_ids, q, k)
    assert bounds == [0, lengths[0], lengths[0] + lengths[1], n]
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    idx = torch.arange(n)
    mask = ((seg[:, None] == seg[None]) & (idx[None] <= idx[:, None]))[None, None]  # [1, 1, N, N]
    out, _ = cpu_attention.attention(
        torch.nn.Module(), q, k, v, mask, scaling=8**-0.5, position_ids=position_ids
    )  # [1, N, h, d]
    ref = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=8**-0.5, enable_gqa=True
    ).transpose(1, 2)
    tol = 1e-5 if dtype == torch.float32 else 0.02
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol * 3, atol=tol * 3)


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize(
    ("dtype", "lengths"),
    [
        (torch.float32, [7, 3, 12]),  # short: one padded batch of the sequences
        (torch.bfloat16, [7, 3, 12]),
        (torch.float32, [260, 5]),  # one sequence >= MATMUL_BELOW: one sequence at a time
    ],
)
def test_packed_row_with_a_sliding_window_and_a_softcap(dtype, lengths, softcap):
    """A windowed layer's packed row (Mistral, Gemma 2/3's local layers) is split too, each sequence
    attending within its window (query i sees keys i - 4 < j <= i), with Gemma 2's logit cap when the
    layer has one: the block-diagonal windowed mask Transformers would build, on capped scores (eager
    arithmetic in float64), values and gradients."""
    window, n = 4, sum(lengths)
    q, k, v = _qkv(1, 4, 2, n, 8, dtype)
    position_ids = torch.cat([torch.arange(n_) for n_ in lengths])[None]  # [1, N]
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    idx = torch.arange(n)
    behind = idx[:, None] - idx[None]
    mask = (seg[:, None] == seg[None]) & (behind >= 0) & (behind < window)  # [N, N]
    out, _ = cpu_attention.attention(
        torch.nn.Module(),
        q,
        k,
        v,
        None,  # `one_row_mask` builds none for a packed row
        scaling=8**-0.5,
        position_ids=position_ids,
        sliding_window=window,
        softcap=softcap,
    )  # [1, N, h, d]
    q64, k64, v64 = (x.double().repeat_interleave(4 // x.shape[1], dim=1) for x in (q, k, v))
    scores = q64 @ k64.transpose(-1, -2) * 8**-0.5  # [1, h, N, N]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    ref = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v64).transpose(1, 2)  # [1, N, h, d]
    tol = 1e-5 if dtype == torch.float32 else 0.02
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want.double(), rtol=tol * 3, atol=tol * 3)


def test_unpacked_rows_are_not_split():
    q, k, _ = _qkv(2, 4, 2, 6, 8, torch.float32)
    assert cpu_attention.packed_segments(torch.arange(6)[None].expand(2, 6), q, k) is None  # batch of 2
    q1, k1 = q[:1], k[:1]
    assert cpu_attention.packed_segments(torch.arange(6)[None], q1, k1) is None  # one sequence
    assert cpu_attention.packed_segments(torch.arange(6)[None], q1, k1[:, :, :3]) is None  # cached keys
    assert cpu_attention.packed_segments(None, q1, k1) is None


def test_packed_model_forward_equals_padded(tiny_model_dir, monkeypatch):
    """The model on a packed row (the remove-padding path) gives each sequence the logits of its padded
    forward, through `packed_attention`."""
    calls = []
    real_fn = cpu_attention.packed_attention
    monkeypatch.setattr(
        cpu_attention, "packed_attention", lambda *a, **kw: calls.append(a[3]) or real_fn(*a, **kw)
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=cpu_attention.register())
    ids, mask = _left_padded_batch(model.config.vocab_size)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
        real = mask.bool()
        packed = model(
            input_ids=ids[real][None], position_ids=position_ids[real][None], attention_mask=None
        ).logits[0]
    torch.testing.assert_close(packed, padded[real], rtol=1e-4, atol=1e-4)
    lengths = mask.sum(1).tolist()  # [33, 40, 21, 40]
    assert calls == [[0, 33, 73, 94, 134]] * 2  # one call per decoder layer, split at each sequence
    assert lengths == [33, 40, 21, 40]

    # The packed forward built no [N, N] mask (`one_row_mask`): the attention read the positions. Only
    # this attention runs packed rows with shared prompts.
    import transformers.masking_utils as masking

    from fusedrl.workers.packing import can_share_prompts

    monkeypatch.setattr(masking, "sdpa_mask", lambda **kw: pytest.fail("built a mask for a packed row"))
    with torch.no_grad():
        again = model(input_ids=ids[real][None], position_ids=position_ids[real][None]).logits[0]
    assert torch.equal(again, packed)
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    assert can_share_prompts(model) and not can_share_prompts(sdpa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_layout_equals_per_sequence_attention(dtype):
    """A compiled model's packed row: three sequences, attention through their `segment_layout`. Every
    token gets exactly its per-sequence causal attention, values and gradients."""
    lengths = [5, 9, 4]
    n = sum(lengths)
    layout = cpu_attention.segment_layout(lengths)
    row, col, real_slots = layout
    assert real_slots.shape == (3, 9)
    assert real_slots.sum(1).tolist() == lengths
    assert row.tolist() == [0] * 5 + [1] * 9 + [2] * 4
    assert col.tolist() == [*range(5), *range(9), *range(4)]
    q, k, v = _qkv(1, 4, 2, n, 8, dtype)
    out, _ = cpu_attention.attention(
        torch.nn.Module(), q, k, v, None, scaling=8**-0.5, **{cpu_attention.LAYOUT_KWARG: layout}
    )  # [1, N, h, d]
    refs, start = [], 0
    for length in lengths:
        s = slice(start, start + length)
        refs.append(
            F.scaled_dot_product_attention(
                q[:, :, s].float(),
                k[:, :, s].float(),
                v[:, :, s].float(),
                is_causal=True,
                scale=8**-0.5,
                enable_gqa=True,
            )
        )
        start += length
    ref = torch.cat(refs, dim=2).transpose(1, 2)  # [1, N, h, d]
    tol = 1e-5 if dtype == torch.float32 else 0.02
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol * 3, atol=tol * 3)
