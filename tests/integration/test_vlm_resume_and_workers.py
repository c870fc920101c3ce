"""GRPO on image prompts through the driver, beyond one uninterrupted worker (docs/multimodal.md): the tiny
random Qwen2.5-VL on generated shape pictures (tests/vlm_support.py), float32 engine and actor.

- Two fused workers: the driver splits the rows (and their images) over the ranks for generation, the
  log-prob passes and the update (with gradient checkpointing, as verl's scripts set it). Each rank's engine sampled on its own rows' images: its log-probs equal a
  plain transformers pass on each row's picture read from the parquet file by the row's uid, and not the
  pass with the other rank's pictures; the rollout-vs-actor gap stays at float32 noise at both steps.
- A run stopped right after step 1's checkpoint and resumed gives step 2 as the uninterrupted run does
  (slow; the SIGKILL version is tests/reliability/test_vlm_crash.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from support import (
    SavedAndStopped,
    assert_same_computed_metrics,
    metrics_by_step,
    started_trainer,
    stopping_after_save,
)
from vlm_support import tiny_vlm_and_shapes, vlm_grpo

from fusedrl.trainer.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

SYNC_TOL = 1e-4  # float32 engine vs float32 actor: ~1e-6 measured; another image is ~1e-2 off


@pytest.fixture(scope="module")
def vlm_and_shapes(tmp_path_factory) -> tuple[str, str]:
    return tiny_vlm_and_shapes(tmp_path_factory)


class RecordingTrainer(PPOTrainer):
    """Keeps every step's metrics and its batch as the advantages see it (one mini-batch: the old log-probs
    come from the update's own pass, so there is no separate log-prob pass to record)."""

    def compute_advantages(self, batch):
        batch = super().compute_advantages(batch)
        self.batches = [*getattr(self, "batches", []), batch.clone()]
        return batch

    def check_health(self, metrics):
        self.steps = [*getattr(self, "steps", []), dict(metrics)]
        super().check_health(metrics)


def _own_image_log_probs(model, batch, items_by_uid, temperature, shift: int = 0) -> torch.Tensor:
    """Log-probs [B, Tr] of the batch's samples under ``model`` with each row's images read from the data set
    by the row's uid (``shift``: row i gets the images of row i + shift instead, a control)."""
    from fusedrl.data.multimodal import VisionInputs
    from fusedrl.workers.vision import vision_log_probs

    uids = [u.split("@")[0] for u in batch.field_list("uid")]  # "train-3@1.0" -> data set row "train-3"
    rows = [items_by_uid[uids[(i + shift) % len(uids)]] for i in range(len(uids))]
    own = batch.clone()
    own.multi_modal_inputs = [VisionInputs.from_items([row]) for row in rows]
    with torch.no_grad():
        return vision_log_probs(model, own, temperature=temperature)[0]


# ~1.5 min on 2 cores (two workers, each with its engine and FSDP2 shard).
# slow since 2026-12-06 (CI budget): the SIGKILL test (tests/reliability/test_vlm_crash.py) runs 2 workers in CI
@pytest.mark.slow
def test_two_workers_sample_and_train_on_their_own_rows_images(vlm_and_shapes, tmp_path):
    from fusedrl.data.multimodal import VisionLanguageDataset
    from fusedrl.models.qwen_vl import load_processor
    from fusedrl.workers.vision import load_vision_language_model

    model_dir, train = vlm_and_shapes
    # verl's VL scripts all set enable_gradient_checkpointing: the actor recomputes its layers in the backward.
    line = [
        *vlm_grpo(model_dir, train, tmp_path, workers=2),
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    ]
    with started_trainer(line, trainer_cls=RecordingTrainer) as t:
        assert t.workers.world_size == 2
        t.fit()
        steps, batches, temperature = t.steps, t.batches, t.temperature
    gaps = [m["rollout/log_prob_abs_diff_max"] for m in steps]
    print("two workers, rollout gap per step:", gaps)
    assert len(steps) == 2 and all(g < SYNC_TOL for g in gaps), gaps
    assert all(m["response_length/mean"] > 0 for m in steps)

    # Step 1 sampled with the start-up weights: score each row's tokens on its own picture, in one process.
    data = VisionLanguageDataset(train, load_processor(model_dir), 48)
    items = {data[i]["uid"]: data[i] for i in range(len(data))}
    batch = batches[0]
    assert batch.num_samples == 8 and len({u.split("@")[0] for u in batch.field_list("uid")}) == 4
    model = load_vision_language_model(model_dir, torch.float32).eval()
    mask = batch.response_mask.bool()  # [B, Tr]
    assert mask.any()
    own = _own_image_log_probs(model, batch, items, temperature)
    half = batch.num_samples // 2  # the driver's split: rows 0-3 on rank 0, rows 4-7 on rank 1
    for rank, rows in enumerate((slice(0, half), slice(half, None))):
        gap = float((own - batch.rollout_log_probs)[rows].abs()[mask[rows]].max())
        print(f"rank {rank}: engine vs its rows' own pictures {gap:.2e}")
        assert gap < SYNC_TOL, (rank, gap)
    swapped = _own_image_log_probs(model, batch, items, temperature, shift=half)  # the other rank's pictures
    other = float((swapped - batch.rollout_log_probs).abs()[mask].max())
    print(f"engine vs the other rank's pictures {other:.2e}")
    assert other > 1e-3, other


@pytest.mark.slow  # three runs of the driver, ~2.5 min on 2 cores
def test_image_run_stopped_after_a_checkpoint_and_resumed_equals_uninterrupted(vlm_and_shapes, tmp_path):
    model_dir, train = vlm_and_shapes

    def overrides(out) -> list[str]:
        return [*vlm_grpo(model_dir, train, out), "trainer.save_freq=1", "trainer.logger=[jsonl]"]

    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    with started_trainer(overrides(full_dir)) as trainer:
        trainer.fit()
    with (
        pytest.raises(SavedAndStopped) as crash,
        started_trainer(overrides(cut_dir), trainer_cls=stopping_after_save(PPOTrainer, step=1)) as t,
    ):
        t.fit()
    assert os.path.basename(str(crash.value)) == "global_step_1"
    with started_trainer(overrides(cut_dir), trainer_cls=RecordingTrainer) as trainer:
        trainer.fit()
        assert trainer.global_step == 2 and len(trainer.steps) == 1  # only step 2 ran after the resume
        resumed_batch = trainer.batches[0]
    rows = resumed_batch.field_list("multi_modal_inputs")
    assert len(rows) == 8 and all(r.image_grid_thw[0].shape == (1, 3) for r in rows)  # images came back
    full, resumed = metrics_by_step(full_dir), metrics_by_step(cut_dir)
    assert sorted(full) == [1, 2] and 2 in resumed  # the stopped run died before logging step 1
    assert full[2]["actor/grad_norm"] > 0
    print(
        "step 2 rollout gap: full",
        full[2]["rollout/log_prob_abs_diff_max"],
        "resumed",
        resumed[2]["rollout/log_prob_abs_diff_max"],
    )
    assert_same_computed_metrics(full[2], resumed[2])
