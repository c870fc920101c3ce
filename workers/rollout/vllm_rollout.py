"""Rollout on an in-process vLLM engine (the default)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from fusedrl.batch import RolloutBatch
from fusedrl.role_config import RolloutConfig
from fusedrl.third_party.vllm import EngineConfig, SampleParams, VLLMEngine
from fusedrl.workers.rollout.base import (
    SamplingConfig,
    attach_responses,
    rollout_dtype,
    unpadded_prompts,
)

_GIB = 1 << 30


class VLLMRollout:
    """Data-parallel rollout: each fused worker's engine generates its own shard of the prompts.

    ``cfg`` is ``actor_rollout_ref.rollout`` (`fusedrl.role_config.RolloutConfig`); responses are
    right-padded to ``max_response_length`` (``data.max_response_length``). Must be built after
    ``torch.distributed`` is initialised.
    """

    def __init__(
        self,
        cfg: RolloutConfig,
        *,
        model_path: str,
        seed: int,
        max_model_len: int,
        max_response_length: int,
        eos_token_id: int,
        pad_token_id: int,
    ) -> None:
        self.cfg = cfg
        self.max_response_length = int(max_response_length)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.engine = VLLMEngine(
            EngineConfig(
                model_path=model_path,
                dtype=rollout_dtype(str(cfg.dtype), cuda=torch.cuda.is_available()),
                seed=seed,
                tensor_parallel_size=int(cfg.tensor_model_parallel_size),
                max_model_len=int(cfg.max_model_len or max_model_len),
                kv_cache_memory_bytes=int(float(cfg.cpu_kv_cache_gb) * _GIB),
                gpu_memory_utilization=float(cfg.gpu_memory_utilization),
                enable_sleep_mode=bool(cfg.free_cache_engine),
                emulate_sleep=bool(cfg.emulate_sleep),
                enable_prefix_caching=bool(cfg.enable_prefix_caching),
                max_num_seqs=int(cfg.max_num_seqs),
                enforce_eager=bool(cfg.enforce_eager),
                enable_chunked_prefill=bool(cfg.enable_chunked_prefill),
                max_num_batched_tokens=int(cfg.max_num_batched_tokens),
                disable_log_stats=bool(cfg.disable_log_stats),
            )
        )

    def generate(self, batch: RolloutBatch, sampling: SamplingConfig) -> RolloutBatch:
        params = SampleParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature if sampling.do_sample else 0.0,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            stop_token_ids=(self.eos_token_id,),
        )
        seeds = batch.sample_seeds.tolist() if batch.sample_seeds is not None else None
        samples = self.engine.generate(unpadded_prompts(batch), params, seeds)
        return attach_responses(
            batch, samples, max_response_length=self.max_response_length, pad_token_id=self.pad_token_id
        )

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        reset_prefix_cache: bool = True,
        partial: bool = False,
    ) -> None:
        self.engine.update_weights(named_tensors, reset_prefix_cache=reset_prefix_cache, partial=partial)

    def param_dtype(self) -> torch.dtype:
        """The engine's parameter dtype: the weight stream is cast to it before it is gathered."""
        return self.engine.param_dtype()

    @property
    def weights_discarded(self) -> bool:
        """Whether the engine holds no weights (a level-2 sleep threw them away): the next stream must
        be complete."""
        return bool(self.engine.weights_discarded)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def sleep(self, level: int) -> None:
        self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.engine.wake_up(tags)
