"""Tests for fusedrl.utils.tiny_vlm and fusedrl.models.qwen_vl: an offline-built Qwen2.5-VL folder whose
image-only processor widens each image to its token count and whose model reads the image."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fusedrl.models.qwen_vl import ImageOnlyQwenVLProcessor, load_processor, mm_token_type_ids
from fusedrl.utils.tiny_vlm import IMAGE_PAD, VISION_END, VISION_START, build_tiny_vlm

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many apples?"}]}]


def _image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> str:
    return build_tiny_vlm(str(tmp_path_factory.mktemp("tiny_vlm")), seed=0)


def test_processor_widens_each_image_to_its_grid(vlm_dir):
    proc = load_processor(vlm_dir)
    assert isinstance(proc, ImageOnlyQwenVLProcessor)
    text = proc.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert f"{VISION_START}{IMAGE_PAD}{VISION_END}How many apples?" in text
    # 60x90 -> resized to 56x84 (multiples of 28) -> a 4x6 grid of 14-pixel patches -> 2x3 merged tokens
    out = proc(text=[text], images=[_image(60, 90, 0)], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert out["pixel_values"].shape == (24, 3 * 2 * 14 * 14)
    ids = out["input_ids"][0]
    assert int((ids == proc.image_token_id).sum()) == 6
    # The special tokens are single ids, equal through the tokenizer alone.
    plain = proc.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(plain) == len(ids) - 5 and plain.count(proc.image_token_id) == 1
    # A large image is bounded by the processor's max_pixels (112x112: 16 tokens).
    big = proc(text=[text], images=[_image(400, 400, 1)], return_tensors="pt")
    assert big["image_grid_thw"].tolist() == [[1, 8, 8]]
    with pytest.raises(ValueError, match="images only"):
        proc(text=[text], videos=[np.zeros((2, 28, 28, 3), dtype=np.uint8)])


def test_model_reads_the_image_with_mrope(vlm_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    proc = load_processor(vlm_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    assert model.config.vision_config.out_hidden_size == model.config.text_config.hidden_size == 64
    assert any(n.startswith("model.visual.blocks.1.") for n, _ in model.named_parameters())
    text = proc.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)

    def logits(image: Image.Image, mrope: bool = True) -> torch.Tensor:
        enc = proc(text=[text], images=[image], return_tensors="pt")
        extra = (
            {"mm_token_type_ids": mm_token_type_ids(enc["input_ids"], proc.image_token_id)} if mrope else {}
        )
        with torch.no_grad():
            return model(
                input_ids=enc["input_ids"],
                pixel_values=enc["pixel_values"],
                image_grid_thw=enc["image_grid_thw"],
                **extra,
            ).logits[0, -1]

    a = logits(_image(60, 90, 0))
    assert torch.isfinite(a).all()
    assert torch.equal(a, logits(_image(60, 90, 0)))
    assert (a - logits(_image(60, 90, 7))).abs().max() > 1e-4  # another image, other logits
    assert (a - logits(_image(60, 90, 0), mrope=False)).abs().max() > 1e-4  # 1D positions are not M-RoPE
