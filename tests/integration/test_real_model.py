"""The fused GRPO stack on the real SmolLM2 architecture, tokenizer, vocabulary and chat template (cut to
2 decoder layers): 2 fused workers, float32 training and rollout.

The 2-layer cut never samples ``<|im_end|>`` on its own, so the module's model adds a multiple of the mean
final hidden state to the tied ``<|im_end|>`` row (`_eos_biased_dir`): most responses then finish within a
few tokens, which lets the end-of-turn checks see real stops. Everything else is SmolLM2's.

One trainer is built for the module; tests run in file order.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from support import FLOAT32_TRAINING, real_model_grpo, started_trainer, sync_gap, update_without_sync

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

SYNC_TOL = 1e-4  # as tests/integration/test_fused_grpo.py
MAX_RESPONSE = 16
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _eos_biased_dir(src: str, out: str) -> str:
    """``src`` with the tied ``<|im_end|>`` row moved along the mean final hidden state, so that sampled
    responses end after a few tokens (seeded; ~14 of 16 within 16 tokens in transformers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    eos = tok.eos_token_id
    torch.manual_seed(0)
    with torch.no_grad():
        states = []
        for a, b in [(3, 4), (12, 30), (7, 9), (55, 21)]:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": f"What is {a} + {b}?"}],
                add_generation_prompt=True,
                tokenize=False,
            )
            ids = tok(ids, add_special_tokens=False, return_tensors="pt")["input_ids"]
            seq = model.generate(ids, do_sample=True, max_new_tokens=16, pad_token_id=eos)
            states.append(model(seq, output_hidden_states=True).hidden_states[-1][0, ids.shape[1] - 1 :])
        h = torch.cat(states)
        head = model.get_output_embeddings().weight
        logits = h @ head.T
        others = torch.cat([logits[:, :eos], logits[:, eos + 1 :]], 1).logsumexp(-1)
        mean = h.mean(0)
        proj = (h @ mean) / (mean @ mean)
        target = torch.log(torch.tensor(0.002 / 0.998))
        delta = ((target - (logits[:, eos] - others)) / proj).median()
        head[eos] += 0.8 * delta * mean / (mean @ mean)  # the embedding too: they are one tensor
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(out)
    for name in _TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), out)
    return out


@pytest.fixture(scope="module")
def model_dir(smollm2_2layer_dir, tmp_path_factory) -> str:
    return _eos_biased_dir(smollm2_2layer_dir, str(tmp_path_factory.mktemp("smollm2_eos")))


@pytest.fixture(scope="module")
def trainer(model_dir, small_train_file, tmp_path_factory):
    with started_trainer(
        [
            *real_model_grpo(
                small_train_file,
                model_dir,
                str(tmp_path_factory.mktemp("run")),
                response=MAX_RESPONSE,
                n=4,
                steps=2,
            ),
            "actor_rollout_ref.rollout.dtype=float32",
            *FLOAT32_TRAINING,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.optim.lr=2e-3",
        ]
    ) as t:
        yield t


def _messages_by_uid(train_file: str) -> dict[str, list[dict]]:
    import pyarrow.parquet as pq

    stem = os.path.splitext(os.path.basename(train_file))[0]
    rows = pq.read_table(train_file).column("prompt").to_pylist()
    return {
        f"{stem}-{i}": [{k: v for k, v in m.items() if v is not None} for m in row]
        for i, row in enumerate(rows)
    }


def test_prompts_render_the_default_system_prompt_like_the_engine(trainer, model_dir, small_train_file):
    """The data pipeline's prompt ids = the folder's chat template (with SmolLM's default system prompt)
    = vLLM's own chat rendering of the same messages (its tokenizer for the folder: the engine itself runs
    with ``skip_tokenizer_init`` and takes the trainer's ids)."""
    from transformers import AutoTokenizer
    from vllm.tokenizers import get_tokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    vllm_tok = get_tokenizer(model_dir)
    messages = _messages_by_uid(small_train_file)
    prompts = trainer.next_prompts()
    assert all(m[0]["role"] != "system" for m in messages.values()), "the data must leave the system turn out"
    for row, uid in enumerate(prompts.uid):
        uid = uid.rsplit("#", 1)[0] if uid not in messages else uid
        ids = prompts.prompts[row][prompts.prompt_mask[row].bool()].tolist()
        text = tok.decode(ids)
        assert DEFAULT_SYSTEM in text, text
        expected = tok.apply_chat_template(messages[uid], add_generation_prompt=True, tokenize=False)
        assert ids == tok.encode(expected, add_special_tokens=False)
        engine_ids = vllm_tok.apply_chat_template(messages[uid], add_generation_prompt=True, tokenize=True)
        if hasattr(engine_ids, "keys"):
            engine_ids = engine_ids["input_ids"]
        assert list(engine_ids) == ids, "vLLM renders the chat differently"


def test_eos_is_the_end_of_turn_token_and_the_engine_stops_there(trainer, model_dir):
    tok = trainer.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert trainer.tokenizer.eos_token_id == im_end == 2
    turn = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "PROBE"}], tokenize=False
    )
    assert turn.split("PROBE")[-1].startswith("<|im_end|>")

    batch = trainer.generate(trainer.next_prompts())
    finished = 0
    for row in range(batch.num_samples):
        real = batch.responses[row][batch.response_mask[row].bool()].tolist()
        length = int(batch.response_mask[row].sum())
        assert batch.response_mask[row, :length].all(), "the response mask has holes"
        if im_end in real:
            assert real.index(im_end) == len(real) - 1, f"tokens after <|im_end|>: {real}"
            finished += 1
        else:
            assert length == MAX_RESPONSE, f"a response stopped at {length} tokens without <|im_end|>: {real}"
    assert finished >= batch.num_samples // 4, f"only {finished}/{batch.num_samples} responses finished"


def test_engine_starts_in_sync(trainer):
    assert sync_gap(trainer, trainer.next_prompts()) < SYNC_TOL


def test_weight_stream_is_exact_after_an_update(trainer):
    prompts = trainer.next_prompts()
    update_without_sync(trainer, prompts)
    stale_gap = sync_gap(trainer, prompts)
    assert stale_gap > 100 * SYNC_TOL, f"skipping the sync went unnoticed (gap {stale_gap:.2e})"
    trainer.sync_weights()
    assert sync_gap(trainer, prompts) < SYNC_TOL


def _check_tied(trainer) -> torch.Tensor:
    """The actor's head is its embedding on every rank, and every engine's head equals the embedding it
    received; returns the actor's full embedding."""
    actor = trainer.workers.run_all(lambda w: w.actor_tied_embeddings.remote())
    assert all(r["same"] for r in actor), "FSDP2 untied lm_head from embed_tokens"
    for r in actor:
        assert torch.equal(r["lm_head"], r["embed"])
    full = torch.cat([r["embed"] for r in actor])  # FSDP2 shards dim 0
    for r in trainer.workers.run_all(lambda w: w.rollout_tied_embeddings.remote()):
        assert r["same"] or r["equal"], "the engine's lm_head is not its embedding"
        assert torch.equal(r["embed"], full), "the engine's embedding is not the actor's"
    return full


def test_tied_embeddings_survive_update_stream_and_checkpoint(trainer, model_dir):
    from safetensors.torch import load_file

    original = load_file(os.path.join(model_dir, "model.safetensors"))["model.embed_tokens.weight"]
    trained = _check_tied(trainer)  # after the update and sync above
    assert not torch.equal(trained, original), "the embedding did not train"

    trainer.save_checkpoint()
    update_without_sync(trainer, trainer.next_prompts())
    moved = trainer.workers.run_all(lambda w: w.actor_tied_embeddings.remote())
    assert not torch.equal(torch.cat([r["embed"] for r in moved]), trained)
    assert trainer.load_checkpoint() is not None  # re-syncs the engines
    assert torch.equal(_check_tied(trainer), trained)
