"""Vision-language prompts: verl's multimodal parquet schema, decoded once, with the image tensors per row.

A row is a verl prompt row (``data_source``, the prompt messages, ``reward_model.ground_truth``, optional
``extra_info``) plus an image column (``image_key``, verl's ``data.image_key``, default ``"images"``): a list
of images, each one of

    {"bytes": b"..."}          encoded image bytes (PNG, JPEG, ...), as verl's geo3k preprocessing writes them
    {"path": "a.png"}          or {"image": "a.png"}: a file path
    "a.png"                    a path as a plain string ("file://" prefix allowed)

A relative path is taken from the parquet file's folder. In the messages each image is a ``<image>`` placeholder
in a text content (verl's convention); the number of placeholders in a row must equal its number of images, in
order. The placeholders become ``{"type": "image"}`` parts of the content, the processor's chat template renders
each as ``<|vision_start|><|image_pad|><|vision_end|>`` and the processor widens ``<|image_pad|>`` to the
image's token count.

Every image is decoded when the dataset is built (RGB, fully loaded), and processed once: each item carries its
prompt ids (image tokens widened), its images (for the rollout engine, which processes them itself) and the
processor's ``pixel_values`` [patches, C*T*P*P] and ``image_grid_thw`` [images, 3] (for the trainer's forward).
A missing or unreadable image is a `DataError` naming the file, the row, the image and the fix; all bad rows
are reported together (up to five shown).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fusedrl.batch import RolloutBatch
from fusedrl.data.dataset import (
    _MAX_REPORTED_PROBLEMS,
    DataError,
    _as_file_list,
    _check_messages,
    _clean_messages,
    _file_tags,
    _read_parquet,
    collate,
    tokenizer_pad_id,
)
from fusedrl.data.vision_inputs import VisionInputs  # re-exported: what `collate_vision` returns

IMAGE_PLACEHOLDER = "<image>"
_PLACEHOLDER_SPLIT = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)})")
_IMAGE_HOW = (
    'store each image as {"bytes": <encoded PNG/JPEG bytes>} or as a path (absolute, or relative to the '
    "parquet file's folder)"
)


def decode_image(value: Any, base_dir: str):  # -> PIL.Image.Image
    """One image cell (bytes dict, path dict, path string, raw bytes or a PIL image) as a loaded RGB PIL image.
    Raises ``ValueError`` saying what is wrong (the caller adds the file and row)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    source: Any = value
    if isinstance(value, Mapping):
        data = value.get("bytes")
        source = data if data is not None else value.get("path") or value.get("image")
        if source is None:
            raise ValueError(f"the image dict has no 'bytes', 'path' or 'image' entry (keys {sorted(value)})")
    if isinstance(source, (bytes, bytearray)):
        stream: Any = io.BytesIO(source)
        label = f"{len(source)} bytes"
    elif isinstance(source, str):
        path = source.removeprefix("file://")
        path = path if os.path.isabs(path) else os.path.join(base_dir, path)
        if not os.path.isfile(path):
            raise ValueError(f"image file not found: {path}")
        stream, label = path, path
    else:
        raise ValueError(f"the image is a {type(source).__name__}; {_IMAGE_HOW}")
    try:
        with Image.open(stream) as image:
            return image.convert("RGB")  # convert() loads the pixels: nothing is read again later
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, SyntaxError ... on damaged data
        raise ValueError(f"cannot decode the image ({label}): {type(exc).__name__}: {exc}") from exc


def image_messages(messages: Sequence[Mapping]) -> tuple[list[dict], int]:
    """Messages with each ``<image>`` of a text content turned into an image part, in order, and the number
    of placeholders. A content without a placeholder stays a string."""
    out: list[dict] = []
    count = 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
            out.append(dict(message))
            continue
        parts: list[dict] = []
        for piece in _PLACEHOLDER_SPLIT.split(content):
            if piece == IMAGE_PLACEHOLDER:
                parts.append({"type": "image"})
                count += 1
            elif piece:
                parts.append({"type": "text", "text": piece})
        out.append({**message, "content": parts})
    return out, count


class VisionLanguageDataset:
    """Image + text prompts from verl-schema parquet files with an image column.

    Args:
        files: a parquet path or a list of them; rows are concatenated in file order.
        processor: a Qwen2-VL-style processor (`fusedrl.models.qwen_vl.load_processor`): a chat template, a
            tokenizer and an image processor; ``processor(text=, images=)`` widens the image tokens.
        max_prompt_length: longest prompt in tokens, image tokens included (``data.max_prompt_length``).
        prompt_key: the message-list column (``data.prompt_key``).
        image_key: the image-list column (``data.image_key``).
        filter_overlong_prompts: drop over-long prompts (counted in ``num_filtered``) instead of raising.
            Cutting a prompt (``data.truncation``) is not offered: it would cut through an image's tokens.

    Each item is a dict with ``prompt_ids`` (list[int]), ``images`` (list of RGB PIL images),
    ``pixel_values`` (float32 [patches, C*T*P*P]), ``image_grid_thw`` (long [images, 3]), ``data_source``,
    ``ground_truth``, ``extra_info`` and ``uid`` (file stem and row, as `fusedrl.data.dataset.RLDataset`).
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        processor: Any,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        image_key: str = "images",
        filter_overlong_prompts: bool = False,
    ) -> None:
        if not isinstance(max_prompt_length, int) or max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be a positive integer, got {max_prompt_length!r}")
        self.files = _as_file_list(files)
        self.processor = processor
        self.max_prompt_length = max_prompt_length
        self.prompt_key = prompt_key
        self.image_key = image_key
        self.filter_overlong_prompts = filter_overlong_prompts
        self.num_filtered = 0
        self._items: list[dict] = []
        for path, tag in zip(self.files, _file_tags(self.files)):
            self._load_file(path, tag)
        if not self._items:
            raise DataError(
                f"{', '.join(self.files)}: no usable prompts ({self.num_filtered} dropped as longer than "
                f"max_prompt_length={max_prompt_length}); raise data.max_prompt_length or use smaller images"
            )

    def _load_file(self, path: str, tag: str) -> None:
        table = _read_parquet(path)
        required = ("data_source", self.prompt_key, "reward_model", self.image_key)
        missing = [c for c in required if c not in table.column_names]
        if missing:
            keys = {self.prompt_key: "data.prompt_key", self.image_key: "data.image_key"}
            hints = [f"set {keys[c]} to the right column (now {c!r})" for c in missing if c in keys]
            raise DataError(
                f"{path}: missing required column(s) {missing}; the file has columns {table.column_names}. "
                f"A vision-language row needs data_source, {self.prompt_key} (chat messages with <image> "
                f"placeholders), {self.image_key} (a list of images) and reward_model.ground_truth"
                + (f"; {'; '.join(hints)}" if hints else "")
            )
        columns = {name: table.column(name).to_pylist() for name in required}
        extra = table.column("extra_info").to_pylist() if "extra_info" in table.column_names else None
        base_dir = os.path.dirname(os.path.abspath(path))
        problems: list[str] = []
        for row in range(table.num_rows):
            try:
                item = self._row_item(columns, extra, row, base_dir)
            except ValueError as exc:
                problems.append(f"row {row}: {exc}")
                continue
            if item is None:
                continue
            item["uid"] = f"{tag}-{row}"
            self._items.append(item)
        if problems:
            shown = "\n  ".join(problems[:_MAX_REPORTED_PROBLEMS])
            more = len(problems) - _MAX_REPORTED_PROBLEMS
            tail = f"\n  ... and {more} more bad rows" if more > 0 else ""
            raise DataError(f"{path}: {len(problems)} bad row(s) (0-based row index):\n  {shown}{tail}")

    def _row_item(self, columns: dict[str, list], extra: list | None, row: int, base_dir: str) -> dict | None:
        """The row's item, None when it is filtered as over-long; ``ValueError`` names what is wrong."""
        problem = _check_messages(columns[self.prompt_key][row])
        if problem is not None:
            raise ValueError(f"column {self.prompt_key!r}: {problem}")
        data_source = columns["data_source"][row]
        if not isinstance(data_source, str) or not data_source:
            raise ValueError(f"data_source is {data_source!r}, expected a non-empty string naming the task")
        reward_model = columns["reward_model"][row]
        if not isinstance(reward_model, Mapping) or reward_model.get("ground_truth") is None:
            raise ValueError('reward_model needs a ground_truth: store it as {"ground_truth": "..."}')
        cells = columns[self.image_key][row]
        cells = [] if cells is None else list(cells)
        images = []
        for k, cell in enumerate(cells):
            try:
                images.append(decode_image(cell, base_dir))
            except ValueError as exc:
                raise ValueError(f"column {self.image_key!r}, image {k}: {exc}; {_IMAGE_HOW}") from exc
        messages, placeholders = image_messages(_clean_messages(columns[self.prompt_key][row]))
        if placeholders != len(images):
            raise ValueError(
                f"{placeholders} {IMAGE_PLACEHOLDER} placeholder(s) in the messages but {len(images)} image(s) "
                f"in column {self.image_key!r}; put one {IMAGE_PLACEHOLDER} in the text where each image goes"
            )
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        encoded = self.processor(text=[text], images=images or None, return_tensors="pt")
        ids = encoded["input_ids"][0].tolist()
        if len(ids) > self.max_prompt_length:
            if self.filter_overlong_prompts:
                self.num_filtered += 1
                return None
            raise ValueError(
                f"the prompt is {len(ids)} tokens with its image tokens, longer than data.max_prompt_length="
                f"{self.max_prompt_length}; raise data.max_prompt_length, use smaller images (the processor's "
                f"max_pixels) or set data.filter_overlong_prompts=true to drop such rows"
            )
        info = extra[row] if extra is not None else None
        return {
            "prompt_ids": ids,
            "images": images,
            "pixel_values": encoded.get("pixel_values", torch.zeros(0, 0)).float(),
            "image_grid_thw": encoded.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long)).long(),
            "data_source": data_source,
            "ground_truth": str(reward_model["ground_truth"]),
            "extra_info": dict(info) if isinstance(info, Mapping) else {},
        }

    def __len__(self) -> int:
        return len(self._items)

    @property
    def pad_token_id(self) -> int:
        """The processor's tokenizer's pad id (its EOS id without one), what `PromptLoader` pads with."""
        return tokenizer_pad_id(self.processor.tokenizer)

    def __getitem__(self, i: int) -> dict:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"VisionLanguageDataset index {i} out of range for {len(self)} prompts")
        item = self._items[i]
        return {**item, "prompt_ids": list(item["prompt_ids"]), "extra_info": dict(item["extra_info"])}


def check_image_model(model_path: str, files: Any, image_key: str) -> None:
    """Refuse a run whose prompt files hold an image column (``image_key``) for a vision-language model the image
    path does not know (a ``vision_config`` in its ``config.json``, a ``model_type`` other than Qwen2-VL /
    Qwen2.5-VL): it would load as a text model and drop every image. Text models and image-free files pass."""
    import json

    import pyarrow.parquet as pq

    from fusedrl.models.qwen_vl import VISION_LANGUAGE_MODEL_TYPES

    config_path = os.path.join(os.fspath(model_path), "config.json")
    if not os.path.isfile(config_path):
        return
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    model_type = config.get("model_type")
    if "vision_config" not in config or model_type in VISION_LANGUAGE_MODEL_TYPES:
        return
    for path in _as_file_list(files):
        if os.path.isfile(path) and image_key in pq.read_schema(path).names:
            raise DataError(
                f"{path}: column {image_key!r} (data.image_key) holds images, but the model "
                f"({model_path}) is a {model_type!r} vision-language model, which fusedrl's image path does not "
                f"read yet (it reads {', '.join(VISION_LANGUAGE_MODEL_TYPES)}; docs/multimodal.md); a run would "
                "drop every image. Use a Qwen2-VL / Qwen2.5-VL model or prompt files without images"
            )


def collate_vision(
    rows: Sequence[Mapping], pad_token_id: int, max_prompt_length: int
) -> tuple[RolloutBatch, VisionInputs]:
    """`fusedrl.data.dataset.collate` of `VisionLanguageDataset` items, and their images in the same row order.
    GRPO's repeated samples: ``batch.repeat_samples(n)`` and ``vision.select(index)`` with the same index."""
    return collate(rows, pad_token_id, max_prompt_length), VisionInputs.from_items(rows)
