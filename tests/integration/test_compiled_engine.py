"""The rollout engine compiled (``rollout.enforce_eager=false``, verl's default) on CPU: vLLM runs the model
through torch.compile, and in-place weight reloads still reach it.

The test suite runs eager engines (``FUSEDRL_ROLLOUT_EAGER=1`` from tests/conftest.py: a compile costs
15-45 s per engine start); this module clears that for its own process and checks:

* the engine really compiled (vLLM's compilation mode is not NONE);
* its greedy tokens' log-probs equal Hugging Face's on the same float32 weights, before and after a reload
  of changed weights: a compiled graph that had frozen the first weights as constants would fail the second;
* `eager_mode`: the environment switch, and a CPU without the C++ compiler Inductor needs falls back to an
  eager engine with one line naming the compiler and the key, instead of failing at start-up.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from support import free_port, spawned_result

from fusedrl.third_party.vllm.engine import EAGER_ENV, eager_mode
from fusedrl.utils.hardware import AVX2_CAP_ENV, ISA_ENV

pytestmark = pytest.mark.integration


def _states(model_dir: str) -> tuple[dict, dict]:
    """The checkpoint's weights, and the same with every MLP weight halved (what the reload swaps in)."""
    from safetensors.torch import load_file

    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    return weights, {n: (t * 0.5 if ".mlp." in n else t) for n, t in weights.items()}


def _hf_log_probs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [n, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]  # [n]


def _body(port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from fusedrl.third_party.vllm import EngineConfig, SampleParams, VLLMEngine

    os.environ.pop(EAGER_ENV, None)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    dist.init_process_group("gloo", rank=0, world_size=1)
    engine = VLLMEngine(
        EngineConfig(model_path=model_dir, dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=256)
    )
    mode = engine.llm.llm_engine.vllm_config.compilation_config.mode
    prompts = [[5, 17, 42, 9, 101, 7], [3, 3, 250, 12]]
    greedy = SampleParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    weights, changed = _states(model_dir)
    result: dict = {"eager": engine.eager, "mode": int(mode), "runs": []}
    for state in (weights, changed, weights):
        engine.update_weights(state.items())
        outs = engine.generate(prompts, greedy)
        result["runs"].append(
            [(p, list(t), torch.tensor(lp)) for p, (t, lp) in zip(prompts, outs, strict=True)]
        )
    torch.save(result, out)
    os._exit(0)  # skip the engine's teardown (it destroys the process group) and vLLM's atexit hooks


def test_compiled_cpu_engine_follows_in_place_reloads(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    r = spawned_result(_body, tiny_model_dir, tmp_path, 900)
    assert r["eager"] is False and r["mode"] != 0, r  # 0: vLLM's CompilationMode.NONE (eager)
    weights, changed = _states(tiny_model_dir)
    first, second, third = r["runs"]
    assert [t for _, t, _ in first] != [t for _, t, _ in second]  # the reload changed what it generates
    assert [t for _, t, _ in first] == [t for _, t, _ in third]  # and reloading the first weights restores it
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for run, state in ((first, weights), (second, changed), (third, weights)):
        model.load_state_dict(state)
        for prompt, tokens, lp in run:
            want = _hf_log_probs(model, prompt, tokens)
            assert torch.allclose(lp, want, atol=1e-4), (lp, want)


def test_eager_mode_switch_and_missing_compiler(monkeypatch):
    monkeypatch.delenv(EAGER_ENV, raising=False)
    assert eager_mode(True, cuda=False) == (True, None)
    assert eager_mode(False, cuda=True) == (False, None)
    monkeypatch.setenv(EAGER_ENV, "1")
    eager, why = eager_mode(False, cuda=True)
    assert eager and EAGER_ENV in why
    monkeypatch.setenv(EAGER_ENV, "0")
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    eager, why = eager_mode(False, cuda=False)
    assert eager
    assert "'no-such-c++-compiler' is not on PATH" in why and "rollout.enforce_eager" in why
    assert eager_mode(False, cuda=True) == (False, None)  # CUDA graphs need no host compiler


_START_ENGINE = """
import os, sys
import torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo", rank=0, world_size=1)
from fusedrl.third_party.vllm import EngineConfig, SampleParams, VLLMEngine
engine = VLLMEngine(EngineConfig(model_path=sys.argv[1], dtype="float32", kv_cache_memory_bytes=64 << 20,
                                 max_model_len=256))
(tokens, _), = engine.generate([[5, 17, 42, 9]], SampleParams(max_tokens=4, temperature=0.0, ignore_eos=True))
print("ENGINE", engine.eager, len(tokens), os.environ["TORCHINDUCTOR_CACHE_DIR"], flush=True)
os._exit(0)
"""


# slow since 2026-12-06 (CI budget: ~100 s; the default suite had reached 38 min on 2 cores)
@pytest.mark.slow
def test_compiled_engine_starts_after_a_run_under_another_instruction_set(tiny_model_dir, tmp_path):
    """A compiled engine whose graph Inductor cached in a run capped at AVX2 (oneDNN / MKL / ATen) crashed
    the next native start with a segfault in oneDNN (seen 2026-12-04): Inductor's cache is not keyed by
    that cap. Each instruction set now compiles into a cache folder of its own. Both starts share one
    temporary folder (``TMPDIR``), as two runs on one machine share ``/tmp``."""
    script = tmp_path / "start_engine.py"
    script.write_text(_START_ENGINE)
    # "native" is the machine's own instruction set even where this test run is itself capped.
    env = {k: v for k, v in os.environ.items() if k not in (EAGER_ENV, "TORCHINDUCTOR_CACHE_DIR", *ISA_ENV)}
    env["TMPDIR"] = str(tmp_path)
    folders = []
    for extra in (AVX2_CAP_ENV, {}, {}):  # capped, native, native again (from the native folder's cache)
        proc = subprocess.run(
            [sys.executable, str(script), tiny_model_dir, str(free_port())],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=600,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ENGINE ")]
        assert proc.returncode == 0 and lines, (extra, proc.returncode, proc.stderr[-3000:])
        eager, n_tokens, folder = lines[0].split()[1:]
        assert eager == "False" and n_tokens == "4"
        folders.append(folder)
    assert folders[0] != folders[1] == folders[2]
    assert all(f.startswith(str(tmp_path)) and os.path.basename(f).startswith("cpu-") for f in folders)
