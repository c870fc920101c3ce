"""The shape-counting task of the vision-language example (`shapes_grpo.py`): pictures, data, the warm start
and the held-out evaluator.

The picture: 56x56 pixels of grey, cut into four 28x28 quadrants (the tiny processor turns each quadrant into
one image token). 1 to 4 quadrants hold a square (side 10-18 pixels, one of four colours, anywhere inside its
quadrant). The question asks how many squares there are, so the answer can only come from the image.

The reward is the built-in ``arithmetic`` rule: 1 when the LAST integer of the response is the count. The
warm-start demonstrations come from two "annotators", as in examples/quickstart/echo_smoke.py: one answers
``3.``, the other ``3. Corners: 12.`` (right in spirit, but the last number is the corner count, so the
verifier says no). Two phrasings get the short answer 80% of the time, the other two only 20%; imitation
learns that mix, so greedy decoding answers in the verbose style on half of the held-out prompts. GRPO's
groups of samples separate the two styles, and the policy learns to stop after the count on every phrasing.
"""

from __future__ import annotations

import io
import os
import random
import time
from collections.abc import Sequence
from typing import Any

DATA_SOURCE = "arithmetic"  # the reward rule: last integer in the response == ground truth
SIZE = 56  # pixels; 2x2 image tokens of 28x28 pixels each
QUADRANT = SIZE // 2
BACKGROUND = (128, 128, 128)
COLOURS = ((220, 30, 30), (30, 160, 40), (40, 60, 220), (230, 200, 20))
MAX_COUNT = 4
# (question, probability that the demonstration is the short, verifier-approved answer)
TEMPLATES = (
    ("<image>How many squares?", 0.8),
    ("<image>Count the squares.", 0.8),
    ("<image>How many squares are in the picture?", 0.2),
    ("<image>Number of squares?", 0.2),
)


# ---------------------------------------------------------------------- pictures and rows
def shapes_png(rng: random.Random) -> tuple[bytes, int]:
    """A picture of 1-``MAX_COUNT`` squares, one per chosen quadrant, as PNG bytes; and the count."""
    from PIL import Image, ImageDraw

    count = rng.randint(1, MAX_COUNT)
    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for quadrant in rng.sample(range(4), count):
        side = rng.randint(10, 18)
        x = (quadrant % 2) * QUADRANT + rng.randint(1, QUADRANT - side - 1)
        y = (quadrant // 2) * QUADRANT + rng.randint(1, QUADRANT - side - 1)
        draw.rectangle([x, y, x + side - 1, y + side - 1], fill=rng.choice(COLOURS))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue(), count


def short_answer(count: int) -> str:
    return f"{count}."


def verbose_answer(count: int) -> str:
    return f"{count}. Corners: {4 * count}."


def _row(rng: random.Random, template: int, split: str, index: int) -> dict:
    png, count = shapes_png(rng)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": TEMPLATES[template][0]}],
        "images": [{"bytes": png}],
        "ability": "counting",
        "reward_model": {"style": "rule", "ground_truth": str(count)},
        "extra_info": {"split": split, "index": index, "template": template},
    }


def write_data(out_dir: str, seed: int, n_train: int = 512, n_test: int = 64) -> dict[str, str]:
    """RL train / held-out test parquet files in verl's multimodal schema (an ``images`` column of PNG bytes,
    ``<image>`` in the prompt). Every picture is drawn anew, so the test pictures are unseen."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    train = [_row(rng, rng.randrange(len(TEMPLATES)), "train", i) for i in range(n_train)]
    # Test: every phrasing equally often, so the warm start's style split shows as about half accuracy.
    test = [_row(rng, i % len(TEMPLATES), "test", i) for i in range(n_test)]
    os.makedirs(out_dir, exist_ok=True)
    paths = {"train": os.path.join(out_dir, "train.parquet"), "test": os.path.join(out_dir, "test.parquet")}
    pq.write_table(pa.Table.from_pylist(train), paths["train"])
    pq.write_table(pa.Table.from_pylist(test), paths["test"])
    return paths


# ---------------------------------------------------------------------- model helpers
def load_items(path: str, processor: Any, max_prompt_length: int) -> list[dict]:
    """The parquet's rows as `fusedrl.data.multimodal.VisionLanguageDataset` items (decoded, processed)."""
    from fusedrl.data.multimodal import VisionLanguageDataset

    dataset = VisionLanguageDataset(path, processor, max_prompt_length)
    return [dataset[i] for i in range(len(dataset))]


def save_model(model: Any, base_dir: str, out_dir: str) -> str:
    """``model``'s weights and config in ``out_dir``, beside the base folder's tokenizer and processor files."""
    import shutil

    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(base_dir):
        if not name.endswith(".safetensors") and name not in ("config.json", "generation_config.json"):
            shutil.copy(os.path.join(base_dir, name), out_dir)
    model.save_pretrained(out_dir)
    return out_dir


# ---------------------------------------------------------------------- warm start (plain PyTorch)
def _with_responses(items: Sequence[dict], responses: Sequence[list[int]], pad_id: int, max_prompt: int):
    """The prompt-only batch of ``items`` plus right-padded ``responses`` (token ids), and its images."""
    import torch

    from fusedrl.data.dataset import collate
    from fusedrl.data.multimodal import VisionInputs

    batch = collate(items, pad_id, max_prompt)
    width = max(len(r) for r in responses)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)  # [B, Tr]
    mask = torch.zeros((len(items), width), dtype=torch.long)  # [B, Tr]
    for r, resp in enumerate(responses):
        ids[r, : len(resp)] = torch.tensor(resp)
        mask[r, : len(resp)] = 1
    batch.set_fields({"responses": ids, "response_mask": mask})
    return batch, VisionInputs.from_items(items)


def sft_warm_start(
    model_dir: str,
    items: Sequence[dict],
    out_dir: str,
    *,
    steps: int,
    lr: float,
    seed: int,
    batch_size: int = 16,
    max_prompt_length: int = 48,
) -> tuple[str, float]:
    """Supervised warm start on demonstrations drawn per step (the style by the phrasing's mix): the
    negative log-likelihood of the response tokens, through the actor's own log-prob pass
    (`fusedrl.workers.vision.vision_response_log_probs`: M-RoPE positions, images beside the rows).
    fusedrl's SFT trainer reads text only, so this stage is plain PyTorch on one process.
    Returns (the saved folder, seconds)."""
    import torch

    from fusedrl.models.qwen_vl import load_processor
    from fusedrl.workers.vision import load_vision_language_model, vision_response_log_probs

    torch.manual_seed(seed)
    rng = random.Random(seed + 1000)
    tok = load_processor(model_dir).tokenizer
    pad_id, eos_id = tok.pad_token_id, tok.eos_token_id
    model = load_vision_language_model(model_dir, torch.float32).train()
    optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 10))  # 10 warm-up steps
    t0 = time.monotonic()
    for step in range(steps):
        rows = rng.sample(list(items), batch_size)
        texts = []
        for row in rows:
            count = int(row["ground_truth"])
            p_short = TEMPLATES[row["extra_info"]["template"]][1]
            texts.append(short_answer(count) if rng.random() < p_short else verbose_answer(count))
        responses = [tok(t, add_special_tokens=False)["input_ids"] + [eos_id] for t in texts]
        batch, vision = _with_responses(rows, responses, pad_id, max_prompt_length)
        log_probs, mask = vision_response_log_probs(
            model, batch, vision, temperature=1.0, pad_token_id=pad_id
        )
        loss = -(log_probs * mask).sum() / mask.sum()  # mean NLL per response token
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        schedule.step()
        if (step + 1) % 50 == 0 or step == steps - 1:
            print(f"[sft] step {step + 1}/{steps} loss {loss.item():.3f}", flush=True)
    seconds = time.monotonic() - t0
    return save_model(model, model_dir, out_dir), seconds


# ---------------------------------------------------------------------- held-out evaluation
def greedy_responses(model: Any, tok: Any, items: Sequence[dict], max_new_tokens: int = 16) -> list[str]:
    """Greedy decoding with transformers (a full forward per token: the model is tiny). A vision token
    ends a response, as the trainer's rollout cuts it (`fusedrl.workers.vision.cut_at_vision_tokens`)."""
    import torch

    from fusedrl.workers.vision import mrope_positions, vision_token_ids

    pad_id, eos_id = tok.pad_token_id, tok.eos_token_id
    vision_ids = torch.tensor(vision_token_ids(model.config))
    max_prompt = max(len(it["prompt_ids"]) for it in items)
    batch, vision = _with_responses(items, [[pad_id]] * len(items), pad_id, max_prompt)
    pixel_values, grids = vision.concatenated()
    b = len(items)
    out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long)  # [B, T]
    done = torch.zeros(b, dtype=torch.bool)
    with torch.no_grad():
        for t in range(max_new_tokens):
            input_ids = torch.cat([batch.prompts, out[:, :t]], dim=1)  # [B, Tp+t]
            attn = torch.cat([batch.prompt_mask, torch.ones(b, t, dtype=torch.long)], dim=1)  # [B, Tp+t]
            positions = mrope_positions(model, input_ids, attn, grids)  # [3, B, Tp+t]
            logits = model(
                input_ids=input_ids,
                attention_mask=attn,
                position_ids=positions,
                pixel_values=pixel_values,
                image_grid_thw=grids,
            ).logits[:, -1]  # [B, V]
            nxt = logits.argmax(-1)  # [B]
            stop = done | torch.isin(nxt, vision_ids)
            out[:, t] = torch.where(stop, torch.full_like(nxt, pad_id), nxt)
            done = stop | (nxt == eos_id)
            if bool(done.all()):
                break
    texts = []
    for row in out.tolist():
        row = row[: row.index(eos_id)] if eos_id in row else row
        texts.append(tok.decode([i for i in row if i != pad_id], skip_special_tokens=True))
    return texts


def held_out_accuracy(model_dir: str, items: Sequence[dict], state: dict | None = None) -> dict[str, Any]:
    """Greedy held-out scores of the folder's model (or of ``state`` loaded into it): ``accuracy`` (the
    verifier's), ``count_skill`` (the FIRST integer is the count), ``short`` (share of one-number answers)
    and a few ``examples``."""
    import re

    import torch

    from fusedrl.models.qwen_vl import load_processor
    from fusedrl.rewards.arithmetic import compute_score
    from fusedrl.workers.vision import load_vision_language_model

    tok = load_processor(model_dir).tokenizer
    model = load_vision_language_model(model_dir, torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=True)
    responses = greedy_responses(model, tok, items)
    truths = [it["ground_truth"] for it in items]
    numbers = [re.findall(r"-?\d+", r) for r in responses]
    n = len(items)
    return {
        "accuracy": sum(compute_score(r, t) for r, t in zip(responses, truths)) / n,
        "count_skill": sum(nums[:1] == [t] for nums, t in zip(numbers, truths)) / n,
        "short": sum(len(nums) == 1 for nums in numbers) / n,
        "examples": responses[:4],
    }
