"""The example scripts under examples/<algorithm>/.

- fast: every GPU recipe (run_qwen2_5_0_5b_gsm8k.sh) prints its override list (``--print-overrides``),
  and that list composes with the trainer YAML: no unknown key, no Hydra parse error, bf16 rollout and
  compute, batch sizes that divide across 1 and 8 GPUs. The recipes themselves need a GPU and a hub
  download, so they are not run here. Also fast: each CPU twin keeps the algorithm settings that
  tests/e2e/test_algorithms.py runs for that algorithm.
- slow: every CPU twin (run_tiny_cpu.sh, and the custom-trainer example) runs 2 steps end to end in its
  own work folder and logs step 2.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ALGORITHMS = ["dapo", "drgrpo", "grpo", "gspo", "ppo", "reinforce_plus_plus", "remax", "rloo"]
TINY = [*ALGORITHMS, "custom_trainer", "grpo_lora"]
GPU_SCRIPT = "run_qwen2_5_0_5b_gsm8k.sh"


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "DATA_DIR", "NGPUS", "STEPS", "WORK")
    }
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env


def _overrides(algorithm: str, **env: str) -> list[str]:
    script = EXAMPLES / algorithm / GPU_SCRIPT
    out = subprocess.run(
        ["bash", str(script), "--print-overrides"],
        env=_env(DATA_DIR="/data/gsm8k", **env),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [line for line in out.stdout.splitlines() if line.strip()]


def test_every_algorithm_has_both_scripts():
    tiny = {p.parent.name for p in EXAMPLES.glob("*/run_tiny_cpu.sh")}
    gpu = {p.parent.name for p in EXAMPLES.glob(f"*/{GPU_SCRIPT}")}
    assert set(TINY) <= tiny, f"missing run_tiny_cpu.sh for {sorted(set(TINY) - tiny)}"
    assert set(ALGORITHMS) <= gpu, f"missing {GPU_SCRIPT} for {sorted(set(ALGORITHMS) - gpu)}"


def _tiny_algorithm_settings(algorithm: str) -> list[str]:
    """The ``ALGORITHM=( ... )`` array of a run_tiny_cpu.sh, one override per entry."""
    text = (EXAMPLES / algorithm / "run_tiny_cpu.sh").read_text()
    match = re.search(r"^ALGORITHM=\((.*?)^\)", text, re.MULTILINE | re.DOTALL)
    assert match, f"{algorithm}/run_tiny_cpu.sh has no ALGORITHM=( ... ) array"
    return match.group(1).split()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_tiny_script_keeps_the_tested_algorithm_settings(algorithm):
    """Each CPU twin uses the settings tests/e2e/test_algorithms.py runs for that algorithm."""
    source = (ROOT / "tests" / "e2e" / "test_algorithms.py").read_text()
    node = next(
        n
        for n in ast.parse(source).body
        if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "ALGORITHMS" for t in n.targets)
    )
    tested = ast.literal_eval(node.value)[algorithm]
    script = _tiny_algorithm_settings(algorithm)
    assert set(tested) <= set(script), f"not in the script: {sorted(set(tested) - set(script))}"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_gpu_recipe_overrides_compose(algorithm):
    from fusedrl.config import load_config

    overrides = _overrides(algorithm)
    assert overrides and all("=" in ov for ov in overrides), overrides
    # validate_config=False: the data and model paths do not exist here (and there is no GPU). Unknown
    # keys and Hydra parse errors are still reported: that check runs before validation.
    cfg = load_config(overrides, validate_config=False)

    arr = cfg.actor_rollout_ref
    assert arr.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.data.train_files == "/data/gsm8k/train.parquet"
    assert arr.rollout.dtype == "bfloat16"
    assert arr.actor.fsdp_config.param_dtype == "bfloat16"
    assert list(cfg.trainer.logger) == ["console", "wandb"]
    assert algorithm in str(cfg.trainer.experiment_name)

    # The batch-size arithmetic validate() checks, for one GPU and for eight.
    bsz, n, mini = int(cfg.data.train_batch_size), int(arr.rollout.n), int(arr.actor.ppo_mini_batch_size)
    assert bsz % mini == 0
    for world in (1, 8):
        assert (bsz * n) % world == 0 and (mini * n) % world == 0, (world, bsz, n, mini)


def test_gpu_recipe_env_and_extra_overrides():
    overrides = _overrides("grpo", MODEL_PATH="/models/qwen", NGPUS="8")
    assert "actor_rollout_ref.model.path=/models/qwen" in overrides
    assert "trainer.n_gpus_per_node=8" in overrides
    script = EXAMPLES / "grpo" / GPU_SCRIPT
    out = subprocess.run(
        ["bash", str(script), "--print-overrides", "trainer.total_epochs=5"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.splitlines()[-1] == "trainer.total_epochs=5"  # the user's overrides come last


def test_lora_recipe_composes_in_verl_keys():
    """The LoRA GPU recipe's verl keys land (lora_*) or are accepted (use_shm, load_format,
    layered_summon), and the engine keeps its weights between rollouts so syncs stay partial."""
    from fusedrl.config import load_config

    notes: list[str] = []
    cfg = load_config(_overrides("grpo_lora"), validate_config=False, report=notes.append)
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (64, 32, "all-linear")
    assert cfg.actor_rollout_ref.rollout.sleep_level == 1
    assert cfg.actor_rollout_ref.actor.optim.lr > 1e-6  # not left at the full fine-tuning rate
    assert len(notes) == 1 and "layered_summon" in notes[0] and "use_shm" in notes[0]
    tiny = (EXAMPLES / "grpo_lora" / "run_tiny_cpu.sh").read_text()
    assert "actor_rollout_ref.model.lora_rank=8" in tiny


@pytest.mark.slow
@pytest.mark.parametrize("example", TINY)
def test_tiny_cpu_script_runs_two_steps(example, tmp_path):
    pytest.importorskip("vllm")
    script = EXAMPLES / example / "run_tiny_cpu.sh"
    try:
        proc = subprocess.run(
            ["bash", str(script)],
            env=_env(WORK=str(tmp_path), STEPS="2"),
            cwd=str(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired as err:
        tail = (err.stdout or b"")[-4000:]
        pytest.fail(f"{script} did not finish in 600 s; output tail:\n{tail!s}")
    tail = proc.stdout[-6000:]
    assert proc.returncode == 0, f"{script} exited {proc.returncode}; output tail:\n{tail}"
    assert re.search(r"\bstep 2 \|", proc.stdout), f"no 'step 2' log line; output tail:\n{tail}"
    assert not re.search(r"\bstep 3 \|", proc.stdout), "STEPS=2 was not honoured"


def test_agentic_gpu_recipe_composes_and_its_tool_loads():
    """examples/agentic: the calculator recipe's overrides compose with the YAML (multi-turn keys included),
    the tool YAML loads once the plugin module is imported, and the tool computes exactly."""
    from fusedrl.agent import ToolSet
    from fusedrl.config import import_plugin, load_config

    overrides = _overrides("agentic")
    cfg = load_config(overrides, validate_config=False)
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.default_agent_name == "tool" and cfg.actor_rollout_ref.rollout.dtype == "bfloat16"
    import_plugin(str(cfg.algorithm.custom_modules[0]))
    tools = ToolSet.from_config({"tool_config_path": str(mt.tool_config_path)})
    calc = tools["calculator"]
    assert calc.schema["function"]["parameters"]["required"] == ["expression"]
    assert calc.execute("t", {"expression": "(48 + 24) * 3 - 7 / 2"}) == "212.5"
    with pytest.raises(ValueError, match="only numbers"):
        calc.execute("t", {"expression": "__import__('os')"})
