"""Resident rows (`fusedrl.resident`): the driver's choice of shards and the worker's store, without Ray."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fusedrl.balance import balance_over_ranks
from fusedrl.batch import RolloutBatch, split_for_ranks
from fusedrl.controller.worker_group import tensors_in
from fusedrl.resident import ResidentShard
from fusedrl.trainer.resident import ResidentRows
from fusedrl.workers.resident_store import ResidentStore

FIELDS = ["responses", "response_mask", "rollout_log_probs"]


@dataclass
class Group:
    world_size: int


def _generated(rows: int, lengths: list[int] | None = None) -> RolloutBatch:
    b = RolloutBatch(
        prompts=torch.arange(rows * 3).view(rows, 3),
        prompt_mask=torch.ones(rows, 3, dtype=torch.long),
        batch_size=[rows],
    )
    b.responses = 100 + torch.arange(rows * 4).view(rows, 4)
    mask = torch.ones(rows, 4, dtype=torch.long)
    for i, n in enumerate(lengths or [4] * rows):
        mask[i, n:] = 0
    b.response_mask = mask
    b.rollout_log_probs = -torch.rand(rows, 4)
    b.advantages = torch.randn(rows, 4)
    b.uid = [f"u{i // 2}" for i in range(rows)]
    return b


def _stores(plan: ResidentRows, group: Group, batch: RolloutBatch, tp: int = 1) -> tuple[RolloutBatch, list]:
    """Generate ``batch`` on ``group`` as `PPOTrainer.generate` does: each engine's store keeps its shard."""
    keep = plan.request(group, tp, step=1, validate=False, fields=FIELDS)
    engines = group.world_size // tp
    shards, _ = split_for_ranks(batch, engines)
    stores = []
    for rank in range(group.world_size):
        store, shard = ResidentStore(engine=rank // tp), shards[rank // tp]
        store.keep(*keep[:2], {n: getattr(shard, n) for n in ["prompts", "prompt_mask", *FIELDS]})
        stores.append(store)
    return plan.mark(batch, keep, engines), stores


def _deliver(stores: list, exports: dict) -> None:
    """`ResidentRows.run_split`'s exports, without Ray: each source's payload fetched by its destination."""
    for source, per_rank in exports.items():
        for rank, rows in per_rank.items():
            stores[rank].fetch(stores[source].payload(rows))


def _assert_resolved_equal_sent(stores, shards, batch, names, replicas=1):
    sent, _ = split_for_ranks(batch.select_fields(*names), len(stores) // replicas)
    for rank, shard in enumerate(shards):
        resolved = stores[rank].resolve(shard)
        for name in names:
            assert torch.equal(getattr(resolved, name), getattr(sent[rank // replicas], name)), (rank, name)


def test_rows_on_their_engine_are_read_there_and_equal_the_sent_rows():
    plan, group = ResidentRows(), Group(world_size=2)
    batch, stores = _stores(plan, group, _generated(5))  # 5 rows over 2 ranks: padded with row 0
    assert batch.resident_rows.tolist() == [[1, 0, 0], [1, 0, 1], [1, 0, 2], [1, 1, 0], [1, 1, 1]]
    batch = batch[torch.tensor([0, 1, 3, 4])]  # a filter dropped row 2: each rank's rows are still its own
    names = [*batch.model_input_fields(), "advantages"]
    shards, exports = plan.shards(group, batch, names, replicas=1)
    assert exports == {} and [s.rows for s in shards] == [[(1, 0, 0), (1, 0, 1)], [(1, 1, 0), (1, 1, 1)]]
    assert shards[0].local == ("prompts", "prompt_mask", "responses", "response_mask")
    assert list(shards[0].sent) == ["advantages"]
    assert len(tensors_in(shards)) == 2  # only the advantages cross (both ranks' shards)
    _assert_resolved_equal_sent(stores, shards, batch, names)


def test_balanced_and_padded_rows_move_worker_to_worker_once():
    plan, group = ResidentRows(), Group(world_size=2)
    batch, stores = _stores(plan, group, _generated(5, lengths=[4, 4, 4, 1, 1]))
    balanced, _ = balance_over_ranks(batch, 2, reorder=True, groups_whole=False)
    assert not torch.equal(balanced.resident_rows[:, 1], batch.resident_rows[:, 1])  # rows changed rank
    names = list(balanced.model_input_fields())
    shards, exports = plan.shards(group, balanced, names, replicas=1, keep="ref_log_probs")
    moved = {(s, d): rows for s, per in exports.items() for d, rows in per.items()}
    assert moved and all(s != d for s, d in moved)  # from the engine that made them to the rank needing them
    for (source, rank), rows in moved.items():
        assert all(e == source for _, e, _ in rows) and rows == [k for k in shards[rank].rows if k[1] != rank]
    _deliver(stores, exports)
    _assert_resolved_equal_sent(stores, shards, balanced, names)
    # The reference's log-probs stay where they were computed; the update's rows are there: nothing moves.
    for rank, shard in enumerate(shards):
        assert stores[rank].answer(shard, torch.full((shard.num_rows, 4), float(rank))) is None
    plan.generations[1].fields.add("ref_log_probs")
    again, exports = plan.shards(group, balanced, [*names, "ref_log_probs"], replicas=1)
    assert exports == {}
    for rank, shard in enumerate(again):
        assert stores[rank].resolve(shard).ref_log_probs.eq(rank).all()


def test_batches_it_cannot_place_take_the_transfer_path():
    plan, group = ResidentRows(), Group(world_size=2)
    batch, _ = _stores(plan, group, _generated(4))
    # Another group (a reference on a pool of its own), a dropped step, or no stamp: transfer.
    assert plan.shards(Group(world_size=2), batch, ["prompts"], replicas=1) is None
    assert ResidentRows().shards(group, _generated(4), ["prompts"], replicas=1) is None
    plan.request(group, 1, step=2, validate=False, fields=FIELDS)
    assert plan.shards(group, batch, ["prompts"], replicas=1) is None


def test_tensor_parallel_engines_and_sequence_parallel_replicas():
    """tp=2: ranks 0, 1 are engine 0 and hold its rows; sp=2: ranks 0, 1 get shard 0 (one engine's rows)."""
    plan, group = ResidentRows(), Group(world_size=4)
    batch, stores = _stores(plan, group, _generated(4), tp=2)
    names = ["prompts", "prompt_mask", "responses"]
    shards, exports = plan.shards(group, batch, names, replicas=2)
    assert (
        exports == {}
        and [s.rows for s in shards] == [[(1, 0, 0), (1, 0, 1)]] * 2 + [[(1, 1, 0), (1, 1, 1)]] * 2
    )
    _assert_resolved_equal_sent(stores, shards, batch, names, replicas=2)
    # sp=1: rank 1 needs row 1, which its engine (0, shared with rank 0) made: read there too.
    shards, exports = plan.shards(group, batch, names, replicas=1)
    assert exports == {} and [s.rows for s in shards] == [[(1, 0, 0)], [(1, 0, 1)], [(1, 1, 0)], [(1, 1, 1)]]
    # Engine 1's rows first: ranks 0 and 1 fetch them from rank 2 (engine 1's first rank), and the reverse.
    swapped = batch[torch.tensor([2, 3, 0, 1])]
    shards, exports = plan.shards(group, swapped, names, replicas=2)
    assert sorted(exports) == [0, 2] and sorted(exports[2]) == [0, 1] and sorted(exports[0]) == [2, 3]
    _deliver(stores, exports)
    _assert_resolved_equal_sent(stores, shards, swapped, names, replicas=2)


def test_store_keeps_an_answer_and_refuses_what_it_does_not_hold():
    store = ResidentStore(engine=0)
    store.keep(
        7, 1, {"prompts": torch.arange(6).view(3, 2), "prompt_mask": torch.ones(3, 2), "uid": ["a"] * 3}
    )
    assert set(store.fields[(7, 0)]) == {"prompts", "prompt_mask"}  # non-tensor values are not kept
    shard = ResidentShard(rows=[(7, 0, 2), (7, 0, 0)], local=("prompts", "prompt_mask"), keep="ref_log_probs")
    assert store.resolve(shard).prompts.tolist() == [[4, 5], [0, 1]]
    assert store.answer(shard, torch.tensor([[0.5], [0.25]])) is None
    later = ResidentShard(rows=[(7, 0, 0), (7, 0, 2)], local=("prompts", "prompt_mask", "ref_log_probs"))
    assert store.resolve(later).ref_log_probs.tolist() == [[0.25], [0.5]]
    with pytest.raises(KeyError, match="'ref_log_probs' of generation 7, engine 0 is not held"):
        store.read([(7, 0, 1)], "ref_log_probs")  # row 1 had no answer
    with pytest.raises(KeyError, match="generation 7, engine 1 are not on this worker"):
        store.read([(7, 1, 0)], "prompts")  # another engine's row, not fetched
    plain = RolloutBatch(prompts=torch.zeros(1, 2), prompt_mask=torch.ones(1, 2), batch_size=[1])
    assert store.resolve(plain) is plain and store.answer(plain, torch.ones(1)) is not None
    store.keep(8, 2, {"prompts": torch.zeros(1, 2)})  # a later step's generation drops step 1's
    with pytest.raises(KeyError, match="generation 7, engine 0 are not on this worker"):
        store.read(later.rows, "prompts")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_advantages_one_number_per_row_cross_as_rows_and_come_back_bit_for_bit():
    """GRPO's ``adv[:, None] * mask`` (-0.0 off the mask of a negative row) and a ``where`` broadcast cross
    as ``[B]``; token-level values do not; the worker rebuilds every bit from its resident response mask."""
    from fusedrl.algorithms.advantages import compute_grpo_advantage
    from fusedrl.resident import on_mask, row_values

    plan, group = ResidentRows(), Group(world_size=2)
    batch, stores = _stores(plan, group, _generated(5, lengths=[4, 2, 0, 3, 1]))  # row 2: no token
    rewards = torch.zeros(5, 4)
    rewards[:, 0] = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0])
    grpo, _ = compute_grpo_advantage(rewards, batch.response_mask, index=["a", "a", "b", "b", "b"])
    assert (grpo < 0).any() and torch.signbit(grpo[batch.response_mask == 0]).any()  # -0.0 off the mask
    values, form = row_values(grpo, batch.response_mask)
    assert form == "times" and values.shape == (5,)
    where = on_mask(torch.tensor([0.5, -1.0, 3.0, -2.0, 0.25]), batch.response_mask, "where")
    assert row_values(where, batch.response_mask)[1] == "where"
    token_level = grpo.clone()
    token_level[0, 1] += 1.0
    assert row_values(token_level, batch.response_mask) is None
    assert row_values(grpo.masked_fill(batch.response_mask == 0, 0.0), batch.response_mask) is not None
    batch.advantages = grpo
    names = [*batch.model_input_fields(), "advantages"]
    shards, exports = plan.shards(group, batch, names, replicas=1)
    _deliver(stores, exports)  # the padding's row 0, to rank 1
    assert [s.per_row for s in shards] == [{"advantages": "times"}] * 2
    assert [s.sent["advantages"].shape for s in shards] == [(3,), (3,)]  # 5 rows padded to 6
    sent, _ = split_for_ranks(batch.select_fields("advantages"), 2)
    for rank, shard in enumerate(shards):
        assert torch.equal(_bits(stores[rank].resolve(shard).advantages), _bits(sent[rank].advantages))


def test_old_log_probs_answer_their_gap_without_the_padding_rows():
    """Each rank answers the gap of its real rows (the padding of the split left out); the driver's sum of
    them is the metric it computes from the whole batch, to the bit."""
    from fusedrl.log_prob_gap import GapStats, gap_metrics, gap_stats

    plan, group = ResidentRows(), Group(world_size=2)
    batch, stores = _stores(plan, group, _generated(5, lengths=[4, 2, 3, 3, 1]))
    old = batch.rollout_log_probs - torch.rand(5, 4) * 0.1
    shards, exports = plan.shards(group, batch, batch.model_input_fields(), 1, keep="old_log_probs", gap=True)
    _deliver(stores, exports)
    assert [s.gap for s in shards] == [3, 2]  # rank 1's third row is row 0 again
    padded_old = torch.cat([old, old[:1]])
    answers = [stores[r].answer(s, padded_old[3 * r : 3 * r + 3]) for r, s in enumerate(shards)]
    assert all(isinstance(a, GapStats) for a in answers) and [a.count for a in answers] == [9, 4]
    expected = gap_metrics([gap_stats(batch.rollout_log_probs, old, batch.response_mask)])
    assert gap_metrics(answers) == expected
    kept = ResidentShard(rows=shards[1].rows, local=("prompts", "prompt_mask", "old_log_probs"))
    assert torch.equal(stores[1].resolve(kept).old_log_probs, padded_old[3:])  # kept for the update


def test_which_runs_leave_the_rollout_log_probs_on_the_workers():
    from fusedrl.config import load_config
    from fusedrl.role_config import run_config
    from fusedrl.trainer.step_plan import rollout_log_probs_stay

    def stay(*extra: str, with_actor: bool = True, images: bool = False) -> list[str]:
        base = ["data.train_files=x", "actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=grpo"]
        run = run_config(load_config([*base, *extra], validate_config=False))
        return rollout_log_probs_stay(run, rollout_with_actor=with_actor, images=images)

    assert stay() == ["rollout_log_probs"]
    assert stay(with_actor=False) == []  # a rollout pool: the actor's calls send the rows
    assert stay(images=True) == []  # images are not kept on the workers: the rows are sent
    assert stay("algorithm.rollout_correction.rollout_is=token") == []
    assert stay("algorithm.rollout_correction.rollout_rs=token") == []
    assert stay("algorithm.rollout_correction.bypass_mode=true") == []
    assert stay("algorithm.use_kl_in_reward=true") == []
    assert stay("algorithm.adv_estimator=optimal_token_baseline") == []
