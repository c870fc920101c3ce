"""A fused worker hangs inside a phase: the driver's watchdog (trainer.step_timeout_s) names it with the
phase, the time waited and the worker's own stack, stops every worker and prints the resume command, within
the timeout (instead of waiting forever)."""

from __future__ import annotations

import time

import pytest
from faults import ray_with_faults
from support import started_trainer

pytestmark = pytest.mark.integration
pytest.importorskip("vllm")

TIMEOUT_S = 20


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_hung_worker_is_named_with_its_stack_and_all_workers_stop(tiny_model_dir, arithmetic_data, tmp_path):
    import psutil

    from fusedrl.controller.worker_group import WorkerTimeoutError

    mark = tmp_path / "hang_started"
    overrides = [
        f"data.train_files={arithmetic_data[0]}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_batch_size=2",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.old_log_prob_from_update=false",  # the separate pass runs: it hangs
        "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=2",
        f"trainer.step_timeout_s={TIMEOUT_S}",
        f"trainer.default_local_dir={tmp_path}",
    ]
    env = {"FUSEDRL_FAULT_HANG": "actor_compute_log_prob:1", "FUSEDRL_FAULT_MARK": str(mark)}
    with ray_with_faults(**env), started_trainer(overrides) as trainer:
        pids = trainer.workers.run_all(lambda w: w.pid.remote())
        with pytest.raises(WorkerTimeoutError) as err:
            trainer.train_step()  # rollout and rewards run; rank 1 hangs in the old-log-prob pass
        noticed = time.time()
        hang_started = float(mark.read_text())
        assert trainer.workers.workers == [], "the group must be stopped"
    waited = noticed - hang_started
    # Named after the timeout, not long after it (the stack dump may take a few seconds).
    assert TIMEOUT_S <= waited < TIMEOUT_S + 30, waited
    text = str(err.value)
    assert "rank(s) 0, 1" in text or "rank(s) 1" in text, text  # rank 0 waits on rank 1 in the all-gather
    assert "`actor_compute_log_prob`" in text and f"trainer.step_timeout_s={TIMEOUT_S}" in text, text
    assert "roles: actor, rollout" in text, text
    rank1 = text.split("--- rank 1 (actor_compute_log_prob) stack:")[1]
    assert "_hang_forever" in rank1 and "time.sleep(3600)" in rank1, text  # the worker's own stack
    assert "rerun the same command" in text, text
    # Every worker process is gone, not left hanging.
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"worker processes still alive: {pids}"
        time.sleep(0.5)
