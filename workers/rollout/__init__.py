"""Rollout engines: vLLM in-process (default) and Hugging Face generate (fallback)."""

from fusedrl.workers.rollout.base import Rollout, SamplingConfig

__all__ = ["Rollout", "SamplingConfig"]
