"""The rollout interface shared by every engine, and the padding that turns samples into a batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fusedrl.batch import RolloutBatch
from fusedrl.sampling import SampleParams  # re-exported: the engines' adapters import it from here

if TYPE_CHECKING:
    from fusedrl.agent import TurnSampling
    from fusedrl.role_config import RolloutConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingConfig:
    """Sampling controls of one generate call (train: ``rollout.*``; validation: ``rollout.val_kwargs``)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    log_probs: bool = True  # False: the rollout answers no ``rollout_log_probs`` (None)


def turn_sampling(sampling: SamplingConfig, *, stop_token_id: int) -> TurnSampling:
    """One generate call's `SamplingConfig` as the agent runner's sampling of every turn (greedy:
    temperature 0)."""
    from fusedrl.agent import TurnSampling

    return TurnSampling(
        temperature=sampling.temperature if sampling.do_sample else 0.0,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        stop_token_id=stop_token_id,
        log_probs=sampling.log_probs,
    )


def sample_params(sampling: SamplingConfig, *, stop_token_id: int) -> SampleParams:
    """One generate call's `SamplingConfig` as request parameters (greedy: temperature 0)."""
    return SampleParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature if sampling.do_sample else 0.0,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        stop_token_ids=(stop_token_id,),
        log_probs=sampling.log_probs,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineContext:
    """What the fused worker gives an engine's ``build`` function (`fusedrl.workers.rollout.registry`)."""

    cfg: RolloutConfig  # actor_rollout_ref.rollout
    model_path: str
    seed: int  # one per rollout (data-parallel) group: the ranks of one TP engine sample alike
    max_model_len: int  # prompt + response budget
    max_response_length: int
    eos_token_id: int
    pad_token_id: int
    actor_module: Any = None  # the actor's FSDP2 module, for an engine that `shares_actor_module`
    vision_token_ids: tuple[int, ...] = ()  # a vision-language model's (its prompts carry images)


def rollout_dtype(name: str, *, cuda: bool) -> str:
    """The engine dtype for ``rollout.dtype``: ``auto`` is bfloat16 on CUDA (its attention kernels need
    16-bit floats) and float32 on CPU (exact rollout-vs-actor agreement, and CPUs without native bf16
    emulate it slowly); anything else is used as given."""
    if name in ("auto", "None", "null", ""):
        return "bfloat16" if cuda else "float32"
    return name


def log_prob_gap_bound(dtypes: set[str]) -> float | None:
    """The bound on mean |rollout - actor| log-prob that float error alone stays far below, for the dtypes
    the two sides compute in (``float32`` / ``bfloat16``): float32 on both agrees to ~1e-5 (bound 1e-3); bf16
    on either side rounds logits to 8 mantissa bits, measured ~1e-3 to 2e-2 (bound 0.1); None for others."""
    if dtypes == {"float32"}:
        return 1e-3
    if dtypes <= {"float32", "bfloat16"}:
        return 0.1
    return None


class Rollout(Protocol):
    """What the fused worker needs of a rollout engine (its adapter; `fusedrl.workers.rollout.registry`
    says what each can do). ``generate`` fills ``responses`` / ``response_mask`` / ``rollout_log_probs``
    [B, Tr] of the batch's rows; ``update_weights`` takes the actor's full tensors in Hugging Face names and
    the engine's `param_dtype` (``partial``: only some modules, the rest kept); ``weights_discarded`` says
    the next stream must be complete (a level-2 sleep)."""

    def generate(self, batch: RolloutBatch, sampling: SamplingConfig) -> RolloutBatch: ...

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        reset_prefix_cache: bool = True,
        partial: bool = False,
    ) -> None: ...

    def param_dtype(self) -> torch.dtype: ...

    @property
    def weights_discarded(self) -> bool: ...

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None: ...

    def reset_prefix_cache(self) -> None: ...


class RequestEngine(Protocol):
    """An engine that takes requests one at a time (the ``request_queue`` trait; a rollout's ``engine``):
    the agent loops queue each turn and collect finished ones; a request can be paused half-way. ``step`` advances every queued request and
    returns those that finished: ``(request_id, token_ids, log_probs, finish_reason)``, ``finish_reason``
    ``"stop"`` (a stop token, included) or ``"length"``."""

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SampleParams) -> None: ...

    def step(self) -> list[tuple[str, list[int], list[float], str]]: ...

    def num_unfinished(self) -> int: ...

    def pause(self, request_ids: Sequence[str] | None = None) -> list[tuple[str, list[int], list[float]]]:
        """Stop unfinished requests (these, or all) and return ``(request_id, token_ids, log_probs)`` of
        what each sampled so far; they leave the engine. A request resumes as a new one whose prompt
        ends with those tokens (partial rollout)."""
        ...


def unpadded_prompts(batch: RolloutBatch) -> list[list[int]]:
    """Prompt ids without their left padding."""
    return [row[mask.bool()].tolist() for row, mask in zip(batch.prompts, batch.prompt_mask)]


def attach_responses(
    batch: RolloutBatch,
    samples: Sequence[tuple[Sequence[int], Sequence[float]]],
    *,
    max_response_length: int,
    pad_token_id: int,
    log_probs: bool = True,
) -> RolloutBatch:
    """Right-pad ``(token_ids, log_probs)`` samples to ``[B, Tr]`` and set them on ``batch``; ``log_probs``
    False: the engine computed none, ``rollout_log_probs`` is None."""
    b = batch.num_samples
    responses = torch.full((b, max_response_length), pad_token_id, dtype=torch.long)  # [B, Tr]
    response_mask = torch.zeros((b, max_response_length), dtype=torch.long)  # [B, Tr]
    values = torch.zeros((b, max_response_length), dtype=torch.float32)  # [B, Tr]
    for i, (ids, lps) in enumerate(samples):
        n = min(len(ids), max_response_length)
        responses[i, :n] = torch.as_tensor(list(ids[:n]), dtype=torch.long)
        response_mask[i, :n] = 1
        if log_probs:
            values[i, :n] = torch.as_tensor(list(lps[:n]), dtype=torch.float32)
    batch.responses = responses
    batch.response_mask = response_mask
    batch.rollout_log_probs = values if log_probs else None
    return batch


class EngineRollout:
    """The `Rollout` of any engine that samples token ids one request at a time (a `RequestEngine` with the
    weight and memory calls): single-turn generation is the one-turn agent loop (`fusedrl.agent.SingleTurnLoop`)
    run by `fusedrl.agent.AgentRunner` on the engine's request queue, every row's request queued before the
    engine's first step, each with its row's seed; responses right-padded to ``max_response_length``
    (``data.max_response_length``). vLLM's and the fake engine's adapters build one around their engine.
    That gives the tokens and log-probs of one batch ``engine.generate(prompts, params, seeds)`` call, bit for
    bit (`tests/integration/test_engine_contract.py`)."""

    def __init__(
        self,
        engine: Any,
        *,
        max_response_length: int,
        eos_token_id: int,
        pad_token_id: int,
        vision_token_ids: Sequence[int] = (),
    ) -> None:
        from fusedrl.agent import AgentRunner, MultiTurnConfig, ToolSet

        self.engine = engine
        self.vision_token_ids = tuple(vision_token_ids)
        self.max_response_length = int(max_response_length)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        # No renderer: a one-turn loop reads no text. Tool threads start only when a call is made (never).
        self.runner = AgentRunner(engine, None, ToolSet(), MultiTurnConfig(default_agent_name="single_turn"))

    def generate(self, batch: RolloutBatch, sampling: SamplingConfig) -> RolloutBatch:
        if batch.multi_modal_inputs is not None:
            return self._generate_on_images(batch, sampling)
        seeds = batch.sample_seeds.tolist() if batch.sample_seeds is not None else [None] * batch.num_samples
        rows = [{"prompt_ids": ids, "seed": seed} for ids, seed in zip(unpadded_prompts(batch), seeds)]
        trajs = self.runner.run(
            rows,
            turn_sampling(sampling, stop_token_id=self.eos_token_id),
            max_response_length=min(sampling.max_tokens, self.max_response_length),
        )
        return attach_responses(
            batch,
            [(t.response_ids, t.log_probs) for t in trajs],
            max_response_length=self.max_response_length,
            pad_token_id=self.pad_token_id,
            log_probs=sampling.log_probs,
        )

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        reset_prefix_cache: bool = True,
        partial: bool = False,
    ) -> None:
        self.engine.update_weights(named_tensors, reset_prefix_cache=reset_prefix_cache, partial=partial)

    def _generate_on_images(self, batch: RolloutBatch, sampling: SamplingConfig) -> RolloutBatch:
        """Rows with images (``multi_modal_inputs``): one batch ``engine.generate`` call given each row's
        images (what the one-turn loop equals bit for bit on text), then each response ends before its first
        sampled vision token (`fusedrl.workers.vision.cut_at_vision_tokens`)."""
        from fusedrl.workers.vision import cut_at_vision_tokens

        params = sample_params(sampling, stop_token_id=self.eos_token_id)
        params = dataclasses.replace(params, max_tokens=min(sampling.max_tokens, self.max_response_length))
        seeds = batch.sample_seeds.tolist() if batch.sample_seeds is not None else None
        images = [row.images[0] for row in batch.field_list("multi_modal_inputs")]  # each row: its images
        samples = self.engine.generate(unpadded_prompts(batch), params, seeds, images=images)
        batch = attach_responses(
            batch,
            samples,
            max_response_length=self.max_response_length,
            pad_token_id=self.pad_token_id,
            log_probs=sampling.log_probs,
        )
        return cut_at_vision_tokens(batch, self.vision_token_ids, self.pad_token_id)

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
