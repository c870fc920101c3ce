"""Partial rollout (`fusedrl.workers.rollout.partial.PartialRollout`) on a scripted request engine whose
response lengths are known, so every pause, resume, per-token version and returned group is hand-checked.

The scripted engine: a prompt ``[L, P, ...]`` of ``P`` tokens asks for a response of ``L`` tokens in all;
tokens already past ``P`` (a resumed request) count as sampled. Each `step` samples one token for every
queued request: token ``100 + position``, log-prob ``-(position + 1) / 100``; it stops (EOS) at ``L``.
"""

from __future__ import annotations

import pytest
import torch

from fusedrl.batch import RolloutBatch
from fusedrl.workers.rollout.base import SampleParams, SamplingConfig
from fusedrl.workers.rollout.partial import PartialRollout

EOS, PAD, TR = 2, 0, 16


class ScriptedEngine:
    def __init__(self) -> None:
        self.queue: dict[str, list] = {}  # id -> [prompt, params, new ids]
        self.submitted: list[tuple[str, list[int], SampleParams]] = []
        self.steps = 0

    def submit(self, request_id: str, prompt: list[int], params: SampleParams) -> None:
        self.submitted.append((request_id, list(prompt), params))
        self.queue[request_id] = [list(prompt), params, []]

    def _pos(self, prompt: list[int], new: list[int]) -> int:
        return len(prompt) - prompt[1] + len(new)  # response tokens sampled so far

    def step(self):
        self.steps += 1
        done = []
        for rid, (prompt, params, new) in list(self.queue.items()):
            pos = self._pos(prompt, new)
            new.append(EOS if pos + 1 == prompt[0] else 100 + pos)
            if new[-1] == EOS or len(new) == params.max_tokens:
                del self.queue[rid]
                lps = [-(self._pos(prompt, []) + k + 1) / 100 for k in range(len(new))]
                done.append((rid, new, lps, "stop" if new[-1] == EOS else "length"))
        return done

    def pause(self, request_ids=None):
        ids = list(self.queue) if request_ids is None else list(request_ids)
        out = []
        for rid in ids:
            prompt, _, new = self.queue.pop(rid)
            out.append((rid, new, [-(self._pos(prompt, []) + k + 1) / 100 for k in range(len(new))]))
        return out

    def num_unfinished(self) -> int:
        return len(self.queue)


def _batch(lengths: list[int], seed0: int = 0) -> RolloutBatch:
    """One row per length (groups of n consecutive rows), prompts [L, 3, 7] left-padded to 5."""
    b = len(lengths)
    prompts = torch.zeros(b, 5, dtype=torch.long)  # [B, Tp]
    mask = torch.zeros(b, 5, dtype=torch.long)  # [B, Tp]
    for i, length in enumerate(lengths):
        prompts[i, 2:] = torch.tensor([length, 3, 7])
        mask[i, 2:] = 1
    batch = RolloutBatch.from_prompts(
        prompts,
        mask,
        uid=[f"u{i}" for i in range(b)],
        data_source=["x"] * b,
        ground_truth=[str(x) for x in lengths],
    )
    batch.sample_seeds = torch.arange(seed0, seed0 + b)
    return batch


def _rollout(n: int = 2, max_resumes: int = 3) -> PartialRollout:
    return PartialRollout(
        ScriptedEngine(),
        n=n,
        max_resumes=max_resumes,
        max_response_length=TR,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )


def _tokens(batch: RolloutBatch, i: int) -> list[int]:
    return batch.responses[i, : int(batch.response_mask[i].sum())].tolist()


def test_the_first_groups_to_finish_return_and_the_rest_resume_under_the_next_version():
    pr, sampling = _rollout(), SamplingConfig(max_tokens=TR)
    # groups of 2: A = (2, 3) tokens, B = (9, 10), C = (3, 2): two of three are wanted
    out = pr.generate_partial(_batch([2, 3, 9, 10, 3, 2]), sampling, version=5, quota=2)
    assert out.ground_truth == ["2", "3", "3", "2"]  # A and C, in the order they finished
    assert pr.engine.steps == 3  # stopped as soon as the second group was whole
    assert _tokens(out, 0) == [100, EOS] and _tokens(out, 1) == [100, 101, EOS]
    assert out.rollout_log_probs[1, :3].tolist() == pytest.approx([-0.01, -0.02, -0.03])
    assert (out.token_versions[out.response_mask.bool()] == 5).all() and out.policy_version.tolist() == [
        5
    ] * 4
    assert (out.token_versions[~out.response_mask.bool()] == 0).all()
    # B was paused after 3 tokens each and is carried
    (group,) = pr.carried
    assert [s.ids for s in group] == [[100, 101, 102]] * 2 and [s.resumes for s in group] == [1, 1]

    # next step: B resumes on prompt + its 3 tokens, with the rest of the budget and a seed of its own
    out2 = pr.generate_partial(_batch([4, 4], seed0=10), sampling, version=6, quota=1)
    resumed = {rid: (p, params) for rid, p, params in pr.engine.submitted[-4:] if rid.startswith("0.")}
    assert resumed["0.0"][0] == [9, 3, 7, 100, 101, 102] and resumed["0.0"][1].max_tokens == TR - 3
    assert resumed["0.0"][1].seed == (2 + 0x9E3779B1) % (1 << 63)  # row 2's seed, resumed once
    assert out2.ground_truth == ["4", "4"]  # the new group (4 tokens) beats B's remaining 6 and 7
    (group,) = pr.carried
    assert [len(s.ids) for s in group] == [7, 7] and [s.resumes for s in group] == [2, 2]
    assert group[0].versions == [5, 5, 5, 6, 6, 6, 6]

    out3 = pr.generate_partial(_batch([12, 12], seed0=20), sampling, version=7, quota=1)
    assert out3.ground_truth == ["9", "10"] and pr.carried and len(pr.carried[0]) == 2
    assert _tokens(out3, 1) == [100 + k for k in range(9)] + [EOS]
    assert out3.token_versions[1, :10].tolist() == [5, 5, 5, 6, 6, 6, 6, 7, 7, 7]
    assert out3.policy_version.tolist() == [5, 5]  # the oldest version in each row
    # the log-probs of a resumed row are those of each position, wherever it was sampled
    assert out3.rollout_log_probs[1, :10].tolist() == pytest.approx([-(k + 1) / 100 for k in range(10)])


def test_a_group_at_its_resume_cap_finishes_before_the_call_returns():
    pr, sampling = _rollout(max_resumes=1), SamplingConfig(max_tokens=TR)
    pr.generate_partial(_batch([2, 2, 12, 12]), sampling, version=0, quota=1)  # the long group paused once
    assert pr.carried[0][0].resumes == 1
    out = pr.generate_partial(_batch([2, 2]), sampling, version=1, quota=1)
    # the short new group finished first, but the capped one is run to its end in this call
    assert out.ground_truth == ["2", "2"] and pr.engine.steps == 2 + 10
    (done,) = pr.carried
    assert all(s.done for s in done) and [len(s.ids) for s in done] == [12, 12]
    out = pr.generate_partial(_batch([5, 5]), sampling, version=2, quota=1)
    assert out.ground_truth == ["12", "12"]  # finished groups carried over come first, no engine step
    assert pr.engine.steps == 12
    assert [s.resumes for s in pr.carried[0]] == [0, 0]  # queued, never stepped: not a resume


def test_bad_quotas_and_groups_are_refused():
    pr, sampling = _rollout(), SamplingConfig(max_tokens=TR)
    pr.generate_partial(_batch([2, 2, 9, 9]), sampling, version=0, quota=1)
    pr.generate_partial(_batch([9, 9]), sampling, version=1, quota=1)  # the long group of call 1 returns
    assert [s.resumes for g in pr.carried for s in g] == [1, 1]
    with pytest.raises(ValueError, match="quota=3"):
        pr.generate_partial(_batch([2, 2]), sampling, version=2, quota=3)
    with pytest.raises(ValueError, match="groups of n=2"):
        pr.generate_partial(_batch([2, 2, 2]), sampling, version=2, quota=1)


def test_the_budget_counts_tokens_sampled_before_a_pause():
    pr, sampling = _rollout(), SamplingConfig(max_tokens=6)
    pr.generate_partial(_batch([2, 2, 15, 15]), sampling, version=0, quota=1)  # long group: 2 tokens so far
    out = pr.generate_partial(_batch([1, 1]), sampling, version=1, quota=2)
    # the long rows stop at the 6-token budget (2 before the pause + 4 after), not 2 + 6
    assert sorted(int(m.sum()) for m in out.response_mask) == [1, 1, 6, 6]
