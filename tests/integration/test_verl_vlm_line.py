"""verl's geo3k GRPO line for Qwen2.5-VL (``examples/grpo_trainer/run_qwen2_5_vl_7b_fsdp.sh`` at verl main
1dda039, its command line in tests/verl_vlm_lines.py) runs through the driver, scaled down to the
tiny random Qwen2.5-VL and shape pictures on CPU: its own keys (packing, dynamic token budgets, gradient
checkpointing, the reference offloaded, the engine's cache freed, batch balancing, validation before training
on image prompts) with only sizes, devices and paths replaced. Two workers, 2 steps, float32 on both sides so
the rollout-vs-actor gap can be held to float32 noise."""

from __future__ import annotations

import pytest
from support import FLOAT32_TRAINING, started_trainer
from verl_vlm_lines import SCRIPTS
from vlm_support import tiny_vlm_and_shapes, write_shapes_parquet

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

SIZES = [  # the script's sizes for 8 GPUs, scaled to 2 CPU workers and 56x56 pictures
    "data.train_batch_size=4",
    "data.max_prompt_length=48",
    "data.max_response_length=12",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=128",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=128",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.optim.lr=1e-2",  # the script's 1e-6 would not move a random model in 2 steps
    "trainer.n_gpus_per_node=2",
    "trainer.total_training_steps=2",
    "trainer.total_epochs=1",
    "trainer.logger=['console']",
    "trainer.save_freq=-1",
    "actor_rollout_ref.rollout.dtype=float32",
    *FLOAT32_TRAINING,
]


# 20-50 s on 2 cores (two workers, each with its engine and FSDP2 shard).
# slow since 2026-12-06 (CI budget): tests/unit/test_verl_vlm_scripts.py loads the line in the default suite
@pytest.mark.slow
def test_verl_qwen2_5_vl_geo3k_line_runs_on_images(tmp_path_factory, tmp_path):
    model_dir, train = tiny_vlm_and_shapes(tmp_path_factory)
    test = write_shapes_parquet(tmp_path / "test.parquet", rows=4)
    line = [
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"actor_rollout_ref.model.path={model_dir}",
        *SCRIPTS["grpo_trainer/run_qwen2_5_vl_7b_fsdp.sh"],
        *SIZES,
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]

    from fusedrl.trainer.ppo_trainer import PPOTrainer

    class Recording(PPOTrainer):
        """Keeps every step's metrics and every validation's."""

        def check_health(self, metrics):
            self.steps = [*getattr(self, "steps", []), dict(metrics)]
            super().check_health(metrics)

        def validate(self):
            metrics = super().validate()
            self.validations = [*getattr(self, "validations", []), metrics]
            return metrics

    with started_trainer(line, trainer_cls=Recording) as trainer:
        model = trainer.run.model
        assert model.enable_gradient_checkpointing and trainer.run.actor.use_dynamic_bsz
        trainer.fit()
        steps, validations = trainer.steps, trainer.validations
    gaps = [m["rollout/log_prob_abs_diff_max"] for m in steps]
    print("verl geo3k line: rollout gap per step", gaps, "validation", validations)
    assert len(steps) == 2 and all(g < 1e-4 for g in gaps), gaps
    assert all(m["actor/grad_norm"] > 0 for m in steps)
    assert len(validations) == 2  # before training (val_before_train's default) and at the last step
    # Greedy generation on the image prompts of the validation file (the engine refuses image tokens without
    # their images), scored per data source.
    assert all("val/test_score/shapes" in v for v in validations), validations
