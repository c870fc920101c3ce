"""The ``fake`` rollout engine: a copy of the policy sampled token by token with plain PyTorch.

The seam's reference engine. It keeps the contract the fused worker relies on the way vLLM does, without
vLLM: its own copy of the weights in the engine dtype (so the actor's updates reach it only through the
weight stream), Hugging Face names in that stream, a full stream checked for completeness, log-probs of the
sampling distribution (after temperature, top-k and top-p, as vLLM's ``processed_logprobs``), one sampling
seed per request, requests taken one at a time (``submit`` / ``step``, what agent loops use), and sleep
levels: level 1 keeps the weights, level 2 makes them garbage (NaN) until the next full stream. It refuses
to generate while asleep or with discarded weights, where vLLM would silently sample garbage: a driver that
forgets a wake-up or a re-stream fails loudly under it.

It is slow (one sequence at a time, no batching), so it is for tests of the seam and for models vLLM cannot
load, not for training speed. It is registered in `fusedrl.workers.rollout.registry` as ``fake``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fusedrl.workers.rollout.base import EngineContext, EngineRollout, SampleParams, rollout_dtype

_TAGS = ("weights", "kv_cache")


@dataclass
class _Request:
    """One sequence being sampled: its prompt, sampling, generator, token budget, cache and tokens so far."""

    prompt: list[int]
    params: SampleParams
    gen: torch.Generator
    budget: int
    past: Any = None
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)


def _processed_log_probs(logits: torch.Tensor, params: SampleParams) -> torch.Tensor:
    """Log-probs of the distribution a token is drawn from: logits / temperature (greedy: as they are),
    then everything outside the top-k and the top-p nucleus removed and the rest renormalised. [V]"""
    scaled = logits.float() / params.temperature if params.temperature > 0 else logits.float()
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        probs, order = torch.sort(torch.softmax(scaled, -1), descending=True)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest prefix reaching top_p
        scaled = scaled.clone()
        scaled[order[drop]] = float("-inf")
    return torch.log_softmax(scaled, -1)


class FakeEngine:
    """``model_path`` loaded in ``dtype`` on ``device``; ``seed`` seeds requests that bring none."""

    def __init__(self, model_path: str, *, dtype: str, seed: int, max_model_len: int, device: str) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model = model.to(device).eval().requires_grad_(False)  # type: ignore[arg-type]
        self.params = dict(self.model.named_parameters())  # tied weights appear once
        self.seed = int(seed)
        self.max_model_len = int(max_model_len)
        self.awake = set(_TAGS)
        self.weights_discarded = False
        self.num_prefix_cache_resets = 0
        self._queue: dict[str, _Request] = {}
        self._requests = 0

    # ------------------------------------------------------------------ generation
    def _ready(self, what: str) -> None:
        if set(_TAGS) - self.awake:
            raise RuntimeError(
                f"{what}: the engine is asleep ({sorted(set(_TAGS) - self.awake)}); wake it first"
            )
        if self.weights_discarded:
            raise RuntimeError(f"{what}: a level-2 sleep discarded the weights; stream them all first")

    def _start(self, prompt: list[int], params: SampleParams) -> _Request:
        seed = params.seed if params.seed is not None else self.seed + self._requests
        self._requests += 1
        budget = max(min(params.max_tokens, self.max_model_len - len(prompt)), 0)
        return _Request(prompt, params, torch.Generator().manual_seed(int(seed)), budget)

    @torch.no_grad()
    def _advance(self, r: _Request) -> str | None:
        """Sample ``r``'s next token; its finish reason when that ends it (None: it goes on)."""
        if len(r.ids) >= r.budget:
            return "length"
        x = torch.tensor([r.prompt if r.past is None else r.ids[-1:]], device=self.device)  # [1, T]
        out = self.model(input_ids=x, past_key_values=r.past, use_cache=True)
        r.past = out.past_key_values
        logp = _processed_log_probs(out.logits[0, -1].cpu(), r.params)  # [V]
        if r.params.temperature > 0:
            token = int(torch.multinomial(logp.exp(), 1, generator=r.gen))
        else:
            token = int(logp.argmax())
        r.ids.append(token)
        if r.params.log_probs:  # as vLLM: none at all for a request that asked for none
            r.lps.append(float(logp[token]))
        if token in r.params.stop_token_ids and not r.params.ignore_eos:
            return "stop"
        return "length" if len(r.ids) >= r.budget else None

    def _sample(self, prompt: list[int], params: SampleParams) -> tuple[list[int], list[float], str]:
        r = self._start(prompt, params)
        while (reason := self._advance(r)) is None:
            pass
        return r.ids, r.lps, reason

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        params: SampleParams,
        seeds: Sequence[int] | None = None,
    ) -> list[tuple[list[int], list[float]]]:
        """One ``(token_ids, log_probs)`` per prompt, in order; ``seeds``: one sampling seed per prompt."""
        self._ready("generate")
        out = []
        for i, prompt in enumerate(prompt_token_ids):
            p = params if seeds is None else _with_seed(params, int(seeds[i]))
            out.append(self._sample(list(prompt), p)[:2])
        return out

    # ------------------------------------------------------------------ request queue (agent loops)
    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SampleParams) -> None:
        self._ready("submit")
        self._queue[request_id] = self._start(list(prompt_token_ids), params)

    def step(self) -> list[tuple[str, list[int], list[float], str]]:
        """One token for every queued request, as vLLM's iteration; returns those that finished."""
        self._ready("step")
        finished = []
        for rid, r in list(self._queue.items()):
            reason = self._advance(r)
            if reason is not None:
                del self._queue[rid]
                finished.append((rid, r.ids, r.lps, reason))
        return finished

    def pause(self, request_ids: Sequence[str] | None = None) -> list[tuple[str, list[int], list[float]]]:
        """Stop queued requests (``request_ids``, or every one) and hand back what each sampled so far."""
        chosen = list(self._queue) if request_ids is None else list(request_ids)
        missing = [rid for rid in chosen if rid not in self._queue]
        if missing:
            raise KeyError(f"pause: not queued: {sorted(missing)}")
        unpausable = sorted(rid for rid in chosen if not self._queue[rid].params.pausable)
        if unpausable:  # vLLM keeps no tokens so far for those: refuse alike
            raise ValueError(f"pause: submitted with SampleParams(pausable=False): {unpausable}")
        return [(rid, (r := self._queue.pop(rid)).ids, r.lps) for rid in chosen]

    def num_unfinished(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ weights and memory
    @torch.no_grad()
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        reset_prefix_cache: bool = True,
        partial: bool = False,
    ) -> None:
        """Copy full tensors (Hugging Face names, any float dtype) into the engine's parameters in place; a
        stream that is not ``partial`` must write every parameter."""
        if "weights" not in self.awake:
            raise RuntimeError("update_weights: the engine's weights are asleep; wake them first")
        if partial and self.weights_discarded:
            raise RuntimeError(
                "update_weights(partial=True): a level-2 sleep discarded the engine's weights; stream them all"
            )
        written: set[int] = set()
        for name, tensor in named_tensors:
            param = self.params.get(name)
            if param is None:
                raise KeyError(f"update_weights: the engine has no parameter {name!r}")
            if param.shape != tensor.shape:
                raise ValueError(
                    f"update_weights: {name} is {tuple(tensor.shape)}, the engine's {tuple(param.shape)}"
                )
            param.copy_(tensor)
            written.add(id(param))
        missing = [n for n, p in self.params.items() if id(p) not in written]
        if not partial and missing:
            raise RuntimeError(f"update_weights: not in the weight stream: {', '.join(missing)}")
        self.weights_discarded = False
        if reset_prefix_cache:
            self.reset_prefix_cache()

    def param_dtype(self) -> torch.dtype:
        return next(iter(self.params.values())).dtype

    def reset_prefix_cache(self) -> None:
        self.num_prefix_cache_resets += 1  # nothing is cached across requests

    @torch.no_grad()
    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if level == 2 and self.awake:
            for param in self.params.values():
                param.fill_(float("nan"))
            self.weights_discarded = True
        self.awake = set()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.awake |= set(_TAGS if tags is None else tags)


def _with_seed(params: SampleParams, seed: int) -> SampleParams:
    from dataclasses import replace

    return replace(params, seed=seed)


def build(ctx: EngineContext) -> EngineRollout:
    """The ``fake`` entry of `fusedrl.workers.rollout.registry`."""
    from fusedrl.workers.fsdp import device_type

    engine = FakeEngine(
        ctx.model_path,
        dtype=rollout_dtype(str(ctx.cfg.dtype), cuda=torch.cuda.is_available()),
        seed=ctx.seed,
        max_model_len=int(ctx.cfg.max_model_len or ctx.max_model_len),
        device=device_type(),
    )
    return EngineRollout(
        engine,
        max_response_length=ctx.max_response_length,
        eos_token_id=ctx.eos_token_id,
        pad_token_id=ctx.pad_token_id,
    )
