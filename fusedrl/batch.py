"""The one batch type that travels between the driver and the fused workers.

A `RolloutBatch` is a tensordict `tensorclass`: every tensor field shares the leading batch dimension
``B`` (one row per *sample*, i.e. per prompt x response pair), so slicing, indexing, concatenation and
splitting across data-parallel ranks act on all fields at once. Fields are filled in as the RL step
progresses; a field that a stage has not produced yet is ``None``.

Shapes: ``Tp`` = ``data.max_prompt_length`` (prompts are *left*-padded), ``Tr`` =
``data.max_response_length`` (responses are *right*-padded). Every response tensor is padded to ``Tr``
by whoever produces it, so batches from different ranks concatenate without re-padding.

Control values (temperature, micro-batch size, ...) never ride in the batch; they are arguments or
config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorClass

# Per-sample Python values (not tensors). They are stacked per row by tensordict, so slicing works.
NON_TENSOR_FIELDS = ("uid", "data_source", "ground_truth", "extra_info", "multi_modal_inputs")


class RolloutBatch(TensorClass):  # type: ignore[misc]
    """Samples of one RL step. Leading dimension ``B`` on every field.

    Prompt (from the dataset):
        prompts:        [B, Tp] int64, token ids, left-padded with the pad id.
        prompt_mask:    [B, Tp] int64, 1 on real prompt tokens, 0 on left padding.
    Rollout (from the rollout engine):
        responses:      [B, Tr] int64, generated ids, right-padded with the pad id.
        response_mask:  [B, Tr] int64, 1 on generated tokens (EOS included), 0 on padding.
        rollout_log_probs: [B, Tr] float32, the engine's log-probs of its own samples.
        response_attention_mask: [B, Tr] int64 or None. Multi-turn rollouts only: 1 on every real response
                        token, sampled (response_mask 1) or observation (tool / user turns, response_mask 0).
                        The model attends to all of them; losses, KL, entropy and advantages see only
                        response_mask. None: the same as response_mask (single-turn).
        agent_stats:    [B, K] float32 or None. Multi-turn rollouts only: per-trajectory numbers named by
                        fusedrl.agent.STAT_NAMES (environment reward, turns, tool calls, errors, ...).
    Scores (from the reward manager, on the driver):
        token_level_scores:  [B, Tr] float32, the task reward, placed on the last response token.
        token_level_rewards: [B, Tr] float32, the scores after any in-reward penalty (equal otherwise).
    Model outputs (from the workers):
        old_log_probs:  [B, Tr] float32, log pi_old(response) from the actor before the update.
        ref_log_probs:  [B, Tr] float32, log pi_ref(response) from the frozen reference.
        critic_values:  [B, Tr] float32, critic value estimates (PPO with GAE only). Not named
                        `values`: that name is a TensorDict method.
        sum_pi_squared: [B, Tr] float32, sum over the vocabulary of pi_old(v)^2 at each response position
                        (only for estimators whose traits ask for it: the optimal token baseline).
    Advantages (pure functions on the driver):
        advantages:     [B, Tr] float32.
        returns:        [B, Tr] float32.
    Per-sample controls of the rollout:
        sample_seeds:   [B] int64, the sampling seed of each row, so a resumed run samples the same tokens.
        reward_baselines: [B] float32, the greedy response's reward for the row's prompt (ReMax).
        reward_components: [B, K] float32 or None, the row's named reward components
                        (``algorithm.gdpo_reward_keys`` of a dict-returning scorer; GDPO).
        policy_version: [B] int64 or None, the actor version (number of its updates) whose weights
                        generated the row (async training, ``trainer/async_trainer.py``; partial rollout:
                        the oldest version in the row).
        token_versions: [B, Tr] int64 or None, the actor version that sampled each response token
                        (partial rollout, ``workers/rollout/partial.py``: a row resumed across steps mixes
                        versions); 0 on padding.
        routed_experts: [B, Tp+Tr, L, k] uint8 (int16 above 255 experts) or None: the experts the engine's
                        L mixture-of-experts layers chose for the token at each position of prompt + response
                        (``rollout.enable_rollout_routing_replay``, `fusedrl.workers.routing_replay`); the
                        dtype's largest value where the engine fed no token (padding, the last response token).
        resident_rows:  [B, 3] int64 or None: where the row's generated fields stay (`fusedrl.resident`): the
                        generation id, the rollout engine (data-parallel shard) that made it, its row there.
                        Never sent to a worker; rows reordered, filtered or padded carry it along.
    Per-sample non-tensor values:
        uid:            list[str], the prompt's id; the n samples of one prompt share it (GRPO groups).
        data_source:    list[str], picks the scoring function.
        ground_truth:   list[str], reference answer for the rule reward.
        extra_info:     list[dict], free-form metadata from the dataset row.
        multi_modal_inputs: list of `fusedrl.data.multimodal.VisionInputs` (one row each) or None: the row's
                        images, decoded and processed (vision-language prompts; docs/multimodal.md).
    """

    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    responses: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    response_attention_mask: torch.Tensor | None = None
    agent_stats: torch.Tensor | None = None
    token_level_scores: torch.Tensor | None = None
    token_level_rewards: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    critic_values: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    sample_seeds: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None
    reward_components: torch.Tensor | None = None
    policy_version: torch.Tensor | None = None
    token_versions: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    resident_rows: torch.Tensor | None = None
    uid: Any = None
    data_source: Any = None
    ground_truth: Any = None
    extra_info: Any = None
    multi_modal_inputs: Any = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_prompts(
        cls,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        uid: Sequence[str],
        data_source: Sequence[str],
        ground_truth: Sequence[str],
        extra_info: Sequence[dict] | None = None,
    ) -> RolloutBatch:
        """A batch holding only prompts, as the dataset yields it."""
        b = prompts.shape[0]
        checks: list[tuple[str, Sequence[Any]]] = [
            ("uid", uid),
            ("data_source", data_source),
            ("ground_truth", ground_truth),
        ]
        if extra_info is not None:
            checks.append(("extra_info", extra_info))
        for name, seq in checks:
            if len(seq) != b:
                raise ValueError(f"RolloutBatch.from_prompts: {name} has {len(seq)} items for {b} prompts")
        return cls(
            prompts=prompts,
            prompt_mask=prompt_mask,
            uid=list(uid),
            data_source=list(data_source),
            ground_truth=[str(g) for g in ground_truth],
            extra_info=list(extra_info) if extra_info is not None else [{} for _ in range(b)],
            batch_size=[b],
        )

    # ------------------------------------------------------------------ views
    def field_list(self, name: str) -> list:
        """A non-tensor field as a plain Python list (tensordict stores it as a stack)."""
        value = getattr(self, name)
        return [] if value is None else list(value)

    @property
    def num_samples(self) -> int:
        return int(self.batch_size[0])

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prompt + response as one causal-LM input.

        Returns ``(input_ids [B, Tp+Tr], attention_mask [B, Tp+Tr], position_ids [B, Tp+Tr])``. Positions
        count real tokens only, so a left-padded prompt gets the same positions as the unpadded prompt the
        rollout engine saw.
        """
        if self.responses is None or self.response_mask is None:
            raise ValueError("RolloutBatch.sequences(): the batch has no responses yet (run generate first)")
        input_ids = torch.cat([self.prompts, self.responses], dim=1)  # [B, Tp+Tr]
        response_attn = (
            self.response_mask if self.response_attention_mask is None else self.response_attention_mask
        )
        attention_mask = torch.cat([self.prompt_mask, response_attn], dim=1).long()  # [B, Tp+Tr]
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, Tp+Tr]
        return input_ids, attention_mask, position_ids

    # ------------------------------------------------------------------ reshaping
    def repeat_samples(self, n: int) -> RolloutBatch:
        """Each row repeated ``n`` times in a row: [p0, p0, p1, p1, ...] for n=2 (GRPO's groups)."""
        if n == 1:
            return self
        index = torch.arange(self.num_samples).repeat_interleave(n)  # [B*n]
        return self[index]

    def model_input_fields(self) -> tuple[str, ...]:
        """The fields a forward pass over prompt + response needs (and the multi-turn attention mask)."""
        base: tuple[str, ...] = ("prompts", "prompt_mask", "responses", "response_mask")
        base += ("response_attention_mask",) if self.response_attention_mask is not None else ()
        base += ("routed_experts",) if self.routed_experts is not None else ()  # routing replay
        return base + self.image_fields()

    def image_fields(self) -> tuple[str, ...]:
        """``("multi_modal_inputs",)`` when the rows carry images (every pass over the prompts needs them)."""
        return ("multi_modal_inputs",) if self.multi_modal_inputs is not None else ()

    def select_fields(self, *names: str) -> RolloutBatch:
        """A batch with only the named fields set (the rest None): ship less over Ray."""
        kept = {name: getattr(self, name) for name in names}
        missing = [name for name, value in kept.items() if value is None]
        if missing:
            raise ValueError(f"RolloutBatch.select_fields: fields {missing} are not set on this batch")
        prompts = kept.pop("prompts", None)
        prompt_mask = kept.pop("prompt_mask", None)
        out = RolloutBatch(
            prompts=prompts if prompts is not None else self.prompts,
            prompt_mask=prompt_mask if prompt_mask is not None else self.prompt_mask,
            batch_size=self.batch_size,
        )
        for name, value in kept.items():
            setattr(out, name, list(value) if name in NON_TENSOR_FIELDS else value)
        return out

    def update_from(self, other: RolloutBatch, *names: str) -> RolloutBatch:
        """Copy the named fields of ``other`` (same rows, same order) into this batch, in place."""
        if other.num_samples != self.num_samples:
            raise ValueError(f"update_from: {other.num_samples} rows vs {self.num_samples}")
        for name in names:
            setattr(self, name, getattr(other, name))
        return self

    def set_fields(self, values: Mapping[str, torch.Tensor]) -> RolloutBatch:
        """Set each named field to its ``[B, ...]`` value (same rows, same order), in place."""
        for name, value in values.items():
            if value.shape[0] != self.num_samples:
                raise ValueError(f"set_fields: {name} has {value.shape[0]} rows vs {self.num_samples}")
            setattr(self, name, value)
        return self


def concat(batches: Sequence[RolloutBatch]) -> RolloutBatch:
    """Concatenate batches along the sample dimension (fields set in one must be set in all)."""
    if not batches:
        raise ValueError("concat() of no batches")
    return torch.cat(list(batches), dim=0)  # type: ignore[return-value,arg-type]


def pad_to_multiple(batch: RolloutBatch, multiple: int) -> tuple[RolloutBatch, int]:
    """Pad ``batch`` by repeating its first rows until its size divides by ``multiple``.

    Returns the padded batch and the number of rows added; `unpad` removes them. Repeating real rows (not
    zeros) keeps every padded row a valid input for every role, so no worker needs a special case.
    """
    b = batch.num_samples
    pad = (-b) % multiple
    if pad == 0:
        return batch, 0
    return concat([batch, batch[padded_rows(b, multiple)[b:]]]), pad


def padded_rows(b: int, multiple: int) -> torch.Tensor:
    """``[b + pad]``: which row of a ``b``-row batch each row of its `pad_to_multiple` padding is (every
    row in order, then the first rows again)."""
    return torch.cat([torch.arange(b), torch.arange((-b) % multiple) % b])


def unpad(batch: RolloutBatch, pad: int) -> RolloutBatch:
    """Drop the ``pad`` rows that `pad_to_multiple` appended."""
    return batch if pad == 0 else batch[: batch.num_samples - pad]


def split_for_ranks(batch: RolloutBatch, world_size: int) -> tuple[list[RolloutBatch], int]:
    """Pad to a multiple of ``world_size`` and cut into equal contiguous chunks, one per DP rank. Each chunk
    owns its tensors: a slice keeps its parent's storage, and pickling a tensor (as Ray does with a call's
    arguments) writes the whole storage, so every rank would be sent the whole batch."""
    padded, pad = pad_to_multiple(batch, world_size)
    chunk = padded.num_samples // world_size
    shards = [padded[r * chunk : (r + 1) * chunk] for r in range(world_size)]
    return ([s.clone() for s in shards] if world_size > 1 else shards), pad


def gather_from_ranks(shards: Sequence[RolloutBatch], pad: int) -> RolloutBatch:
    """Inverse of `split_for_ranks`: concatenate rank outputs in rank order and drop the padding."""
    return unpad(concat(shards), pad)


def last_sampled_index(response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` position of each row's last sampled token (0 for a row with none). Multi-turn responses
    interleave observation tokens, so this is the last 1 of the mask, not the response length."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device).expand_as(response_mask)
    return torch.where(response_mask.bool(), positions, 0).max(dim=1).values  # [B]


def on_last_sampled_token(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, Tr]`` float32 zeros with each row's ``values[b]`` on its last sampled token (rows without a
    sampled token stay zero): how a sequence-level reward becomes a token-level one."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    has_tokens = response_mask.sum(-1) > 0  # [B]
    rows = torch.arange(response_mask.shape[0], device=response_mask.device)
    out[rows, last_sampled_index(response_mask)] = torch.where(has_tokens, values.float(), 0.0)
    return out
