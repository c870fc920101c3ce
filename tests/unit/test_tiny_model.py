"""Tests for fusedrl.utils.tiny_model: an offline-built Qwen2 model folder that every loader agrees on."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fusedrl.utils.tiny_model import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    PAD_TOKEN,
    PRESETS,
    build_tiny_model,
    build_tokenizer,
    count_parameters,
    main,
    make_config,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 1234 + 56789?"},
]
RENDERED_CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is 1234 + 56789?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
STRINGS = [
    "What is 23 + 45?",
    "The answer is 68.",
    "12345678901234567890 - 987654321 = -42",
    "  leading spaces,   runs of  spaces and trailing ",
    "Hello, world! It's (3.14 * 2) = 6.28; [x={a}] #### 7...?!",
    "tabs\tand\nnew lines\r\n\n",
    "Ünïcødé façade naïve café — “quotes” … € 中文 日本語 한국어 🙂",
    "zzqxj QWERTY never-seen-words_and_CamelCase",
    RENDERED_CHAT,
]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_model")
    tok_dir = root / "tok"
    build_tokenizer(tok_dir)
    model_dir = Path(build_tiny_model(root / "model", preset="tiny", seed=0))
    return {"root": root, "tok": tok_dir, "model": model_dir}


def _raw_ids(folder: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_folder_contents(built):
    model_dir = built["model"]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    assert list(model_dir.glob("*.safetensors"))
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    assert cfg["tie_word_embeddings"] is False
    assert cfg["max_position_embeddings"] == 2048
    assert cfg["vocab_size"] % 64 == 0
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert head_dim in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM CPU attention sizes


def test_all_loading_routes_agree(built):
    from transformers import AutoTokenizer

    tok_from_tok_dir = AutoTokenizer.from_pretrained(built["tok"])
    tok_from_model_dir = AutoTokenizer.from_pretrained(built["model"])
    # transformers forces Qwen2Tokenizer on a qwen2 folder; we declare the same class for the tokenizer folder.
    assert type(tok_from_model_dir).__name__ == "Qwen2Tokenizer"
    assert type(tok_from_tok_dir).__name__ == "Qwen2Tokenizer"
    for text in STRINGS:
        ref = _raw_ids(built["tok"], text)
        assert ref == _raw_ids(built["model"], text), text
        assert tok_from_tok_dir.encode(text, add_special_tokens=False) == ref, text
        assert tok_from_model_dir.encode(text, add_special_tokens=False) == ref, text
        # No BOS/EOS is added by default (Qwen2 convention).
        assert tok_from_model_dir(text)["input_ids"] == ref, text


def test_digits_are_split_and_roundtrip(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["model"])
    ids = tok.encode("12345", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["1", "2", "3", "4", "5"]
    for text in STRINGS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, text
        assert None not in tok.convert_ids_to_tokens(ids)
    # Special tokens are single ids inside text.
    chat_ids = tok.encode(RENDERED_CHAT, add_special_tokens=False)
    assert chat_ids[0] == tok.convert_tokens_to_ids(IM_START)
    assert chat_ids.count(tok.convert_tokens_to_ids(IM_END)) == 2


def test_special_tokens_and_chat_template(built):
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(built["model"])
    eos_id = tok.convert_tokens_to_ids(IM_END)
    pad_id = tok.convert_tokens_to_ids(PAD_TOKEN)
    assert tok.eos_token == IM_END and tok.eos_token_id == eos_id
    assert tok.pad_token == PAD_TOKEN and tok.pad_token_id == pad_id
    assert tok.bos_token is None
    assert tok.model_max_length == 2048
    assert IM_START in tok.all_special_tokens

    rendered = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == RENDERED_CHAT
    assert rendered.endswith("<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert no_prompt.endswith("<|im_end|>\n") and not no_prompt.endswith("assistant\n")
    assert tok.chat_template == CHAT_TEMPLATE

    cfg = json.loads((built["model"] / "config.json").read_text())
    assert cfg["eos_token_id"] == eos_id and cfg["pad_token_id"] == pad_id and cfg["bos_token_id"] == pad_id
    gen = GenerationConfig.from_pretrained(built["model"])
    assert gen.eos_token_id == eos_id and gen.pad_token_id == pad_id
    assert len(tok) <= cfg["vocab_size"]


def test_model_loads_and_forwards(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["model"])
    model = AutoModelForCausalLM.from_pretrained(built["model"]).eval()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    n_params = sum(p.numel() for p in model.parameters())
    assert 200_000 <= n_params <= 800_000
    assert n_params == count_parameters(built["model"])  # untied: every parameter is stored
    ids = tok(RENDERED_CHAT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert model.dtype == torch.float32


def test_same_seed_same_weights(built, tmp_path):
    again = build_tiny_model(tmp_path / "again", preset="tiny", seed=0)
    a = load_file(str(built["model"] / "model.safetensors"))
    b = load_file(os.path.join(again, "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert (built["model"] / "tokenizer.json").read_text() == (Path(again) / "tokenizer.json").read_text()

    other = build_tiny_model(tmp_path / "other", preset="tiny", seed=1)
    c = load_file(os.path.join(other, "model.safetensors"))
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_custom_corpus_and_dtype(tmp_path):
    corpus = ["just a few words", "1 + 1 = 2", "the answer is 2"] * 10
    out = build_tiny_model(tmp_path / "bf16", preset="tiny", seed=3, dtype="bfloat16", corpus=corpus)
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    cfg = json.loads(Path(out, "config.json").read_text())
    assert cfg["vocab_size"] == 320  # 256 bytes + 3 specials + a few merges, rounded up to 64


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_sizes(preset):
    """Parameter counts from the config alone (meta device: nothing is allocated)."""
    from transformers import Qwen2ForCausalLM

    sizes = {
        "tiny": (0.2e6, 0.8e6),
        "quick": (0.8e6, 1.1e6),
        "small": (15e6, 21e6),
        "mid": (80e6, 100e6),
        "half_b": (3.4e8, 3.8e8),
    }
    expected = sizes[preset]
    cfg = make_config(preset, vocab_size=512, pad_id=0, eos_id=2)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert expected[0] <= n <= expected[1], n
    assert cfg.hidden_size // cfg.num_attention_heads in (32, 64)


def test_cli(tmp_path, capsys):
    """`python -m fusedrl.utils.tiny_model` entry point, run in-process (a child would re-import torch)."""
    out = tmp_path / "cli"
    main(["--out", str(out), "--preset", "tiny", "--seed", "0"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == str(out)
    assert lines[1].startswith("parameters: ") and int(lines[1].split()[-1]) == count_parameters(out)
    assert (out / "model.safetensors").is_file()


@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_vllm_tokenizer_agrees(built):
    from vllm.tokenizers import get_tokenizer

    for folder in (built["model"], built["tok"]):
        tok = get_tokenizer(str(folder))
        for text in STRINGS:
            ids = tok.encode(text, add_special_tokens=False)
            assert ids == _raw_ids(built["tok"], text), (folder.name, text)
            assert tok.decode(ids) == text
        assert tok.eos_token_id == tok.convert_tokens_to_ids(IM_END)


@pytest.mark.integration
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_vllm_generates(built):
    """vLLM (CPU, in-process engine) accepts the folder and generates; run in a child process for isolation."""
    script = textwrap.dedent(
        f"""
        import os, json
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams
        llm = LLM(model={str(built["model"])!r}, dtype="float32", enforce_eager=True,
                  kv_cache_memory_bytes=64 << 20, seed=0)
        out = llm.generate(["What is 2 + 3?"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        print("RESULT " + json.dumps(list(out[0].outputs[0].token_ids)))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert result, proc.stdout[-3000:]
    token_ids = json.loads(result[-1][len("RESULT ") :])
    assert len(token_ids) == 8
    cfg = json.loads((built["model"] / "config.json").read_text())
    assert all(0 <= t < cfg["vocab_size"] for t in token_ids)
