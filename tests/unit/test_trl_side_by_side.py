"""The TRL side-by-side benchmark's pure parts: what a fusedrl variant sets, and the learning-curve table."""

from __future__ import annotations

from pathlib import Path

import yaml

from benchmarks.trl_side_by_side import curve_table, fusedrl_overrides

ROOT = Path(__file__).resolve().parents[2]
WORK_KEYS = {
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.optim.lr",
}


def _keys(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def test_the_default_variant_sets_only_the_work_and_the_yaml_engine_dtype():
    """``+default`` is the command a user writes: no dtype, packing, compile or eager key of its own; the
    engine dtype the harness pins goes back to the YAML's."""
    keys = _keys(fusedrl_overrides(2, "float32", "float32", True, True, True, False, default=True, lr=5e-6))
    yaml_dtype = yaml.safe_load((ROOT / "trainer/config/ppo_trainer.yaml").read_text())["actor_rollout_ref"][
        "rollout"
    ]["dtype"]
    assert set(keys) == WORK_KEYS | {"actor_rollout_ref.rollout.dtype"}
    assert keys["actor_rollout_ref.rollout.dtype"] == yaml_dtype
    assert keys["actor_rollout_ref.actor.optim.lr"] == "5e-06"
    assert keys["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == "32"  # 16 x 4 over 2 workers


def test_a_chosen_variant_names_its_choices():
    keys = _keys(fusedrl_overrides(1, "bfloat16", "float32", True, False, True, True, default=False, lr=1e-6))
    assert keys["actor_rollout_ref.model.use_remove_padding"] == "true"
    assert keys["actor_rollout_ref.model.compile_layers"] == "true"
    assert keys["actor_rollout_ref.rollout.enforce_eager"] == "false"
    assert keys["actor_rollout_ref.actor.fsdp_config.param_dtype"] == "bfloat16"
    assert keys["actor_rollout_ref.rollout.dtype"] == "float32"
    assert keys["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == "64"


def test_curve_table_means_of_first_and_last_ten_steps_and_wall_time():
    # 12 steps of 2 s; rewards 0.0 .. 1.1: first 10 mean 0.45, last 10 (0.2 .. 1.1) mean 0.65, 24 s.
    curve = [(2.0, i / 10) for i in range(12)]
    table = curve_table({"trl": [{"curve": curve}], "fusedrl-2+default": [{"curve": curve[:10]}]})
    lines = table.splitlines()
    assert lines[2] == "| trl (1) | 0.450 | 0.650 | 12 | 24 |"
    assert lines[3] == "| fusedrl-2+default (1) | 0.450 | 0.450 | 10 | 20 |"
