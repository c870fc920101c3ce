"""Every decoder architecture fusedrl accepts gets the padded eager forward's numbers on every path:
packed rows (Transformers' masks and fusedrl's CPU attention), shared prompts, fusedrl's CPU attention on
padded rows, compiled layers and Ulysses sequence parallelism.

Tiny random models built on the spot (2 layers, hidden 64, 4 query heads of 32, vocabulary 400, float32),
one per architecture, each exercising what sets it apart: Llama (the plain decoder), Qwen2 with its second
layer windowed (``use_sliding_window``), Qwen3 (q/k norms), Mistral (every layer windowed), Gemma (one
key/value head, GeGLU, scaled embeddings), Gemma 2 (alternating windows, attention and final logit
soft-capping) and Gemma 3 (a local and a global layer, q/k norms). Windows of `WINDOW` tokens are shorter
than most sequences of the batch and the soft-cap is small, so a path that ignored them would move the
numbers (`test_windows_and_caps_change_the_numbers`); weights are drawn at `INIT` so attention is far
from uniform.

The reference is Transformers' eager attention on the padded batch. Every path's log-probs, entropy and
parameter gradients of one loss are compared with it. Float32's unit roundoff is u = 6e-8; log-probs are
log-sum-exps over 400 logits of sums over hidden 64 through 2 layers, compared between different kernels
(SDPA's, the matmuls, eager), whose sums run in other orders on AVX2-only and AVX-512 CPUs: ~1e-6 (seen
on an AVX-512 EPYC: up to 1.4e-6, entropy 2.4e-6). Log-probs and entropy: `ATOL` 2e-5. Gradients add up
~100 tokens' contributions: relative norm `GRAD_RTOL` 1e-4 (seen: up to 1.1e-6). A wrong mask moves
log-probs by > 1e-3 (the controls), an ignored window or soft-cap of Ulysses by > 1 (seen before they were
applied there).

Compiled layers (`test_compiled_layers`) are marked slow: compiling one architecture's forward and backward
took 15-180 s per layout on the 2 shared cores (`make test-slow` runs them); the default run covers the
other paths of every architecture in about a minute.
"""

from __future__ import annotations

import os
import time
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from support import free_port, padded_batch

import fusedrl.workers.cpu_attention as cpu_attention
from fusedrl.workers.logprob import response_log_probs

TEMPERATURE = 0.8
WINDOW = 4  # tokens; the sequences below have 2 to 17
INIT = 0.1  # initializer_range: attention far from uniform
ATOL = 2e-5
GRAD_RTOL = 1e-4
COMMON = {
    "vocab_size": 400,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "initializer_range": INIT,
    "use_cache": False,  # as the training roles load models (with a cache Transformers reads no packed rows)
}


def _config(arch: str):
    """The tiny config of ``arch`` (module docstring)."""
    import transformers as tf

    window = {"sliding_window": WINDOW}
    return {
        "llama": lambda: tf.LlamaConfig(**COMMON),
        "qwen2": lambda: tf.Qwen2Config(**COMMON, **window, use_sliding_window=True, max_window_layers=1),
        "qwen3": lambda: tf.Qwen3Config(**COMMON),
        "mistral": lambda: tf.MistralConfig(**COMMON, **window),
        "gemma": lambda: tf.GemmaConfig(**{**COMMON, "num_key_value_heads": 1}),
        "gemma2": lambda: tf.Gemma2Config(
            **COMMON, **window, attn_logit_softcapping=1.0, final_logit_softcapping=5.0
        ),
        "gemma3": lambda: tf.Gemma3TextConfig(
            **COMMON, **window, layer_types=["sliding_attention", "full_attention"]
        ),
    }[arch]()


ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3"]
WINDOWED = {"qwen2": 1, "mistral": 2, "gemma2": 1, "gemma3": 1}  # windowed layers per model


@cache
def _weights(arch: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(arch), attn_implementation="eager").state_dict()


def _model(arch: str, attn: str, **changes):
    """``arch``'s tiny model with the attention ``attn`` (``cpu``: fusedrl's CPU attention), float32, the
    same weights whatever the attention; ``changes`` edit the config first (the controls)."""
    from transformers import AutoModelForCausalLM

    config = _config(arch)
    for key, value in changes.items():
        setattr(config, key, value)
    impl = cpu_attention.register() if attn == "cpu" else attn
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    model.load_state_dict(_weights(arch))
    return model


def _batch():
    """8 rows over 4 prompts (3, 2, 2 and 1 rows, scattered as balancing leaves them), prompts of 3 to 9
    tokens left-padded to 10, own responses of 1 to 8 tokens right-padded to 8."""
    gen = torch.Generator().manual_seed(1)
    base = padded_batch([5, 9, 3, 7], [6, 4, 8, 1], tp=10, tr=8, gen=gen)
    batch = base[torch.tensor([0, 1, 0, 2, 1, 0, 3, 2])]
    batch.responses = torch.randint(3, 400, batch.responses.shape, generator=gen)
    lengths = torch.tensor([6, 2, 3, 8, 4, 1, 1, 5])
    batch.response_mask = (torch.arange(8)[None] < lengths[:, None]).long()  # [B, Tr]
    return batch


def _loss(log_probs: torch.Tensor, entropy: torch.Tensor, batch) -> torch.Tensor:
    weights = torch.randn(batch.responses.shape, generator=torch.Generator().manual_seed(5))  # [B, Tr]
    mask = batch.response_mask
    return (log_probs * weights * mask).sum() + 0.1 * (entropy * mask).sum()


def _numbers(model, batch, **kwargs) -> dict:
    """Log-probs and entropy ``[B, Tr]`` (0 on padding) and every parameter's gradient of `_loss`."""
    model.zero_grad(set_to_none=True)
    lp, ent = response_log_probs(model, batch, temperature=TEMPERATURE, with_entropy=True, **kwargs)
    assert ent is not None
    _loss(lp, ent, batch).backward()
    mask = batch.response_mask
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"log_probs": (lp * mask).detach(), "entropy": (ent * mask).detach(), "grads": grads}


@cache
def _reference(arch: str) -> dict:
    return _numbers(_model(arch, "eager"), _batch())


def _assert_matches(got: dict, want: dict) -> None:
    mask = _batch().response_mask.bool()
    assert want["log_probs"][mask].abs().min() > 1e-3  # real numbers, not zeros on both sides
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=ATOL)
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        rel = float((got["grads"][name] - grad).norm() / grad.norm())
        assert rel < GRAD_RTOL, (name, rel)


def _hf_attention(arch: str) -> str:
    """Transformers' attention fusedrl may run ``arch`` with: SDPA, or eager where SDPA cannot compute the
    model (Gemma 2's logit soft-capping; `fusedrl.architecture_config` refuses sdpa for it)."""
    return "eager" if getattr(_config(arch), "attn_logit_softcapping", None) else "sdpa"


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_rows_with_transformers_masks(arch):
    """Packed rows under SDPA / eager: Transformers builds the block-diagonal mask from the positions."""
    _assert_matches(
        _numbers(_model(arch, _hf_attention(arch)), _batch(), remove_padding=True), _reference(arch)
    )


@pytest.mark.parametrize("path", ["padded", "packed", "shared"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_attention(arch, path):
    """fusedrl's CPU attention on padded rows, packed rows and packed rows with shared prompts."""
    kwargs = {"padded": {}, "packed": {"remove_padding": True}}.get(
        path, {"remove_padding": True, "share_prompts": True}
    )
    _assert_matches(_numbers(_model(arch, "cpu"), _batch(), **kwargs), _reference(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_rows_build_no_mask(arch, monkeypatch):
    """Under fusedrl's CPU attention a packed row (with shared prompts or not) makes Transformers build no
    ``[N, N]`` mask, whatever the architecture; a padded batch still gets its mask."""
    import transformers.masking_utils as masking

    built: list[tuple] = []
    real = masking.sdpa_mask
    monkeypatch.setattr(masking, "sdpa_mask", lambda **kw: built.append(kw["attention_mask"]) or real(**kw))
    model, batch = _model(arch, "cpu"), _batch()
    with torch.no_grad():
        for share in (False, True):
            response_log_probs(model, batch, temperature=1.0, remove_padding=True, share_prompts=share)
        assert built == []
        response_log_probs(model, batch, temperature=1.0)
    assert len(built) == (2 if arch in ("qwen2", "gemma2", "gemma3") else 1)  # one per kind of layer
    assert all(mask is not None for mask in built)  # the padded batch's


@pytest.mark.parametrize("arch", sorted(WINDOWED) + ["gemma2-softcap"])
def test_windows_and_caps_change_the_numbers(arch):
    """Controls: without its window (or Gemma 2 without its attention soft-cap) the model's log-probs
    move by far more than `ATOL`, so the comparisons above see a path that ignores them."""
    name, change = (
        ("gemma2", {"attn_logit_softcapping": None})
        if arch == "gemma2-softcap"
        else (arch, {"sliding_window": 10_000, "use_sliding_window": False})
    )
    with torch.no_grad():
        lp, _ = response_log_probs(_model(name, "eager", **change), _batch(), temperature=TEMPERATURE)
    gap = (lp * _batch().response_mask - _reference(name)["log_probs"]).abs().max()
    assert gap > 1e-3


def test_one_long_row_keeps_its_window():
    """One unpadded sequence longer than its window gets no mask from `one_row_mask` either: the CPU
    attention applies the window itself (the packed path's per-sequence kernel, here for one row)."""
    model, ref = _model("mistral", "cpu"), _model("mistral", "eager")
    ids = torch.randint(3, 400, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = (m(input_ids=ids, position_ids=torch.arange(12)[None]).logits for m in (model, ref))
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def _compiled(arch: str, packed: bool) -> tuple[dict, float]:
    from fusedrl.workers.layer_compile import compile_layers

    model = _model(arch, "cpu")
    assert compile_layers(model)
    start = time.perf_counter()
    got = _numbers(model, _batch(), remove_padding=packed)
    return got, time.perf_counter() - start


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_layers(arch, packed):
    """`fusedrl.workers.layer_compile.compile_layers` under the CPU attention: packed rows carry their
    layout into the compiled layers, padded ones their mask."""
    got, seconds = _compiled(arch, packed)
    print(f"compiled {arch} {'packed' if packed else 'padded'}: {seconds:.1f} s")
    _assert_matches(got, _reference(arch))


# ------------------------------------------------------------------------------------------ Ulysses


def _ulysses_rank(rank: int, out: str) -> None:
    import torch.distributed as dist

    from fusedrl.workers.ulysses import ulysses_response_log_probs

    results = {}
    batch = _batch()
    for arch in ARCHS:
        model = _model(arch, _hf_attention(arch))
        lp, ent = ulysses_response_log_probs(
            model, batch, dist.group.WORLD, temperature=TEMPERATURE, with_entropy=True
        )
        assert ent is not None
        _loss(lp, ent, batch).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        for g in grads.values():
            dist.all_reduce(g)  # each rank's gradients cover its own tokens: the group's sum is the gradient
        mask = batch.response_mask
        results[arch] = {"log_probs": (lp * mask).detach(), "entropy": (ent * mask).detach(), "grads": grads}
    torch.save(results, Path(out) / f"rank{rank}.pt")


def _ulysses_entry(rank: int, world_size: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _ulysses_rank(rank, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ulysses_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ulysses_archs")
    mp.spawn(_ulysses_entry, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ARCHS)
def test_ulysses(ulysses_ranks, arch):
    """Ulysses with 2 ranks (Gemma's single key/value head is repeated to split it): both ranks get the
    padded forward's numbers."""
    for rank in ulysses_ranks:
        _assert_matches(rank[arch], _reference(arch))


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (WINDOW, None), (None, 1.0), (WINDOW, 1.0)])
def test_ulysses_masked_path_equals_per_sequence_path(window, softcap):
    """Ulysses' attention off CPU (`masked_attention`: one ``[n, n]`` mask, as on CUDA) gives what its CPU
    path (per sequence) gives, with windows and soft-caps: the spawned test above runs the CPU path."""
    from fusedrl.workers.ulysses import masked_attention

    gen = torch.Generator().manual_seed(3)
    lengths = [7, 3, 12]
    q, k, v = (torch.randn(1, 4, sum(lengths), 16, generator=gen, requires_grad=True) for _ in range(3))
    segment = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))  # [n]
    bounds = [0, 7, 10, 22]
    shape = {"scaling": 0.25, "window": window, "softcap": softcap}
    got = masked_attention(q, k, v, segment, **shape)
    want = cpu_attention.packed_attention(q, k, v, bounds, **shape)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(
        torch.autograd.grad(got.square().sum(), (q, k, v)),
        torch.autograd.grad(want.square().sum(), (q, k, v)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------- config-time checks


def _problems(tmp_path: Path, model_json: dict, *overrides: str) -> list[str]:
    """The problems `fusedrl.config.load_config` reports for a model folder holding only ``model_json``
    as its config.json (validation reads nothing else of it)."""
    import json

    from fusedrl.config import ConfigError, load_config

    model = tmp_path / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(model_json))
    train = tmp_path / "train.parquet"
    train.touch()
    args = [f"data.train_files={train}", f"actor_rollout_ref.model.path={model}"]
    try:
        load_config([*args, "actor_rollout_ref.rollout.name=hf", *overrides])
    except ConfigError as err:
        return list(err.problems)
    return []


def test_ulysses_heads_are_checked_before_ray_starts(tmp_path):
    """sp must divide the attention heads (the worker's check_heads would raise after Ray started)."""
    sp = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    model = {"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 2}
    problems = _problems(tmp_path, model, "trainer.n_gpus_per_node=4", f"{sp}=4")
    mine = [p for p in problems if p.startswith(f"`{sp}`")]
    assert mine == [
        f"`{sp}`=4 does not divide the 6 attention heads of {tmp_path / 'model'}/config.json (llama): "
        "Ulysses gives each rank of a sequence-parallel group heads / sp of them. Use one of 1, 2, 3, 6."
    ]
    assert not [p for p in _problems(tmp_path / "two", model, f"{sp}=2") if p.startswith(f"`{sp}`")]


def test_softcapped_model_refuses_sdpa(tmp_path):
    """Gemma 2's logit soft-cap with Transformers' SDPA (which drops it): refused, naming the key and the
    fix; auto and eager are accepted."""
    attn = "actor_rollout_ref.model.attn_implementation"
    model = {"model_type": "gemma2", "num_attention_heads": 8, "attn_logit_softcapping": 50.0}
    problems = [p for p in _problems(tmp_path, model, f"{attn}=sdpa") if p.startswith(f"`{attn}`")]
    assert len(problems) == 1
    assert "gemma2 caps its attention logits (attn_logit_softcapping=50.0" in problems[0]
    assert "Use auto" in problems[0] and "or eager" in problems[0]
    for i, ok in enumerate(("auto", "eager")):
        assert not [
            p for p in _problems(tmp_path / str(i), model, f"{attn}={ok}") if p.startswith(f"`{attn}`")
        ]


def test_a_model_path_without_config_json_is_not_read(tmp_path):
    from fusedrl.architecture_config import model_config

    assert model_config(tmp_path) is None and model_config("org/name") is None
    (tmp_path / "config.json").write_text(
        '{"model_type": "gemma3", "text_config": {"num_attention_heads": 3}}'
    )
    assert model_config(tmp_path)["num_attention_heads"] == 3  # a multimodal config: its text model's
