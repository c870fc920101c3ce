"""Multi-turn agent rollouts on the fused worker's own engine.

`AgentRollout` holds the run's engine (any engine with the ``request_queue`` trait: it takes requests one at
a time) and hands it every weight stream, sleep and wake-up as the engine's own `EngineRollout` does; its
``generate`` runs one agent loop per row through `fusedrl.agent.AgentRunner` instead of one batch
``generate`` call. Each row's trajectory comes back as:

    responses               sampled ids and observation ids, in order, right-padded to Tr
    response_mask           1 exactly on sampled ids
    response_attention_mask 1 on every real response token (sampled or observation)
    rollout_log_probs       the engine's log-probs on sampled ids, 0 elsewhere
    agent_stats             [B, K] per-trajectory numbers (fusedrl.agent.STAT_NAMES)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fusedrl.agent import STAT_NAMES, AgentRunner, ChatRenderer, ToolSet
from fusedrl.agent.trajectory import Trajectory
from fusedrl.batch import RolloutBatch
from fusedrl.workers.rollout.base import (
    EngineContext,
    EngineRollout,
    Rollout,
    SamplingConfig,
    turn_sampling,
    unpadded_prompts,
)


class AgentRollout(EngineRollout):
    """Agent loops on the engine of ``inner`` (an `EngineRollout` of an engine with a request queue), which
    this rollout holds and hands every weight stream, sleep and wake-up as ``inner`` would;
    ``ctx.cfg`` is ``actor_rollout_ref.rollout`` (with ``multi_turn``), ``tools`` extra Python tools."""

    def __init__(self, inner: Rollout, ctx: EngineContext, *, tools: Sequence[Any] = ()) -> None:
        from transformers import AutoTokenizer

        super().__init__(
            inner.engine,  # type: ignore[attr-defined]  # a RequestEngine (the request_queue trait)
            max_response_length=ctx.max_response_length,
            eos_token_id=ctx.eos_token_id,
            pad_token_id=ctx.pad_token_id,
        )
        self.multi_turn = ctx.cfg.multi_turn
        self.tools = ToolSet.from_config(
            {"tool_config_path": self.multi_turn.tool_config_path}, extra=list(tools)
        )
        tokenizer = AutoTokenizer.from_pretrained(ctx.model_path)
        self.renderer = ChatRenderer(tokenizer, self.tools.schemas() or None)
        self.runner = AgentRunner(self.engine, self.renderer, self.tools, self.multi_turn)
        # routing replay: the vLLM rollout's recorder of each request's experts (`RecordingRollout`)
        self.recorder = getattr(inner, "recorder", None)

    def generate(self, batch: RolloutBatch, sampling: SamplingConfig) -> RolloutBatch:
        run = lambda: self.runner.run(  # noqa: E731
            agent_rows(batch),
            turn_sampling(sampling, stop_token_id=self.eos_token_id),
            max_response_length=min(sampling.max_tokens, self.max_response_length),
        )
        if self.recorder is None:
            trajs = run()
        else:
            with self.recorder.recording():
                trajs = run()
        attach_trajectories(
            batch,
            trajs,
            max_response_length=self.max_response_length,
            pad_token_id=self.pad_token_id,
            log_probs=sampling.log_probs,
        )
        if self.recorder is not None:  # each sampled token's experts, from the turn that sampled it
            batch.routed_experts = self.recorder.trajectory_rows(batch, [t.turn_starts for t in trajs])
        return batch


def agent_rows(batch: RolloutBatch) -> list[dict[str, Any]]:
    """What the agent runner reads of each row of ``batch``: prompt ids, ``extra_info``, the loop's name,
    the chat messages, uid, ground truth, data source and the row's sampling seed."""
    extra = batch.field_list("extra_info") or [{} for _ in range(batch.num_samples)]
    uids = batch.field_list("uid") or [str(i) for i in range(batch.num_samples)]
    ground_truth = batch.field_list("ground_truth") or [None] * batch.num_samples
    data_source = batch.field_list("data_source") or [None] * batch.num_samples
    seeds = batch.sample_seeds.tolist() if batch.sample_seeds is not None else range(batch.num_samples)
    rows = []
    for i, ids in enumerate(unpadded_prompts(batch)):
        info = dict(extra[i] or {})
        rows.append(
            dict(
                prompt_ids=ids,
                extra_info=info,
                agent_name=info.get("agent_name"),
                messages=info.get("raw_prompt"),
                uid=uids[i],
                ground_truth=ground_truth[i],
                data_source=data_source[i],
                seed=int(seeds[i]),
            )
        )
    return rows


def attach_trajectories(
    batch: RolloutBatch,
    trajs: Sequence[Trajectory],
    *,
    max_response_length: int,
    pad_token_id: int,
    log_probs: bool = True,
) -> RolloutBatch:
    """Set one trajectory per row of ``batch`` on it (the fields of the module docstring); ``log_probs``
    False: the engine computed none, ``rollout_log_probs`` is None."""
    b, tr = batch.num_samples, max_response_length
    responses = torch.full((b, tr), pad_token_id, dtype=torch.long)  # [B, Tr]
    mask = torch.zeros((b, tr), dtype=torch.long)  # [B, Tr]
    attn = torch.zeros((b, tr), dtype=torch.long)  # [B, Tr]
    values = torch.zeros((b, tr), dtype=torch.float32)  # [B, Tr]
    for i, t in enumerate(trajs):
        n = len(t.response_ids)  # <= Tr: the runner keeps every trajectory within the budget
        responses[i, :n] = torch.as_tensor(t.response_ids, dtype=torch.long)
        mask[i, :n] = torch.as_tensor(t.mask, dtype=torch.long)
        attn[i, :n] = 1
        if log_probs:
            values[i, :n] = torch.as_tensor(t.log_probs, dtype=torch.float32)
    batch.responses = responses
    batch.response_mask = mask
    batch.response_attention_mask = attn
    batch.rollout_log_probs = values if log_probs else None
    batch.agent_stats = torch.tensor([t.stat_row() for t in trajs], dtype=torch.float32).view(
        b, len(STAT_NAMES)
    )  # [B, K]
    return batch
