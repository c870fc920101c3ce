"""Where a Hugging Face causal LM keeps its decoder layers: FSDP2 wraps one unit per layer
(`fusedrl.workers.fsdp`) and `fusedrl.workers.layer_compile` compiles each; both read them here."""

from __future__ import annotations

from torch import nn


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a HF causal LM (``model.model.layers`` for Llama/Qwen-style models)."""
    if hasattr(model, "get_base_model"):  # a PEFT model: the layers are the wrapped model's
        model = model.get_base_model()  # type: ignore[operator]
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers at model.model.layers")
    return list(layers)
