"""The log-prob pass of a vision-language policy (Qwen2-VL / Qwen2.5-VL): images beside the batch, M-RoPE
positions, vision tokens out of the loss.

What differs from a text policy's pass (`fusedrl.workers.logprob.response_log_probs`):

* **Images ride beside the batch.** `VisionInputs` (`fusedrl.data.vision_inputs`) holds each row's
  ``pixel_values`` [patches_i, C*T*P*P] and
  ``image_grid_thw`` [images_i, 3] (the processor's output, `fusedrl.data.multimodal`); a row has any number of
  images, so they are per-row lists, cut with the rows (`VisionInputs.select`). The forward concatenates the
  rows' patches in row order, the order the model scatters image features into image tokens.
* **Positions are M-RoPE.** Text tokens get one position on all three axes; an image's tokens get (temporal,
  height, width) grid positions; the text after an image starts after the image's largest extent. The
  positions come from the model's own ``get_rope_index`` over the real tokens of each row (left padding
  skipped), the same rule vLLM applies (``get_mrope_input_positions``), so they are the positions the rollout
  engine used. Positions counting tokens (the text pass's) are wrong after the first image.
* **Vision tokens end what is trained on.** A policy can sample ``<|image_pad|>`` or ``<|vision_start|>``
  itself (a random or young model does). transformers would take such a response token for an image slot and
  fail (more image tokens than image features), so it is replaced by the pad id for the forward. vLLM embeds
  it as a text token, which transformers' forward cannot reproduce, so the tokens after it are scored in
  another context than the engine sampled them in (measured: log-prob gaps up to 0.33 in float32 on those rows,
  5e-7 elsewhere). Such a token and everything after it in its response are out of the loss: ``loss_mask`` of
  `vision_response_log_probs`. Prompt image tokens are never in the loss (the loss reads response tokens only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fusedrl.batch import RolloutBatch
from fusedrl.data.vision_inputs import VisionInputs  # re-exported: the pass's input
from fusedrl.workers.vision_packing import pack_vision_rows


def vision_token_mask(tokens: torch.Tensor, vision_token_ids: Sequence[int]) -> torch.Tensor:
    """True where ``tokens`` [...] is one of the vision special tokens (image / video pads, vision start / end)."""
    return torch.isin(tokens, torch.tensor(list(vision_token_ids), device=tokens.device))


def vision_token_ids(config) -> tuple[int, ...]:
    """The vision special token ids of a Qwen2-VL / Qwen2.5-VL config."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return tuple(int(getattr(config, n)) for n in names if getattr(config, n, None) is not None)


def vlm_core(model: Any) -> Any:
    """The ``Qwen2_5_VLModel`` (vision tower + text decoder, ``get_rope_index``) inside ``model``: a
    conditional-generation model, the same under PEFT's LoRA wrappers (``get_base_model``), or the core itself."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base if hasattr(base, "get_rope_index") else base.model


def mrope_positions(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, grids: torch.Tensor | None
) -> torch.Tensor:
    """M-RoPE position ids [3, B, T] of left/right-padded rows (0 on padding), from the model's
    ``get_rope_index``; ``input_ids`` must hold image tokens only where the prompts' images are."""
    image_id = int(model.config.image_token_id)
    types = (input_ids == image_id).long() * attention_mask  # [B, T]: 1 on image tokens
    inner = vlm_core(model)
    positions, _ = inner.get_rope_index(
        input_ids, mm_token_type_ids=types, image_grid_thw=grids, attention_mask=attention_mask
    )
    return positions  # [3, B, T]


def vision_response_log_probs(
    model: Any,
    batch: RolloutBatch,
    vision: VisionInputs,
    *,
    temperature: float,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``model`` (a ``Qwen2_5_VLForConditionalGeneration``, FSDP-wrapped or not) over the
    batch's prompt+response with its images; returns ``(log_probs [B, Tr],
    loss_mask [B, Tr])``: the response mask up to (not including) the first vision token a row sampled; the
    log-probs are 0 outside it.
    Runs with the caller's grad mode (no_grad for old / reference log-probs, grad in the update)."""
    log_probs, _, loss_mask = _vision_forward(
        model, batch, vision, temperature=temperature, pad_token_id=pad_token_id, with_entropy=False
    )
    return log_probs, loss_mask


def _vision_forward(
    model: Any,
    batch: RolloutBatch,
    vision: VisionInputs,
    *,
    temperature: float,
    pad_token_id: int,
    with_entropy: bool,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`vision_response_log_probs` plus, with ``with_entropy``, the entropy [B, Tr] of each position;
    ``packed``: the rows' real tokens in one row (`fusedrl.workers.vision_packing`), the same values up to
    summation order."""
    ids = vision_token_ids(model.config)
    response_vision = vision_token_mask(batch.responses, ids) & batch.response_mask.bool()  # [B, Tr]
    responses = batch.responses.masked_fill(response_vision, pad_token_id)  # [B, Tr]
    input_ids = torch.cat([batch.prompts, responses], dim=1)  # [B, Tp+Tr]
    attention_mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).long()  # [B, Tp+Tr]
    pixel_values, grids = vision.concatenated()
    positions = mrope_positions(model, input_ids, attention_mask, grids)  # [3, B, Tp+Tr]
    tp, tr = batch.prompts.shape[1], batch.responses.shape[1]
    kwargs = {} if grids is None else {"pixel_values": pixel_values, "image_grid_thw": grids}
    if packed:
        row = pack_vision_rows(input_ids, attention_mask, positions, batch.response_mask)
        logits = model(
            input_ids=row.input_ids,
            position_ids=row.position_ids,
            attention_mask=None,
            logits_to_keep=row.pred_index,
            use_cache=False,  # with a cache transformers reads no sequence boundaries from the positions
            **kwargs,
        ).logits[0]  # [M, V]: the positions that predict the response tokens
        targets = responses[row.response_mask]  # [M]
    else:
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, **kwargs
        ).logits[:, tp - 1 : tp + tr - 1]  # [B, Tr, V]: position t predicts token t+1
        targets = responses  # [B, Tr]
    logits = logits.float() / temperature  # [..., V]
    token_logits = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [...]
    log_z = torch.logsumexp(logits, dim=-1)  # [...]
    log_probs = token_logits - log_z  # [...]
    entropy = None
    if with_entropy:  # H = logZ - sum_v p_v * logit_v
        entropy = log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # [...]
    if packed:  # [M] -> [B, Tr], 0 off the response tokens
        log_probs = row.unpack(log_probs)
        entropy = None if entropy is None else row.unpack(entropy)
    loss_mask = batch.response_mask * (response_vision.cumsum(dim=1) == 0)  # [B, Tr]: up to a vision token
    return log_probs * loss_mask, None if entropy is None else entropy * loss_mask, loss_mask


def shard_vision_language_model(
    model: Any,
    mesh: Any,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
) -> Any:
    """FSDP2 for a Qwen2-VL / Qwen2.5-VL: one unit per vision block and per decoder layer, then the root.

    `fusedrl.workers.fsdp.apply_fsdp2` looks for the decoder layers at ``model.model.layers``; transformers 5
    holds a vision-language model's at ``model.model.language_model.layers`` and its vision blocks at
    ``model.model.visual.blocks``. ``gradient_checkpointing`` (``model.enable_gradient_checkpointing``):
    transformers' non-reentrant checkpointing of every vision block and decoder layer, as the text path's
    (`fusedrl.workers.fsdp.shard_for_training`): in training mode their activations are recomputed in the
    backward inside the FSDP2 unit."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    inner = vlm_core(model)
    for unit in [*inner.visual.blocks, *inner.language_model.layers]:
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    return model


def freeze_vision_tower(model: Any) -> int:
    """Stop training the vision tower (verl's ``actor_rollout_ref.actor.freeze_vision_tower``): its parameters
    get no gradient, so the optimizer leaves them. Call before sharding. The weight stream still carries them
    (the engine's completeness check wants every checkpoint tensor). Returns the number of frozen tensors."""
    frozen = 0
    for p in vlm_core(model).visual.parameters():
        p.requires_grad_(False)
        frozen += 1
    return frozen


# ---------------------------------------------------------------------- the trainer's path (fused worker)


def load_vision_language_model(path: str, dtype: torch.dtype) -> Any:
    """A Qwen2-VL / Qwen2.5-VL folder as its conditional-generation model (``AutoModelForCausalLM`` refuses
    their configs), on CPU in ``dtype`` (the master dtype), for training forwards (no KV cache)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    model.config.use_cache = False
    return model


def batch_vision(batch: RolloutBatch) -> VisionInputs:
    """The batch's per-row `VisionInputs` (``multi_modal_inputs``, one row each) as one, in row order."""
    rows = batch.field_list("multi_modal_inputs")
    return VisionInputs(
        pixel_values=[p for r in rows for p in r.pixel_values],
        image_grid_thw=[g for r in rows for g in r.image_grid_thw],
        images=[i for r in rows for i in r.images],
    )


def _pad_id(model: Any) -> int:
    """The id a sampled vision token is replaced by for the forward (any text id: it is out of the loss)."""
    text = model.config.get_text_config()
    for name in ("pad_token_id", "eos_token_id"):
        for config in (model.config, text):
            if isinstance(getattr(config, name, None), int):
                return int(getattr(config, name))
    return 0


def vision_log_probs(
    model: Any,
    batch: RolloutBatch,
    *,
    temperature: float,
    with_entropy: bool = False,
    remove_padding: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The actor's loss pass on a batch whose rows carry ``multi_modal_inputs``: ``(log_probs [B, Tr],
    entropy [B, Tr] or None)``, both 0 outside `vision_response_log_probs`'s loss mask (the rollout already
    cut responses before a sampled vision token: `cut_at_vision_tokens`, so that mask is ``response_mask``)."""
    log_probs, entropy, _ = _vision_forward(
        model,
        batch,
        batch_vision(batch),
        temperature=temperature,
        pad_token_id=_pad_id(model),
        with_entropy=with_entropy,
        packed=remove_padding,
    )
    return log_probs, entropy


@torch.no_grad()
def vision_batched_log_probs(
    model: Any,
    batch: RolloutBatch,
    *,
    temperature: float,
    micro_batch_size: int,
    remove_padding: bool = False,
) -> torch.Tensor:
    """Old / reference log-probs [B, Tr] of a batch with images, in micro-batches of ``micro_batch_size``
    consecutive rows, each padded or packed (``remove_padding``; token-budget micro-batches are not built for
    images)."""
    step = max(1, int(micro_batch_size))
    parts = []
    for i in range(0, batch.num_samples, step):
        lp, _ = vision_log_probs(
            model, batch[i : i + step], temperature=temperature, remove_padding=remove_padding
        )
        parts.append(lp)
    return torch.cat(parts, dim=0)


def cut_at_vision_tokens(batch: RolloutBatch, vision_ids: Sequence[int], pad_token_id: int) -> RolloutBatch:
    """End each sampled response before its first vision token, in place: that token and what follows become
    padding (``responses`` pad, ``response_mask`` and ``rollout_log_probs`` 0), as if the engine had stopped
    there. The actor cannot score tokens after a sampled vision token in the context the engine sampled them
    in (module docstring), so the whole step (reward, log-prob check, loss) sees the response up to it."""
    hit = vision_token_mask(batch.responses, vision_ids) & batch.response_mask.bool()  # [B, Tr]
    keep = (hit.long().cumsum(dim=1) == 0).long()  # [B, Tr]
    batch.response_mask = batch.response_mask * keep
    batch.responses = torch.where(keep.bool(), batch.responses, pad_token_id)
    if batch.rollout_log_probs is not None:  # None: not asked for this step
        batch.rollout_log_probs = batch.rollout_log_probs * keep
    return batch


def vision_model_token_ids(model_path: str) -> tuple[int, ...]:
    """`vision_token_ids` of the model folder's config; ``()`` for a text model."""
    from transformers import AutoConfig

    from fusedrl.models.qwen_vl import is_vision_language_model

    if not is_vision_language_model(model_path):
        return ()
    return vision_token_ids(AutoConfig.from_pretrained(model_path))
