"""Rollout on an in-process vLLM engine (the default): the ``vllm`` entry of the engine registry."""

from __future__ import annotations

import torch

from fusedrl.third_party.vllm import EngineConfig, VLLMEngine
from fusedrl.workers.rollout.base import EngineContext, EngineRollout, rollout_dtype

_GIB = 1 << 30
# A vision-language engine's image limit per prompt (vLLM's limit_mm_per_prompt; verl's rollout.limit_images
# is not read yet).
MAX_IMAGES_PER_PROMPT = 8


def build(ctx: EngineContext) -> EngineRollout:
    """Data-parallel rollout: each fused worker's engine generates its own shard of the prompts (a
    tensor-parallel group of workers shares one). Must be built after ``torch.distributed`` is
    initialised."""
    cfg = ctx.cfg
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
            enable_prefix_caching=bool(cfg.enable_prefix_caching),
            max_num_seqs=int(cfg.max_num_seqs),
            enforce_eager=bool(cfg.enforce_eager),
            enable_chunked_prefill=bool(cfg.enable_chunked_prefill),
            max_num_batched_tokens=int(cfg.max_num_batched_tokens),
            disable_log_stats=bool(cfg.disable_log_stats),
            max_images_per_prompt=MAX_IMAGES_PER_PROMPT if ctx.vision_token_ids else 0,
        )
    )
    return EngineRollout(
        engine,
        max_response_length=ctx.max_response_length,
        eos_token_id=ctx.eos_token_id,
        pad_token_id=ctx.pad_token_id,
        vision_token_ids=ctx.vision_token_ids,
    )
