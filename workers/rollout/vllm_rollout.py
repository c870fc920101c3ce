"""Rollout on an in-process vLLM engine (the default): the ``vllm`` entry of the engine registry."""

from __future__ import annotations

import logging
from typing import Any

import torch

from fusedrl.batch import RolloutBatch
from fusedrl.role_config import records_routed_experts
from fusedrl.third_party.vllm import EngineConfig, VLLMEngine
from fusedrl.workers.rollout.base import EngineContext, EngineRollout, SamplingConfig, rollout_dtype

logger = logging.getLogger(__name__)

_GIB = 1 << 30
# A vision-language engine's image limit per prompt (vLLM's limit_mm_per_prompt; verl's rollout.limit_images
# is not read yet).
MAX_IMAGES_PER_PROMPT = 8


def build(ctx: EngineContext) -> EngineRollout:
    """Data-parallel rollout: each fused worker's engine generates its own shard of the prompts (a
    tensor-parallel group of workers shares one). Must be built after ``torch.distributed`` is
    initialised."""
    cfg = ctx.cfg
    record = records_routed_experts(cfg)
    eager, prefix_caching = bool(cfg.enforce_eager), bool(cfg.enable_prefix_caching)
    if record:  # routing replay: hooks run eager only, and a prefix-cache hit would skip prompt positions
        from fusedrl.third_party.vllm.routed_experts import START_MESSAGE, engine_overrides

        logger.warning(START_MESSAGE)
        eager, prefix_caching = (
            engine_overrides()["enforce_eager"],
            engine_overrides()["enable_prefix_caching"],
        )
    engine = VLLMEngine(
        EngineConfig(
            model_path=ctx.model_path,
            dtype=rollout_dtype(str(cfg.dtype), cuda=torch.cuda.is_available()),
            seed=ctx.seed,
            tensor_parallel_size=int(cfg.tensor_model_parallel_size),
            max_model_len=int(cfg.max_model_len or ctx.max_model_len),
            kv_cache_memory_bytes=int(float(cfg.cpu_kv_cache_gb) * _GIB),
            gpu_memory_utilization=float(cfg.gpu_memory_utilization),
            enable_sleep_mode=bool(cfg.free_cache_engine),
            emulate_sleep=bool(cfg.emulate_sleep),
            enable_prefix_caching=prefix_caching,
            max_num_seqs=int(cfg.max_num_seqs),
            enforce_eager=eager,
            enable_chunked_prefill=bool(cfg.enable_chunked_prefill),
            max_num_batched_tokens=int(cfg.max_num_batched_tokens),
            disable_log_stats=bool(cfg.disable_log_stats),
            max_images_per_prompt=MAX_IMAGES_PER_PROMPT if ctx.vision_token_ids else 0,
        )
    )
    return (RecordingRollout if record else EngineRollout)(
        engine,
        max_response_length=ctx.max_response_length,
        eos_token_id=ctx.eos_token_id,
        pad_token_id=ctx.pad_token_id,
        vision_token_ids=ctx.vision_token_ids,
    )


class RecordingRollout(EngineRollout):
    """The vLLM rollout that also returns the experts the engine chose for each token (``routed_experts``,
    `fusedrl.third_party.vllm.routed_experts`): ``rollout.enable_rollout_routing_replay`` /
    ``record_routed_experts``."""

    def __init__(self, engine: Any, **kwargs: Any) -> None:
        from fusedrl.third_party.vllm.routed_experts import RoutedExpertsRecorder

        super().__init__(engine, **kwargs)
        self.recorder = RoutedExpertsRecorder(engine)

    def generate(self, batch: RolloutBatch, sampling: SamplingConfig) -> RolloutBatch:
        if batch.multi_modal_inputs is not None:
            raise NotImplementedError("recorded experts (routing replay) of image prompts")
        with self.recorder.recording() as recorded:
            out = super().generate(batch, sampling)
        # the one-turn agent loop names row i's request "i.0" (`fusedrl.agent.runner`)
        out.routed_experts = recorded.rows(out, [f"{i}.0" for i in range(out.num_samples)])
        return out
