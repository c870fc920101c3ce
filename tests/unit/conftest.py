"""Fixtures shared by unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """A tiny model and arithmetic parquet files for command lines that load (tests/verl_lines.py)."""
    from fusedrl.data.arithmetic import write_arithmetic_parquet
    from fusedrl.utils.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("verl_lines")
    model = build_tiny_model(str(root / "model"))
    train, test = write_arithmetic_parquet(str(root / "data"), n_train=16, n_test=4, seed=0)
    return {"model": model, "train": train, "test": test}
