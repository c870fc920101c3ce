"""A fused worker dies mid-run: the driver stops within a bounded time, names the rank, says whether it was
killed for memory and how much memory it held last, and how to resume.

Without fail-fast gathering the surviving rank would sit in an FSDP all-gather until the process-group
timeout (30 min) and the driver would wait on it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
from faults import ray_with_faults
from support import FLOAT32_TRAINING, started_trainer

pytestmark = pytest.mark.integration
pytest.importorskip("vllm")

HOG_MB = 600


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_killed_worker_stops_the_driver_with_a_clear_message(tiny_model_dir, arithmetic_data, tmp_path):
    from fusedrl.controller import WorkerDiedError

    overrides = [
        f"data.train_files={arithmetic_data[0]}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_batch_size=2",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=2",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.rollout.dtype=float32",
        *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
        "trainer.val_before_train=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=50",
        f"trainer.default_local_dir={tmp_path}",
    ]
    # Rank 1 holds HOG_MB of extra host memory, then is SIGKILLed (as the kernel's OOM killer would).
    with ray_with_faults(FUSEDRL_FAULT_HOG_MB=f"1:{HOG_MB}"), started_trainer(overrides) as trainer:
        pid1 = trainer.workers.run_all(lambda w: w.pid.remote())[1]
        trainer.train_step()  # healthy; the driver polls the workers' memory meanwhile
        # Kill rank 1 while rank 0 is in the middle of collective work.
        threading.Timer(1.0, lambda: os.kill(pid1, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as err:
            for _ in range(50):
                trainer.train_step()
        elapsed = time.monotonic() - start
    assert elapsed < 90, f"the driver took {elapsed:.0f}s to notice"
    text = str(err.value)
    assert "rank 1" in text and "died" in text and "rerun the same command" in text, text
    assert "actor" in text and "rollout" in text
    # Not an OOM kill, and the message must not claim one; it names the RSS rank 1 reported last.
    assert "Not killed for memory" in text or "is unknown" in text, text
    assert "OOM killer killed it" not in text and "memory monitor killed it" not in text, text
    rss = float(re.search(r"last reported RSS was ([\d.]+) GB", text).group(1))
    assert rss >= HOG_MB * (1 << 20) / 1e9, text
    assert f"pid {pid1}" in text, text
