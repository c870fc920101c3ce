"""The chunked LM head (`fusedrl.workers.chunked_head`) gives the whole-logits path's log-probs, entropy, Σπ²
and gradients, without ever holding a micro-batch's ``[M, V]`` logits.

Float32 throughout. Both paths compute the same logits (one matmul per tile instead of one for all: the
CPU kernels may sum the 32- or 64-term dot products in another order) and the same statistics in another
order (online over vocabulary tiles vs one logsumexp; closed-form gradients vs autograd's). Float32's unit
roundoff is u = 6e-8; a log-prob is a log-sum-exp of <= 49k terms: relative error ~ sqrt(V) u ~ 1e-5 of
values of size ~1-10 at worst, seen ~5e-7. Values: atol 1e-5. Gradients add up ~100 positions' products:
atol 1e-5 of the largest entry, rtol 1e-4 (seen ~1e-6). A wrong term of a gradient (the entropy's ``log p +
H`` factor, a missing temperature, a target in the wrong tile) moves entries by > 1e-2 of the largest.

Tiles are made small here (`CHUNK_ELEMENTS`, `TILE_ROWS` patched) so that every test crosses several row
and vocabulary tiles, except the memory test, which uses the shipped sizes on a 49,152-token vocabulary.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from support import free_port, padded_batch

import fusedrl.workers.chunked_head as chunked_head
from fusedrl.workers.chunked_head import whole_token_log_probs
from fusedrl.workers.logprob import response_log_probs

TP, TR = 8, 6
PROMPT_LENS = [8, 3, 5, 2, 7]
RESPONSE_LENS = [6, 2, 4, 6, 1]
TEMPERATURE = 0.7
ATOL = 1e-5
GRAD_RTOL = 1e-4
KINDS = {"plain": {}, "entropy": {"with_entropy": True}, "sum_pi_squared": {"with_sum_pi_squared": True}}


def _config(family: str, vocab: int = 512, hidden: int = 32):
    """A tiny Llama with tied embeddings (SmolLM2's layout) or a tiny Qwen2 with its own LM head."""
    import transformers

    cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    return cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=family == "llama",
        max_position_embeddings=64,
        use_cache=False,
    )


def _model(family: str, vocab: int = 512, hidden: int = 32, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cls = transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen2ForCausalLM
    return cls(_config(family, vocab, hidden)).float()


def _batch(seed: int = 1):
    return padded_batch(PROMPT_LENS, RESPONSE_LENS, tp=TP, tr=TR, gen=torch.Generator().manual_seed(seed))


def _weights(batch, seed: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch.response_mask.shape, generator=gen) * batch.response_mask  # [B, Tr]


def _small_tiles(monkeypatch) -> None:
    # 8 positions x 75 vocabulary entries per tile: every micro-batch crosses several of each.
    monkeypatch.setattr(chunked_head, "CHUNK_ELEMENTS", 600)
    monkeypatch.setattr(chunked_head, "TILE_ROWS", 8)


def _count_chunked_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = chunked_head.chunked_token_stats

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(chunked_head, "chunked_token_stats", counted)
    return calls


def _assert_grads_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        atol = ATOL * max(1.0, float(value.abs().max()))
        torch.testing.assert_close(got[name], value, atol=atol, rtol=GRAD_RTOL, msg=name)


def _pass(model, batch, w, *, packed: bool, kind: str, enabled: bool, monkeypatch) -> dict:
    """Log-probs and the extra of one forward, and the parameter gradients of a loss using both."""
    monkeypatch.setattr(chunked_head, "ENABLED", enabled)
    model.zero_grad(set_to_none=True)
    lp, extra = response_log_probs(
        model, batch, temperature=TEMPERATURE, remove_padding=packed, **KINDS[kind]
    )
    mask = batch.response_mask
    loss = (lp * w).sum() + (0.0 if extra is None else 0.5 * (extra * w.abs()).sum())  # []
    loss.backward()
    return {
        "log_probs": (lp * mask).detach(),
        "extra": None if extra is None else (extra * mask).detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    }


# --------------------------------------------------------------------------- the statistics alone


@pytest.mark.parametrize("extra", [None, "entropy", "sum_pi_squared"])
@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
@pytest.mark.parametrize("bias", [False, True])
def test_stats_and_gradients_equal_whole_logits(monkeypatch, extra, temperature, bias):
    """`chunked_token_stats` against `whole_token_log_probs` of the whole logits: values and the gradients with
    respect to the hidden states, the head weight and its bias."""
    _small_tiles(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    n, hidden, vocab = 21, 16, 300
    h = torch.randn(n, hidden, generator=gen).requires_grad_()  # [N, H]
    weight = (torch.randn(vocab, hidden, generator=gen) * 0.5).requires_grad_()  # [V, H]
    b = torch.randn(vocab, generator=gen).requires_grad_() if bias else None  # [V]
    targets = torch.randint(0, vocab, (n,), generator=gen)  # [N]
    targets[:3] = torch.tensor([0, vocab - 1, 75])  # the first and last entries, a tile's first column
    g = torch.randn(n, 2, generator=gen)  # [N, 2]
    inputs = [t for t in (h, weight, b) if t is not None]

    got = chunked_head.chunked_token_stats(h, weight, b, targets, temperature=temperature, extra=extra)
    got_grads = torch.autograd.grad((got * g[:, : got.shape[1]]).sum(), inputs)
    lp, x = whole_token_log_probs(
        torch.nn.functional.linear(h, weight, b),
        targets,
        temperature=temperature,
        with_entropy=extra == "entropy",
        with_sum_pi_squared=extra == "sum_pi_squared",
    )
    want = torch.stack([lp] if x is None else [lp, x], dim=-1)  # [N, k]
    want_grads = torch.autograd.grad((want * g[:, : want.shape[1]]).sum(), inputs)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    _assert_grads_close(dict(enumerate(got_grads)), dict(enumerate(want_grads)))


def test_large_logits_stay_finite(monkeypatch):
    """Logits of ~1e4 (no overflow in the exponentials; the entropy of a near one-hot distribution ~0)."""
    _small_tiles(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(10, 8, generator=gen) * 300.0
    weight = torch.randn(200, 8, generator=gen) * 10.0
    targets = torch.randint(0, 200, (10,), generator=gen)
    got = chunked_head.chunked_token_stats(h, weight, None, targets, temperature=1.0, extra="entropy")
    lp, ent = whole_token_log_probs(h @ weight.T, targets, temperature=1.0, with_entropy=True)
    torch.testing.assert_close(got, torch.stack([lp, ent], -1), atol=1e-3, rtol=1e-5)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
def test_whole_path_divides_by_the_temperature_only_when_it_is_not_one(kind, dtype, temperature):
    """At temperature 1.0 the whole-logits path skips the division (no ``aten.div`` runs) and its values and
    gradient equal bit for bit those of the division by 1.0; other temperatures divide."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Divisions(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.div:
                Divisions.count += 1
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 7, 50, generator=gen) * 4).to(dtype).requires_grad_()  # [B, T, V]
    targets = torch.randint(0, 50, (3, 7), generator=gen)  # [B, T]
    g = torch.randn(2, 3, 7, generator=gen)  # [2, B, T]
    flags = {"with_entropy": False, **KINDS[kind]}

    def loss(lp, x):
        return (lp * g[0]).sum() + (0.0 if x is None else (x * g[1]).sum())

    with Divisions():
        lp, x = whole_token_log_probs(logits, targets, temperature=temperature, **flags)
    assert (Divisions.count == 0) == (temperature == 1.0), Divisions.count
    (grad,) = torch.autograd.grad(loss(lp, x), logits)
    # the same math with the division always taken (the code before the skip)
    z = logits.float() / temperature
    log_z = torch.logsumexp(z, dim=-1)
    want_lp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    want_x = None
    if kind == "entropy":
        want_x = chunked_head.entropy_from_logits(z)
    elif kind == "sum_pi_squared":
        want_x = torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * log_z)
    (want_grad,) = torch.autograd.grad(loss(want_lp, want_x), logits)
    assert torch.equal(lp, want_lp)
    assert (x is None and want_x is None) or torch.equal(x, want_x)
    assert torch.equal(grad, want_grad)


# --------------------------------------------------------------------------- through the model


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_response_log_probs_equal_whole_logits(monkeypatch, family, packed, kind):
    """`response_log_probs` chunked vs whole: log-probs, entropy / Σπ² and every parameter's gradient (the
    tied embedding of Llama, Qwen2's own LM head, the decoder layers through the hidden states)."""
    _small_tiles(monkeypatch)
    calls = _count_chunked_calls(monkeypatch)
    model, batch = _model(family), _batch()
    w = _weights(batch)
    chunked = _pass(model, batch, w, packed=packed, kind=kind, enabled=True, monkeypatch=monkeypatch)
    assert calls, "the chunked head did not run"
    whole = _pass(model, batch, w, packed=packed, kind=kind, enabled=False, monkeypatch=monkeypatch)
    assert len(calls) == 1
    assert whole["log_probs"][batch.response_mask.bool()].abs().min() > 1e-3  # real numbers
    torch.testing.assert_close(chunked["log_probs"], whole["log_probs"], atol=ATOL, rtol=0)
    if kind != "plain":
        torch.testing.assert_close(chunked["extra"], whole["extra"], atol=ATOL, rtol=0)
    head = "model.embed_tokens.weight" if family == "llama" else "lm_head.weight"
    assert whole["grads"][head].abs().max() > 1e-3
    _assert_grads_close(chunked["grads"], whole["grads"])


def test_small_logits_take_the_whole_path(monkeypatch):
    """A micro-batch whose logits fit one tile (a tiny model's) runs the whole-logits path: no overhead."""
    calls = _count_chunked_calls(monkeypatch)
    model, batch = _model("llama"), _batch()
    response_log_probs(model, batch, temperature=TEMPERATURE, with_entropy=True)
    assert not calls


def test_lora_model_chunked_unless_the_head_is_adapted(monkeypatch):
    """A PEFT model runs the chunked head (gradients of the adapters equal); with the LM head itself
    adapted (a LoRA layer, not a plain linear) the whole-logits path runs."""
    from peft import LoraConfig, get_peft_model

    _small_tiles(monkeypatch)
    calls = _count_chunked_calls(monkeypatch)
    batch = _batch()
    w = _weights(batch)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    model = get_peft_model(_model("llama"), config)
    for p in model.parameters():  # lora_B starts at 0: move it so that every adapter gets a gradient
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    chunked = _pass(model, batch, w, packed=True, kind="entropy", enabled=True, monkeypatch=monkeypatch)
    assert len(calls) == 1
    whole = _pass(model, batch, w, packed=True, kind="entropy", enabled=False, monkeypatch=monkeypatch)
    assert whole["grads"] and all("lora_" in n for n in whole["grads"])  # only the adapters train
    torch.testing.assert_close(chunked["log_probs"], whole["log_probs"], atol=ATOL, rtol=0)
    _assert_grads_close(chunked["grads"], whole["grads"])

    adapted = get_peft_model(
        _model("qwen2"), LoraConfig(r=4, target_modules=["lm_head"], lora_dropout=0.0, task_type="CAUSAL_LM")
    )
    assert chunked_head.output_head(adapted) is None
    response_log_probs(adapted, batch, temperature=TEMPERATURE, remove_padding=True)
    assert len(calls) == 1


def test_a_model_that_changes_the_logits_falls_back(monkeypatch):
    """A causal LM whose forward changes the head's output (as Gemma-2's soft-capping would) is caught: one
    warning, the whole-logits numbers, and the whole path from then on."""
    import transformers

    class ScaledLlamaForCausalLM(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0
            return out

    _small_tiles(monkeypatch)
    calls = _count_chunked_calls(monkeypatch)
    torch.manual_seed(0)
    model = ScaledLlamaForCausalLM(_config("llama")).float()
    batch = _batch()
    with torch.no_grad():
        lp, _ = response_log_probs(model, batch, temperature=TEMPERATURE)
    assert len(calls) == 1 and chunked_head.output_head(model) is None
    inputs = dict(zip(("input_ids", "attention_mask", "position_ids"), batch.sequences()))
    logits = model(**inputs).logits  # [B, Tp+Tr, V], doubled by the model
    want = torch.log_softmax(logits[:, TP - 1 : -1].float() / TEMPERATURE, -1)  # [B, Tr, V]
    want = want.gather(-1, batch.responses[..., None])[..., 0]  # [B, Tr]
    mask = batch.response_mask
    torch.testing.assert_close(lp.detach() * mask, want.detach() * mask, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- memory


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most elements of any tensor an operator returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_no_tensor_of_the_whole_logits(monkeypatch, packed):
    """SmolLM2's 49,152-token vocabulary with the shipped tile size: no operator of the forward or the
    backward returns a tensor as large as the micro-batch's logits (``M x V``), only tiles of at most
    `CHUNK_ELEMENTS`. The control (the whole-logits path) does create them, so the check can fail."""
    vocab, hidden, tr = 49152, 8, 8
    model = _model("llama", vocab=vocab, hidden=hidden)
    gen = torch.Generator().manual_seed(4)
    batch = padded_batch([4, 2, 3, 4] * 4, [8, 7, 8, 6] * 4, tp=4, tr=tr, gen=gen)  # 116 response tokens
    positions = int(batch.response_mask.sum()) if packed else batch.num_samples * tr
    assert positions * vocab > chunked_head.CHUNK_ELEMENTS > vocab * hidden  # more than one tile; > weights
    largest = {}
    for enabled in (True, False):
        monkeypatch.setattr(chunked_head, "ENABLED", enabled)
        with _LargestTensor() as seen:
            lp, ent = response_log_probs(
                model, batch, temperature=TEMPERATURE, with_entropy=True, remove_padding=packed
            )
            ((lp + 0.1 * ent) * batch.response_mask).sum().backward()
        largest[enabled] = seen.largest
    assert largest[True] <= chunked_head.CHUNK_ELEMENTS < positions * vocab
    assert largest[False] >= positions * vocab  # the control


# --------------------------------------------------------------------------- FSDP2 and Ulysses, two ranks


def _ranks_body(rank: int, out: str) -> None:
    """On a 2-rank gloo group: (1) the tied Llama under FSDP2, each rank its own half of the batch, chunked
    head, padded with entropy and packed with Σπ², one pass inside `gathered_for_pass` (gathered through
    the backward) and one without (FSDP2 re-gathers the root for the backward); the full gradients. (2)
    Ulysses sp=2 on an unsharded model, chunked vs whole."""
    import torch.distributed as dist

    from fusedrl.workers.fsdp import apply_fsdp2, build_mesh, gathered_for_pass
    from fusedrl.workers.ulysses import ulysses_response_log_probs

    chunked_head.CHUNK_ELEMENTS, chunked_head.TILE_ROWS = 600, 8
    calls: list[int] = []
    original = chunked_head.chunked_token_stats
    chunked_head.chunked_token_stats = lambda *a, **k: calls.append(1) or original(*a, **k)
    batch = _batch()
    half = batch[torch.arange(rank * 2, rank * 2 + 3)]  # rows 0-2 and 2-4: different on each rank
    w = _weights(half)
    model = apply_fsdp2(_model("llama"), build_mesh())
    results: dict = {}
    for packed, kind, gathered in ((False, "entropy", True), (True, "sum_pi_squared", False)):
        model.zero_grad(set_to_none=True)
        with gathered_for_pass(model) if gathered else _nothing():
            lp, extra = response_log_probs(
                model, half, temperature=TEMPERATURE, remove_padding=packed, **KINDS[kind]
            )
            ((lp * w).sum() + 0.5 * (extra * w.abs()).sum()).backward()
        results[kind] = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    results["fsdp_chunked_calls"] = len(calls)
    plain = _model("qwen2")
    for enabled in (True, False):
        chunked_head.ENABLED = enabled
        plain.zero_grad(set_to_none=True)
        lp, ent = ulysses_response_log_probs(  # [B, Tr] each
            plain, batch, dist.group.WORLD, temperature=TEMPERATURE, with_entropy=True
        )
        ((lp * _weights(batch)).sum() + (ent * _weights(batch).abs()).sum()).backward()
        grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)
        results[f"ulysses/{enabled}"] = {"log_probs": lp.detach(), "entropy": ent.detach(), "grads": grads}
    results["ulysses_chunked_calls"] = len(calls) - results["fsdp_chunked_calls"]
    torch.save(results, Path(out) / f"rank{rank}.pt")


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _entry(rank: int, world_size: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _ranks_body(rank, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("chunked_head")
    mp.spawn(_entry, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.timeout(300)
def test_fsdp2_gradients_equal_the_unsharded_model(two_ranks, monkeypatch):
    """FSDP2 averages the two ranks' gradients of their own halves: the unsharded model's whole-logits
    gradients of the two halves, averaged (the tied embedding's included)."""
    monkeypatch.setattr(chunked_head, "ENABLED", False)
    model, batch = _model("llama"), _batch()
    assert [r["fsdp_chunked_calls"] for r in two_ranks] == [2, 2]
    for packed, kind in ((False, "entropy"), (True, "sum_pi_squared")):
        want: dict = {}
        for rank in range(2):
            half = batch[torch.arange(rank * 2, rank * 2 + 3)]
            grads = _pass(
                model, half, _weights(half), packed=packed, kind=kind, enabled=False, monkeypatch=monkeypatch
            )
            for name, g in grads["grads"].items():
                want[name] = want.get(name, 0) + g / 2
        assert want["model.embed_tokens.weight"].abs().max() > 1e-3
        for r in two_ranks:
            _assert_grads_close(r[kind], want)


@pytest.mark.timeout(300)
def test_ulysses_chunked_equals_whole(two_ranks):
    for r in two_ranks:
        assert r["ulysses_chunked_calls"] == 1
        chunked, whole = r["ulysses/True"], r["ulysses/False"]
        for key in ("log_probs", "entropy"):
            torch.testing.assert_close(chunked[key], whole[key], atol=ATOL, rtol=0)
        _assert_grads_close(chunked["grads"], whole["grads"])


# --------------------------------------------------------------------------- the roles, on SmolLM2


def _roles_body(port: int, model_dir: str, out: str) -> None:
    """The actor's and reference's passes as the worker runs them (roles from the config, FSDP2, packed rows
    as on CPU) on the real 2-layer SmolLM2: how many chunked-head forwards and backwards each pass ran."""
    from support import single_rank_group

    with single_rank_group(port):
        from fusedrl.config import role_configs_from_overrides
        from fusedrl.workers.actor import ActorRole, RefRole

        fn = chunked_head._ChunkedHeadStats
        calls = {"forward": 0, "backward": 0}
        forward, backward = fn.forward, fn.backward

        def counted(kind, original):
            return staticmethod(lambda *a, **k: calls.__setitem__(kind, calls[kind] + 1) or original(*a, **k))

        fn.forward, fn.backward = counted("forward", forward), counted("backward", backward)
        cfg = role_configs_from_overrides(
            [
                "data.train_files=unused",
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                "actor_rollout_ref.actor.fsdp_config.param_dtype=null",
                "actor_rollout_ref.ref.fsdp_config.param_dtype=null",
            ]
        )
        gen = torch.Generator().manual_seed(6)
        batch = padded_batch([9, 5, 7, 8] * 4, [12] * 16, tp=9, tr=12, gen=gen)
        batch.advantages = torch.randn(16, 1, generator=gen).expand(16, 12) * batch.response_mask
        actor, ref = ActorRole(cfg.model, cfg.actor, rollout_n=4), RefRole(cfg.model, cfg.ref)
        seen = {"packed": bool(cfg.model.use_remove_padding)}
        for name, run in (
            ("old_log_prob", lambda: actor.compute_log_prob(batch, temperature=1.0, micro_batch_size=8)),
            ("ref_log_prob", lambda: ref.compute_log_prob(batch, temperature=1.0)),
            ("update", lambda: actor.update(batch, temperature=1.0)),
        ):
            calls.update(forward=0, backward=0)
            value = run()
            if name == "old_log_prob":
                batch.old_log_probs = value
            elif name == "ref_log_prob":
                batch.ref_log_probs = value
            seen[name] = dict(calls)
        torch.save(seen, out)


def test_actor_and_reference_passes_run_the_chunked_head_on_smollm2(smollm2_2layer_dir, tmp_path):
    """On the real model (49,152-token tied head, Llama) the old log-prob, reference and update passes all
    take the chunked head, and the update's backward through the LM head is the chunked one: 8 rows x 12
    response tokens make 4.7M logits, over `CHUNK_ELEMENTS`."""
    from support import spawned_result

    seen = spawned_result(_roles_body, smollm2_2layer_dir, tmp_path, timeout=600)
    assert seen["packed"]  # the CPU default: packed rows, 96 positions per micro-batch
    assert seen["old_log_prob"] == {"forward": 2, "backward": 0}  # 16 rows, micro-batches of 8
    assert seen["ref_log_prob"]["forward"] >= 1 and seen["ref_log_prob"]["backward"] == 0
    assert seen["update"]["forward"] == seen["update"]["backward"] >= 2, seen["update"]
