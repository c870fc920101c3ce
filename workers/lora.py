"""LoRA in the fused worker: PEFT adapters on the actor, the reference as the actor with its adapters off,
and the weight stream of merged target modules into the rollout engine.

* The actor is the PEFT model (``peft.get_peft_model``) wrapped by FSDP2 like any other role's model;
  only the adapter matrices require gradients, so only they reach AdamW (`build_adamw`).
* The reference policy is that same module under ``disable_adapter()``: the base model, with no second
  copy of its weights (`LoraRefView`).
* The engine is built from ``model.path`` (the base weights). After an update only the adapted modules
  change, so `merged_lora_stream` yields, per adapted module, ``W + (alpha / r) * B @ A`` computed from
  the gathered shards on the fly (never written back into the actor), named as in the base model. The
  engine's loaders fuse q/k/v and gate/up into one kernel, and a fused kernel must be given all its parts
  at once, so a module's fused siblings (`reload_units`) travel with it, unmerged if not adapted. After a
  level-2 sleep (weights discarded) the whole model is streamed, adapted modules merged. A mixture of
  experts' stacked expert tensors, which PEFT adapts as parameters (``all-linear`` reaches them), are merged
  per expert (`_merged_experts`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fusedrl.lora import base_name, is_adapter_name, lora_rank, target_modules, tied_target_message
from fusedrl.role_config import ModelConfig, RefConfig
from fusedrl.workers.fsdp import StreamStats, gather_full


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what ``target_modules`` may list)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})


def add_lora(model: nn.Module, model_cfg: ModelConfig) -> nn.Module:
    """Wrap a Hugging Face causal LM with trainable LoRA adapters (``peft``), or load the saved adapter
    at ``model.lora_adapter_path``. ``lora_B`` starts at zero (PEFT's default), so the wrapped model
    computes exactly what the base model does until the first update.

    Raises ValueError naming the model's linear modules when ``target_modules`` matches none of them, and
    naming the key and the fix when an adapter lands on a tied embedding or LM head (a regex or a saved
    adapter can reach them; the driver refuses the names written out before anything starts).
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    available = linear_module_names(model)
    tied = _tied_embedding_modules(model)
    path = model_cfg.lora_adapter_path
    try:
        if path:
            peft_model = PeftModel.from_pretrained(model, str(path), is_trainable=True)
        else:
            exclude = model_cfg.exclude_modules
            config = LoraConfig(
                r=lora_rank(model_cfg),
                lora_alpha=model_cfg.lora_alpha,  # type: ignore[arg-type]  # int in PEFT's annotation; a float works
                target_modules=target_modules(model_cfg.target_modules),
                exclude_modules=None if exclude is None else target_modules(exclude),
                lora_dropout=0.0,
                bias="none",
                task_type="CAUSAL_LM",
            )
            peft_model = get_peft_model(model, config)
    except ValueError as err:
        if "not found" not in str(err) and "did not match" not in str(err):
            raise
        raise ValueError(
            f"actor_rollout_ref.model.target_modules={model_cfg.target_modules!r} matches no module of "
            f"{model_cfg.path}: {err}. Its linear modules are: {', '.join(available)} "
            "(or use all-linear)."
        ) from err
    if not lora_layers(peft_model):
        raise ValueError(
            f"actor_rollout_ref.model.target_modules={model_cfg.target_modules!r} adapted no module; "
            f"the model's linear modules are: {', '.join(available)}"
        )
    on_tied = sorted(
        base_name(n)
        for n, m in lora_layers(peft_model).items()
        if id(m.get_base_layer()) in tied  # type: ignore[operator]
    )
    if on_tied:
        key, value = ("lora_adapter_path", path) if path else ("target_modules", model_cfg.target_modules)
        raise ValueError(
            tied_target_message(f"actor_rollout_ref.model.{key}", value, on_tied, model_cfg.path)
        )
    return peft_model


def _tied_embedding_modules(model: nn.Module) -> set[int]:
    """``id``s of the input embedding and LM head modules when they share one weight, else empty."""
    get_in, get_out = (
        getattr(model, "get_input_embeddings", None),
        getattr(model, "get_output_embeddings", None),
    )
    embed = get_in() if get_in is not None else None
    head = get_out() if get_out is not None else None
    if embed is None or head is None or getattr(head, "weight", None) is not getattr(embed, "weight", ()):
        return set()
    return {id(embed), id(head)}


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{module name: PEFT LoRA layer}`` of every adapted module."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}  # type: ignore[misc]


class LoraRefView:
    """The reference role of a LoRA run: the actor's own module with its adapters switched off.

    ``compute_log_prob`` is the base model's log-prob pass; no weights are copied or loaded."""

    def __init__(self, actor: Any, ref_cfg: RefConfig) -> None:
        self.actor = actor
        self.cfg = ref_cfg

    @property
    def model(self) -> nn.Module:
        return self.actor.model

    def compute_log_prob(self, batch: Any, *, temperature: float) -> torch.Tensor:
        """``log pi_base(response)``: ``[B, Tr]``, the actor's forward under ``disable_adapter()``."""
        from fusedrl.workers.logprob import batched_log_probs, token_budget

        self.actor.model.eval()
        if batch.multi_modal_inputs is not None:  # images: the vision-language pass (`workers/vision.py`)
            from fusedrl.workers.vision import vision_batched_log_probs

            with self.actor.model.disable_adapter():
                return vision_batched_log_probs(
                    self.actor.model,
                    batch,
                    temperature=temperature,
                    micro_batch_size=self.cfg.log_prob_micro_batch_size_per_gpu,
                    remove_padding=self.actor.use_remove_padding,
                )
        with self.actor.model.disable_adapter():
            return batched_log_probs(
                self.actor.model,
                batch,
                temperature=temperature,
                micro_batch_size=self.cfg.log_prob_micro_batch_size_per_gpu,
                max_token_len=token_budget(
                    self.cfg.log_prob_use_dynamic_bsz, self.cfg.log_prob_max_token_len_per_gpu
                ),
                remove_padding=self.actor.use_remove_padding,
                sp_group=self.actor.sp_group,
                share_prompts=self.actor.share_prompts,
            )


@torch.no_grad()
def merged_lora_stream(
    model: nn.Module, *, full: bool, stats: StreamStats | None = None, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(base model name, full tensor)`` with every adapted module merged: ``W + (alpha/r) B @ A``.

    ``full=False``: only the adapted modules' parameters and those of their fused siblings (`reload_units`);
    ``full=True``: every parameter and buffer of the base model (after the engine lost its weights).
    Collective like `fusedrl.workers.fsdp.stream_full_tensors` (each shard gathered by every rank in the
    same order). The merge is computed in float32 into a new tensor: the actor's weights are untouched,
    and about one module's full tensors are alive at a time. ``dtype``: floating tensors come in it (the
    receiver's), unmerged shards cast before their gather as in `gather_full`.
    """
    from fusedrl.third_party.vllm.reload import reload_units

    layers = lora_layers(model)
    adapted = {base_name(name) for name in layers}
    wanted = reload_units(adapted)
    experts = _expert_adapters(layers)
    state = model.state_dict()  # DTensor shards: no gathering yet
    for name, tensor in state.items():
        if is_adapter_name(name):
            continue
        hf = base_name(name)
        module_hf = hf.rsplit(".", 1)[0]
        if not full and module_hf not in wanted:
            continue
        peft_module = name.rsplit(".", 2)[0] if name.endswith(".base_layer.weight") else None
        if hf in experts:
            out, is_new = _merged_experts(experts[hf], tensor, state, dtype)
        elif peft_module in layers:
            out, is_new = _merged(layers[peft_module], tensor, state, peft_module, dtype)
        else:
            out, is_new = gather_full(tensor, dtype)
        if stats is not None:
            stats.record(out, is_new)
        yield hf, out
        del out


def _merged(
    layer: nn.Module,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    prefix: str,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, bool]:
    """``W + sum over active adapters of scaling * B @ A`` (full tensors, float32 math, in ``dtype``, else
    W's)."""
    w, _ = gather_full(weight)
    merged = w.to(torch.float32, copy=True)
    for adapter in layer.active_adapters:  # type: ignore[union-attr]
        a, _ = gather_full(state[f"{prefix}.lora_A.{adapter}.weight"])  # [r, in]
        b, _ = gather_full(state[f"{prefix}.lora_B.{adapter}.weight"])  # [out, r]
        scale = float(layer.scaling[adapter])  # type: ignore[index]
        merged.addmm_(b.to(torch.float32), a.to(torch.float32), alpha=scale)  # [out, in]
    return merged.to(w.dtype if dtype is None else dtype), True


def _expert_adapters(layers: dict[str, nn.Module]) -> dict[str, list[tuple[str, nn.Module]]]:
    """``{base name of a stacked expert tensor: [(PEFT module name, its adapter layer)]}``: PEFT's
    ``ParamWrapper`` adapts a mixture of experts' 3D parameters directly (``all-linear`` reaches them), one
    wrapper per parameter, nested around the experts module."""
    from peft.tuners.lora.layer import ParamWrapper

    out: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, layer in layers.items():
        if isinstance(layer, ParamWrapper) and int(layer.num_experts) > 1:
            out.setdefault(base_name(f"{name}.{layer.parameter_name}"), []).append((name, layer))
    return out


def _merged_experts(
    adapters: list[tuple[str, nn.Module]],
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, bool]:
    """A stacked expert tensor [E, d0, d1] plus its adapters' deltas (float32 math, in ``dtype``, else W's).

    PEFT's expert adapter holds ``lora_A`` [E * r, d_in] and ``lora_B`` [d_out, E * r]; expert e's delta is
    ``scaling * B_e @ A_e`` with ``A_e = A.view(E, r, d_in)[e]``, ``B_e = B.view(d_out, r, E)[:, :, e]``, laid
    out as [E, d_out, d_in] when PEFT swapped the parameter's in/out features (its 3D default), else
    [E, d_in, d_out]."""
    w, _ = gather_full(weight)
    merged = w.to(torch.float32, copy=True)
    for prefix, layer in adapters:
        experts = int(layer.num_experts)  # type: ignore[arg-type]
        for adapter in layer.active_adapters:  # type: ignore[union-attr]
            a, _ = gather_full(state[f"{prefix}.lora_A.{adapter}.weight"])
            b, _ = gather_full(state[f"{prefix}.lora_B.{adapter}.weight"])
            a3 = a.to(torch.float32).reshape(experts, -1, a.shape[-1])  # [E, r, d_in]
            b3 = b.to(torch.float32).reshape(b.shape[0], -1, experts)  # [d_out, r, E]
            layout = "e o i" if layer._did_swap_in_out_features else "e i o"
            delta = torch.einsum(f"o r e, e r i -> {layout}", b3, a3)
            if delta.shape != merged.shape:
                raise RuntimeError(
                    f"{prefix}: expert adapter delta {tuple(delta.shape)} for {tuple(merged.shape)}"
                )
            merged.add_(delta, alpha=float(layer.scaling[adapter]))  # type: ignore[index]
    return merged.to(w.dtype if dtype is None else dtype), True


def save_adapter(model: nn.Module, out_dir: str, *, rank: int) -> list[str]:
    """Write the adapter as a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``) that
    ``peft.PeftModel.from_pretrained(base, out_dir)`` loads. Collective (the adapter shards are gathered);
    rank 0 writes. Returns the files written ([] on other ranks)."""
    import os

    from peft.utils import get_peft_model_state_dict

    from fusedrl.workers.checkpoint_io import save_safetensors

    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if is_adapter_name(name):
            full, _ = gather_full(tensor)
            tensors[name] = full.detach().to("cpu").clone()
    if rank != 0:
        return []
    # PEFT's own key selection and renaming (drops the adapter name), on the gathered tensors.
    adapter_state = get_peft_model_state_dict(model, state_dict=tensors)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "adapter_model.safetensors")
    save_safetensors({k: v.contiguous() for k, v in adapter_state.items()}, path)
    config: Any = model.peft_config["default"]  # type: ignore[index]
    config.save_pretrained(out_dir)
    return [path, os.path.join(out_dir, "adapter_config.json")]
