"""The vision-language GPU recipe (examples/vision_language/run_qwen2_5_vl_3b_geo3k.sh) and its helpers.

The recipe prints its override list (``--print-overrides``); with the model replaced by the tiny random
Qwen2.5-VL and the data by a few Geometry3K-shaped rows written by the example's own converter
(``geo3k_data.make_rows``), fusedrl's config loader accepts the list WITH validation, drops nothing, and the
recipe's values land on the keys the trainer reads. The recipe's reward (``geo3k_reward``) is checked on
hand-written responses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vision_language"
RECIPE = EXAMPLE / "run_qwen2_5_vl_3b_geo3k.sh"


@pytest.fixture(scope="module")
def example_modules():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import geo3k_data
        import geo3k_reward

        yield geo3k_data, geo3k_reward
    finally:
        sys.path.remove(str(EXAMPLE))


def _recipe_overrides(*extra: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "DATA_DIR", "NGPUS", "EPOCHS")}
    out = subprocess.run(
        ["bash", str(RECIPE), "--print-overrides", *extra],
        env={**clean, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [line for line in out.stdout.splitlines() if line.strip()]


def test_geo3k_rows_are_verl_multimodal_rows(example_modules):
    from PIL import Image

    geo3k_data, _ = example_modules
    diagram = Image.new("RGB", (60, 40), (255, 255, 255))
    rows = geo3k_data.make_rows([{"problem": "<image>Find x.", "answer": " 3 ", "images": [diagram]}], "test")
    row = rows[0]
    assert row["data_source"] == "hiyouga/geometry3k" and row["reward_model"]["ground_truth"] == "3"
    assert (
        row["prompt"][0]["content"].startswith("<image>Find x. ")
        and "\\boxed{}" in row["prompt"][0]["content"]
    )
    assert row["images"][0]["bytes"].startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="test row 0: 0 <image> placeholder"):
        geo3k_data.make_rows([{"problem": "Find x.", "answer": "3", "images": [diagram]}], "test")


def test_geo3k_reward_weighs_accuracy_and_format(example_modules):
    _, reward = example_modules
    score = lambda text: reward.compute_score("hiyouga/geometry3k", text, "3")  # noqa: E731
    assert score("<think>x = 6 / 2</think> The answer is \\boxed{3}.") == pytest.approx(1.0)
    assert score("The answer is \\boxed{3}.") == pytest.approx(0.9)  # right, no think block
    assert score("<think>x = 8 / 2</think> \\boxed{4}") == pytest.approx(0.1)  # well formed, wrong
    assert score("<think>no box</think> 3") == 0.0


def test_geo3k_recipe_loads_with_the_tiny_vlm(tmp_path, example_modules):
    """The recipe's whole command line, validated, on the tiny VLM and tiny Geometry3K-shaped files."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from fusedrl.config import load_config
    from fusedrl.role_config import run_config
    from fusedrl.utils.tiny_vlm import build_tiny_vlm

    geo3k_data, _ = example_modules
    model = build_tiny_vlm(str(tmp_path / "model"), seed=0)
    diagram = Image.new("RGB", (60, 40), (255, 255, 255))
    rows = geo3k_data.make_rows(
        [{"problem": "<image>Find x.", "answer": "3", "images": [diagram]}] * 4, "train"
    )
    data_dir = tmp_path / "geo3k"
    data_dir.mkdir()
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist(rows), str(data_dir / f"{split}.parquet"))

    overrides = _recipe_overrides("trainer.logger=[console]", MODEL_PATH=model, DATA_DIR=str(data_dir))
    assert overrides[-1] == "trainer.logger=[console]"  # the user's overrides come last
    said: list[str] = []
    cfg = load_config(overrides, report=said.append)  # validated: no ConfigError
    assert not [
        line for line in said if "no effect" in line or "dropped" in line
    ]  # every key of the recipe counts
    run = run_config(cfg)
    assert run.data.image_key == "images" and run.actor.freeze_vision_tower is False
    arr = cfg.actor_rollout_ref
    assert arr.model.path == model and cfg.data.train_files == str(data_dir / "train.parquet")
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (1024, 2048)
    assert cfg.algorithm.adv_estimator == "grpo" and arr.rollout.n == 5
    assert arr.actor.use_kl_loss is True and arr.actor.kl_loss_type == "low_var_kl"
    assert arr.actor.kl_loss_coef == pytest.approx(0.01) and arr.actor.optim.lr == pytest.approx(1e-6)
    # bf16 as written (the GPU recipe's); a CPU without native bf16 (`make test-avx2`) loads it as float32,
    # with fusedrl's one-line message (fusedrl.cpu_dtype)
    assert {
        "actor_rollout_ref.rollout.dtype=bfloat16",
        "actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16",
    } <= set(overrides)
    assert arr.rollout.dtype == arr.actor.fsdp_config.param_dtype
    assert arr.rollout.dtype in ("bfloat16", "float32")
    assert cfg.custom_reward_function.path == str(EXAMPLE / "geo3k_reward.py")
    assert cfg.custom_reward_function.name == "compute_score"
    assert arr.model.use_remove_padding is True and arr.model.enable_gradient_checkpointing is True
    assert arr.actor.use_dynamic_bsz is True and arr.actor.ppo_max_token_len_per_gpu == 16384
    assert cfg.trainer.n_gpus_per_node == 8 and cfg.trainer.total_epochs == 15
    assert cfg.data.train_batch_size == 512 and arr.actor.ppo_mini_batch_size == 128


def test_geo3k_recipe_defaults_name_the_3b_model_and_env_overrides():
    overrides = _recipe_overrides(NGPUS="4", EPOCHS="2")
    assert "actor_rollout_ref.model.path=Qwen/Qwen2.5-VL-3B-Instruct" in overrides
    assert "trainer.n_gpus_per_node=4" in overrides and "trainer.total_epochs=2" in overrides
    assert f"data.train_files={Path.home()}/data/geo3k/train.parquet" in overrides
