"""fusedrl.data.multimodal: verl's multimodal parquet schema (an image column of bytes dicts or paths, <image>
placeholders in the messages), decoded once, and the errors a bad image row gets."""

from __future__ import annotations

import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from fusedrl.data.dataset import DataError
from fusedrl.data.multimodal import VisionLanguageDataset, decode_image, image_messages


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from fusedrl.utils.tiny_vlm import build_vlm_processor

    return build_vlm_processor(tmp_path_factory.mktemp("vlm_processor"))


def _image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _row(content: str, images: list, gt: str = "3") -> dict:
    return {
        "data_source": "shapes",
        "prompt": [{"role": "user", "content": content}],
        "images": images,
        "reward_model": {"ground_truth": gt},
    }


def _write(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_image_messages_split_placeholders_in_order():
    messages, n = image_messages(
        [
            {"role": "system", "content": "Count."},
            {"role": "user", "content": "<image>Left, right:<image> how many?"},
        ]
    )
    assert n == 2
    assert messages[0] == {"role": "system", "content": "Count."}
    assert messages[1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "Left, right:"},
        {"type": "image"},
        {"type": "text", "text": " how many?"},
    ]


def test_bytes_and_paths_decode_once_to_the_processors_tensors(processor, tmp_path):
    a, b = _image(60, 90, 0), _image(28, 28, 1)  # 6 image tokens and 1
    (tmp_path / "imgs").mkdir()
    b.save(tmp_path / "imgs" / "b.png")
    rows = [
        _row(
            "<image>How many? Then <image>.",
            [{"bytes": _png(a), "path": None}, {"bytes": None, "path": "imgs/b.png"}],
        ),
        _row("<image>How many?", [{"bytes": None, "path": f"file://{tmp_path / 'imgs' / 'b.png'}"}]),
        _row("No image here.", []),
    ]
    data = VisionLanguageDataset(_write(tmp_path / "train.parquet", rows), processor, max_prompt_length=64)
    assert len(data) == 3 and data[0]["uid"] == "train-0"
    first = data[0]
    assert first["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 2]]  # in placeholder order
    assert first["prompt_ids"].count(processor.image_token_id) == 6 + 1
    messages, _ = image_messages(rows[0]["prompt"])
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    direct = processor(text=[text], images=[a, b], return_tensors="pt")
    assert first["prompt_ids"] == direct["input_ids"][0].tolist()
    assert torch.equal(first["pixel_values"], direct["pixel_values"])
    assert [im.size for im in first["images"]] == [(90, 60), (28, 28)]
    assert np.array_equal(np.asarray(first["images"][0]), np.asarray(a))  # PNG bytes round-trip exactly
    assert data[1]["image_grid_thw"].tolist() == [[1, 2, 2]]
    assert data[2]["images"] == [] and data[2]["pixel_values"].numel() == 0
    assert processor.image_token_id not in data[2]["prompt_ids"]


def test_image_key_names_the_column(processor, tmp_path):
    rows = [{**_row("<image>?", []), "pictures": [{"bytes": _png(_image(28, 56, 2))}]}]
    rows[0].pop("images")
    path = _write(tmp_path / "p.parquet", rows)
    with pytest.raises(DataError, match=r"missing required column\(s\) \['images'\].*data.image_key"):
        VisionLanguageDataset(path, processor, max_prompt_length=64)
    data = VisionLanguageDataset(path, processor, max_prompt_length=64, image_key="pictures")
    assert data[0]["image_grid_thw"].tolist() == [[1, 2, 4]]


def test_bad_image_rows_are_named_with_the_fix(processor, tmp_path):
    good = {"bytes": _png(_image(28, 28, 3))}
    rows = [
        _row("<image>ok", [good]),
        _row("<image>missing", [{"bytes": None, "path": "nowhere/x.png"}]),
        _row("<image>broken", [{"bytes": b"not an image at all", "path": None}]),
        _row("<image><image>two placeholders", [good]),
    ]
    path = _write(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError) as info:
        VisionLanguageDataset(path, processor, max_prompt_length=64)
    msg = str(info.value)
    assert msg.startswith(f"{path}: 3 bad row(s)")
    assert "row 0" not in msg
    missing = os.path.join(str(tmp_path), "nowhere", "x.png")
    assert f"row 1: column 'images', image 0: image file not found: {missing}" in msg
    assert "row 2: column 'images', image 0: cannot decode the image (19 bytes)" in msg
    assert 'store each image as {"bytes"' in msg
    assert "row 3: 2 <image> placeholder(s) in the messages but 1 image(s)" in msg


def test_decode_image_refuses_a_dict_without_an_image():
    with pytest.raises(ValueError, match="no 'bytes', 'path' or 'image' entry"):
        decode_image({"bytes": None, "path": None}, "/")
    with pytest.raises(ValueError, match="the image is a int"):
        decode_image(3, "/")


def test_overlong_prompts_error_or_are_filtered(processor, tmp_path):
    rows = [
        _row("<image>big", [{"bytes": _png(_image(112, 112, 4))}]),
        _row("<image>small", [{"bytes": _png(_image(28, 28, 5))}]),
    ]
    path = _write(tmp_path / "long.parquet", rows)
    with pytest.raises(DataError, match=r"row 0: the prompt is \d+ tokens with its image tokens"):
        VisionLanguageDataset(path, processor, max_prompt_length=20)
    data = VisionLanguageDataset(path, processor, max_prompt_length=20, filter_overlong_prompts=True)
    assert len(data) == 1 and data.num_filtered == 1 and data[0]["uid"] == "long-1"


def test_collate_keeps_images_with_their_rows(processor, tmp_path):
    from fusedrl.data.multimodal import collate_vision

    rows = [
        _row("<image>a", [{"bytes": _png(_image(60, 90, 6))}]),
        _row("b", []),
        _row("<image><image>c", [{"bytes": _png(_image(28, 56, 7))}, {"bytes": _png(_image(56, 56, 8))}]),
    ]
    data = VisionLanguageDataset(_write(tmp_path / "c.parquet", rows), processor, max_prompt_length=48)
    batch, vision = collate_vision([data[i] for i in range(3)], pad_token_id=0, max_prompt_length=48)
    index = torch.arange(3).repeat_interleave(2)  # GRPO's n=2 samples: [0, 0, 1, 1, 2, 2]
    batch, vision = batch.repeat_samples(2), vision.select(index)
    assert batch.prompts.shape == (6, 48) and len(vision.images) == 6
    for i in range(6):
        tokens = int((batch.prompts[i] == processor.image_token_id).sum())
        grids = vision.image_grid_thw[i]
        assert tokens == int(grids.prod(-1).sum()) // 4  # 2x2 patches per image token
        assert vision.pixel_values[i].shape[0] == int(grids.prod(-1).sum())
        assert len(vision.images[i]) == grids.shape[0] == [1, 0, 2][i // 2]
    assert batch.uid == ["c-0", "c-0", "c-1", "c-1", "c-2", "c-2"]
    patches, grids = vision.concatenated()
    assert patches is not None and grids is not None
    assert grids.tolist() == [[1, 4, 6], [1, 4, 6], [1, 2, 4], [1, 4, 4], [1, 2, 4], [1, 4, 4]]
