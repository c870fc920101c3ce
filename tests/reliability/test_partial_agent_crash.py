"""Partial rollout of multi-turn agent loops (``async_training.partial_rollout`` with ``multi_turn``, fused
pool, 2 workers, `fusedrl.workers.rollout.partial_agent`) SIGKILLed in the middle of step 3, while agent
trajectories are suspended on the workers, resumes from checkpoint 2 and equals an uninterrupted run: the
same logged metrics at every step (token ages, carried groups and turns included) and the same final
checkpoint within float32 tolerance.

``trainer.save_freq=2``: steps 2 and 4 save, so they drain (every trajectory in flight runs to its end and
the checkpoint holds finished groups only); steps 1 and 3 leave one group per worker in flight, suspended
mid-turn or before a turn. A worker trains on 2 groups a step and keeps 3 in flight, its engine running 4 of
their 12 trajectories at a time, so step 3 takes the group step 2 finished beyond its quota and runs its 2
new groups until one has finished: the other is suspended. The kill comes right after step 3's rollout
(before its update), so the workers die holding it; the resumed run starts step 3 from checkpoint 2's
finished groups, as the uninterrupted run did, and step 4 finishes what step 3 left. ``plugin_user_turns``
(tests/agent_plugins.py) runs no tool thread, so where trajectories pause depends on the engine alone and
both runs pause them alike."""

from __future__ import annotations

import os

import driver_runs
import pytest
import torch
from driver_runs import driver_args, kill_mid_step_then_resume, metrics, read, run_to_end

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")

PLUGIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "agent_plugins.py")
PARTIAL_AGENT = {
    "data.max_response_length": "96",
    "algorithm.custom_modules": f"[{PLUGIN}]",
    "actor_rollout_ref.rollout.multi_turn.enable": "true",
    "actor_rollout_ref.rollout.multi_turn.default_agent_name": "plugin_user_turns",
    "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn": "12",
    "algorithm.rollout_correction.rollout_is": "token",
    "async_training.partial_rollout": "true",
    "data.train_batch_size": "4",  # 2 groups trained per worker
    "async_training.staleness_threshold": "0.5",  # 1 more per worker in flight: 3
    # 12 trajectories per engine, every turn 12 tokens (the tiny model seldom stops): run all at once, the
    # groups finish at one engine step and none is left suspended (6 at a time: none at step 3 either). 4 at
    # a time (one group's turn) the groups take turns: the third to start is suspended when two have finished.
    "actor_rollout_ref.rollout.max_num_seqs": "4",
    "trainer.save_freq": "2",  # steps 2 and 4 drain and save; steps 1 and 3 carry suspended trajectories
}

# Printed by the driver after each step's partial rollout, with the groups the workers hold unfinished
# (read-only: their saved form). The driver hangs for the kill there, after step HANG_IN_STEP_AT's rollout
# (`kill_mid_step_then_resume` sets it), not at the step's first weight sync (the start of a partial step,
# before anything is in flight).
TRACE_ROLLOUT = """
import os, time
_HANG_AT = os.environ.pop("HANG_IN_STEP_AT", "")
from fusedrl.trainer.partial_trainer import PartialRolloutTrainer as _P
_generate = _P.generate_partial
def _traced(self, metrics):
    out = _generate(self, metrics)
    states = self.group_for("rollout").run_all(lambda w: w.rollout_partial_state.remote())
    live = sum(not g["finished"] for s in states for g in s["groups"])
    print(f"ROLLED_OUT {self.global_step} drained={int(self.drains_this_step)} suspended={live}", flush=True)
    if str(self.global_step) == _HANG_AT:
        print(f"HANGING_IN_STEP {self.global_step}", flush=True)
        time.sleep(3600)
    return out
_P.generate_partial = _traced
"""


def _args(model_dir, train_file, out, reward_file) -> list[str]:
    base = driver_args(model_dir, train_file, out, reward_file)
    kept = [a for a in base if a.split("=", 1)[0] not in PARTIAL_AGENT]
    return [*kept, *(f"{key}={value}" for key, value in PARTIAL_AGENT.items())]


def test_partial_agent_sigkill_with_suspended_trajectories_then_resume_equals_uninterrupted(
    tiny_model_dir, arithmetic_data, reward_file, tmp_path, monkeypatch
):
    monkeypatch.setattr(driver_runs, "DRIVER", TRACE_ROLLOUT + driver_runs.DRIVER)
    reference = tmp_path / "reference"
    run_to_end(_args(tiny_model_dir, arithmetic_data[0], reference, reward_file), tmp_path / "ref.log")
    ref = metrics(reference)
    assert [m["partial/drained"] for m in ref] == [0.0, 1.0, 0.0, 1.0]
    assert [m["partial/carried_groups"] for m in ref] == [2.0, 2.0, 2.0, 2.0]  # 1 per worker after each step
    assert all(m["agent/assistant_turns/mean"] > 1.0 for m in ref), "not multi-turn"
    log = read(tmp_path / "ref.log")
    for step, drained, suspended in ((1, 0, 2), (2, 1, 0), (3, 0, 2), (4, 1, 0)):
        assert f"ROLLED_OUT {step} drained={drained} suspended={suspended}" in log, log[-3000:]
    out = tmp_path / "run"

    def killed_after_rollout_with_finished_groups_saved(out_dir) -> None:
        log = read(tmp_path / "run1.log")
        assert "ROLLED_OUT 3 drained=0 suspended=2\nHANGING_IN_STEP 3" in log, log[-3000:]  # 1 per worker
        state = torch.load(out_dir / "global_step_2" / "partial_rollout.pt", weights_only=True)
        groups = [g for worker in state["workers"] for g in worker["groups"]]
        assert len(state["workers"]) == 2 and len(groups) == 2, state["workers"]  # 1 per worker
        assert all(g["finished"] for g in groups)  # drained: no suspended trajectory in the checkpoint

    args = _args(tiny_model_dir, arithmetic_data[0], out, reward_file)
    kill_mid_step_then_resume(
        args, out, reference, tmp_path, check_killed=killed_after_rollout_with_finished_groups_saved, step=3
    )
