"""Shared helpers for the benchmarks: machine description, model cache, statistics, result recording."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("FUSEDRL_BENCH_CACHE", "/tmp/fusedrl_bench"))
# The current figures; every run's whole section goes to benchmarks/results_archive/ (`benchmarks.results_page`)
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
# Instruction-set flags that decide CPU figures: AVX2 only, AVX-512, native bf16 (AVX-512 BF16), AMX
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch

    from fusedrl.utils.hardware import BF16_CPU_FLAGS, cpu_flags, native_bf16

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    have = cpu_flags()
    flags = "/".join(sorted(have & set(BF16_CPU_FLAGS)))  # AMX multiplies bf16 ~3x AVX-512 BF16
    bf16 = f"native bf16: {flags}" if native_bf16()[0] else "no native bf16 (emulated)"
    isa = " ".join(f for f in ISA_FLAGS if f in have) or "none of " + "/".join(ISA_FLAGS)
    # A capped run (make test-avx2, trl_side_by_side --isa avx2) computes as a smaller CPU does
    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    capped = f", capped at {cap}" if cap else ""
    return (
        f"{os.cpu_count()} CPU cores ({cpu}; flags {isa}{capped}; {bf16}), {mem_gb:.0f} GiB RAM, {gpu}; "
        f"torch {torch.__version__}"
    )


def model_dir(preset: str) -> str:
    """A random-init Qwen2 of the preset, built once and cached; ``smollm2``: the real pretrained
    SmolLM2-135M-Instruct (float32), imported once from its PyPI package (`fusedrl.models.smollm2`)."""
    from fusedrl.utils.tiny_model import build_tiny_model

    if preset == "smollm2":
        from fusedrl.models.smollm2 import model_dir as smollm2_dir

        return smollm2_dir("float32")

    out = CACHE / f"model_{preset}"
    if not (out / "config.json").exists():
        build_tiny_model(str(out), preset=preset, seed=0)
    return str(out)


def arithmetic_data() -> str:
    from fusedrl.data.arithmetic import write_arithmetic_parquet

    out = CACHE / "arith"
    if not (out / "train.parquet").exists():
        write_arithmetic_parquet(str(out), n_train=512, n_test=64, seed=0)
    return str(out / "train.parquet")


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt(s: dict[str, float], unit: str = "", digits: int = 3) -> str:
    return f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}-{s['max']:.{digits}f}, n={s['n']})"


def run_in_subprocess(
    module: str, args: list[str], timeout: int = 900, env: dict[str, str] | None = None
) -> dict:
    """Run ``python -m module args`` and return the JSON object it prints on its last ``RESULT`` line.

    Each measurement that builds a vLLM engine gets its own process: an engine lives as long as its
    process (its teardown destroys the process group), exactly as in a fused worker.
    """
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{module} {args} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def git_commit() -> str:
    """The short commit measured, "+changes" when tracked code differs from it: a figure belongs to the
    defaults of the code that ran (the results files themselves do not count)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=10
        )
        if head.returncode != 0:
            return ""
        results = [":!benchmarks/RESULTS.md", ":!benchmarks/results_archive"]
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", *results], cwd=ROOT, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return head.stdout.strip() + ("+changes" if dirty.returncode else "")


def record(title: str, command: str, table: str, payload: dict, block: str = "") -> None:
    """Print the table and a JSON line; append the run to this month's archive and rewrite its block on the
    results page (`benchmarks.results_page`), with the machine, date and commit."""
    from benchmarks.results_page import Run, curated, record_run

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    # A shared machine's load decides absolute figures; only ratios from one run's alternating rounds travel
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    payload = {**payload, "loadavg_1_5_15": load}
    table = f"Load average at the end (1/5/15 min): {load}\n\n{table}"
    print(table)
    print("JSON " + json.dumps(payload))
    run = Run(title, stamp, machine(), command, table, json.dumps(payload), commit=git_commit(), block=block)
    archive, name = record_run(run, page_path=RESULTS)
    page = f"{RESULTS.relative_to(ROOT)} (block {name})"
    if curated(RESULTS.read_text(), name):
        page = f"not {page}: a curated block, add the run's row by hand"
    print(f"recorded: {archive.relative_to(ROOT)} (full run); {page}")
