"""verl's GSM8K quickstart command line, module name changed, runs 2 steps of PPO with a critic.

The line is the one in verl's quickstart docs (Qwen2.5-0.5B keys) with the paths pointed at local tiny
files (the arithmetic task stands in for GSM8K: nothing is downloaded) and the sizes shrunk to fit 2 CPU
cores; two verl keys are added to exercise them here: ``trainer.critic_warmup=1`` and
``trainer.log_val_generations=2`` and ``actor.checkpoint.save_contents`` with ``hf_model`` (verl's own). Slow: the model, critic and vLLM start on 1 worker.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

pytest.importorskip("vllm")


def test_verl_quickstart_line_trains_ppo_with_a_critic(tiny_model_dir, arithmetic_data, tmp_path):
    train, test = arithmetic_data
    line = [
        f"data.train_files={train}",
        f"data.val_files={test}",
        "data.train_batch_size=4",  # verl: 256
        "data.max_prompt_length=64",  # verl: 512
        "data.max_response_length=8",  # verl: 512
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # verl: 64
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",  # verl: 4
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",  # verl: 8
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "critic.optim.lr=1e-5",
        f"critic.model.path={tiny_model_dir}",
        "critic.ppo_micro_batch_size_per_gpu=2",  # verl: 4
        "algorithm.kl_ctrl.kl_coef=0.001",
        "trainer.logger=['console','jsonl']",  # verl: console (jsonl added to read the steps back)
        "trainer.val_before_train=False",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.save_freq=10",
        "trainer.test_freq=10",
        "trainer.total_epochs=15",
        "trainer.total_training_steps=2",  # added: 2 steps
        f"trainer.default_local_dir={tmp_path}",
        "trainer.critic_warmup=1",
        "actor_rollout_ref.actor.checkpoint.save_contents=['model','optimizer','extra','hf_model']",
        "trainer.log_val_generations=2",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "fusedrl.trainer.main_ppo", *line],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = [json.loads(x) for x in Path(tmp_path, "metrics.jsonl").read_text().splitlines()]
    by_step = {int(s["step"]): s for s in steps if "step" in s}
    # verl's defaults: PPO with GAE and a critic, one sample per prompt, no KL loss.
    assert all(math.isfinite(by_step[i]["critic/vf_loss"]) for i in (1, 2))
    assert "actor/pg_loss" not in by_step[1]  # critic_warmup=1: only the critic trains at step 1
    assert math.isfinite(by_step[2]["actor/pg_loss"]) and "actor/kl_loss" not in by_step[2]
    assert by_step[2]["actor/lr"] == pytest.approx(1e-6) and by_step[2]["critic/lr"] == pytest.approx(1e-5)
    # The last step validates (test_freq) and prints 2 samples.
    assert "val/test_score/mean" in by_step[2]
    assert by_step[2]["timing_s/testing"] > 0 and "timing_s/testing" not in by_step[1]  # verl's metric
    assert out.stdout.count("[val step 2 sample") == 2
    # The last step saves (save_freq), with a Hugging Face folder of the policy (save_contents: hf_model).
    assert Path(tmp_path, "global_step_2", "huggingface", "config.json").is_file()
