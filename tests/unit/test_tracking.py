"""Tracker backends: console line, jsonl, TensorBoard event files, offline wandb runs."""

from __future__ import annotations

import glob
import io
import json
import os
import struct
import sys
import time

import pytest

from fusedrl.tracking import KNOWN_LOGGERS, Tracker, format_console, format_duration, timer

STEPS = [
    {"critic/score/mean": 0.25, "actor/pg_loss": -0.5, "timing_s/step": 2.0},
    {"critic/score/mean": 0.5, "actor/pg_loss": 0.125, "timing_s/step": 2.0},
    {"critic/score/mean": 0.75, "actor/pg_loss": 0.0625, "timing_s/step": 2.0},
]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_known_loggers_and_unknown_backend(tmp_path):
    assert KNOWN_LOGGERS == ("console", "jsonl", "file", "tensorboard", "wandb")
    with pytest.raises(ValueError, match="mlflow"):
        Tracker(["console", "mlflow"], run_dir=str(tmp_path))


def test_format_console_labels_progress_and_eta():
    metrics = {
        "critic/score/mean": 0.5,
        "actor/pg_loss": -0.01234,
        "response_length/mean": 42.25,
        "timing_s/gen": 1.5,
        "timing_s/step": 3.0,
        "some/other": 7.0,
    }
    line = format_console(3, metrics, total_steps=12, eta_s=125)
    assert line.startswith("[3/12 25%] step 3 | ")
    assert "reward 0.500" in line
    assert "pg_loss -0.0123" in line
    assert "resp_len 42.2" in line
    assert "time: gen 1.50s step 3.00s" in line
    assert line.endswith(" | eta 2m05s")
    assert "some/other" not in line
    # Without a total: the plain line, unchanged from before.
    assert format_console(3, {"critic/score/mean": 0.5}) == "step 3 | reward 0.500"


def test_format_duration():
    assert format_duration(0) == "0s"
    assert format_duration(59.4) == "59s"
    assert format_duration(61) == "1m01s"
    assert format_duration(3 * 3600 + 5 * 60 + 9) == "3h05m"


def test_console_progress_and_eta_from_mean_step_time(tmp_path):
    out = io.StringIO()
    tracker = Tracker(["console"], run_dir=str(tmp_path), stream=out, total_steps=10)
    clock = FakeClock()
    tracker.step_clock.clock = clock
    tracker.log({"val/test_score/mean": 0.1}, step=0)  # validation before training: the anchor
    clock.now += 4.0
    tracker.log({"critic/score/mean": 0.2}, step=1)
    clock.now += 8.0
    tracker.log({"critic/score/mean": 0.3}, step=2)  # mean (4 + 8) / 2 = 6 s, 8 steps left
    clock.now += 6.0
    tracker.log({"critic/score/mean": 0.4}, step=10)
    tracker.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[0/10 0%] step 0 | val 0.100"
    assert lines[1] == "[1/10 10%] step 1 | reward 0.200 | eta 36s"
    assert lines[2] == "[2/10 20%] step 2 | reward 0.300 | eta 48s"
    assert lines[3] == "[10/10 100%] step 10 | reward 0.400"


def test_console_first_step_eta_uses_step_timing(tmp_path):
    out = io.StringIO()
    with Tracker(["console"], run_dir=str(tmp_path), stream=out, total_steps=4) as tracker:
        tracker.log({"timing_s/step": 30.0}, step=1)
    assert out.getvalue().strip() == "[1/4 25%] step 1 | time: step 30.00s | eta 1m30s"


def test_timer_accumulates():
    metrics: dict[str, float] = {}
    with timer("gen", metrics):
        pass
    with timer("gen", metrics):
        pass
    assert metrics["timing_s/gen"] >= 0.0
    assert list(metrics) == ["timing_s/gen"]


def test_jsonl_round_trip(tmp_path):
    tracker = Tracker(["jsonl"], run_dir=str(tmp_path / "run"))
    for step, metrics in enumerate(STEPS, start=1):
        tracker.log(metrics, step)
    tracker.close()
    tracker.close()  # idempotent
    with open(tmp_path / "run" / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert records == [{"step": step, **m} for step, m in enumerate(STEPS, start=1)]


def test_non_numeric_metric_fails_before_writing(tmp_path):
    tracker = Tracker(["jsonl"], run_dir=str(tmp_path))
    with pytest.raises((TypeError, ValueError)):
        tracker.log({"a": 1.0, "b": "text"}, 1)
    tracker.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


# ---------------------------------------------------------------------------------------------- tensorboard
def _read_tensorboard(logdir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    tracker = Tracker(["tensorboard"], run_dir=str(tmp_path), config={"lr": 1e-6})
    for step, metrics in enumerate(STEPS, start=1):
        tracker.log(metrics, step)
    tracker.close()
    logdir = str(tmp_path / "tensorboard")
    assert glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    scalars = _read_tensorboard(logdir)
    for key in STEPS[0]:
        expected = [(step, m[key]) for step, m in enumerate(STEPS, start=1)]
        assert scalars[key] == [(s, pytest.approx(v)) for s, v in expected]


def test_tensorboard_dir_from_env(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb_elsewhere"))
    with Tracker(["tensorboard"], run_dir=str(tmp_path / "run")) as tracker:
        tracker.log({"x": 1.5}, 7)
    assert tracker.tensorboard_dir == str(tmp_path / "tb_elsewhere")
    assert _read_tensorboard(str(tmp_path / "tb_elsewhere")) == {"x": [(7, 1.5)]}


def test_tensorboard_missing_says_pip_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        Tracker(["tensorboard"], run_dir=str(tmp_path))


# ---------------------------------------------------------------------------------------------- wandb
def _wandb_records(path: str) -> list:
    """Decode a wandb transaction log (``run-<id>.wandb``).

    Layout: a 7-byte file header (``:W&B``, a 2-byte magic, a version byte), then records framed as in the
    LevelDB log format: 32 KiB blocks, each chunk a 7-byte header (crc32, uint16 length, type) and its
    payload; type 1 is a whole record, 2/3/4 the first/middle/last pieces of a split one. Each record is a
    ``wandb_internal_pb2.Record`` protobuf.
    """
    from wandb.proto import wandb_internal_pb2

    block = 32768
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, pieces, records = 7, b"", []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        pieces += data[pos : pos + length]
        pos += length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def _wandb_history(records: list) -> dict[int, dict[str, float]]:
    history: dict[int, dict[str, float]] = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row = {
            (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
            for item in record.history.item
        }
        history[int(row["_step"])] = {k: v for k, v in row.items() if not k.startswith("_")}
    return history


def test_wandb_offline_run_logs_values(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("WANDB_DIR", raising=False)
    run_dir = tmp_path / "run"
    tracker = Tracker(
        ["wandb"],
        run_dir=str(run_dir),
        project_name="fusedrl-test",
        experiment_name="grpo-tiny",
        config={"trainer": {"total_epochs": 1}, "lr": 1e-6},
        total_steps=len(STEPS),
    )
    run = tracker.wandb_run
    assert run is not None and run.offline
    for step, metrics in enumerate(STEPS, start=1):
        tracker.log(metrics, step)
    tracker.close()
    assert tracker.wandb_run is None

    run_dirs = glob.glob(str(run_dir / "wandb" / "offline-run-*"))
    assert len(run_dirs) == 1
    logs = glob.glob(os.path.join(run_dirs[0], "run-*.wandb"))
    assert len(logs) == 1
    # wandb's service process writes the file: `finish()` can return before it has flushed (seen: 1 run in 5
    # read only the 7-byte header). Wait for the run record and every step, then check their contents.
    deadline = time.monotonic() + 30
    while True:
        records = _wandb_records(logs[0])
        kinds = [r.WhichOneof("record_type") for r in records]
        if ("run" in kinds and kinds.count("history") >= len(STEPS)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)

    run_record = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run_record.project == "fusedrl-test"
    assert run_record.display_name == "grpo-tiny"
    config = {u.key: json.loads(u.value_json) for u in run_record.config.update}
    assert config["trainer"] == {"total_epochs": 1}
    assert config["lr"] == pytest.approx(1e-6)

    history = _wandb_history(records)
    assert history == {step: pytest.approx(m) for step, m in enumerate(STEPS, start=1)}


def test_wandb_missing_says_pip_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        Tracker(["console", "wandb"], run_dir=str(tmp_path))
