"""A GRPO command line in verl main's layout (2026-08: ``reward.*``, ``ray_kwargs.ray_init.*``, ``trainer.v1``,
``model_engine``, the ``file`` logger) runs 2 steps on the tiny model.

``ray_kwargs.ray_init.runtime_env.py_executable`` is verl's ``uv ... run ...`` launcher. The test puts a stand-in
``uv`` first on PATH that records each call and runs this Python, so the run shows Ray started the workers
through the command the line names (the value reached ``ray.init``), on machines with or without uv.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]

SHIM = """#!/bin/sh
echo "$*" >> "{log}"
# uv [global flags] run [run flags] ARGS...: drop uv's words, run ARGS with this Python
while [ $# -gt 0 ] && [ "$1" != run ]; do shift; done
shift
while [ $# -gt 0 ]; do
  case "$1" in
    --extra|--with|--python|--package) shift 2 ;;
    --frozen|--locked|--all-packages|--no-sync|-v|-q) shift ;;
    *) break ;;
  esac
done
exec "{python}" "$@"
"""


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_verl_main_grpo_line_runs_two_steps(tiny_model_dir, arithmetic_data, tmp_path):
    train, test = arithmetic_data
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "uv_calls.txt"
    uv = bin_dir / "uv"
    uv.write_text(SHIM.format(log=log, python=sys.executable))
    uv.chmod(0o755)
    reward = tmp_path / "score.py"
    reward.write_text(
        "def graded(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n    return bonus\n"
    )
    line = [
        "model_engine=dp",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={train}",
        f"data.val_files={test}",
        "data.train_batch_size=2",
        "data.max_prompt_length=64",
        "data.max_response_length=8",
        "data.filter_overlong_prompts=True",
        "data.truncation='error'",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "reward.reward_manager.name=naive",
        "reward.num_workers=0",
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=graded",
        "+reward.reward_kwargs.bonus=0.25",
        "trainer.use_v1=True",
        "trainer.v1.trainer_mode=sync",
        "trainer.logger=['console','file','jsonl']",
        "trainer.project_name=verl_main",
        "trainer.experiment_name=grpo",
        "trainer.val_before_train=False",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.total_epochs=1",
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        "ray_kwargs.ray_init.runtime_env.py_executable='uv -v run --all-packages --extra cpu'",
        "+ray_kwargs.ray_init.runtime_env.env_vars.FUSEDRL_VERL_MAIN=1",
    ]
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "VERL_FILE_LOGGER_PATH": str(tmp_path / "verl_file.jsonl"),
    }
    out = subprocess.run(
        [sys.executable, "-m", "fusedrl.trainer.main_ppo", *line],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=ROOT,  # uv resolves fusedrl's pyproject.toml (extra `cpu`)
        env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "unknown key" not in out.stdout + out.stderr
    # Ray started the workers through the py_executable of the command line.
    calls = log.read_text().splitlines()
    assert calls and all(c.startswith("-v run --all-packages --extra cpu") for c in calls), calls
    # verl's file logger format, at verl's path variable.
    rows = [json.loads(x) for x in (tmp_path / "verl_file.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        data = row["data"]
        assert math.isfinite(data["actor/pg_loss"]) and math.isfinite(data["actor/kl_loss"])
        # reward.custom_reward_function's function scored, with reward.reward_kwargs' bonus (an empty response
        # scores 0 without a call)
        assert data["critic/score/max"] == pytest.approx(0.25)
