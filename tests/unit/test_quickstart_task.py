"""The quickstart's task (examples/quickstart/quickstart.py): each problem's ground truth is the larger or
smaller of its numbers as the question asks, and no training problem uses the set of numbers of a held-out
problem (so no held-out question is trained on in any phrasing)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]


def _quickstart():
    spec = importlib.util.spec_from_file_location(
        "quickstart", ROOT / "examples" / "quickstart" / "quickstart.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _numbers(row) -> frozenset[int]:
    return frozenset(int(n) for n in re.findall(r"\d+", row["prompt"][0]["content"]))


def test_answers_follow_the_question_and_held_out_number_sets_are_never_trained(tmp_path):
    paths = _quickstart().write_data(str(tmp_path), seed=3, n_train=600, n_test=200)
    train, test = pd.read_parquet(paths["train"]), pd.read_parquet(paths["test"])
    assert (len(train), len(test)) == (600, 200)
    for df in (train, test):
        for _, row in df.iterrows():
            question = row["prompt"][0]["content"]
            numbers = [int(n) for n in re.findall(r"\d+", question)]
            assert len(numbers) in (2, 3) and all(10 <= n <= 99 for n in numbers), question
            want = max(numbers) if ("larger" in question or "largest" in question) else min(numbers)
            assert row["reward_model"]["ground_truth"] == str(want), question
            assert row["data_source"] == "arithmetic"
    held_out = {_numbers(row) for _, row in test.iterrows()}
    assert not held_out & {_numbers(row) for _, row in train.iterrows()}
    kinds = {re.sub(r"\d+", "N", row["prompt"][0]["content"]) for _, row in train.iterrows()}
    assert len(kinds) == 4  # all four phrasings are trained


def test_another_seed_gives_other_problems(tmp_path):
    qs = _quickstart()
    a = pd.read_parquet(qs.write_data(str(tmp_path / "a"), seed=0, n_train=50, n_test=20)["test"])
    b = pd.read_parquet(qs.write_data(str(tmp_path / "b"), seed=1, n_train=50, n_test=20)["test"])
    assert [p[0]["content"] for p in a["prompt"]] != [p[0]["content"] for p in b["prompt"]]


def test_seeds_report_shows_spread_validations_the_last_and_the_peak():
    spec = importlib.util.spec_from_file_location(
        "seeds_report", ROOT / "examples" / "quickstart" / "seeds_report.py"
    )
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    # 20 validations every 3 steps; accuracy step / 100, except a peak of 0.9 at step 21.
    metrics = [{"step": s, "val/test_score/mean": 0.9 if s == 21 else s / 100} for s in range(3, 61, 3)]
    metrics += [{"step": s, "critic/score/mean": 0.5} for s in range(1, 61)]  # training steps: ignored
    assert report.held_out_points(metrics) == (
        "3: 3.0%, 15: 15.0%, 27: 27.0%, 36: 36.0%, 48: 48.0%, 60: 60.0% (peak 90.0% at 21)"
    )
    assert report.held_out_points(metrics[:3]) == "3: 3.0%, 6: 6.0%, 9: 9.0%"  # few: all of them
    assert report.held_out_points(metrics[20:]) == "-"
