"""The Qwen2-VL / Qwen2.5-VL processor without its video half, for machines without a working torchvision.

transformers 5.19's ``Qwen2_5_VLProcessor`` holds an image processor, a tokenizer and a video processor, and
refuses to be built without all three; its video processor (``Qwen2VLVideoProcessor``) needs torchvision, and on
the CPU machines of this project torchvision cannot load (the registry's wheel is built for CUDA torch:
``libc10_cuda.so`` missing, then ``operator torchvision::nms does not exist``). Images need no torchvision: the
PIL image processor (``Qwen2VLImageProcessorPil``) does the resize / normalise / patchify.

`ImageOnlyQwenVLProcessor` is the same processor with the video processor left out: it takes images and
text, expands each ``<|image_pad|>`` to the image's token count and returns ``pixel_values`` [patches,
C*T*P*P] and ``image_grid_thw`` [images, 3] exactly as the full class would. Videos are refused. A model folder
keeps ``processor_class: Qwen2_5_VLProcessor`` (what it is, for machines that have torchvision); fusedrl loads
it through `load_processor`. The vLLM engine uses the same class (`fusedrl.third_party.vllm.multimodal`).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import Qwen2_5_VLProcessor
from transformers.processing_utils import ProcessorMixin

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"


class ImageOnlyQwenVLProcessor(Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` with an image processor and a tokenizer only (no video processor)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs: Any) -> None:
        # What Qwen2_5_VLProcessor.__init__ sets, then the mixin's checks over our two attributes only.
        self.image_token = getattr(tokenizer, "image_token", None) or IMAGE_PAD
        self.video_token = getattr(tokenizer, "video_token", None) or VIDEO_PAD
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    def __call__(self, images=None, text=None, videos=None, **kwargs: Any):  # type: ignore[override]
        if videos is not None:
            raise ValueError(
                "ImageOnlyQwenVLProcessor takes images only: Qwen2-VL's video processor needs torchvision, "
                "which does not load on this machine"
            )
        return super().__call__(images=images, text=text, **kwargs)


def load_processor(model_path: str | os.PathLike, **kwargs: Any) -> ImageOnlyQwenVLProcessor:
    """The image-only processor saved in a Qwen2-VL / Qwen2.5-VL model folder (``preprocessor_config.json``
    with the PIL image processor, and the tokenizer files)."""
    return ImageOnlyQwenVLProcessor.from_pretrained(os.fspath(model_path), **kwargs)


VISION_LANGUAGE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def is_vision_language_model(model_path: str | os.PathLike) -> bool:
    """Whether the model folder holds a Qwen2-VL / Qwen2.5-VL (its ``config.json`` ``model_type``)."""
    import json

    config = os.path.join(os.fspath(model_path), "config.json")
    if not os.path.isfile(config):
        return False
    with open(config, encoding="utf-8") as f:
        return json.load(f).get("model_type") in VISION_LANGUAGE_MODEL_TYPES


def mm_token_type_ids(input_ids, image_token_id: int):
    """``mm_token_type_ids`` for transformers' Qwen2-VL / Qwen2.5-VL forward: 1 at image tokens, else 0
    [B, T]. Without it (or without ``image_grid_thw``) transformers 5.19 silently falls back to 1D positions
    (``compute_3d_position_ids``) instead of M-RoPE, and its log-probs are no longer the engine's."""
    return (input_ids == image_token_id).long()
