"""Environments run off the loop that steps the engine, under the tools' timeout.

On the fake engine (no process group needed): a hanging environment step ends its own trajectory after
``tool_timeout_s`` (``env_timeouts``) while the other trajectories keep generating and finish; a
trajectory's environment is closed however it ends; an environment that raises fails the step loudly.
"""

from __future__ import annotations

import threading
import time

import pytest

from fusedrl.agent import (
    AgentRunner,
    ChatRenderer,
    Environment,
    MultiTurnConfig,
    ToolSet,
    TurnSampling,
    register_environment,
)

HANG_S = 3.0
TIMEOUT_S = 0.3
CLOSED: list[str] = []
LOCK = threading.Lock()


@register_environment("test_env_hangs_on_row_0")
class HangsOnRowZero(Environment):
    """Three user turns, then done; the episode of row 0 hangs in its second step."""

    def reset(self, row):
        self.uid, self.steps = row["uid"], 0

    def step(self, text):
        self.steps += 1
        if self.uid == "r0" and self.steps == 2:
            time.sleep(HANG_S)
        return [{"role": "user", "content": f"step {self.steps}"}], 1.0, self.steps >= 3

    def close(self):
        with LOCK:
            CLOSED.append(self.uid)


@register_environment("test_env_raises")
class Raises(Environment):
    def step(self, text):
        raise ValueError("the environment's own bug")


def _runner(model_dir: str, agent: str):
    from transformers import AutoTokenizer

    from fusedrl.workers.rollout.fake_engine import FakeEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = FakeEngine(model_dir, dtype="float32", seed=0, max_model_len=512, device="cpu")
    renderer = ChatRenderer(tok)
    cfg = MultiTurnConfig(default_agent_name=agent, tool_timeout_s=TIMEOUT_S, max_tokens_per_turn=4)
    rows = []
    for k in range(3):
        messages = [{"role": "user", "content": f"question {k}"}]
        ids = tok.encode(renderer.render(messages, add_generation_prompt=True), add_special_tokens=False)
        rows.append(dict(prompt_ids=ids, messages=messages, seed=k, uid=f"r{k}", extra_info={}))
    sampling = TurnSampling(temperature=1.0, stop_token_id=tok.eos_token_id)
    return AgentRunner(engine, renderer, ToolSet(), cfg), rows, sampling


def test_a_hanging_environment_ends_its_own_trajectory(tiny_model_dir):
    runner, rows, sampling = _runner(tiny_model_dir, "test_env_hangs_on_row_0")
    CLOSED.clear()
    t0 = time.perf_counter()
    trajs = runner.run(rows, sampling, max_response_length=64)
    wall = time.perf_counter() - t0
    hung, *others = trajs
    assert hung.stats["env_timeouts"] == 1 and hung.stats["assistant_turns"] == 2
    for t in others:  # they kept generating while row 0's step hung: all three turns, no timeout
        assert t.stats["env_timeouts"] == 0 and t.stats["assistant_turns"] == 3, t.stats
        assert t.stats["reward"] == 3.0
    assert wall < HANG_S, wall  # the step did not wait for the abandoned call
    time.sleep(HANG_S)  # the abandoned step returns in the background; then every episode was closed
    assert sorted(CLOSED) == ["r0", "r1", "r2"]


def test_an_environment_that_raises_fails_the_step(tiny_model_dir):
    runner, rows, sampling = _runner(tiny_model_dir, "test_env_raises")
    with pytest.raises(ValueError, match="the environment's own bug"):
        runner.run(rows[:1], sampling, max_response_length=64)
