"""The scheduling simulation of benchmarks/async_overlap.py against hand-computed schedules."""

from __future__ import annotations

import pytest

from benchmarks.async_overlap import simulate


def test_synchronous_schedule_is_the_sum_of_the_phases():
    assert simulate(2.0, 1.0, 0.5, 3, 0) == pytest.approx(3 * 3.5)


def test_one_step_off_schedule_by_hand():
    # G=2, T=1, S=0.5. Step 1 trains at 2 (gen 1 done), gen 2 runs 2..4, update 2..3, sync 4..4.5.
    # Step 2 trains at 4.5, gen 3 runs 4.5..6.5, update 4.5..5.5, sync 6.5..7. Step 3 trains at 7,
    # nothing left to generate, update 7..8, sync 8..8.5.
    assert simulate(2.0, 1.0, 0.5, 3, 1) == pytest.approx(8.5)
    # Training-bound: the generation hides behind the update; steady state max(G, T) + S per step.
    long = simulate(1.0, 2.0, 0.5, 101, 1) - simulate(1.0, 2.0, 0.5, 100, 1)
    assert long == pytest.approx(2.5)
