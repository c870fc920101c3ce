"""Metrics helpers of the driver: per-step batch statistics and the mean of per-rank metrics."""

from __future__ import annotations

import numpy as np

from fusedrl.batch import RolloutBatch
from fusedrl.log_prob_gap import gap_metrics, gap_stats

Metrics = dict[str, float]


def mean_over_ranks(per_rank: list[Metrics]) -> Metrics:
    """The mean of each metric over the workers' answers (every rank reports the same keys)."""
    keys = per_rank[0].keys()
    return {k: float(np.mean([m[k] for m in per_rank])) for k in keys}


def batch_metrics(
    batch: RolloutBatch, step_time: float, global_step: int, gap: Metrics | None = None
) -> Metrics:
    """Scores, advantages, lengths, the rollout-vs-actor log-prob gap and throughput of one step's batch.
    The gap (`fusedrl.log_prob_gap`) from the batch's log-probs, or ``gap``: its metrics as the workers that
    hold them answered (`fusedrl.trainer.actor_calls`); ``{}``: the rollout computed no log-probs this step
    (`fusedrl.trainer.step_plan.rollout_log_probs_wanted`), no gap metrics."""
    mask = batch.response_mask.float()  # [B, Tr]
    lengths = mask.sum(-1)  # [B]
    scores = batch.token_level_scores.sum(-1)  # [B]
    adv = batch.advantages[batch.response_mask.bool()]  # [N valid]
    if gap is None:
        if batch.rollout_log_probs is None or batch.old_log_probs is None:
            raise ValueError(
                "batch_metrics: the batch holds no rollout_log_probs / old_log_probs (they stayed on the "
                "workers, fusedrl.resident) and no gap metrics were given"
            )
        gap = gap_metrics([gap_stats(batch.rollout_log_probs, batch.old_log_probs, batch.response_mask)])
    prompt_tokens = float(batch.prompt_mask.sum())
    real = batch.response_mask if batch.response_attention_mask is None else batch.response_attention_mask
    agent: Metrics = {}
    if batch.agent_stats is not None:
        from fusedrl.agent.rewards import agent_metrics

        agent = agent_metrics(batch.agent_stats)
    return {
        **agent,
        "critic/score/mean": float(scores.mean()),
        "critic/score/max": float(scores.max()),
        "critic/score/min": float(scores.min()),
        "critic/advantages/mean": float(adv.mean()) if adv.numel() else 0.0,
        "critic/advantages/max": float(adv.max()) if adv.numel() else 0.0,
        "critic/advantages/min": float(adv.min()) if adv.numel() else 0.0,
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((real.sum(-1) >= mask.shape[1]).float().mean()),
        "prompt_length/mean": prompt_tokens / batch.num_samples,
        # Rollout vs trainer log-probs of the same tokens: ~0 when the weight sync is right.
        **gap,
        "perf/total_num_tokens": prompt_tokens + float(real.sum()),
        "perf/throughput": (prompt_tokens + float(real.sum())) / max(step_time, 1e-9),
        "training/global_step": float(global_step),
    }
