"""The parts of an in-process vLLM engine that fusedrl reaches into (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the
``external_launcher`` executor: the engine core and the worker's model runner live in this process)."""

from __future__ import annotations

from typing import Any


def engine_core(llm: Any) -> Any:
    """``llm``'s `EngineCore` (scheduler, executor); a clear error where it runs in another process."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise RuntimeError(
            "the vLLM engine core is not in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 puts it here), "
            f"found a {type(client).__name__}"
        )
    return core


def model_runner(llm: Any) -> Any:
    """The worker's own model runner (the engine runs in this process: the object itself comes back)."""
    return llm.collective_rpc(lambda worker: worker.model_runner)[0]
