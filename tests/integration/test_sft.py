"""SFT on the real stack (Ray, 2 gloo workers, FSDP2): a memorisable task is learnt, checkpoints round-trip,
and the exported Hugging Face folder reproduces the trainer's loss."""

from __future__ import annotations

import json
import os
import random

import pandas as pd
import pytest
import torch

pytestmark = pytest.mark.integration


def _arithmetic_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        rows.append({"prompt": f"What is {a} + {b}?", "response": f"The answer is {a + b}."})
    return rows


def _hf_loss(model, batch: dict[str, torch.Tensor]) -> float:
    """Token-mean next-token NLL over the loss-mask tokens, computed independently of the trainer."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    target_logp = logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["loss_mask"][:, 1:].float()
    return float(-(target_logp * mask).sum() / mask.sum())


def _first_step_reference(model_dir: str, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Loss and gradient norm of one full-batch, single-process step on the initial model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    target_logp = logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["loss_mask"][:, 1:].float()
    loss = -(target_logp * mask).sum() / mask.sum()
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    return float(loss.detach()), float(norm)


def test_sft_learns_checkpoints_and_exports(ray_cluster, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from fusedrl.data.sft_dataset import collate
    from fusedrl.trainer.sft_trainer import SFTTrainer, load_sft_config

    train = str(tmp_path / "train.parquet")
    val = str(tmp_path / "val.parquet")
    pd.DataFrame(_arithmetic_rows(64, seed=0)).to_parquet(train)
    pd.DataFrame(_arithmetic_rows(8, seed=1)).to_parquet(val)
    out_dir = str(tmp_path / "run")
    cfg = load_sft_config(
        [
            f"data.train_files={train}",
            f"data.val_files={val}",
            f"model.path={tiny_model_dir}",
            "data.max_length=48",
            "data.train_batch_size=16",
            "data.micro_batch_size_per_gpu=4",
            "model.fsdp_config.param_dtype=null",  # float32: step 1 is compared with a float32 HF step
            "optim.lr=3e-3",
            "optim.lr_scheduler=constant",
            "optim.warmup_steps_ratio=0.1",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=30",
            "trainer.save_freq=10",
            "trainer.test_freq=15",
            "trainer.logger=[console,jsonl]",
            f"trainer.default_local_dir={out_dir}",
        ]
    )
    trainer = SFTTrainer(cfg)
    try:
        trainer.init_workers()
        last = trainer.fit()

        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            records = {rec["step"]: rec for rec in map(json.loads, f)}
        assert sorted(records) == list(range(1, 31))
        first_loss, final_loss = records[1]["train/loss"], records[30]["train/loss"]
        assert final_loss < 0.6 * first_loss, (first_loss, final_loss)
        assert records[3]["train/lr"] == pytest.approx(3e-3) and records[1]["train/lr"] < 3e-3  # warmup
        assert "val/loss" in records[15] and "val/loss" in last
        assert all(rec["train/loss_tokens"] > 0 for rec in records.values())

        # Checkpoints round-trip: an older one gives a different loss, the last one the current loss.
        batch = collate([trainer.train_dataset[i] for i in range(8)], trainer.train_dataset.pad_token_id)
        loss_now = trainer.evaluate_batch(batch)["loss"]
        trainer.workers.run_all(lambda w: w.load_checkpoint.remote(os.path.join(out_dir, "global_step_10")))
        loss_10 = trainer.evaluate_batch(batch)["loss"]
        trainer.workers.run_all(lambda w: w.load_checkpoint.remote(os.path.join(out_dir, "global_step_30")))
        assert loss_10 > loss_now + 1e-3
        assert trainer.evaluate_batch(batch)["loss"] == pytest.approx(loss_now, abs=1e-6)
    finally:
        trainer.close()

    # Step 1 ran on 2 ranks x 2 micro-batches; its loss and (pre-clip) gradient norm must equal one
    # token-mean step over the whole batch in a single process: the normalisation is global.
    first = collate(
        [trainer.train_dataset[i] for i in trainer.train_loader.epoch_order(0)[:16]],
        trainer.train_dataset.pad_token_id,
    )
    ref_loss, ref_norm = _first_step_reference(tiny_model_dir, first)
    assert records[1]["train/loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert records[1]["train/grad_norm"] == pytest.approx(ref_norm, rel=1e-4)

    # The exported folder (trainer.export_dir=null -> <default_local_dir>/hf) is a plain HF model that
    # reproduces the trainer's loss on the same batch.
    hf_dir = os.path.join(out_dir, "hf")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert _hf_loss(model, batch) == pytest.approx(loss_now, abs=1e-4)
