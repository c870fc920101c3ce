"""`benchmarks.train_passes` measures the bf16 matmul ceiling only where bf16 is native or asked for.

On a CPU without native bf16 that matmul is emulated (~4.7 s each on an AVX2-only EPYC, 31 a round): the
float32-only run skips it and says so in its table. The run itself (the passes, ~1.5 min) is replaced here by
a stub of `run_layout` that records what the ranks were asked to measure."""

from __future__ import annotations

import sys

import pytest

import benchmarks.train_passes as tp
import fusedrl.utils.hardware as hardware


@pytest.mark.parametrize(
    ("param_dtype", "variants", "native", "measured"),
    [
        (None, ["base"], False, ["float32"]),
        ("float32", ["base", "packed", "no_trim"], False, ["float32"]),
        (None, ["base"], True, ["float32", "bfloat16"]),  # native: measured whatever the run
        ("bfloat16", ["base"], False, ["float32", "bfloat16"]),
        ("bf16", ["base"], False, ["float32", "bfloat16"]),
        (None, ["base", "bf16_packed"], False, ["float32", "bfloat16"]),
        (None, ["bf16_gloo"], False, ["float32", "bfloat16"]),
    ],
)
def test_ceiling_dtypes(param_dtype, variants, native, measured):
    dtypes, note = tp.ceiling_dtypes(param_dtype, variants, native)
    assert dtypes == measured
    assert ("not measured" in note) == ("bfloat16" not in measured)


def _result(ceilings: list[str]) -> dict:
    times = {p: [1.0] for p in tp.PHASES}
    return {
        "world": 1,
        "threads": 1,
        "fwd_gflop_per_rank": 2.0,
        "fwd_bwd_gflop_per_rank": 6.0,
        "fwd_gflop_held_per_rank": 2.0,
        "fwd_bwd_gflop_held_per_rank": 6.0,
        "times": {"base": times, "bf16": times},
        "warmup_s": {"base": 1.0, "bf16": 1.0},
        "ceiling_gflops_per_rank": {name: [40.0 if name == "float32" else 10.0] for name in ceilings},
        "profiles": {},
    }


@pytest.mark.parametrize("variants", ["base", "base,bf16"])
def test_table_without_native_bf16(monkeypatch, capsys, variants):
    asked: list[list[str]] = []

    def run_layout(world, threads, args):
        asked.append(args["ceiling_dtypes"])
        result = _result(args["ceiling_dtypes"])
        result["times"] = {v: result["times"][v] for v in args["variants"]}
        return result

    monkeypatch.setattr(tp, "run_layout", run_layout)
    monkeypatch.setattr(hardware, "native_bf16", lambda: (False, "CPU test (no avx512_bf16 / amx_bf16)"))
    monkeypatch.setenv("LD_PRELOAD", "")  # main() sets it for the ranks; restored after the test
    monkeypatch.setattr(
        sys,
        "argv",
        ["train_passes", "--layouts", "1x1", "--preset", "tiny", "--variants", variants, "--no-record"],
    )
    tp.main()
    out = capsys.readouterr().out
    if variants == "base":
        assert asked == [["float32"]]
        assert "1x1: fp32 40, bf16 not measured (no native bf16 and no bf16 pass asked for)" in out
    else:
        assert asked == [["float32", "bfloat16"]]
        assert "1x1: fp32 40, bf16 10 " in out
        # the bf16 variant's rate against the bf16 ceiling: (2 + 2 + 6) GFLOP / 3 s = 3.3 GFLOP/s = 33% of 10
        assert "| 1x1 | bf16 |" in out and "3 = 33% of bfloat16 10" in out
    # the float32 passes against the float32 ceiling: 3.3 GFLOP/s = 8% of 40
    assert "| 1x1 | base |" in out and "3 = 8% of float32 40" in out
