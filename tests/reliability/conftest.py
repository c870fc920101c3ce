"""Fixtures of the reliability tests: one uninterrupted reference run per session for the slow driver tests."""

from __future__ import annotations

import pytest
from driver_runs import REWARD, driver_args, run_to_end


@pytest.fixture(scope="session")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "reward.py"
    path.write_text(REWARD)
    return path


@pytest.fixture(scope="session")
def reference_run(tiny_model_dir, arithmetic_data, reward_file, tmp_path_factory):
    """The output folder of `driver_args`' 4 steps run uninterrupted (metrics.jsonl, global_step_1..4)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run_to_end(
        driver_args(tiny_model_dir, arithmetic_data[0], out, reward_file), out.parent / "reference.log"
    )
    return out
