"""Environments run off the loop that steps the engine, under ``multi_turn.env_timeout_s``.

On the fake engine (no process group needed): a hanging environment step ends its own trajectory after
``env_timeout_s`` (``env_timeouts``, one warning naming the environment and the key) while the other
trajectories keep generating and finish; a slow step within the limit holds back its own trajectory only
(the others sample whole turns while it blocks); a trajectory's environment is closed however it ends; an
environment that raises fails the step loudly.
"""

from __future__ import annotations

import logging
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

HANG_S = 60.0  # the hung call's own cap; the test releases it as soon as the rollout returned
RELEASE = threading.Event()
HUNG_RETURNED = threading.Event()
TIMEOUT_S = 1.0  # well above a trivial call on a loaded machine, far below the hang
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
            RELEASE.wait(HANG_S)
            HUNG_RETURNED.set()
        return [{"role": "user", "content": f"step {self.steps}"}], 1.0, self.steps >= 3

    def close(self):
        with LOCK:
            CLOSED.append(self.uid)


OTHERS_DONE = threading.Event()  # set when rows 1 and 2 have both taken their last step
STEP_TIMES: list[tuple[str, int, float, float]] = []  # (uid, step number, start, end)


@register_environment("test_env_slow_on_row_0")
class SlowOnRowZero(Environment):
    """Three user turns, then done; row 0's first step blocks its thread until rows 1 and 2 have finished
    (at most 20 s, within the limit): it can only end early if they kept generating while it blocked."""

    def reset(self, row):
        self.uid, self.steps = row["uid"], 0

    def step(self, text):
        self.steps += 1
        start = time.perf_counter()
        if self.uid == "r0" and self.steps == 1:
            OTHERS_DONE.wait(timeout=20.0)
        with LOCK:
            STEP_TIMES.append((self.uid, self.steps, start, time.perf_counter()))
            if sum(1 for uid, k, *_ in STEP_TIMES if uid != "r0" and k == 3) == 2:
                OTHERS_DONE.set()
        return [{"role": "user", "content": f"step {self.steps}"}], 1.0, self.steps >= 3


@register_environment("test_env_raises")
class Raises(Environment):
    def step(self, text):
        raise ValueError("the environment's own bug")


def _runner(model_dir: str, agent: str, env_timeout_s: float = TIMEOUT_S):
    from transformers import AutoTokenizer

    from fusedrl.workers.rollout.fake_engine import FakeEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = FakeEngine(model_dir, dtype="float32", seed=0, max_model_len=512, device="cpu")
    renderer = ChatRenderer(tok)
    # The tools' timeout stays long: the environment's calls are limited by env_timeout_s alone.
    cfg = MultiTurnConfig(
        default_agent_name=agent, tool_timeout_s=60.0, env_timeout_s=env_timeout_s, max_tokens_per_turn=4
    )
    rows = []
    for k in range(3):
        messages = [{"role": "user", "content": f"question {k}"}]
        ids = tok.encode(renderer.render(messages, add_generation_prompt=True), add_special_tokens=False)
        rows.append(dict(prompt_ids=ids, messages=messages, seed=k, uid=f"r{k}", extra_info={}))
    sampling = TurnSampling(temperature=1.0, stop_token_id=tok.eos_token_id)
    return AgentRunner(engine, renderer, ToolSet(), cfg), rows, sampling


def test_a_hanging_environment_ends_its_own_trajectory(tiny_model_dir, caplog):
    runner, rows, sampling = _runner(tiny_model_dir, "test_env_hangs_on_row_0")
    CLOSED.clear()
    RELEASE.clear()
    HUNG_RETURNED.clear()
    with caplog.at_level(logging.WARNING, logger="fusedrl.agent.runner"):
        try:
            trajs = runner.run(rows, sampling, max_response_length=64)
            returned_before_the_hung_call = not HUNG_RETURNED.is_set()
        finally:
            RELEASE.set()  # the abandoned call returns in the background now
    hung, *others = trajs
    assert hung.stats["env_timeouts"] == 1 and hung.stats["assistant_turns"] == 2
    for t in others:  # they kept generating while row 0's step hung: all three turns, no timeout
        assert t.stats["env_timeouts"] == 0 and t.stats["assistant_turns"] == 3, t.stats
        assert t.stats["reward"] == 3.0
    assert returned_before_the_hung_call  # the step did not wait for the abandoned call
    # The documented outcome: one warning naming the environment's method, the row and the key to raise.
    (warning,) = [r.getMessage() for r in caplog.records if "env_timeout_s" in r.getMessage()]
    assert "HangsOnRowZero.step()" in warning and "row 0" in warning, warning
    assert "actor_rollout_ref.rollout.multi_turn.env_timeout_s=1 s" in warning, warning
    deadline = time.perf_counter() + 10  # every episode was closed, the hung one's included
    while len(CLOSED) < 3 and time.perf_counter() < deadline:
        time.sleep(0.1)
    assert sorted(CLOSED) == ["r0", "r1", "r2"]


def test_a_slow_environment_step_does_not_stall_the_other_trajectories(tiny_model_dir):
    runner, rows, sampling = _runner(tiny_model_dir, "test_env_slow_on_row_0", env_timeout_s=30.0)
    STEP_TIMES.clear()
    OTHERS_DONE.clear()
    trajs = runner.run(rows, sampling, max_response_length=64)
    for t in trajs:  # within the limit: nothing timed out, every trajectory ran its three turns
        assert t.stats["env_timeouts"] == 0 and t.stats["assistant_turns"] == 3, t.stats
    times = {(uid, k): (start, end) for uid, k, start, end in STEP_TIMES}
    block_start, block_end = times[("r0", 1)]
    assert block_end - block_start < 20.0  # released by the others finishing, not by its own cap
    # While row 0's first step blocked, rows 1 and 2 sampled their second and third turns (their steps 2
    # and 3 each follow a generation): the engine kept stepping, the blocked call held back row 0 only.
    for uid in ("r1", "r2"):
        for k in (2, 3):
            start, end = times[(uid, k)]
            assert block_start < start and end <= block_end, (uid, k, times)


def test_env_timeout_s_is_checked():
    assert MultiTurnConfig(env_timeout_s=0).problems() == [
        "`actor_rollout_ref.rollout.multi_turn.env_timeout_s`=0: must be > 0."
    ]


def test_an_environment_that_raises_fails_the_step(tiny_model_dir):
    runner, rows, sampling = _runner(tiny_model_dir, "test_env_raises")
    with pytest.raises(ValueError, match="the environment's own bug"):
        runner.run(rows[:1], sampling, max_response_length=64)
