"""Damaged checkpoints on disk: the newest has one flipped byte (same size: only its SHA-256 can tell), the
one before a truncated file. The rerun names both files, moves both folders aside, resumes from the intact
checkpoint before them, and from there equals an uninterrupted run."""

from __future__ import annotations

import os
import shutil

import pytest
from driver_runs import assert_resumed_run_equals_reference, driver_args, run_to_end

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")


def test_flipped_byte_and_truncated_file_fall_back_to_the_previous_checkpoint(
    tiny_model_dir, arithmetic_data, reward_file, reference_run, tmp_path
):
    out = tmp_path / "run"
    out.mkdir()
    for step in (1, 2, 3):  # the uninterrupted run's checkpoints, as if that run had died after step 3
        shutil.copytree(reference_run / f"global_step_{step}", out / f"global_step_{step}")
    (out / "latest_checkpointed_iteration.txt").write_text("3\n")
    flipped = out / "global_step_3" / "actor" / "rank_1.safetensors"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor data: it would load without error, as garbage
    flipped.write_bytes(bytes(data))
    truncated = out / "global_step_2" / "actor" / "rank_0.safetensors"
    size = truncated.stat().st_size
    with open(truncated, "r+b") as f:
        f.truncate(size // 2)

    text = run_to_end(driver_args(tiny_model_dir, arithmetic_data[0], out, reward_file), tmp_path / "run.log")
    assert "global_step_3 is damaged: actor/rank_1.safetensors fails its SHA-256 check" in text, text[-3000:]
    assert f"global_step_2 is damaged: actor/rank_0.safetensors has {size // 2} bytes" in text, text[-3000:]
    assert f"resumed from {out / 'global_step_1'} at step 1" in text, text[-3000:]
    aside = sorted(n for n in os.listdir(out) if ".corrupt-" in n)
    assert [n.split(".")[0] for n in aside] == ["global_step_2", "global_step_3"], aside
    # Steps 2-4 were rerun from checkpoint 1 and equal the uninterrupted run's, final checkpoint included.
    assert_resumed_run_equals_reference(reference_run, out, [2, 3, 4])
