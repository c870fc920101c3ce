"""Arithmetic rule reward, the data_source dispatcher and NaiveRewardManager."""

from __future__ import annotations

import math

import pytest
import torch

from fusedrl.batch import RolloutBatch
from fusedrl.rewards import NaiveRewardManager, default_compute_score
from fusedrl.rewards.arithmetic import compute_score


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from fusedrl.utils.tiny_model import build_tokenizer

    cache = tmp_path_factory.getbasetemp() / "fusedrl_test_tokenizer"
    if (cache / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cache)
    return build_tokenizer(cache)


# ---------------------------------------------------------------- arithmetic rule
@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("The answer is 68.", "68", 1.0),
        ("68 then 12", "68", 0.0),
        ("-5", "-5", 1.0),
        ("no number", "3", 0.0),
        ("", "0", 0.0),
        ("23 - 45 = -22", "-22", 1.0),
        ("23 - 45 = 22", "-22", 0.0),
        ("so it is 007", "7", 1.0),
        ("The answer is 68", 68, 1.0),
        ("12 + 3 = 15\n#### 15", " 15 ", 1.0),
        ("3.5", "5", 1.0),  # only integers count: the last one here is 5
    ],
)
def test_arithmetic_compute_score(response, truth, expected):
    assert compute_score(response, truth) == expected


def test_arithmetic_bad_ground_truth():
    with pytest.raises(ValueError, match="integer"):
        compute_score("1", "one")


def test_arithmetic_huge_number_is_just_wrong():
    assert compute_score("9" * 5000, "9") == 0.0


def test_default_compute_score_dispatch():
    assert default_compute_score("arithmetic", "The answer is 68.", "68") == 1.0
    assert default_compute_score("arithmetic", "nope", "68", extra_info={"index": 0}) == 0.0
    with pytest.raises(NotImplementedError) as info:
        default_compute_score("my/task", "x", "1")
    assert "my/task" in str(info.value) and "custom_reward_function.path" in str(info.value)


# ---------------------------------------------------------------- manager
TR = 12


def _batch(tokenizer, texts, truths, data_sources=None, eos=None):
    """Right-padded responses; ``eos[i]`` says whether row i ends with the EOS token."""
    pad, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    b = len(texts)
    eos = eos if eos is not None else [True] * b
    responses = torch.full((b, TR), pad, dtype=torch.long)
    mask = torch.zeros((b, TR), dtype=torch.long)
    lengths = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text, add_special_tokens=False) if text else []
        if eos[i]:
            ids = ids + [eos_id]
        assert len(ids) <= TR, (text, len(ids))
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, : len(ids)] = 1
        lengths.append(len(ids))
    batch = RolloutBatch.from_prompts(
        torch.ones((b, 3), dtype=torch.long),
        torch.ones((b, 3), dtype=torch.long),
        uid=[f"u{i}" for i in range(b)],
        data_source=data_sources or ["arithmetic"] * b,
        ground_truth=truths,
        extra_info=[{"index": i} for i in range(b)],
    )
    batch.responses = responses
    batch.response_mask = mask
    return batch, lengths


def test_manager_places_score_on_last_valid_token(tokenizer):
    texts = ["The answer is 68.", "68 then 12", "-5", "", "no number"]
    truths = ["68", "68", "-5", "0", "1"]
    batch, lengths = _batch(tokenizer, texts, truths, eos=[True, True, False, False, True])
    assert lengths[3] == 0 and all(n < TR for n in lengths)  # real right padding on every row

    scores, metrics = NaiveRewardManager(tokenizer)(batch)
    assert scores.shape == (5, TR) and scores.dtype == torch.float32
    expected = [1.0, 0.0, 1.0, 0.0, 0.0]
    for i, (n, value) in enumerate(zip(lengths, expected)):
        row = torch.zeros(TR)
        if n:
            row[n - 1] = value
        assert torch.equal(scores[i], row), (i, scores[i])
    assert scores.sum().item() == 2.0
    assert metrics["reward/errors"] == 0.0
    assert metrics["reward/empty_responses"] == 1.0
    assert metrics["reward/score/mean"] == pytest.approx(2 / 5)


def test_manager_decodes_valid_tokens_without_special_tokens(tokenizer):
    seen = []

    def spy(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return 0.5

    batch, lengths = _batch(tokenizer, ["The answer is 68.", "-5"], ["68", "-5"], eos=[True, False])
    scores, _ = NaiveRewardManager(tokenizer, compute_score=spy)(batch)
    assert seen == [
        ("arithmetic", "The answer is 68.", "68", {"index": 0}),
        ("arithmetic", "-5", "-5", {"index": 1}),
    ]
    assert scores[0, lengths[0] - 1] == 0.5 and scores[1, lengths[1] - 1] == 0.5
    assert scores.sum().item() == 1.0


def test_manager_dict_scores_and_metrics(tokenizer):
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        ok = compute_score(solution_str, ground_truth)
        return {"score": 2.0 * ok - 1.0, "acc": ok}

    batch, lengths = _batch(
        tokenizer, ["is 7", "is 8", "is 9"], ["7", "7", "9"], data_sources=["a", "a", "b"]
    )
    scores, metrics = NaiveRewardManager(tokenizer, compute_score=scorer)(batch)
    assert [scores[i, lengths[i] - 1].item() for i in range(3)] == [1.0, -1.0, 1.0]
    assert metrics["reward/extra/acc/mean"] == pytest.approx(2 / 3)
    assert metrics["reward/a/score/mean"] == 0.0 and metrics["reward/b/score/mean"] == 1.0


def test_manager_bad_results(tokenizer):
    batch, _ = _batch(tokenizer, ["is 7", "is 8"], ["7", "8"])

    def no_score_key(**kwargs):
        return {"acc": 1.0}

    with pytest.raises(RuntimeError, match="without 'score'"):
        NaiveRewardManager(tokenizer, compute_score=no_score_key)(batch)

    calls = iter([1.0, math.nan])
    scores, metrics = NaiveRewardManager(tokenizer, compute_score=lambda **kw: next(calls))(batch)
    assert metrics["reward/errors"] == 1.0 and torch.isfinite(scores).all() and scores.sum().item() == 1.0


def test_manager_reraises_with_sample_index(tokenizer):
    batch, _ = _batch(
        tokenizer,
        ["is 7", "is 8", "is 9"],
        ["7", "8", "9"],
        data_sources=["arithmetic", "arithmetic", "mystery"],
    )
    with pytest.raises(RuntimeError) as info:
        NaiveRewardManager(tokenizer)(batch)
    msg = str(info.value)
    assert "sample 2" in msg and "mystery" in msg
    assert isinstance(info.value.__cause__, NotImplementedError)


def test_manager_needs_responses(tokenizer):
    batch = RolloutBatch.from_prompts(
        torch.ones((1, 3), dtype=torch.long),
        torch.ones((1, 3), dtype=torch.long),
        uid=["u"],
        data_source=["arithmetic"],
        ground_truth=["1"],
    )
    with pytest.raises(ValueError, match="no responses"):
        NaiveRewardManager(tokenizer)(batch)
