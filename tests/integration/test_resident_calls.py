"""Rows that stay on the worker that made them (`fusedrl.resident`, issue 39 item 3) give what sending them gives.

On one fused worker (fake engine, GRPO with a KL loss, float32): the reference's and the actor's log-probs
of a resident call equal those of the transfer path bit for bit, a row the driver cannot place falls back
to sending the rows (and still agrees), and the update reading the model inputs and the reference's kept
log-probs on the worker gives the losses, gradient norm and old log-probs of the update that was sent them
(its GRPO advantages crossing as one number per row, rebuilt there). The old-log-prob pass and the update
answer the rollout-vs-actor log-prob gap as numbers: the driver's metrics from the tensors, to the bit. A
slow test trains two steps each way on two balanced ranks (rows moved worker to worker): the metrics (the
gap's to the bit) and the parameters agree.
"""

from __future__ import annotations

import pytest
import ray
import torch
from support import assert_same_computed_metrics, fake_engine_grpo, started_trainer

from fusedrl.log_prob_gap import GapStats, gap_metrics, gap_stats
from fusedrl.metrics import batch_metrics
from fusedrl.trainer import step_plan

pytestmark = pytest.mark.integration


def _sent(traffic, before: dict, call: str) -> int:
    return traffic.by_call.get(f"{call} out", 0) - before.get(f"{call} out", 0)


def test_resident_calls_equal_the_transfer_path(tiny_model_dir, arithmetic_data, tmp_path):
    with started_trainer(fake_engine_grpo(tiny_model_dir, arithmetic_data[0], tmp_path)) as trainer:
        trainer.global_step = 1
        batch = trainer.step_rollout({})
        assert batch.resident_rows is not None and batch.rollout_log_probs is None  # they stayed there
        group, plan, t = trainer.workers, trainer.resident, trainer.temperature
        rows = [tuple(r) for r in batch.resident_rows.tolist()]
        ((ref,),) = [r.values() for r in group.run_all(lambda w: w.resident_export.remote({0: rows}))]
        rollout_log_probs = ray.get(ref)["fields"]["rollout_log_probs"]  # read off the worker, for the test
        traffic, names = group.traffic, batch.model_input_fields()

        def log_probs(method: str, rows) -> tuple[torch.Tensor, int]:
            before = dict(traffic.by_call)
            parts = plan.run_split(group, lambda w, s: getattr(w, method).remote(s, t), rows, names, 1)
            return group.gather_tensors(parts, rows), _sent(traffic, before, method)

        group.run_all(lambda w: w.load_ref.remote())
        resident, sent = log_probs("ref_compute_log_prob", batch)
        assert sent == 0
        plan.enabled = False
        transfer, sent = log_probs("ref_compute_log_prob", batch)
        plan.enabled = True
        assert sent == 4 and torch.equal(resident, transfer)
        moved = batch.clone()
        moved.resident_rows[0, 0] = 99  # a generation the driver does not know: every row is sent
        fallback, sent = log_probs("ref_compute_log_prob", moved)
        assert sent == 4 and torch.equal(fallback, transfer)
        group.run_all(lambda w: w.offload_ref.remote())
        group.run_all(lambda w: w.load_actor.remote())
        old, sent = log_probs("actor_compute_log_prob", batch)
        plan.enabled = False
        assert sent == 0 and torch.equal(old, log_probs("actor_compute_log_prob", batch)[0])
        plan.enabled = True
        full = batch.clone()
        full.rollout_log_probs, full.old_log_probs = rollout_log_probs, old
        transfer_gap = gap_metrics([gap_stats(rollout_log_probs, old, batch.response_mask)])
        # The separate pass keeps the old log-probs there and answers the gap: the driver's numbers, exactly.
        before = dict(traffic.by_call)
        assert trainer.compute_log_probs(batch).old_log_probs is None
        assert traffic.by_call.get("actor_compute_log_prob back", 0) == before.get(
            "actor_compute_log_prob back", 0
        )
        assert plan.log_prob_gap == transfer_gap and plan.holds(batch, "old_log_probs")

        # The reference's log-probs stay on the worker; the update reads them there (lr 0: the same weights).
        batch = trainer.compute_advantages(trainer.compute_ref_log_probs(batch, keep=True))
        assert batch.ref_log_probs is None
        fields = [*names, *step_plan.update_fields(trainer.run, old_from_forward=True)]
        assert "ref_log_probs" in fields
        group.run_all(lambda w: w.load_actor.remote(optimizer=True))
        call = lambda w, s: w.actor_update_old_from_forward.remote(s, t, 0.0)  # noqa: E731
        before = dict(traffic.by_call)
        assert plan.shards(group, batch, fields, 1)[0][0].per_row == {"advantages": "times"}  # [B] crosses
        ((kept_metrics, kept_old),) = plan.run_split(group, call, batch, fields, 1)
        assert _sent(traffic, before, "actor_update_old_from_forward") == 1  # the advantages
        batch.ref_log_probs = transfer
        plan.enabled = False
        ((sent_metrics, sent_old),) = plan.run_split(group, call, batch, fields, 1)
        plan.enabled, plan.log_prob_gap = True, None
        ((_, gap),) = plan.run_split(group, call, batch, fields, 1, gap=True)  # the update's forward: the gap
    assert torch.equal(kept_old, sent_old) and torch.equal(kept_old, old)
    assert isinstance(gap, GapStats) and plan.log_prob_gap == transfer_gap
    full.advantages = batch.advantages
    assert batch_metrics(batch, 1.0, 1, plan.log_prob_gap) == batch_metrics(full, 1.0, 1)  # every metric
    losses = [k for k in sent_metrics if k.startswith("actor/") and "loss" in k]
    assert losses and "actor/grad_norm" in sent_metrics
    for key in [*losses, "actor/grad_norm"]:
        assert kept_metrics[key] == sent_metrics[key], key


@pytest.mark.slow
def test_two_steps_resident_equal_two_steps_sent_on_two_balanced_ranks(
    tiny_model_dir, arithmetic_data, tmp_path
):
    """Two fused workers; the balancing (here reversing the balanced order, so every row changes rank) moves
    rows between ranks, worker to worker."""
    from fusedrl.trainer.ppo_trainer import PPOTrainer

    class Reversed(PPOTrainer):
        def balance_batch(self, batch, metrics):
            balanced = super().balance_batch(batch, metrics)
            return balanced[torch.arange(balanced.num_samples - 1, -1, -1)]

    runs = []
    for resident in (True, False):
        overrides = fake_engine_grpo(tiny_model_dir, arithmetic_data[0], tmp_path / str(resident))
        overrides += ["trainer.n_gpus_per_node=2", "trainer.balance_batch=true"]
        with started_trainer(overrides, trainer_cls=Reversed) as trainer:
            trainer.resident.enabled = resident
            before = trainer.groups.tensor_crossings()
            metrics, moved = [], 0
            for trainer.global_step in (1, 2):
                metrics.append(trainer.train_step())
                moved += sum(len(g.delivered) for g in trainer.resident.generations.values())
            crossings = trainer.groups.tensor_crossings() - before
            states = trainer.workers.run_all(lambda w: w.actor_state.remote())
        runs.append((metrics, states, crossings, moved))
    (kept, kept_states, kept_crossings, moved), (sent, sent_states, sent_crossings, _) = runs
    assert moved == 16  # every row, at step 1 and 2: fetched by the other rank, not sent by the driver
    assert (kept_crossings, sent_crossings) == (6, 30)
    for a, b in zip(kept, sent):
        assert_same_computed_metrics(b, a)
        for stat in ("mean", "max"):  # the workers' numbers, added up: the driver's, to the bit
            assert a[f"rollout/log_prob_abs_diff_{stat}"] == b[f"rollout/log_prob_abs_diff_{stat}"]
    for kept_state, sent_state in zip(kept_states, sent_states):
        assert kept_state.keys() == sent_state.keys()
        for name, value in sent_state.items():
            assert torch.equal(kept_state[name], value), name
