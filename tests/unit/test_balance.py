"""Token-budget micro-batches and rank balancing (fusedrl.balance) on hand-made lengths, and the config
checks of dynamic batch size (a budget must hold one whole sequence)."""

from __future__ import annotations

import pytest
import torch
from verl_lines import problems_of as _problems

from fusedrl.balance import (
    apply_order,
    balanced_rank_order,
    rank_token_loads,
    sequence_lengths,
    token_budget_bins,
)
from fusedrl.batch import RolloutBatch, split_for_ranks
from fusedrl.config import load_config


def _check_partition(bins: list[list[int]], lengths: list[int], budget: int) -> None:
    rows = [i for b in bins for i in b]
    assert sorted(rows) == list(range(len(lengths))), "every row exactly once"
    assert all(b for b in bins), "no empty micro-batch"
    for b in bins:
        assert sum(lengths[i] for i in b) <= budget, (b, [lengths[i] for i in b], budget)
        assert b == sorted(b), "rows keep their order inside a micro-batch"


# ---------------------------------------------------------------------- token_budget_bins
def test_bins_hand_made():
    lengths = [7, 3, 5, 2, 9, 1]  # total 27
    bins = token_budget_bins(lengths, 10)
    _check_partition(bins, lengths, 10)
    # ceil(27 / 10) = 3 bins. Longest first into the least loaded: 9 | 7 | 5, then 3 -> the 5 (8),
    # 2 -> the 7 (9), 1 -> the 8 (9): loads 9, 9, 9.
    assert bins == [[4], [0, 3], [1, 2, 5]]


def test_bins_add_a_bin_when_the_greedy_fill_overflows():
    # total 18, budget 6: the volume bound says 3 bins, but no two 4s share a bin, so 4 are needed.
    lengths = [4, 4, 4, 4, 2]
    bins = token_budget_bins(lengths, 6)
    _check_partition(bins, lengths, 6)
    assert len(bins) == 4


def test_bins_everything_fits_in_one():
    assert token_budget_bins([3, 1, 2], 100) == [[0, 1, 2]]


def test_bins_one_row_each_when_every_row_fills_the_budget():
    lengths = [5, 5, 5]
    assert sorted(token_budget_bins(lengths, 5)) == [[0], [1], [2]]


def test_bins_min_bins_is_honoured():
    lengths = [1, 1, 1, 1]
    bins = token_budget_bins(lengths, 100, min_bins=3)
    _check_partition(bins, lengths, 100)
    assert len(bins) == 3


def test_bins_row_longer_than_budget_is_an_error():
    with pytest.raises(ValueError, match="max_token_len_per_gpu"):
        token_budget_bins([3, 12, 2], 10)


def test_bins_more_bins_than_rows_is_an_error():
    with pytest.raises(ValueError, match="non-empty"):
        token_budget_bins([1, 2], 10, min_bins=3)


@pytest.mark.parametrize("seed", range(20))
def test_bins_random_lengths(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 50, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist()
    budget = 50 + seed * 7
    bins = token_budget_bins(lengths, budget)
    _check_partition(bins, lengths, budget)
    # Never far from the volume bound: LPT is within 4/3 of optimal, plus one for the integer rounding.
    assert len(bins) <= max(1, -(-sum(lengths) * 4 // (3 * budget))) + 1


# ---------------------------------------------------------------------- balanced_rank_order
def test_rank_order_hand_made():
    # Unbalanced as given: rank 0 gets the three long rows (30 tokens), rank 1 the short ones (3).
    lengths = [10, 10, 10, 1, 1, 1]
    assert rank_token_loads(lengths, 2) == [30, 3]
    order = balanced_rank_order(lengths, 2)
    assert sorted(order) == list(range(6))
    balanced = [lengths[i] for i in order]
    assert rank_token_loads(balanced, 2) == [21, 12]  # 10+10+1 | 10+1+1: the best equal-count split
    # Rows keep their relative order inside a rank.
    assert order[:3] == sorted(order[:3]) and order[3:] == sorted(order[3:])


def test_rank_order_keeps_exact_rank_sizes_with_uneven_batch():
    lengths = [9, 1, 8, 2, 7]  # 5 rows on 2 ranks: split_for_ranks gives 3 + 2 (plus one padding row)
    order = balanced_rank_order(lengths, 2)
    assert sorted(order) == list(range(5))
    balanced = [lengths[i] for i in order]
    # 9 -> r0, 8 -> r1, 7 -> r1 (now full), 2 and 1 -> r0: 12 | 15, the best split into 3 + 2 rows.
    assert rank_token_loads(balanced, 2) == [12, 15]
    assert rank_token_loads(lengths, 2) == [18, 9]
    assert max(rank_token_loads(balanced, 2)) < max(rank_token_loads(lengths, 2))


def test_rank_order_world_size_one_is_identity():
    assert balanced_rank_order([5, 1, 3], 1) == [0, 1, 2]


@pytest.mark.parametrize("seed", range(10))
def test_rank_order_random_is_never_worse(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 200, (32,), generator=gen).tolist()
    order = balanced_rank_order(lengths, 4)
    assert sorted(order) == list(range(32))
    before, after = rank_token_loads(lengths, 4), rank_token_loads([lengths[i] for i in order], 4)
    assert sum(before) == sum(after)
    assert max(after) - min(after) <= max(lengths)  # greedy bound
    assert max(after) <= max(before)


def test_rank_order_keeps_groups_whole():
    """Four prompts x 2 samples on 2 ranks: heaviest group first onto the least-loaded rank, every group
    on one rank, loads 20+2 | 16+6."""
    lengths = [10, 10, 1, 1, 8, 8, 3, 3]
    groups = [[0, 1], [2, 3], [4, 5], [6, 7]]
    order = balanced_rank_order(lengths, 2, groups)
    assert order == [0, 1, 2, 3, 4, 5, 6, 7]
    assert rank_token_loads([lengths[i] for i in order], 2) == [22, 22]
    # Row by row: the same loads, every group split across the ranks.
    assert balanced_rank_order(lengths, 2) == [0, 2, 4, 6, 1, 3, 5, 7]


def test_rank_order_places_a_group_that_fits_nowhere_row_by_row():
    """3 groups of 2 on 2 ranks of 3 rows: the lightest group fits no rank whole after the first two."""
    lengths = [5, 5, 4, 4, 1, 1]
    order = balanced_rank_order(lengths, 2, [[0, 1], [2, 3], [4, 5]])
    # 10 -> r0, 8 -> r1; then rows 4 and 5 one by one: 4 -> r1 (load 8), 5 -> r0 (r1 is full)
    assert order == [0, 1, 5, 2, 3, 4]
    assert rank_token_loads([lengths[i] for i in order], 2) == [11, 9]


def _batch(prompt_lens: list[int], response_lens: list[int], tp: int = 5, tr: int = 4) -> RolloutBatch:
    b = len(prompt_lens)
    prompt_mask = torch.zeros(b, tp, dtype=torch.long)
    response_mask = torch.zeros(b, tr, dtype=torch.long)
    for i, (lp, lr) in enumerate(zip(prompt_lens, response_lens)):
        prompt_mask[i, tp - lp :] = 1
        response_mask[i, :lr] = 1
    prompts = torch.arange(b).unsqueeze(1).expand(b, tp) * prompt_mask  # row id on real tokens
    return RolloutBatch(
        prompts=prompts,
        prompt_mask=prompt_mask,
        responses=torch.zeros(b, tr, dtype=torch.long),
        response_mask=response_mask,
        uid=[f"u{i // 2}" for i in range(b)],
        batch_size=[b],
    )


def test_sequence_lengths_and_apply_order_move_every_field():
    batch = _batch([5, 4, 1, 1], [4, 3, 1, 1])
    assert sequence_lengths(batch) == [9, 7, 2, 2]
    assert [sum(sequence_lengths(s)) for s in split_for_ranks(batch, 2)[0]] == [16, 4]
    order = balanced_rank_order(sequence_lengths(batch), 2)
    assert order == [0, 3, 1, 2]  # 9+2 | 7+2
    moved = apply_order(batch, order)
    assert moved.field_list("uid") == ["u0", "u1", "u0", "u1"]
    assert moved.prompts[:, -1].tolist() == order  # the tensors moved with the rows
    assert [sum(sequence_lengths(s)) for s in split_for_ranks(moved, 2)[0]] == [11, 9]


# ---------------------------------------------------------------------- config validation
@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    from fusedrl.data.arithmetic import write_arithmetic_parquet
    from fusedrl.utils.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("budget_cfg")
    model = build_tiny_model(str(root / "model"))
    train, _ = write_arithmetic_parquet(str(root / "data"), n_train=8, n_test=2, seed=0)
    return [
        f"data.train_files={train}",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.name=hf",
        "data.max_prompt_length=64",
        "data.max_response_length=32",
        # GRPO with the KL loss: a reference, no critic (the tests below add the critic themselves)
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.use_kl_loss=true",
    ]


def test_budget_too_small_names_key_and_fix(base):
    problems = _problems(
        [
            *base,
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=95",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=96",  # fits exactly
            "actor_rollout_ref.actor.use_kl_loss=false",  # no reference role: its budget is not checked
        ]
    )
    assert len(problems) == 1, problems
    p = problems[0]
    assert p.startswith("`actor_rollout_ref.actor.ppo_max_token_len_per_gpu`=95")
    assert "96" in p and "use_dynamic_bsz=false" in p


def test_inherited_budgets_say_where_they_come_from(base):
    problems = _problems(
        [
            *base,
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10",
        ]
    )
    keys = sorted(p.split("`")[1] for p in problems)
    assert keys == [
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    ]
    rollout = next(p for p in problems if p.startswith("`actor_rollout_ref.rollout."))
    assert "follows `actor_rollout_ref.actor.ppo_max_token_len_per_gpu`" in rollout


def test_critic_budgets_checked_only_with_a_critic(base):
    small = ["critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=50"]
    load_config([*base, *small])  # GRPO builds no critic: nothing to check
    problems = _problems([*base, *small, "algorithm.adv_estimator=gae"])
    assert sorted(p.split("`")[1] for p in problems) == [
        "critic.forward_max_token_len_per_gpu",
        "critic.ppo_max_token_len_per_gpu",
    ]


def test_small_budget_without_dynamic_bsz_is_fine(base):
    cfg = load_config([*base, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10"])
    assert cfg.actor_rollout_ref.actor.use_dynamic_bsz is False


def test_non_integer_budget(base):
    problems = _problems(
        [
            *base,
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=lots",
        ]
    )
    assert any(p.startswith("`actor_rollout_ref.actor.ppo_max_token_len_per_gpu`='lots'") for p in problems)


def test_defaults_follow_verl(base):
    cfg = load_config(base)
    arr = cfg.actor_rollout_ref
    # Packing is `auto` (verl: true): resolved on each worker for its device (fusedrl.auto_defaults).
    assert arr.model.use_remove_padding == "auto" and cfg.critic.model.use_remove_padding == "auto"
    assert arr.actor.use_dynamic_bsz is False and arr.actor.ppo_max_token_len_per_gpu == 16384
    assert (
        arr.rollout.log_prob_max_token_len_per_gpu == 16384
        and arr.ref.log_prob_max_token_len_per_gpu == 16384
    )
    assert cfg.critic.forward_max_token_len_per_gpu == cfg.critic.ppo_max_token_len_per_gpu == 32768
    assert cfg.trainer.balance_batch is True
    on = load_config(
        [
            *base,
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.model.use_remove_padding=true",
        ]
    )
    assert on.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz is True
    assert on.actor_rollout_ref.ref.log_prob_use_dynamic_bsz is True and on.critic.use_dynamic_bsz is True
    assert on.critic.model.use_remove_padding is True


@pytest.mark.parametrize(
    ("setting", "resolved", "packed"),
    [
        ("true", {}, True),
        ("false", {}, False),
        ("auto", {}, True),
        ("auto", {"use_remove_padding": False}, False),
    ],
)
def test_trainer_keeps_a_prompts_samples_on_one_rank_when_packed_rows_share_it(
    base, setting, resolved, packed
):
    """`PPOTrainer.balance_batch` with shared prompts in packed rows keeps each uid's rows on one rank;
    padded, it balances row by row (groups may split). ``auto`` reads what the workers resolved; unresolved it
    counts as packed (keeping a prompt's rows together is right either way)."""
    from types import SimpleNamespace

    from fusedrl.role_config import run_config
    from fusedrl.trainer.ppo_trainer import PPOTrainer

    cfg = load_config([*base, f"actor_rollout_ref.model.use_remove_padding={setting}"])
    assert cfg.actor_rollout_ref.model.share_prompt_prefix is True  # the default
    batch = _batch([5, 5, 1, 1, 4, 4, 2, 2], [4, 4, 1, 1, 4, 4, 1, 1])  # uids u0 u0 u1 u1 u2 u2 u3 u3
    settings = {f"actor_rollout_ref.model.{k}": v for k, v in resolved.items()}  # what the workers reported
    trainer = SimpleNamespace(
        run=run_config(cfg),
        workers=SimpleNamespace(world_size=2),
        groups=SimpleNamespace(auto_settings=settings),
    )
    metrics: dict = {}
    out = PPOTrainer.balance_batch(trainer, batch, metrics)
    uids = out.field_list("uid")
    split = set(uids[:4]) & set(uids[4:])
    assert (not split) if packed else split == {"u0", "u1", "u2", "u3"}
    assert metrics["balance/max_over_mean_rank_tokens"] == pytest.approx(1.0)  # 18 | 18 either way


def test_rank_order_keeps_rows_home_where_that_balances_as_well():
    """Rows that stay on the rank that generated them (``home``) are left there when that placement is as
    balanced as balancing makes it (within `LOCALITY_SLACK`): no row moves, no export."""
    lengths = [10, 10, 1, 1, 8, 8, 3, 3]  # groups [0,1] [2,3] on rank 0 (22), [4,5] [6,7] on rank 1 (22)
    groups = [[0, 1], [2, 3], [4, 5], [6, 7]]
    home = [0, 0, 0, 0, 1, 1, 1, 1]
    assert balanced_rank_order(lengths, 2, groups, home) == list(range(8))
    # Generated the other way round (rank 0 holds groups 0 and 2: 36 vs 8 tokens): one swap of equal-sized
    # groups gives 22 | 22, the balanced peak. The first swap found that lowers the peak most: group 0 (20)
    # for group 3 (6); groups 2 and 1 stay home, 4 of 8 rows move.
    home = [0, 0, 1, 1, 0, 0, 1, 1]
    order = balanced_rank_order(lengths, 2, groups, home)
    assert order == [4, 5, 6, 7, 0, 1, 2, 3]  # rank 0: groups 2 and 3; rank 1: groups 0 and 1
    assert rank_token_loads([lengths[i] for i in order], 2) == [22, 22]
    assert sum(home[row] != rank for rank, rows in enumerate((order[:4], order[4:])) for row in rows) == 4


def test_rank_order_home_never_balances_worse_than_the_slack():
    """Random groups and homes: whatever the home placement, the fullest rank carries at most
    `LOCALITY_SLACK` more than without ``home``; rows of a split group or a placement of other sizes balance
    as without ``home``."""
    from fusedrl.balance import LOCALITY_SLACK

    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(20, 90, (64,), generator=gen).tolist()
        groups = [list(range(i, i + 4)) for i in range(0, 64, 4)]
        home = [g // 8 for g in range(16) for _ in range(4)]  # ranks 0, 1 got 8 groups each, in order
        perm = torch.randperm(16, generator=gen).tolist()
        home = [home[4 * perm[i // 4]] for i in range(64)]  # groups' homes shuffled, 8 per rank
        plain = balanced_rank_order(lengths, 2, groups)
        near = balanced_rank_order(lengths, 2, groups, home)
        assert sorted(near) == list(range(64))
        peak = max(rank_token_loads([lengths[i] for i in plain], 2))
        assert max(rank_token_loads([lengths[i] for i in near], 2)) <= peak * (1 + LOCALITY_SLACK)
        for rows in (near[:32], near[32:]):  # groups whole
            assert {r // 4 for r in rows} == {g for g in range(16) if all(r in rows for r in groups[g])}
    lengths = [5, 1, 5, 1]
    assert balanced_rank_order(lengths, 2, [[0, 1], [2, 3]], [0, 1, 1, 1]) == balanced_rank_order(
        lengths, 2, [[0, 1], [2, 3]]
    )  # group 0 on two ranks: no home placement
    assert balanced_rank_order(lengths, 2, None, [0, 0, 0, 1]) == balanced_rank_order(lengths, 2)  # 3 + 1
