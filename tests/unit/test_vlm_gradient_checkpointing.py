"""Gradient checkpointing of a vision-language policy under FSDP2 (``model.enable_gradient_checkpointing``,
`fusedrl.workers.vision.shard_vision_language_model`): on the tiny Qwen2.5-VL (one gloo rank, float32) the
image batch's loss and every gradient, vision tower included, equal the run without it, and each vision block
and decoder layer entered its forward twice (once more in the backward: a pre-hook counts it, since torch stops
a recompute once it has what the backward needs, before the forward's end)."""

from __future__ import annotations

import pytest
import torch
from support import free_port, single_rank_group
from vlm_support import write_shapes_parquet

from fusedrl.batch import RolloutBatch


def _image_batch(model_dir: str, train: str) -> RolloutBatch:
    """4 shape prompts with their pictures and 6 random response tokens each (no vision token)."""
    from fusedrl.data.multimodal import VisionLanguageDataset, collate_vision
    from fusedrl.models.qwen_vl import load_processor

    data = VisionLanguageDataset(train, load_processor(model_dir), 48)
    rows = [data[i] for i in range(4)]
    batch, vision = collate_vision(rows, data.pad_token_id, 48)
    gen = torch.Generator().manual_seed(0)
    batch.responses = torch.randint(3, 200, (4, 6), generator=gen)  # [B, Tr]: text ids of the tiny vocab
    batch.response_mask = torch.ones(4, 6, dtype=torch.long)  # [B, Tr]
    batch.multi_modal_inputs = [vision.select([i]) for i in range(4)]
    return batch


def _loss_and_grads(model_dir: str, batch: RolloutBatch, checkpointing: bool):
    from torch.distributed.device_mesh import init_device_mesh

    from fusedrl.workers.vision import (
        load_vision_language_model,
        shard_vision_language_model,
        vision_log_probs,
    )

    model = load_vision_language_model(model_dir, torch.float32)
    mesh = init_device_mesh("cpu", (1,))
    model = shard_vision_language_model(model, mesh, gradient_checkpointing=checkpointing).train()
    units = [model.model.visual.blocks[0], model.model.language_model.layers[0]]
    calls = [0, 0]
    for k, unit in enumerate(units):
        unit.register_forward_pre_hook(lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
    log_probs, entropy = vision_log_probs(model, batch, temperature=1.0, with_entropy=True)  # [B, Tr] each
    loss = -log_probs.sum() - 0.1 * entropy.sum()
    loss.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, calls


def test_checkpointed_vision_model_gives_the_same_gradients(tmp_path):
    from fusedrl.utils.tiny_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(str(tmp_path / "vlm"), seed=0)
    batch = _image_batch(model_dir, write_shapes_parquet(tmp_path / "train.parquet", rows=4))
    with single_rank_group(free_port()):
        loss, grads, calls = _loss_and_grads(model_dir, batch, checkpointing=False)
        loss_ckpt, grads_ckpt, calls_ckpt = _loss_and_grads(model_dir, batch, checkpointing=True)
    assert calls == [1, 1] and calls_ckpt == [2, 2], (calls, calls_ckpt)  # recomputed in the backward
    assert loss_ckpt == pytest.approx(loss, rel=1e-6)
    assert set(grads_ckpt) == set(grads) and any(".visual." in f".{n}" for n in grads)
    for name, g in grads.items():
        assert torch.allclose(grads_ckpt[name], g, rtol=1e-5, atol=1e-7), name
