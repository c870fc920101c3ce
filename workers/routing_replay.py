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

import torch
from torch import nn


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers, in layer order (one per sparse block)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


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
            ids = expert_ids[:, layer].to(own.device, torch.long)  # [T, k]
            if ids.shape != own.shape:
                raise ValueError(
                    f"replay_routing: {ids.shape[0]} tokens x top-{ids.shape[1]} replayed into a forward of "
                    f"{own.shape[0]} tokens x top-{own.shape[1]} (router {layer})"
                )
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # [T, E]
            weights = probs.gather(-1, ids)  # [T, k]
            if getattr(router, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
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
