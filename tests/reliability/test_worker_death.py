"""A fused worker dies mid-run: the driver stops within a bounded time, names the rank, says how to resume.

Without fail-fast gathering the surviving rank would sit in an FSDP all-gather until the process-group
timeout (30 min) and the driver would wait on it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("vllm")


def test_killed_worker_stops_the_driver_with_a_clear_message(tiny_model_dir, arithmetic_data, tmp_path):
    import ray

    from fusedrl.config import load_config
    from fusedrl.controller import WorkerDiedError
    from fusedrl.trainer.ppo_trainer import PPOTrainer
    from fusedrl.trainer.runtime import init_ray

    cfg = load_config(
        [
            f"data.train_files={arithmetic_data[0]}",
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "data.train_batch_size=2",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=50",
            f"trainer.default_local_dir={tmp_path}",
        ]
    )
    init_ray(cfg)
    trainer = PPOTrainer(cfg)
    try:
        trainer.init_workers()
        pid1 = trainer.workers.run_all(lambda w: w.pid.remote())[1]
        trainer.train_step()  # healthy
        # Kill rank 1 while rank 0 is in the middle of collective work.
        threading.Timer(1.0, lambda: os.kill(pid1, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as err:
            for _ in range(50):
                trainer.train_step()
        elapsed = time.monotonic() - start
        assert elapsed < 90, f"the driver took {elapsed:.0f}s to notice"
        text = str(err.value)
        assert "rank 1" in text and "died" in text and "rerun the same command" in text
        assert "actor" in text and "rollout" in text
    finally:
        trainer.close()
        ray.shutdown()
