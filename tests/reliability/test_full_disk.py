"""The checkpoint disk fills up mid-run (a real, small tmpfs): the failed save removes its half-written
folder, leaves the previous checkpoint intact and stops the run naming the path, the error and the free
space. A read-only checkpoint folder is refused when the config is loaded, before anything starts."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest
from support import started_trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")


@contextlib.contextmanager
def small_filesystem(path, size_mb: int, *options: str):
    """A tmpfs of ``size_mb`` mounted at ``path`` (the tests run as root, in CI too)."""
    path.mkdir(parents=True, exist_ok=True)
    opts = ",".join([f"size={size_mb}m", *options])
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 0, f"mounting a tmpfs needs root (CAP_SYS_ADMIN): {done.stderr}"
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(path, leave_bytes: int) -> None:
    """Another process fills the disk: one file taking all but ``leave_bytes`` of the free space."""
    free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
    with open(os.path.join(path, "filler.bin"), "wb") as f:
        f.write(b"\0" * max(0, free - leave_bytes))


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tiny_model_dir, arithmetic_data, tmp_path):
    from fusedrl.checkpoint import CheckpointSaveError, checkpoint_problem
    from fusedrl.trainer.ppo_trainer import PPOTrainer

    class DiskFillsBeforeSecondSave(PPOTrainer):
        def save_checkpoint(self):
            if self.global_step == 2:
                _fill(root, leave_bytes=64 << 10)
            return super().save_checkpoint()

    with small_filesystem(tmp_path / "disk", 64) as disk:
        root = disk / "ckpt"
        overrides = [
            f"data.train_files={arithmetic_data[0]}",
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "data.train_batch_size=2",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "algorithm.adv_estimator=grpo",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=3",
            "trainer.save_freq=1",
            f"trainer.default_local_dir={root}",
        ]
        with started_trainer(overrides, trainer_cls=DiskFillsBeforeSecondSave) as trainer:
            with pytest.raises(CheckpointSaveError) as err:
                trainer.fit()
            assert trainer.global_step == 2
        text = str(err.value)
        assert (
            f"saving the checkpoint of step 2 into {root} failed: [Errno 28] No space left on device" in text
        )
        assert f"Free space on the file system of {root}:" in text and "of 67.1 MB" in text, text
        assert f"the previous checkpoint ({root / 'global_step_1'}) is intact" in text, text
        names = sorted(os.listdir(root))
        assert names == ["filler.bin", "global_step_1", "latest_checkpointed_iteration.txt"], names
        assert checkpoint_problem(root / "global_step_1", verify=True) is None

        # Start-up check: a read-only checkpoint folder is a config error, before Ray starts.
        from fusedrl.config import ConfigError, load_config

        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(
            ConfigError, match=r"trainer.default_local_dir.*cannot create files in .*Read-only"
        ):
            load_config(overrides)
