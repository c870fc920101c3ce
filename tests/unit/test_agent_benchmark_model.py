"""benchmarks/agent_rollout.py: the modelled turn-synchronous / continuous bound on a hand-computed workload,
and the per-call tool latencies (deterministic, within t x (1 +- spread))."""

from __future__ import annotations

import pytest

from benchmarks.agent_rollout import modelled_speedup, tool_latencies, workload


def test_modelled_speedup_hand_computed():
    infos = [
        {
            "turns": 2,
            "turn_tokens": [10, 10],
            "sleep_ms": [100, 999],
        },  # the 999 ms would follow its last turn
        {"turns": 1, "turn_tokens": [30, 0], "sleep_ms": [500, 500]},  # one turn: its tool is never called
    ]
    # Turn-sync at 10 ms a step: turn 0 waits for the 30-token generation (0.3 s) and A's tool (0.1 s),
    # turn 1 for A's 10 tokens (0.1 s): 0.5 s. Continuous: A 20 steps + 0.1 s = 0.3 s, B 30 steps = 0.3 s.
    assert modelled_speedup(infos, 0.010) == pytest.approx(0.5 / 0.3)
    # Tools only (free steps): both wait 0.1 s.
    assert modelled_speedup(infos, 0.0) == pytest.approx(1.0)


def test_tool_latencies_are_deterministic_and_bounded():
    a = tool_latencies(200, 0.5, 3, 4)
    assert a == tool_latencies(200, 0.5, 3, 4) and a != tool_latencies(200, 0.5, 4, 4)
    assert all(100 <= x <= 300 for x in a)
    assert tool_latencies(200, 0.0, 3, 4) == [200] * 4
    rows = workload(32, 4, 200, 0.5, (8, 48))
    assert {r["turns"] for r in rows} == {1, 2, 3, 4}
    assert all(8 <= n <= 48 for r in rows for n in r["turn_tokens"])
