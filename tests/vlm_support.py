"""The tiny vision-language run the image tests share (importable as ``vlm_support``: ``tests/`` is on
``sys.path``): generated pictures of coloured squares in verl's multimodal parquet schema, the tiny random
Qwen2.5-VL, and the GRPO command line on them (float32 on both sides)."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from support import FLOAT32_TRAINING

COLOURS = [(220, 30, 30), (30, 160, 40), (40, 60, 220), (230, 200, 20)]


def shapes_png(seed: int) -> tuple[bytes, int]:
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


def write_shapes_parquet(path: str | Path, rows: int = 8) -> str:
    """``rows`` prompts "How many squares?", one picture each (row r: `shapes_png(r)`), as verl writes them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = []
    for r in range(rows):
        png, count = shapes_png(r)
        table.append(
            {
                "data_source": "shapes",
                "prompt": [{"role": "user", "content": "<image>How many squares?"}],
                "images": [{"bytes": png}],
                "reward_model": {"ground_truth": str(count)},
            }
        )
    pq.write_table(pa.Table.from_pylist(table), str(path))
    return str(path)


def tiny_vlm_and_shapes(tmp_path_factory) -> tuple[str, str]:
    """``(model folder, train parquet)``: the tiny random Qwen2.5-VL (seed 0) and 8 shape prompts."""
    from fusedrl.utils.tiny_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(str(tmp_path_factory.mktemp("tiny_vlm")), seed=0)
    return model_dir, write_shapes_parquet(tmp_path_factory.mktemp("shapes") / "train.parquet")


def vlm_grpo(
    model_dir: str, train: str, run_dir: str | Path, *, workers: int = 1, steps: int = 2
) -> list[str]:
    """GRPO on the shape prompts: 4 prompts x 2 samples of 12 tokens a step, float32 engine and actor, a KL
    loss to the reference, lr 1e-2, ``workers`` fused workers, ``steps`` steps."""
    return [
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
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        f"trainer.n_gpus_per_node={workers}",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={run_dir}",
    ]
