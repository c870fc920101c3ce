"""The per-step decisions of the PPO loop (`fusedrl.trainer.step_plan`) and the last-token placement of
sequence rewards, checked by hand."""

from __future__ import annotations

import torch
from support import typed_run

from fusedrl.batch import last_sampled_index, on_last_sampled_token
from fusedrl.trainer.step_plan import due, sample_seeds


def test_due_every_freq_and_at_the_end():
    assert [s for s in range(1, 8) if due(3, s, 7)] == [3, 6, 7]
    assert not any(due(0, s, 7) for s in range(1, 8))
    assert not any(due(-1, s, 7) for s in range(1, 8))


def test_sample_seeds_differ_by_row_step_and_round():
    a = sample_seeds(1, 2, 0, 4)
    assert a.tolist() == [(1 * 1_000_003 + 2 * 10_007 + i * 7919) % (2**31 - 1) for i in range(4)]
    assert not torch.equal(a, sample_seeds(1, 3, 0, 4))
    assert not torch.equal(a, sample_seeds(1, 2, 1, 4))


def test_sequence_value_lands_on_the_last_sampled_token():
    # Row 0: sampled, observation, sampled, padding -> last sampled is position 2; row 1 has none.
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0]])
    assert last_sampled_index(mask).tolist() == [2, 0]
    out = on_last_sampled_token(torch.tensor([2.5, 7.0]), mask)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.0, 0.0, 2.5, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_optimal_token_baseline_keeps_the_old_log_prob_pass_and_gets_its_inputs():
    from fusedrl.batch import RolloutBatch
    from fusedrl.trainer.step_plan import advantage_inputs, old_log_probs_reusable

    # ppo_mini_batch_size 8 x n 2 = 16 rows per mini-batch on 1 worker: GRPO reuses the update's forward.
    grpo, otb = (
        typed_run("algorithm.adv_estimator=grpo"),
        typed_run("algorithm.adv_estimator=optimal_token_baseline"),
    )
    assert old_log_probs_reusable(grpo, world=1, num_samples=16, actor_trains=True)
    assert not old_log_probs_reusable(otb, world=1, num_samples=16, actor_trains=True)

    batch = RolloutBatch.from_prompts(
        torch.ones(2, 1, dtype=torch.long),
        torch.ones(2, 1, dtype=torch.long),
        uid=["a", "a"],
        data_source=["s", "s"],
        ground_truth=["1", "1"],
    )
    batch.response_mask = torch.ones(2, 3)
    batch.old_log_probs = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.25, 0.25, 0.25]]))
    batch.rollout_log_probs = torch.log(torch.tensor([[0.25, 0.5, 0.5], [0.25, 0.25, 0.25]]))
    batch.sum_pi_squared = torch.full((2, 3), 0.5)
    assert "sum_pi_squared" not in advantage_inputs(grpo, batch)  # other estimators get the usual inputs
    inputs = advantage_inputs(otb, batch)
    assert inputs["index"] == ["a", "a"] and inputs["sum_pi_squared"] is batch.sum_pi_squared
    assert "rollout_is_weights" not in inputs
    corrected = typed_run(
        "algorithm.adv_estimator=optimal_token_baseline",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=1.5",
    )
    w = advantage_inputs(corrected, batch)["rollout_is_weights"]
    assert torch.allclose(w, torch.tensor([[1.5, 1.0, 1.0], [1.0, 1.0, 1.0]]))  # min(0.5 / 0.25, 1.5)


def test_config_rejects_otb_with_bypass_and_sp_not_dividing_workers():
    import pytest

    from fusedrl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(
            [
                "data.train_files=x",
                "actor_rollout_ref.rollout.n=2",
                "algorithm.adv_estimator=optimal_token_baseline",
                "algorithm.rollout_correction.bypass_mode=true",
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=3",
            ]
        )
    text = str(err.value)
    assert "bypass_mode" in text and "set bypass_mode=false" in text
    assert "ulysses_sequence_parallel_size`=3 does not divide the 2 workers" in text


def test_rollout_correction_reuses_the_update_forward_unless_batch_normalized():
    """Per-row corrections (IS weights, rejection) run in the actor's loss, which then reads the rollout's
    log-probs; the batch-wide mean of ``rollout_is_batch_normalize`` keeps the separate pass, as bypass does."""
    from fusedrl.trainer.step_plan import old_log_probs_reusable, update_fields

    rc = "algorithm.rollout_correction"
    cases = {
        (f"{rc}.rollout_is=token",): True,
        (f"{rc}.rollout_is=sequence",): True,
        (f"{rc}.rollout_rs=token", f"{rc}.rollout_rs_threshold=2.0"): True,
        (f"{rc}.rollout_rs=seq_max_k2", f"{rc}.rollout_rs_threshold=0.1"): True,
        (f"{rc}.rollout_is=token", f"{rc}.rollout_is_batch_normalize=true"): False,
        (f"{rc}.bypass_mode=true", f"{rc}.rollout_rs=token", f"{rc}.rollout_rs_threshold=2.0"): False,
    }
    for overrides, reusable in cases.items():
        run = typed_run("algorithm.adv_estimator=grpo", *overrides)
        assert old_log_probs_reusable(run, world=1, num_samples=16, actor_trains=True) is reusable, overrides
        assert not old_log_probs_reusable(run, world=1, num_samples=32, actor_trains=True)  # 2 mini-batches
        if reusable:
            assert update_fields(run, old_from_forward=True) == ["advantages", "rollout_log_probs"]
            assert update_fields(run, old_from_forward=False) == ["old_log_probs", "advantages"]
    plain = typed_run("algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true")
    assert update_fields(plain, old_from_forward=True) == ["advantages", "ref_log_probs"]
