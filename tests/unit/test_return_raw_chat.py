"""``data.return_raw_chat``: each row's chat messages reach the reward function as ``extra_info["raw_prompt"]``,
through the trainer's real dataset construction (`prompt_data`), the loader and the reward manager (inline
and in worker processes)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from fusedrl.batch import RolloutBatch

SEEN: list[dict] = []


def _inline_scorer(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    SEEN.append(dict(extra_info or {}))
    return 0.0


def _message_count_scorer(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    # Runs in a worker process: the messages must have crossed the process boundary.
    return float(len((extra_info or {}).get("raw_prompt", [])))


def _first_batch(config, tokenizer) -> RolloutBatch:
    from fusedrl.role_config import run_config
    from fusedrl.trainer.data_setup import prompt_data

    _, loader, _ = prompt_data(run_config(config), tokenizer, None)
    batch = next(iter(loader))
    b = batch.num_samples
    batch.responses = torch.full((b, 4), int(tokenizer.eos_token_id), dtype=torch.long)
    batch.response_mask = torch.zeros((b, 4), dtype=torch.long)
    batch.response_mask[:, 0] = 1  # one EOS token per row
    return batch


@pytest.mark.parametrize("workers", [0, 1])
def test_return_raw_chat_reaches_the_reward_function(workers, tiny_model_dir, arithmetic_data):
    from transformers import AutoTokenizer

    from fusedrl.config import load_config
    from fusedrl.rewards import build_reward_manager

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = pq.read_table(arithmetic_data[0]).column("prompt").to_pylist()
    common = [
        f"data.train_files={arithmetic_data[0]}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.shuffle=false",
        "algorithm.adv_estimator=grpo",
        f"reward_model.num_workers={workers}",
    ]
    on = load_config([*common, "data.return_raw_chat=true"])
    off = load_config([*common, "data.return_raw_chat=false"])
    scorer = _inline_scorer if workers == 0 else _message_count_scorer

    batch = _first_batch(on, tokenizer)
    manager = build_reward_manager(on, tokenizer, scorer)
    try:
        scores, _ = manager(batch)
    finally:
        getattr(manager, "close", lambda: None)()
    if workers == 0:
        # Unshuffled: the first batch is the file's first rows, messages as stored.
        assert [s["raw_prompt"] for s in SEEN] == [list(map(dict, m)) for m in rows[:4]]
    else:
        assert scores.sum(-1).tolist() == [float(len(m)) for m in rows[:4]]

    SEEN.clear()
    batch = _first_batch(off, tokenizer)
    manager = build_reward_manager(off, tokenizer, scorer)
    try:
        scores, _ = manager(batch)
    finally:
        getattr(manager, "close", lambda: None)()
    if workers == 0:
        assert len(SEEN) == 4 and not any("raw_prompt" in s for s in SEEN)
    else:
        assert scores.abs().sum() == 0
    SEEN.clear()
