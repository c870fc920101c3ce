"""Expert parallelism for mixture-of-experts layers: each rank holds ``num_experts / ep`` of every sparse block's
experts, and tokens travel to the rank that holds their expert and back, by all-to-all.

Under plain FSDP2 every rank gathers a whole layer, all its experts included, to run its own tokens through
the few experts each token picks. With expert parallelism over a group of ``ep`` ranks, rank ``r`` keeps
experts ``[r * E/ep, (r + 1) * E/ep)`` for good (no gather), and a sparse block's forward is:

1. route: the block's router picks ``top_k`` experts per token, on the token's own rank (unchanged);
2. dispatch: each (token, slot) pair's hidden state goes to the rank holding its expert (``all_to_all_single``
   with per-rank split sizes; the sizes themselves are exchanged first);
3. compute: each rank runs its experts on the rows it received, from every rank;
4. combine: the outputs go back by the reverse all-to-all, and each token's ``top_k`` outputs are summed with
   the router's weights on the token's own rank, so the router's gradient is computed where the router is.

The backward of an all-to-all is the reverse all-to-all, so every gradient goes home: hidden states to the
token's rank, expert weights' gradients stay on the expert's rank, summed over every rank's tokens. The group
is the data-parallel group (each rank brings its own tokens); FSDP2 averages the other parameters' gradients
over it, so the expert gradients are averaged too (``1 / ep``): the gradient a replicated expert would get.

The experts stay ``DTensor`` parameters sharded on dim 0 over a one-dimensional mesh of the group, so
``full_tensor()`` (the weight stream to the engine, checkpoints, export) still sees the whole
``[E, 2I, H]`` / ``[E, H, I]`` tensors under their transformers names. Collectives: gloo on CPU (its
``alltoall`` takes uneven and empty splits), NCCL on GPU.

Scope: transformers 5's stacked experts (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], SwiGLU;
Qwen2-MoE, Qwen3-MoE and their kin); `shard_experts` swaps the modules in place. The roles call it from
`fusedrl.workers.fsdp.shard_for_training` when ``fsdp_config.turbo_config.distributed.expert_parallel_size`` > 1
(docs/moe.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


def stacked_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every transformers stacked-experts module (3D ``gate_up_proj`` and ``down_proj``)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)
        and isinstance(getattr(m, "down_proj", None), nn.Parameter)
        and m.gate_up_proj.dim() == 3
    ]


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``send`` sizes go to the group's ranks in order; ``recv`` rows come back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _ScaleGrad(torch.autograd.Function):
    """The identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad * ctx.scale, None


class ExpertParallelExperts(nn.Module):
    """A stacked-experts module whose experts are spread over ``mesh``: this rank holds its ``E / ep`` of them
    (`DTensor` parameters ``gate_up_proj`` / ``down_proj``, ``Shard(0)``) and runs every rank's tokens
    routed to them. Called as the module it replaces: ``(hidden [T, H], top_k_index [T, k], top_k_weights
    [T, k]) -> [T, H]``. ``last_dispatch``: the rows this rank sent to each rank in its last forward.

    ``mesh``: a one-dimensional mesh of the expert-parallel ranks. Given FSDP2's data-parallel mesh itself, the
    experts lie exactly as FSDP2 would have sharded them (dim 0 over the same ranks), so the optimizer state,
    checkpoints and the weight stream see the same tensors; FSDP2 must then leave them alone
    (`fsdp_ignored_params`)."""

    gate_up_proj: nn.Parameter  # DTensor [E, 2I, H], this rank's [E/ep, 2I, H]
    down_proj: nn.Parameter  # DTensor [E, H, I], this rank's [E/ep, H, I]
    act_fn: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, experts: nn.Module, mesh: DeviceMesh) -> None:
        super().__init__()
        if mesh.ndim != 1:
            raise ValueError(f"expert parallelism takes a one-dimensional mesh, not {mesh}")
        group = mesh.get_group()
        self.group = group
        self.ep = dist.get_world_size(group)
        full_gate_up = cast(torch.Tensor, experts.gate_up_proj)
        self.num_experts = int(full_gate_up.shape[0])
        if self.num_experts % self.ep:
            raise ValueError(
                f"expert parallelism: {self.num_experts} experts do not split over {self.ep} ranks; "
                "choose an expert-parallel size that divides num_experts"
            )
        self.local = self.num_experts // self.ep
        self.act_fn = cast(Callable[[torch.Tensor], torch.Tensor], experts.act_fn)
        self.grad_scale = 1.0 / self.ep
        first = dist.get_rank(group) * self.local
        for name in ("gate_up_proj", "down_proj"):
            full = cast(torch.Tensor, getattr(experts, name)).detach()
            mine = full[first : first + self.local].clone()  # [E/ep, ...]
            shard = DTensor.from_local(mine, mesh, [Shard(0)], shape=full.shape, stride=full.stride())
            setattr(self, name, nn.Parameter(shard, requires_grad=getattr(experts, name).requires_grad))
        self.last_dispatch: list[int] = []

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)  # [T*k] expert of each (token, slot)
        order = torch.argsort(flat, stable=True)  # [T*k] (token, slot) pairs grouped by expert
        rows = hidden_states[order // k]  # [T*k, H]
        counts = torch.bincount(flat, minlength=self.num_experts)  # [E] rows for each expert
        if counts.numel() != self.num_experts:
            raise ValueError(
                f"expert ids above {self.num_experts - 1} (a router that masks with E is not supported)"
            )
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # [ep * E/ep]: from rank s, for my e
        send = counts.view(self.ep, self.local).sum(1).tolist()  # [ep]
        recv = recv_counts.view(self.ep, self.local).sum(1).tolist()  # [ep]
        self.last_dispatch = send

        received = _AllToAll.apply(rows, send, recv, self.group)  # [N, H], by source rank, then expert
        expert_of_row = torch.arange(self.local, device=flat.device).repeat(self.ep)  # [ep * E/ep]
        expert_of_row = expert_of_row.repeat_interleave(recv_counts)  # [N] local expert of each row
        out = self._experts(received, expert_of_row)  # [N, H]
        back = _AllToAll.apply(out, recv, send, self.group)  # [T*k, H] in `order`
        per_slot = back[torch.argsort(order)].view(tokens, k, -1)  # [T, k, H]
        weighted = per_slot * top_k_weights[..., None]  # [T, k, H]
        return weighted.sum(1).to(hidden_states.dtype)  # [T, H]

    def _experts(self, x: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        """Each local expert's SwiGLU on its rows of ``x`` [N, H]. Every expert runs, on no rows too, so the
        weights are always in the graph and every rank joins the backward's all-to-all."""
        # in the computation's dtype (FSDP2's mixed precision casts the other parameters; these it ignores)
        mine = [cast(DTensor, p).to_local().to(x.dtype) for p in (self.gate_up_proj, self.down_proj)]
        gate_up = _ScaleGrad.apply(mine[0], self.grad_scale)  # [E/ep, 2I, H]
        down = _ScaleGrad.apply(mine[1], self.grad_scale)  # [E/ep, H, I]
        out = torch.zeros_like(x)  # [N, H]
        for e in range(self.local):
            idx = torch.nonzero(expert_of_row == e).squeeze(1)  # [n_e]
            gate, up = nn.functional.linear(x[idx], gate_up[e]).chunk(2, dim=-1)  # [n_e, I] each
            y = nn.functional.linear(self.act_fn(gate) * up, down[e])  # [n_e, H]
            out = out.index_add(0, idx, y.to(out.dtype))
        return out


def shard_experts(model: nn.Module, mesh: DeviceMesh | None = None) -> list[str]:
    """Replace every stacked-experts module of ``model`` by an `ExpertParallelExperts` over ``mesh`` (a 1-D
    mesh of every rank when None), in place; returns the replaced modules' names. Every rank of the mesh must
    call it, with the same (full) weights."""
    if mesh is None:
        world = dist.group.WORLD
        mesh = DeviceMesh.from_group(world, "cuda" if torch.cuda.is_available() else "cpu")
    replaced = stacked_experts(model)
    if not replaced:
        raise ValueError(f"{type(model).__name__}: no stacked experts (gate_up_proj / down_proj) to shard")
    for name, experts in replaced:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, ExpertParallelExperts(experts, mesh))
    return [name for name, _ in replaced]


def fsdp_ignored_params(module: nn.Module) -> set[nn.Parameter]:
    """The expert-parallel parameters inside ``module``: ``fully_shard(..., ignored_params=...)`` of a unit
    that holds them, so FSDP2 neither gathers them nor reduces their gradients (already averaged)."""
    return {
        p
        for m in module.modules()
        if isinstance(m, ExpertParallelExperts)
        for p in (m.gate_up_proj, m.down_proj)
    }
