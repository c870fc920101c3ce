"""Multi-turn responses interleave sampled tokens (response_mask 1) with observation tokens (mask 0, still
attended to). Hand-computed checks that GAE, KL (in reward), entropy / loss aggregation and the policy loss
ignore observation tokens, that the outcome reward sits on the last sampled token, and that the model input
attends to observation tokens with consecutive positions."""

from __future__ import annotations

import pytest
import torch

from fusedrl.agent import STAT_NAMES
from fusedrl.agent.rewards import add_agent_rewards, agent_metrics
from fusedrl.algorithms.advantages import compute_gae_advantage
from fusedrl.algorithms.kl_control import apply_kl_in_reward
from fusedrl.algorithms.losses import agg_loss, vanilla_policy_loss
from fusedrl.balance import sequence_lengths
from fusedrl.batch import RolloutBatch, last_sampled_index

MASK = torch.tensor([[1, 1, 0, 0, 1, 0]])  # sampled, sampled, observation x2, sampled, padding
GARBAGE = 1e3  # values / log-probs on observation positions that would dominate any sum they entered


def test_gae_skips_observation_tokens():
    values = torch.tensor([[0.5, -0.2, GARBAGE, GARBAGE, 0.3, GARBAGE]])
    rewards = torch.tensor([[0.0, 0.0, GARBAGE, GARBAGE, 1.0, 0.0]])
    gamma, lam = 0.9, 0.8
    _, returns = compute_gae_advantage(rewards, MASK, values=values, gamma=gamma, lam=lam)
    # By hand on the sampled tokens only (t = 0, 1, 4), the episode ending after t = 4:
    a4 = 1.0 - 0.3  # 0.7
    a1 = (0.0 + gamma * 0.3 + 0.2) + gamma * lam * a4  # 0.974
    a0 = (0.0 + gamma * -0.2 - 0.5) + gamma * lam * a1  # 0.02128
    expected = torch.tensor([[a0 + 0.5, a1 - 0.2, 0.0, 0.0, a4 + 0.3, 0.0]])
    torch.testing.assert_close(returns, expected, atol=1e-6, rtol=0)


def test_kl_in_reward_ignores_observation_tokens():
    scores = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    log_probs = torch.tensor([[-1.0, -2.0, GARBAGE, GARBAGE, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.5, -GARBAGE, -GARBAGE, -1.25, 0.0]])
    rewards, mean_kl = apply_kl_in_reward(scores, log_probs, ref, MASK, beta=0.1, kind="kl")
    assert mean_kl == pytest.approx((0.5 + 0.5 + 0.25) / 3, abs=1e-6)
    expected = torch.tensor([[-0.05, -0.05, 0.0, 0.0, 1.0 - 0.025, 0.0]])
    torch.testing.assert_close(rewards, expected, atol=1e-6, rtol=0)


def test_entropy_kl_loss_aggregation_ignores_observation_tokens():
    per_token = torch.tensor([[1.0, 2.0, GARBAGE, GARBAGE, 3.0, GARBAGE]])  # entropy or KL per token
    assert float(agg_loss(per_token, MASK, "token-mean")) == pytest.approx(2.0)
    assert float(agg_loss(per_token, MASK, "seq-mean-token-mean")) == pytest.approx(2.0)


def test_policy_loss_equals_loss_without_observation_tokens():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(1, 6, generator=gen)
    new = old + 0.3 * torch.randn(1, 6, generator=gen)
    new[0, 2:4] = GARBAGE  # a ratio of e^1000 on observation tokens
    adv = torch.randn(1, 6, generator=gen)
    keep = MASK[0].bool()
    loss, _ = vanilla_policy_loss(new, old, adv, MASK)
    ref, _ = vanilla_policy_loss(new[:, keep], old[:, keep], adv[:, keep], torch.ones(1, int(keep.sum())))
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=0)


def test_outcome_reward_on_last_sampled_token():
    # Trailing observation tokens (attended, not sampled) must not receive the reward.
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert last_sampled_index(mask).tolist() == [3, 0]
    stats = torch.zeros(2, len(STAT_NAMES))
    stats[:, STAT_NAMES.index("reward")] = torch.tensor([1.5, 2.0])
    out = add_agent_rewards(torch.zeros(2, 6), mask, stats)
    assert out.tolist() == [[0, 0, 0, 1.5, 0, 0], [0] * 6]  # a row without sampled tokens gets nothing
    stats[:, STAT_NAMES.index("tool_calls")] = torch.tensor([3.0, 1.0])
    m = agent_metrics(stats)
    assert m["agent/tool_calls/total"] == 4.0 and m["agent/reward/mean"] == 1.75


def test_model_input_attends_to_observation_tokens():
    batch = RolloutBatch(
        prompts=torch.tensor([[0, 5, 6]]),
        prompt_mask=torch.tensor([[0, 1, 1]]),
        responses=torch.tensor([[7, 8, 9, 10, 11, 0]]),
        response_mask=MASK,
        batch_size=[1],
    )
    batch.response_attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    ids, attn, pos = batch.sequences()
    assert attn.tolist() == [[0, 1, 1, 1, 1, 1, 1, 1, 0]]
    assert pos[0, 1:8].tolist() == list(range(7))  # observation tokens keep consecutive positions
    assert sequence_lengths(batch) == [7]  # token budgets count what is computed on
    assert batch.model_input_fields()[-1] == "response_attention_mask"
    single = batch.select_fields("prompts", "prompt_mask", "responses", "response_mask")
    assert single.model_input_fields() == ("prompts", "prompt_mask", "responses", "response_mask")


def test_packed_forward_layout_with_observation_tokens():
    from fusedrl.workers.packing import pack_batch

    batch = RolloutBatch(
        prompts=torch.tensor([[0, 5, 6], [4, 5, 6]]),
        prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        responses=torch.tensor([[7, 8, 9, 10, 11, 0], [12, 13, 0, 0, 0, 0]]),
        response_mask=torch.cat([MASK, torch.tensor([[1, 1, 0, 0, 0, 0]])]),
        batch_size=[2],
    )
    batch.response_attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]])
    packed = pack_batch(batch)
    assert packed.input_ids[0].tolist() == [5, 6, 7, 8, 9, 10, 11, 4, 5, 6, 12, 13]
    # Each sampled target is predicted from the token just before it, observation tokens included.
    assert packed.targets.tolist() == [7, 8, 11, 12, 13]
    assert packed.pred_index.tolist() == [1, 2, 5, 9, 10]


def test_dataset_agent_name_column_and_tools_in_template(tiny_model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from fusedrl.data.dataset import RLDataset

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = (
        "{% if tools %}{{ '<|im_start|>system\\n' + tools[0]['function']['name'] + '<|im_end|>\\n' }}{% endif %}"
        + tok.chat_template
    )
    rows = [
        dict(
            data_source="d",
            prompt=[{"role": "user", "content": "hi"}],
            reward_model={"ground_truth": "1"},
            agent_name=a,
        )
        for a in ("tool", None)
    ]
    path = str(tmp_path / "rows.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    schema = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    ds = RLDataset(path, tok, 64, tools=[schema], keep_messages=True)
    assert ds[0]["extra_info"]["agent_name"] == "tool" and "agent_name" not in ds[1]["extra_info"]
    assert ds[0]["extra_info"]["raw_prompt"] == [{"role": "user", "content": "hi"}]
    assert tok.decode(ds[0]["prompt_ids"]).startswith("<|im_start|>system\nlookup<|im_end|>")
    plain = RLDataset(path, tok, 64)
    assert "raw_prompt" not in plain[0]["extra_info"] and "lookup" not in tok.decode(plain[0]["prompt_ids"])
