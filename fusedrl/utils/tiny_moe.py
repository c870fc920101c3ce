"""Build a random-init Qwen3-MoE causal LM with the tiny tokenizer, entirely offline.

The mixture-of-experts sibling of `fusedrl.utils.tiny_model` (same tokenizer, same folder layout: config.json,
model.safetensors, generation_config.json, tokenizer files), for CPU tests of MoE runs: every decoder layer is
a sparse block of ``num_experts`` experts with top-``num_experts_per_tok`` routing and no shared expert.

transformers 5 holds a layer's experts as two 3D parameters (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]) and the router as ``mlp.gate.weight`` [E, H]; the saved checkpoint
uses the same names, and vLLM's Qwen3-MoE loader reads them into its fused-MoE parameters.

CLI::

    python -m fusedrl.utils.tiny_moe --out DIR [--preset moe_tiny] [--seed 0] [--dtype float32]
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from fusedrl.utils.tiny_model import MODEL_MAX_LENGTH, cli, save_random_model

# head_dim 32 (a head size vLLM's CPU attention accepts; Qwen3 states it explicitly). Parameter counts for a
# 512-token vocabulary.
MOE_PRESETS: dict[str, dict[str, Any]] = {
    # ~0.18M parameters: 2 layers, 8 experts, top-2
    "moe_tiny": dict(
        hidden_size=64,
        intermediate_size=128,  # unused: every layer is sparse
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    ),
    # ~1.1M parameters: 4 layers, 8 experts of width 64 (a vLLM-cpu reloadable width), top-2; the size of
    # the dense `quick` preset, for the echo GRPO run (benchmarks/moe_echo_grpo.py)
    "moe_quick": dict(
        hidden_size=128,
        intermediate_size=256,  # unused: every layer is sparse
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
}


def make_moe_config(
    preset: str,
    vocab_size: int,
    pad_id: int,
    eos_id: int,
    dtype: str = "float32",
    overrides: dict[str, Any] | None = None,
):
    from transformers import Qwen3MoeConfig

    if preset not in MOE_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(MOE_PRESETS)}")
    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size,
        max_position_embeddings=MODEL_MAX_LENGTH,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        use_sliding_window=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        output_router_logits=False,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **{**MOE_PRESETS[preset], **(overrides or {})},
    )
    cfg.dtype = dtype
    return cfg


def build_tiny_moe_model(
    out_dir: str | os.PathLike,
    preset: str = "moe_tiny",
    seed: int = 0,
    dtype: str = "float32",
    corpus: Iterable[str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> str:
    """Write tokenizer + randomly initialised Qwen3MoeForCausalLM (safetensors) to ``out_dir``; return it.
    ``overrides``: config fields that replace the preset's (``moe_intermediate_size=64``)."""
    from transformers import Qwen3MoeForCausalLM

    def config(vocab_size: int, pad_id: int, eos_id: int):
        return make_moe_config(
            preset, vocab_size, pad_id=pad_id, eos_id=eos_id, dtype=dtype, overrides=overrides
        )

    return save_random_model(out_dir, Qwen3MoeForCausalLM, config, seed=seed, dtype=dtype, corpus=corpus)


def main(argv: list[str] | None = None) -> None:
    cli(argv, MOE_PRESETS, "moe_tiny", build_tiny_moe_model)


if __name__ == "__main__":
    main()
