"""verl main's vision-language example scripts (FSDP + vLLM) load with `fusedrl.config.load_config`.

Each line (tests/verl_vlm_lines.py) is what the script passes to ``verl.trainer.main_ppo`` with its defaults
(GPU, vLLM, no uv), as the script at verl main 1dda039 (2026-08-22) renders it; the data files, the model folder
and the run folder are local ones: the model is the tiny random Qwen2.5-VL for every script
(Qwen3-VL, GLM-4.1V and MiniCPM-o are not built here). Keys with no effect are named on one line, never
unknown; a value fusedrl cannot run is one problem naming the key.

Left out: the Megatron scripts (``run_qwen2_5_vl_7b_megatron.sh``, ``run_qwen3_vl_8b_megatron.sh``,
``run_qwen3_vl_30b_a3b_megatron.sh``, ``run_qwen3_vl_235b_a22b_megatron.sh``), the VeOmni ones
(``run_qwen3_vl_30b_moe_veomni.sh``) and ``profile/run_qwen2_5_vl_7b_torch_memory.sh`` (sglang rollout).
"""

from __future__ import annotations

import pytest
from verl_lines import problem_keys
from verl_vlm_lines import DISTILLATION_LINE, SCRIPTS

from fusedrl.config import load_config


@pytest.fixture(scope="module")
def vlm_files(tmp_path_factory) -> dict[str, str]:
    """The tiny random Qwen2.5-VL and shape-picture parquet files in verl's multimodal schema."""
    from vlm_support import write_shapes_parquet

    from fusedrl.utils.tiny_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("verl_vlm_lines")
    return {
        "model": build_tiny_vlm(str(root / "model"), seed=0),
        "train": write_shapes_parquet(root / "train.parquet", rows=8),
        "test": write_shapes_parquet(root / "test.parquet", rows=4),
        "run": str(root / "run"),
    }


def _local(files: dict[str, str], line: list[str]) -> list[str]:
    return [
        f"data.train_files={files['train']}",
        f"data.val_files={files['test']}",
        f"actor_rollout_ref.model.path={files['model']}",
        *(ov.replace("TEACHER", files["model"]) for ov in line),
        "trainer.project_name=verl_grpo_geo3k",
        "trainer.experiment_name=local",
        f"trainer.default_local_dir={files['run']}",
    ]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_verl_vision_language_script_loads(vlm_files, script):
    said: list[str] = []
    cfg = load_config(_local(vlm_files, SCRIPTS[script]), report=said.append)  # no ConfigError
    text = " ".join(said)
    assert "unknown" not in text, text
    assert cfg.data.image_key == "images"
    assert cfg.actor_rollout_ref.model.path == vlm_files["model"]
    assert cfg.actor_rollout_ref.rollout.name == "vllm"
    if "use_fused_kernels=True" in " ".join(SCRIPTS[script]):
        assert "use_fused_kernels" in text  # named as having no effect
    if script.startswith("tuning/lora"):  # LoRA on the decoder, the vision tower left out (verl's meaning)
        model = cfg.actor_rollout_ref.model
        assert (model.lora_rank, model.lora_alpha) == (64, 32)
        assert model.exclude_modules == ".*visual.*"
    if "minicpm" in script:  # verl's remote-code dataset class is named, not silently used or refused
        assert "data.custom_cls" in text and "trust_remote_code" in text
    if "30b_a3b" in script:
        rc = cfg.algorithm.rollout_correction
        assert (rc.rollout_is, rc.rollout_rs) == ("sequence", "token_k1")


def test_verl_vision_language_distillation_script_is_one_refusal(vlm_files):
    assert "distillation.enabled" in problem_keys(_local(vlm_files, DISTILLATION_LINE))
