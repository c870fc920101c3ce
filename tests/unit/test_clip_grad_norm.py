"""`fusedrl.workers.optim_step.clip_grad_norm` on FSDP2's sharded gradients equals PyTorch's DTensor path.

Two gloo ranks hold two copies of one FSDP2-wrapped model (shards of uneven sizes, one of them empty on
rank 1) with the same gradients; one copy is clipped by ``torch.nn.utils.clip_grad_norm_`` (the DTensor
path, its norm read with ``full_tensor()``), the other by the local-shard path. The norms and every clipped
gradient shard must be equal bit for bit (the same operations in the same order), with the clip active,
inactive, and with a non-finite gradient, after which `GuardedStepper` skips the step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp
from support import free_port, gloo_rank
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    # weights [7, 5] / [3, 7] / [1, 3]: shards of 4 + 3, 2 + 1 and 1 + 0 rows over two ranks
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 1))


def _sharded_pair(rank: int) -> tuple[nn.Module, nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    models = []
    for _ in range(2):
        model = _model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        torch.manual_seed(1 + rank)  # each rank its own data; both copies the same
        x = torch.randn(6, 5)
        (model(x) * 3.0).pow(2).sum().backward()
        models.append(model)
    return models[0], models[1]


def _shards(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.to_local() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _check(rank: int) -> None:
    from torch.distributed.tensor import DTensor

    from fusedrl.workers.optim_step import GuardedStepper, clip_grad_norm

    for max_norm in (0.05, 1e6):  # clipped / untouched
        reference, local = _sharded_pair(rank)
        assert all(isinstance(p.grad, DTensor) for p in local.parameters())
        assert any(p.grad.to_local().numel() == 0 for p in local.parameters()) == (rank == 1)
        before = [g.clone() for g in _shards(local)]
        assert _same(before, _shards(reference))
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm).full_tensor()
        original = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = None  # the local path must not fall back to it
        try:
            norm = clip_grad_norm(local.parameters(), max_norm)
        finally:
            torch.nn.utils.clip_grad_norm_ = original
        assert not isinstance(norm, DTensor)
        assert norm.item() == expected.item(), (norm.item(), expected.item())
        assert _same(_shards(local), _shards(reference))
        assert _same(_shards(local), before) == (max_norm > 1)  # the clip did (not) change them
        if max_norm < 1:
            assert expected.item() > 1.0  # the clip was active: the norm far above 0.05

    # A non-finite gradient on one rank: both paths report the same non-finite norm everywhere, and the
    # stepper skips the step (parameters unchanged, gradients dropped, the skip counted).
    reference, local = _sharded_pair(rank)
    if rank == 0:
        for model in (reference, local):
            next(model.parameters()).grad.to_local()[0, 0] = float("inf")
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).full_tensor()
    stepper = GuardedStepper(local, torch.optim.SGD(local.parameters(), lr=1.0), 1.0)
    params = [p.to_local().clone() for p in local.parameters()]
    value = stepper()
    assert math.isinf(value) and math.isinf(expected.item())
    assert stepper.num_skipped == 1 and stepper.consecutive_skipped == 1
    assert _same([p.to_local() for p in local.parameters()], params)
    assert all(p.grad is None for p in local.parameters())

    # A finite step through the stepper: the reported norm is the DTensor path's, the step is taken.
    reference, local = _sharded_pair(rank)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05).full_tensor()
    stepper = GuardedStepper(local, torch.optim.SGD(local.parameters(), lr=1.0), 0.05)
    assert stepper() == expected.item() and stepper.num_skipped == 0


def test_local_shard_clip_equals_dtensor_clip_on_two_ranks():
    mp.spawn(gloo_rank, args=(2, free_port(), _check, ()), nprocs=2, join=True)


@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_plain_gradients_take_pytorchs_path(max_norm):
    reference, local = _model(), _model()
    for model in (reference, local):
        model(torch.randn(4, 5, generator=torch.Generator().manual_seed(3))).pow(2).sum().backward()
    from fusedrl.workers.optim_step import clip_grad_norm

    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    assert clip_grad_norm(local.parameters(), max_norm).item() == expected.item()
    assert _same([p.grad for p in local.parameters()], [p.grad for p in reference.parameters()])
