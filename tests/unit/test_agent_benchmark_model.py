"""benchmarks/agent_rollout.py: the modelled turn-synchronous / continuous bound on hand-computed workloads
(fixed and heavy-tailed tool latencies), and the per-call tool latencies (deterministic, mean t)."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.agent_rollout import conditions, modelled_speedup, modelled_times, tool_latencies, workload


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


def test_modelled_speedup_heavy_tail_hand_computed():
    # Tools only (free steps). Two 3-turn trajectories: A's first tool call is slow, B's second one is.
    # Turn-sync waits for the slowest of each turn: 1.0 s + 1.0 s = 2.0 s. Continuous: each trajectory
    # waits only its own calls: 1.0 s + 0.1 s = 1.1 s. A fixed 0.55 s (the same mean) gives 1.1 s both ways.
    infos = [
        {"turns": 3, "turn_tokens": [4, 4, 4], "sleep_ms": [1000, 100, 0]},
        {"turns": 3, "turn_tokens": [2, 6, 2], "sleep_ms": [100, 1000, 0]},
    ]
    assert modelled_times(infos, 0.0) == pytest.approx((2.0, 1.1))
    assert modelled_speedup(infos, 0.0) == pytest.approx(2.0 / 1.1)
    # At 10 ms a step: turn-sync adds the longest turn each time, 4 + 6 + 4 = 14 steps (2.14 s);
    # continuous: A 12 steps + 1.1 s = 1.22 s, B 10 steps + 1.1 s = 1.2 s.
    assert modelled_speedup(infos, 0.010) == pytest.approx(2.14 / 1.22)
    fixed = [{**info, "sleep_ms": [550, 550, 0]} for info in infos]
    assert modelled_speedup(fixed, 0.0) == pytest.approx(1.0)


def test_fixed_latency_gains_nothing_in_the_tool_bound_limit():
    # The K-turn trajectory waits (K-1) t, as turn-sync does: only generation can differ.
    rows = workload(64, 8, 200, 0.0, (2, 6), "fixed")
    assert modelled_speedup(rows, 0.0) == pytest.approx(1.0)
    assert modelled_speedup(workload(64, 8, 200, 1.0, (2, 6), "lognormal"), 0.0) > 2.0


@pytest.mark.parametrize("latency, spread", [("exp", 0.0), ("lognormal", 1.0), ("lognormal", 1.5)])
def test_heavy_tailed_latencies_are_seeded_with_mean_t(latency, spread):
    a = tool_latencies(200, spread, 3, 8, latency)
    assert a == tool_latencies(200, spread, 3, 8, latency) and a != tool_latencies(200, spread, 4, 8, latency)
    assert a != tool_latencies(200, spread, 3, 8, latency, seed=7)
    draws = [x for i in range(4000) for x in tool_latencies(200, spread, i, 8, latency)]
    assert min(draws) >= 0
    assert statistics.mean(draws) == pytest.approx(200, rel=0.05)
    assert max(draws) > 1000  # heavy tail: some calls take 5x the mean
    assert tool_latencies(200, 0.0, 3, 4, "fixed") == [200] * 4


def test_conditions_and_bad_latency():
    assert conditions(["fixed", "uniform", "exp", "lognormal"], [0.25, 0.5], [1.0]) == [
        ("fixed", 0.0),
        ("uniform", 0.25),
        ("uniform", 0.5),
        ("exp", 0.0),
        ("lognormal", 1.0),
    ]
    with pytest.raises(ValueError):
        conditions(["pareto"], [0.5], [1.0])
    with pytest.raises(ValueError):
        tool_latencies(200, 0.5, 0, 4, "pareto")
