"""Build a PPOTrainer on the real stack for a benchmark (a local Ray runtime, fused workers)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def trainer_for(preset: str, workers: int, extra: list[str], out_dir: str) -> Iterator:
    from benchmarks.common import arithmetic_data, model_dir
    from fusedrl.config import load_config
    from fusedrl.trainer.runtime import started_trainer

    cfg = load_config(
        [
            f"data.train_files={arithmetic_data()}",
            f"actor_rollout_ref.model.path={model_dir(preset)}",
            f"trainer.n_gpus_per_node={workers}",
            "actor_rollout_ref.rollout.dtype=float32",
            "trainer.logger=[jsonl]",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={out_dir}",
            *extra,
        ]
    )
    with started_trainer(cfg) as trainer:
        yield trainer
