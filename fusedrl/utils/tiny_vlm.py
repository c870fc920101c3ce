"""Build a random-init Qwen2.5-VL vision-language model with the tiny tokenizer and a local processor, offline.

The vision-language sibling of `fusedrl.utils.tiny_model` (same BPE tokenizer, with Qwen2-VL's vision special
tokens added): a ``Qwen2_5_VLForConditionalGeneration`` whose vision tower (14-pixel patches, 2x2 merge, window
attention) and text decoder (multimodal rotary positions, M-RoPE) are a few thousand times smaller than
Qwen2.5-VL-3B's, plus a ``Qwen2_5_VLProcessor`` (the PIL image processor: torchvision does not load here,
`fusedrl.models.qwen_vl`) saved beside it. The folder loads with transformers (``AutoModelForImageTextToText``;
the processor through `fusedrl.models.qwen_vl.load_processor`) and with vLLM (through
`fusedrl.third_party.vllm.multimodal`).

Images are resized to multiples of 28 pixels within [``min_pixels``, ``max_pixels``] (the processor's
``size``); each 28x28 block becomes one ``<|image_pad|>`` token of the prompt. The tiny processor keeps images
small (at most 112x112 pixels: 16 image tokens) so tests stay fast.

CLI::

    python -m fusedrl.utils.tiny_vlm --out DIR [--preset vlm_tiny] [--seed 0] [--dtype float32]
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from fusedrl.utils.tiny_model import (
    _DTYPES,
    IM_END,
    MODEL_MAX_LENGTH,
    PAD_TOKEN,
    VOCAB_MULTIPLE,
    _round_up,
    build_tokenizer,
    cli,
)

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# ChatML with Qwen2-VL's image slots: a message's content is a string, or a list of parts
# ({"type": "image"} or {"type": "text", "text": ...}); each image part becomes
# <|vision_start|><|image_pad|><|vision_end|>, which the processor widens to the image's token count.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# head_dim 32 for the text decoder (a head size vLLM's CPU attention accepts); mrope_section splits its 16
# rotary frequencies between the temporal, height and width position ids (Qwen2.5-VL-3B: [16, 24, 24] of 64).
VLM_PRESETS: dict[str, dict[str, Any]] = {
    # ~0.2M parameters with a 512-token vocabulary: 2 vision blocks (hidden 64), 2 decoder layers (hidden 64)
    "vlm_tiny": dict(
        text=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            mrope_section=[4, 6, 6],
        ),
        vision=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,  # two merged blocks wide: window attention has more than one window
            fullatt_block_indexes=[1],
        ),
    ),
}

# Image size bounds of the tiny processor, in pixels: 28x28 (1 image token) to 112x112 (16 image tokens).
MIN_PIXELS = 28 * 28
MAX_PIXELS = 112 * 112


def make_vlm_config(
    preset: str, vocab_size: int, token_ids: dict[str, int], dtype: str = "float32"
):  # -> Qwen2_5_VLConfig
    """The Qwen2.5-VL config of ``preset``; ``token_ids`` maps the pad, eos and vision token strings to ids."""
    from transformers import Qwen2_5_VLConfig

    if preset not in VLM_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(VLM_PRESETS)}")
    text = dict(VLM_PRESETS[preset]["text"])
    mrope_section = text.pop("mrope_section")
    vision = dict(VLM_PRESETS[preset]["vision"], out_hidden_size=text["hidden_size"])
    pad_id, eos_id = token_ids[PAD_TOKEN], token_ids[IM_END]
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            max_position_embeddings=MODEL_MAX_LENGTH,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
            use_sliding_window=False,
            tie_word_embeddings=False,
            bos_token_id=pad_id,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            **text,
        ),
        vision_config=vision,
        image_token_id=token_ids[IMAGE_PAD],
        video_token_id=token_ids[VIDEO_PAD],
        vision_start_token_id=token_ids[VISION_START],
        vision_end_token_id=token_ids[VISION_END],
        tie_word_embeddings=False,
    )
    cfg.dtype = dtype
    cfg.get_text_config().dtype = dtype
    return cfg


def build_vlm_processor(out_dir: str | os.PathLike, corpus: Iterable[str] | None = None):
    """The tiny tokenizer plus Qwen2-VL's vision tokens, and a PIL Qwen2-VL image processor bounded to
    [`MIN_PIXELS`, `MAX_PIXELS`], saved together as a ``Qwen2_5_VLProcessor`` in ``out_dir``; returns it
    reloaded with ``AutoProcessor``."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from fusedrl.models.qwen_vl import ImageOnlyQwenVLProcessor, load_processor

    out_dir = os.fspath(out_dir)
    build_tokenizer(out_dir, corpus=corpus)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=14, merge_size=2
    )
    processor = ImageOnlyQwenVLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=VLM_CHAT_TEMPLATE
    )
    processor.save_pretrained(out_dir)
    # As in tiny_model: declare the class transformers imposes on a Qwen folder, so every route loads alike;
    # and name the processor what it is (a machine with torchvision loads it with AutoProcessor).
    for name, key, value in [
        ("tokenizer_config.json", "tokenizer_class", "Qwen2Tokenizer"),
        ("tokenizer_config.json", "processor_class", "Qwen2_5_VLProcessor"),
        ("processor_config.json", "processor_class", "Qwen2_5_VLProcessor"),
    ]:
        path = os.path.join(out_dir, name)
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        cfg[key] = value
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)
            f.write("\n")
    return load_processor(out_dir)


def build_tiny_vlm(
    out_dir: str | os.PathLike,
    preset: str = "vlm_tiny",
    seed: int = 0,
    dtype: str = "float32",
    corpus: Iterable[str] | None = None,
) -> str:
    """Write the processor and a randomly initialised Qwen2_5_VLForConditionalGeneration (safetensors) to
    ``out_dir``; return it."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    out_dir = os.fspath(out_dir)
    processor = build_vlm_processor(out_dir, corpus=corpus)
    tok = processor.tokenizer
    token_ids = {t: tok.convert_tokens_to_ids(t) for t in [PAD_TOKEN, IM_END, *VISION_TOKENS]}
    cfg = make_vlm_config(preset, _round_up(len(tok), VOCAB_MULTIPLE), token_ids, dtype=dtype)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    model.to(getattr(torch, dtype))
    pad_id, eos_id = token_ids[PAD_TOKEN], token_ids[IM_END]
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    cli(argv, VLM_PRESETS, "vlm_tiny", build_tiny_vlm)


if __name__ == "__main__":
    main()
