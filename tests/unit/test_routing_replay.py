"""Routing replay, the trainer half (`fusedrl.workers.routing_replay`), on the tiny random Qwen3-MoE.

Replaying a model's own routing changes nothing; replaying other experts gives, on a sparse block, exactly
the hand-built mixture of those experts weighted by the router's renormalised probabilities, gradients to
the router included; the mismatch statistic counts the (token, layer) pairs routed otherwise.
"""

from __future__ import annotations

import pytest
import torch

from fusedrl.workers.routing_replay import own_routing, replay_routing, routers


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from fusedrl.utils.tiny_moe import build_tiny_moe_model

    path = build_tiny_moe_model(str(tmp_path_factory.mktemp("tiny_moe")), seed=0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _ids() -> torch.Tensor:
    return torch.tensor([[5, 17, 33, 9, 41, 2, 77, 64, 12, 3]])  # [1, T]


def test_replaying_the_models_own_routing_changes_nothing(moe):
    chosen, handles = own_routing(moe)
    with torch.no_grad():
        plain = moe(input_ids=_ids()).logits
    for h in handles:
        h.remove()
    own = torch.stack(chosen, dim=1)  # [T, layers, k]
    stats: dict = {}
    with torch.no_grad(), replay_routing(moe, own, stats):
        replayed = moe(input_ids=_ids()).logits
    assert torch.equal(plain, replayed) and stats["routing_mismatch"] == 0.0
    assert not routers(moe)[0]._forward_hooks  # the hooks are gone after the block


def test_replayed_experts_give_the_hand_built_mixture_and_its_router_gradient(moe):
    block = moe.model.layers[0].mlp
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 6, moe.config.hidden_size, generator=gen)  # [1, T, H]
    n_exp, k = moe.config.num_experts, moe.config.num_experts_per_tok
    with torch.no_grad():
        _, _, own = block.gate(x.view(-1, x.shape[-1]))  # [T, k]
    forced = (own + 3) % n_exp  # other experts for every token
    assert not (forced.sort(-1).values == own.sort(-1).values).all(-1).any()

    stats: dict = {}
    with replay_routing(block, forced[:, None, :], stats):
        out = block(x)  # [1, T, H]
    out.square().sum().backward()
    got_grad = block.gate.weight.grad.clone()
    block.zero_grad()

    # by hand: softmax over all experts, the forced ones' probabilities renormalised, each expert's SwiGLU
    h = x.view(-1, x.shape[-1])  # [T, H]
    probs = torch.softmax(h @ block.gate.weight.T, dim=-1)  # [T, E]
    w = probs.gather(-1, forced)
    w = w / w.sum(-1, keepdim=True)  # [T, k]
    experts = block.experts
    rows = []
    for t in range(h.shape[0]):
        acc = torch.zeros(h.shape[-1])
        for j in range(k):
            e = int(forced[t, j])
            gate, up = (experts.gate_up_proj[e] @ h[t]).chunk(2)
            acc = acc + w[t, j] * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
        rows.append(acc)
    want = torch.stack(rows).view_as(out)
    want.square().sum().backward()
    assert torch.allclose(out, want, atol=1e-6, rtol=1e-5)
    assert got_grad.abs().sum() > 0
    assert torch.allclose(got_grad, block.gate.weight.grad, atol=1e-6, rtol=1e-5)
    assert stats["routing_mismatch"] == 1.0
    block.zero_grad()


def test_wrong_shapes_are_refused(moe):
    with (
        pytest.raises(ValueError, match="2 routers"),
        replay_routing(moe, torch.zeros(10, 1, 2, dtype=torch.long)),
    ):
        pass
    with (
        pytest.raises(ValueError, match="for a forward of 10 tokens"),
        torch.no_grad(),
        replay_routing(moe, torch.zeros(7, 2, 2, dtype=torch.long)),
    ):
        moe(input_ids=_ids())
