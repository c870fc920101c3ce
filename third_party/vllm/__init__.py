"""vLLM adapter: engine construction, in-place weight reload, CPU/CUDA differences."""

from fusedrl.third_party.vllm.engine import EngineConfig, SampleParams, VLLMEngine

__all__ = ["EngineConfig", "SampleParams", "VLLMEngine"]
