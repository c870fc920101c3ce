"""`fusedrl.data.multimodal.check_image_model`: prompt files with images and a vision-language model the image
path does not read (verl's Qwen3-VL / GLM-4.1V scripts) are one error naming the model type, the column and the
fix, instead of a text run that drops every image; text models, image-free files and Qwen2.5-VL pass."""

from __future__ import annotations

import json

import pytest
from vlm_support import write_shapes_parquet

from fusedrl.data.dataset import DataError
from fusedrl.data.multimodal import check_image_model


def _model(tmp_path, name: str, config: dict) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_an_unknown_vision_language_model_with_image_prompts_is_refused(tmp_path):
    images = write_shapes_parquet(tmp_path / "images.parquet", rows=2)
    qwen3_vl = _model(tmp_path, "qwen3_vl", {"model_type": "qwen3_vl", "vision_config": {"depth": 2}})
    with pytest.raises(DataError) as info:
        check_image_model(qwen3_vl, [images], "images")
    said = str(info.value)
    assert "images.parquet" in said and "'images' (data.image_key)" in said and "'qwen3_vl'" in said
    assert "qwen2_5_vl" in said  # what is read
    # The column named by data.image_key is the one looked for.
    check_image_model(qwen3_vl, images, "pictures")


def test_text_models_image_free_files_and_qwen2_5_vl_pass(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = write_shapes_parquet(tmp_path / "images.parquet", rows=2)
    text_only = str(tmp_path / "text.parquet")
    pq.write_table(pa.Table.from_pylist([{"data_source": "x", "prompt": "hi"}]), text_only)
    check_image_model(_model(tmp_path, "llama", {"model_type": "llama"}), images, "images")
    check_image_model(
        _model(tmp_path, "qwen25vl", {"model_type": "qwen2_5_vl", "vision_config": {}}), images, "images"
    )
    check_image_model(
        _model(tmp_path, "glm4v", {"model_type": "glm4v", "vision_config": {}}), text_only, "images"
    )
    check_image_model(str(tmp_path / "no_folder"), images, "images")  # a hub id: the loader reports it
