"""Routing replay for mixture-of-experts policies: the trainer's forward uses the experts the engine chose.

The engine and the trainer compute a token's router logits with different kernels; where two experts' scores
are close, they pick different experts and the policy ratio compares two different functions. Replay (R3 in
the literature: the rollout's routing replayed in training) records each sampled token's top-k expert ids in
the engine and makes the trainer's forward send every token to those experts. This module is the trainer
half: `replay_routing` forces given expert ids into every sparse block of a model during a forward.

Which variant: the router still computes its logits over all experts and is trained; only the choice of
experts is replaced. A token's expert weights are the router's own probabilities of the replayed experts,
renormalised over them when the model normalises its top-k (``norm_topk_prob``, Qwen3-MoE's default) —
the weights the trainer's router would give had it chosen those experts, so gradients reach the router
through them as in the model's own forward.

Routers are found by class name (transformers' ``*TopKRouter`` modules of the sparse blocks, in layer
order); the ids are ``[tokens, moe_layers, top_k]`` in the order of the forward's flattened tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers, in layer order (one per sparse block)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def _layer_ids(source: torch.Tensor, layer: int, own: torch.Tensor, what: str) -> torch.Tensor:
    """Router ``layer``'s ids [T, k] of ``source`` [tokens, layers, top_k], checked against the forward's."""
    ids = source[:, layer].to(own.device, torch.long)  # [T, k]
    if ids.shape != own.shape:
        raise ValueError(
            f"{what}: {ids.shape[0]} tokens x top-{ids.shape[1]} for a forward of {own.shape[0]} tokens x "
            f"top-{own.shape[1]} (router {layer})"
        )
    return ids


def _replayed_weights(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The weights [T, k] the router gives experts ``ids``: its own probabilities of them (from ``logits``
    [T, E]), renormalised over them when the model normalises its top-k (``norm_topk_prob``)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # [T, E]
    weights = probs.gather(-1, ids)  # [T, k]
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


@contextlib.contextmanager
def replay_routing(model: nn.Module, expert_ids: torch.Tensor, stats: dict | None = None) -> Iterator[None]:
    """Within the block, every router of ``model`` sends token ``t`` of the forward to experts
    ``expert_ids[t, layer]`` ([tokens, moe_layers, top_k] integers). ``stats``, when given, receives
    ``routing_mismatch``: the fraction of (token, layer) pairs whose own top-k set differs from the replayed
    one (a forward that runs the routers more than once, e.g. activation recomputation, counts each run)."""
    found = routers(model)
    if expert_ids.dim() != 3 or expert_ids.shape[1] != len(found):
        raise ValueError(
            f"replay_routing: expert ids of shape {tuple(expert_ids.shape)} for a model with {len(found)} "
            "routers; expected [tokens, routers, top_k]"
        )
    differ = [0, 0]

    def hook(layer: int):
        def forced(router: nn.Module, args: tuple, output: tuple) -> tuple:
            logits, _, own = output  # [T, E], [T, k], [T, k]
            ids = _layer_ids(expert_ids, layer, own, "replay_routing")  # [T, k]
            weights = _replayed_weights(router, logits, ids)  # [T, k]
            with torch.no_grad():
                same = (own.sort(-1).values == ids.sort(-1).values).all(-1)  # [T]
                differ[0] += int((~same).sum())
                differ[1] += int(same.numel())
            return logits, weights.to(logits.dtype), ids

        return forced

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(found)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if stats is not None:
            stats["routing_mismatch"] = differ[0] / differ[1] if differ[1] else 0.0


def own_routing(model: nn.Module) -> tuple[list[torch.Tensor], list]:
    """A list that fills, during forwards, with each router's chosen expert ids ([tokens, top_k], in layer
    order), and the hook handles to remove: what the model routes by itself (the ids to compare or replay)."""
    chosen: list[torch.Tensor] = []
    handles = [
        r.register_forward_hook(lambda _m, _a, out: chosen.append(out[2].detach().clone()))
        for r in routers(model)
    ]
    return chosen, handles


# ---------------------------------------------------------------------- the batch's recorded experts
def not_routed(dtype: torch.dtype) -> int:
    """The value `RolloutBatch.routed_experts` holds where the engine fed no token: the dtype's largest."""
    return int(torch.iinfo(dtype).max)


def routed_dtype(num_experts: int) -> torch.dtype:
    """The compact dtype of recorded expert ids: uint8 up to 255 experts (255 marks 'not routed'), else int16."""
    return torch.uint8 if num_experts < 255 else torch.int16


@dataclass(frozen=True, slots=True)
class RoutingUse:
    """What a log-prob forward does with a batch's ``routed_experts``: ``force`` them into the routers
    (replay) and/or ``measure`` how often the routing differs from them (`MEASURED`)."""

    force: bool
    measure: bool


# Response tokens counted in measured forwards since the last `take_routing_metrics`: [tokens, whose own
# top-k differs from the engine's in some layer, whose experts used differ].
MEASURED = [0, 0, 0]


def take_routing_metrics() -> dict[str, float]:
    """The routing mismatch of the measured forwards since the last call (then reset); empty if none ran.
    ``moe/routing_mismatch``: the fraction of response tokens whose router's own top-k set differs from the
    engine's in at least one layer; ``moe/replayed_routing_mismatch``: the same for the experts the forward
    used (0 with replay, equal to the first without)."""
    tokens, own, used = MEASURED
    MEASURED[:] = [0, 0, 0]
    if not tokens:
        return {}
    return {"moe/routing_mismatch": own / tokens, "moe/replayed_routing_mismatch": used / tokens}


@contextlib.contextmanager
def routed_forward(
    model: nn.Module, recorded: torch.Tensor, counted: torch.Tensor, use: RoutingUse
) -> Iterator[None]:
    """Within the block, one forward of ``model`` over tokens whose engine routing is ``recorded``
    ([tokens, moe_layers, top_k] of `RolloutBatch.routed_experts`, in the forward's flattened token order):
    with ``use.force`` every token the engine routed goes to the engine's experts (the rest route as the
    model does), with the weights of `replay_routing`; with ``use.measure`` the ``counted`` tokens ([tokens]
    bool: the response tokens) the engine routed are added to `MEASURED`."""
    found = routers(model)
    if recorded.dim() != 3 or recorded.shape[1] != len(found):
        raise ValueError(
            f"routing replay: recorded experts of shape {tuple(recorded.shape)} for a model with {len(found)} "
            "mixture-of-experts routers; expected [tokens, routers, top_k]"
        )
    known = recorded[:, 0, 0] != not_routed(recorded.dtype)  # [T]
    own_differs = torch.zeros(recorded.shape[0], dtype=torch.bool)  # [T]
    used_differs = torch.zeros(recorded.shape[0], dtype=torch.bool)  # [T]

    def hook(layer: int):
        def route(router: nn.Module, args: tuple, output: tuple) -> tuple:
            logits, weights, own = output  # [T, E], [T, k], [T, k]
            ids = _layer_ids(recorded, layer, own, "routing replay")  # [T, k]
            forced = known.to(own.device).unsqueeze(-1) if use.force else None  # [T, 1]
            used = own if forced is None else torch.where(forced, ids, own)  # [T, k]
            with torch.no_grad():
                theirs = ids.sort(-1).values
                own_differs.logical_or_((own.sort(-1).values != theirs).any(-1).cpu() & known)
                used_differs.logical_or_((used.sort(-1).values != theirs).any(-1).cpu() & known)
            if forced is None:
                return output
            chosen = _replayed_weights(router, logits, used)  # [T, k]
            # tokens the engine did not route keep the router's own output, bit for bit
            return logits, torch.where(forced, chosen.to(weights.dtype), weights), used

        return route

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(found)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    if use.measure:
        counted = counted.cpu() & known
        MEASURED[0] += int(counted.sum())
        MEASURED[1] += int((own_differs & counted).sum())
        MEASURED[2] += int((used_differs & counted).sum())
