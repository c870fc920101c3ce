"""bf16 on the real SmolLM2 architecture (cut to 2 decoder layers), as fusedrl runs it where bf16 is native:
FSDP2 mixed precision (``param_dtype=bfloat16``, float32 master weights) for the actor and the reference,
and the vLLM engine in bf16. ``trainer.emulated_bf16=allow`` keeps bf16 on CPUs without bf16 instructions.

* The engine's log-probs of its own samples stay within a bf16 bound of the actor's at start and after an
  update and sync, while the same update left unsynced moves them past it.
* The reference is the actor's starting policy bit for bit: the update's KL to it is exactly 0 before the
  actor has moved (the reference holds the same bf16 rounding of the same float32 weights; see
  docs/concepts.md, "bf16 and the KL to the reference").

One trainer is built for the module; tests run in file order.
"""

from __future__ import annotations

import pytest
import torch
from support import real_model_grpo, started_trainer, update_without_sync

# ~3.5 min on a 2-core AVX2 CPU (bf16 emulated, engine and training): excluded from `make test`.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

vllm = pytest.importorskip("vllm")

# bf16 engine vs bf16 actor (float32 master weights cast by FSDP2): vLLM's kernels and the actor's round to
# bf16 at different places. Measured on this module's samples (AVX2 EPYC, emulated bf16; 2 runs, identical):
# |gap| over response tokens, max 0.45 / mean 0.038 at start, max 0.09 / mean 0.0085 after an update and sync;
# the same update unsynced: max 7.2 / mean 0.90. The bounds leave ~3x over the largest measured gap and sit
# well under the unsynced one (the mean's bound is the rollout check's bf16 bound, docs/concepts.md).
MAX_BOUND = 1.5
MEAN_BOUND = 0.1


@pytest.fixture(scope="module")
def trainer(smollm2_2layer_dir, small_train_file, tmp_path_factory):
    with started_trainer(
        [
            *real_model_grpo(
                small_train_file,
                smollm2_2layer_dir,
                str(tmp_path_factory.mktemp("run")),
            ),
            "actor_rollout_ref.rollout.dtype=bfloat16",
            "actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16",
            "actor_rollout_ref.ref.fsdp_config.param_dtype=bfloat16",
            "trainer.emulated_bf16=allow",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",  # not the log-prob passes' 8 rows
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        ]
    ) as t:
        yield t


def _gaps(trainer, prompts) -> tuple[float, float]:
    """(max, mean) |engine log-prob - actor log-prob| over the engine's own fresh samples."""
    batch = trainer.compute_log_probs(trainer.generate(prompts))
    mask = batch.response_mask.bool()
    assert mask.any(), "the engine generated no tokens"
    diff = (batch.rollout_log_probs - batch.old_log_probs).abs()[mask]
    return float(diff.max()), float(diff.mean())


def test_roles_compute_in_bf16(trainer):
    for dtypes in trainer.workers.run_all(lambda w: w.compute_dtypes.remote()):
        assert dtypes == {"actor": "bfloat16", "rollout": "bfloat16"}


def test_engine_starts_within_the_bf16_bound(trainer):
    gap, mean = _gaps(trainer, trainer.next_prompts())
    print(f"bf16 start: max gap {gap:.3e}, mean {mean:.3e}")
    assert gap < MAX_BOUND and mean < MEAN_BOUND


def test_kl_to_the_reference_is_exactly_zero_before_the_first_update(trainer):
    batch = trainer.generate(trainer.next_prompts())
    batch = trainer.compute_rewards(batch, {})
    batch = trainer.compute_log_probs(batch)
    batch = trainer.compute_ref_log_probs(batch)
    mask = batch.response_mask.bool()
    assert torch.equal(batch.old_log_probs[mask], batch.ref_log_probs[mask])
    batch = trainer.compute_advantages(batch)
    metrics = trainer.update_actor(batch)  # the loss's KL: the update's own forward vs the reference
    print(f"bf16 step-1 kl_loss {metrics['actor/kl_loss']!r}")
    assert metrics["actor/kl_loss"] == 0.0
    trainer.sync_weights()


def test_engine_within_the_bound_after_update_and_sync(trainer):
    prompts = trainer.next_prompts()
    update_without_sync(trainer, prompts)
    stale, stale_mean = _gaps(trainer, prompts)
    trainer.sync_weights()
    gap, mean = _gaps(trainer, prompts)
    print(f"bf16 after update: unsynced max {stale:.3e} mean {stale_mean:.3e}; synced {gap:.3e} / {mean:.3e}")
    assert gap < MAX_BOUND and mean < MEAN_BOUND
    assert stale > MAX_BOUND and stale_mean > MEAN_BOUND, (
        f"the unsynced update stayed within the bounds ({stale:.2e})"
    )
