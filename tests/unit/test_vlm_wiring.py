"""The trainer wiring of vision-language prompts, without Ray or an engine: the loader's batches carry each row's
images (``multi_modal_inputs``) through the driver's reshaping, a text batch carries none, sampled vision tokens
end a response, and the config keys load with their defaults."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from fusedrl.batch import RolloutBatch, gather_from_ranks, split_for_ranks
from fusedrl.data.dataset import PromptLoader, collate
from fusedrl.data.multimodal import VisionLanguageDataset
from fusedrl.workers.vision import batch_vision, cut_at_vision_tokens


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from fusedrl.utils.tiny_vlm import build_vlm_processor

    return build_vlm_processor(str(tmp_path_factory.mktemp("proc")))


def _png(h: int, w: int, shade: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (shade, 255 - shade, 40)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def dataset(processor, tmp_path_factory) -> VisionLanguageDataset:
    # Row r holds r % 3 images of distinct sizes, so rows are told apart by their grids.
    sizes = [(28, 28), (56, 28), (56, 56)]
    rows = []
    for r in range(6):
        n = r % 3
        rows.append(
            {
                "data_source": "shapes",
                "prompt": [{"role": "user", "content": "<image>" * n + f"row {r}"}],
                "images": [{"bytes": _png(*sizes[(r + k) % 3], 20 * r)} for k in range(n)],
                "reward_model": {"ground_truth": str(r)},
            }
        )
    path = str(tmp_path_factory.mktemp("data") / "vl.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return VisionLanguageDataset(path, processor, max_prompt_length=48)


def test_loader_batches_carry_each_rows_images_through_the_drivers_reshaping(dataset):
    batch = next(iter(PromptLoader(dataset, 6, shuffle=False)))
    rows = batch.field_list("multi_modal_inputs")
    assert [len(r.images[0]) for r in rows] == [0, 1, 2, 0, 1, 2]
    for i, r in enumerate(rows):
        assert torch.equal(r.pixel_values[0], dataset[i]["pixel_values"])
    assert batch.image_fields() == ("multi_modal_inputs",)
    repeated = batch.repeat_samples(2)  # GRPO's groups: each sample keeps its prompt's images
    sent = repeated.select_fields("prompts", "prompt_mask", *repeated.image_fields())
    shards, pad = split_for_ranks(sent, 4)  # 12 rows over 4 ranks, then back
    back = gather_from_ranks(shards, pad).field_list("multi_modal_inputs")
    assert [torch.equal(a.image_grid_thw[0], rows[i // 2].image_grid_thw[0]) for i, a in enumerate(back)] == [
        True
    ] * 12
    merged = batch_vision(repeated[torch.tensor([5, 1, 3])])  # a micro-batch in another order
    assert [g.shape[0] for g in merged.image_grid_thw] == [2, 0, 1]  # prompts 2, 0, 1
    assert torch.equal(merged.pixel_values[0], dataset[2]["pixel_values"])


def test_text_batches_carry_no_images():
    items = [
        {"prompt_ids": [5, 6, 7], "uid": "a", "data_source": "x", "ground_truth": "1"},
        {"prompt_ids": [8], "uid": "b", "data_source": "x", "ground_truth": "2"},
    ]
    batch = collate(items, 0, 4)
    assert batch.multi_modal_inputs is None and batch.image_fields() == ()
    batch.responses = torch.zeros(2, 3, dtype=torch.long)
    batch.response_mask = torch.ones(2, 3, dtype=torch.long)
    assert batch.model_input_fields() == ("prompts", "prompt_mask", "responses", "response_mask")


def test_a_sampled_vision_token_ends_the_response():
    vision, pad = (90, 91), 0
    batch = RolloutBatch(
        prompts=torch.ones(3, 2, dtype=torch.long),
        prompt_mask=torch.ones(3, 2, dtype=torch.long),
        batch_size=[3],
    )
    batch.responses = torch.tensor([[4, 90, 5, 6], [4, 5, 6, 0], [91, 4, 0, 0]])
    batch.response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    batch.rollout_log_probs = -torch.rand(3, 4) * batch.response_mask
    lp = batch.rollout_log_probs.clone()
    cut_at_vision_tokens(batch, vision, pad)
    assert batch.response_mask.tolist() == [[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]
    assert batch.responses.tolist() == [[4, 0, 0, 0], [4, 5, 6, 0], [0, 0, 0, 0]]
    assert torch.equal(batch.rollout_log_probs, lp * batch.response_mask)


def test_config_keys_load_with_their_defaults_and_overrides():
    from fusedrl.config import load_config
    from fusedrl.role_config import run_config

    base = ["data.train_files=x.parquet", "actor_rollout_ref.model.path=m"]
    run = run_config(load_config(base, validate_config=False))
    assert run.data.image_key == "images" and run.actor.freeze_vision_tower is False
    run = run_config(
        load_config(
            [*base, "data.image_key=pictures", "actor_rollout_ref.actor.freeze_vision_tower=true"],
            validate_config=False,
        )
    )
    assert run.data.image_key == "pictures" and run.actor.freeze_vision_tower is True
