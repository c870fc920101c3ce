"""fusedrl.workers.vision: the vision-language log-prob pass. On a tiny random Qwen2.5-VL, a left-padded batch
with images (M-RoPE positions from the model's rope index) gives each row's own unpadded log-probs; vision
tokens a response sampled are out of the loss and out of the gradient; the gradient reaches the vision tower."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fusedrl.batch import RolloutBatch
from fusedrl.workers.vision import VisionInputs, vision_response_log_probs, vision_token_ids

TP, TR = 40, 6


def _image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from fusedrl.models.qwen_vl import load_processor
    from fusedrl.utils.tiny_vlm import build_tiny_vlm

    path = build_tiny_vlm(str(tmp_path_factory.mktemp("tiny_vlm")), seed=0)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, load_processor(path)


def _items(proc) -> list[dict]:
    """Three prompts: one image, two images, none."""
    out = []
    for images, text in (
        ([_image(60, 90, 0)], "Count."),
        ([_image(28, 56, 1), _image(56, 56, 2)], "Compare."),
        ([], "Hi."),
    ):
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        chat = proc.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        enc = proc(text=[chat], images=images or None, return_tensors="pt")
        out.append(
            {
                "prompt_ids": enc["input_ids"][0].tolist(),
                "pixel_values": enc.get("pixel_values", torch.zeros(0, 1176)),
                "image_grid_thw": enc.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long)),
            }
        )
    return out


def _batch(items: list[dict], responses: list[list[int]]) -> RolloutBatch:
    b = len(items)
    prompts, prompt_mask = torch.zeros(b, TP, dtype=torch.long), torch.zeros(b, TP, dtype=torch.long)
    resp, resp_mask = torch.zeros(b, TR, dtype=torch.long), torch.zeros(b, TR, dtype=torch.long)
    for i, (it, r) in enumerate(zip(items, responses)):
        n = len(it["prompt_ids"])
        prompts[i, TP - n :] = torch.tensor(it["prompt_ids"])
        prompt_mask[i, TP - n :] = 1
        resp[i, : len(r)] = torch.tensor(r)
        resp_mask[i, : len(r)] = 1
    return RolloutBatch(
        prompts=prompts, prompt_mask=prompt_mask, responses=resp, response_mask=resp_mask, batch_size=[b]
    )


def _row_log_probs(model, proc, item: dict, tokens: list[int]) -> torch.Tensor:
    """One unpadded row through transformers' own M-RoPE route (mm_token_type_ids). [len(tokens)]"""
    from fusedrl.models.qwen_vl import mm_token_type_ids

    ids = torch.tensor([item["prompt_ids"] + tokens])
    kw = {}
    if item["image_grid_thw"].numel():
        kw = dict(
            pixel_values=item["pixel_values"],
            image_grid_thw=item["image_grid_thw"],
            mm_token_type_ids=mm_token_type_ids(ids, proc.image_token_id),
        )
    with torch.no_grad():
        logits = model(input_ids=ids, **kw).logits[0, len(item["prompt_ids"]) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


RESPONSES = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]


def test_padded_batch_with_images_gives_each_rows_log_probs(vlm):
    model, proc = vlm
    items = _items(proc)
    batch = _batch(items, RESPONSES)
    with torch.no_grad():
        lp, mask = vision_response_log_probs(
            model, batch, VisionInputs.from_items(items), temperature=1.0, pad_token_id=0
        )
    assert torch.equal(mask, batch.response_mask)
    for i, (it, r) in enumerate(zip(items, RESPONSES)):
        assert (lp[i, : len(r)] - _row_log_probs(model, proc, it, r)).abs().max() < 1e-5
        assert (lp[i, len(r) :] == 0).all()
    # Repeated rows (GRPO's samples) and a subset: the same numbers.
    rows = [1, 1, 0]
    sub = batch[torch.tensor(rows)]
    with torch.no_grad():
        lp_sub, _ = vision_response_log_probs(
            model, sub, VisionInputs.from_items(items).select(rows), temperature=1.0, pad_token_id=0
        )
    assert (lp_sub - lp[torch.tensor(rows)]).abs().max() < 1e-5


def test_token_count_positions_are_not_mrope(vlm):
    """What the M-RoPE positions change: the text pass's positions (counting tokens) give other log-probs."""
    model, proc = vlm
    items = _items(proc)[:1]
    batch = _batch(items, RESPONSES[:1])
    vision = VisionInputs.from_items(items)
    input_ids, attention_mask, positions = batch.sequences()
    with torch.no_grad():
        lp, _ = vision_response_log_probs(model, batch, vision, temperature=1.0, pad_token_id=0)
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
            pixel_values=vision.pixel_values[0], image_grid_thw=vision.image_grid_thw[0],
        ).logits[0, TP - 1 : -1]  # fmt: skip
    counted = torch.log_softmax(logits, -1).gather(-1, batch.responses[0][:, None])[:, 0]
    assert (lp[0] - counted).abs().max() > 1e-4


def test_sampled_vision_tokens_are_out_of_the_loss_and_the_gradient(vlm):
    model, proc = vlm
    items = _items(proc)
    ids = vision_token_ids(model.config)
    assert proc.image_token_id in ids and len(ids) == 4
    image_pad, vision_start = proc.image_token_id, int(model.config.vision_start_token_id)

    def grads(token: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        responses = [[5, token, 7, 8, 9, 10], [11, 12, vision_start], [14, 15, 16, 17]]
        batch = _batch(items, responses)
        model.zero_grad()
        lp, mask = vision_response_log_probs(
            model, batch, VisionInputs.from_items(items), temperature=1.0, pad_token_id=0
        )
        (-(lp * mask).sum()).backward()
        return mask, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    mask, g_pad = grads(image_pad)  # would be a 7th image token in row 0 without the masking: a forward error
    # The vision token and what follows it (scored in another context than the engine's) are out of the loss.
    assert mask[0].tolist() == [1, 0, 0, 0, 0, 0] and mask[1].tolist() == [1, 1, 0, 0, 0, 0]
    assert mask[2].tolist() == [1, 1, 1, 1, 0, 0]
    # The gradient reaches the vision tower, and does not depend on which vision token was sampled.
    assert g_pad["model.visual.patch_embed.proj.weight"].abs().sum() > 0
    assert g_pad["model.visual.blocks.1.attn.qkv.weight"].abs().sum() > 0
    _, g_start = grads(vision_start)
    assert all(torch.equal(g_pad[n], g_start[n]) for n in g_pad)
    model.zero_grad()


def test_packed_rows_give_the_padded_log_probs_entropy_and_gradients(vlm):
    """`use_remove_padding` on image rows: the real tokens of the 3 rows (2, 1 and 0 images) end to end in one
    row, text positions (the mask's restarts) and M-RoPE positions packed with them; the log-probs, entropies
    and gradients are the padded forward's (float32, up to summation order)."""
    from fusedrl.workers.vision import _vision_forward
    from fusedrl.workers.vision_packing import pack_vision_rows

    model, proc = vlm
    items = _items(proc)
    batch = _batch(items, RESPONSES)
    vision = VisionInputs.from_items(items)

    def run(packed: bool):
        model.zero_grad()
        lp, ent, mask = _vision_forward(
            model, batch, vision, temperature=0.7, pad_token_id=0, with_entropy=True, packed=packed
        )
        (-(lp * mask).sum() - 0.1 * ent.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return lp.detach(), ent.detach(), mask, grads

    lp_pad, ent_pad, mask_pad, g_pad = run(False)
    lp_pack, ent_pack, mask_pack, g_pack = run(True)
    model.zero_grad()
    assert torch.equal(mask_pad, mask_pack)
    assert (lp_pack - lp_pad).abs().max() < 1e-5 and (ent_pack - ent_pad).abs().max() < 1e-5
    assert (lp_pack[mask_pack == 0] == 0).all()
    assert set(g_pack) == set(g_pad) and "model.visual.patch_embed.proj.weight" in g_pack
    for name, g in g_pad.items():
        assert (g_pack[name] - g).abs().max() <= 1e-4 * (1 + g.abs().max()), name
    # The packed row: every real token once, text positions restarting per row, M-RoPE rows beside them.
    input_ids, attention_mask, _ = batch.sequences()
    from fusedrl.workers.vision import mrope_positions

    mrope = mrope_positions(model, input_ids, attention_mask, vision.concatenated()[1])
    row = pack_vision_rows(input_ids, attention_mask, mrope, batch.response_mask)
    lengths = [len(it["prompt_ids"]) + len(r) for it, r in zip(items, RESPONSES)]
    assert row.input_ids.shape == (1, sum(lengths)) and row.position_ids.shape == (4, 1, sum(lengths))
    starts = (row.position_ids[0, 0] == 0).nonzero().flatten().tolist()
    assert starts == [0, lengths[0], lengths[0] + lengths[1]]
    # An image row's M-RoPE positions are not its text positions; the text-only row's are.
    assert not torch.equal(row.position_ids[1, 0, : lengths[0]], row.position_ids[0, 0, : lengths[0]])
    last = slice(lengths[0] + lengths[1], None)
    assert all(torch.equal(row.position_ids[k, 0, last], row.position_ids[0, 0, last]) for k in (1, 2, 3))
