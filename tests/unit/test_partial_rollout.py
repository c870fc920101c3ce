"""Partial rollout (`fusedrl.workers.rollout.partial.PartialRollout`) on a scripted request engine whose
response lengths are known (`benchmarks.partial_rollout_model.ScriptedEngine`: a prompt ``[L, P, ...]`` of
``P`` tokens asks for ``L`` response tokens; each step samples token ``100 + position`` with log-prob
``-(position + 1) / 100`` for every queued request, EOS at ``L``), so every pause, resume, per-token
version and returned group is hand-checked; and the model of the gain built on it.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.partial_rollout_model import ScriptedEngine, scripted_batch, simulate
from fusedrl.batch import RolloutBatch
from fusedrl.workers.rollout.base import SamplingConfig
from fusedrl.workers.rollout.partial import PartialRollout

EOS, PAD, TR = 2, 0, 16
_batch = scripted_batch


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


def test_the_modelled_gain_comes_from_the_tail_and_an_iterations_fixed_cost():
    common = dict(steps=8, groups=4, n=2, median=16, max_len=256, max_resumes=3, fixed=1.0, per_request=0.0)
    sync = simulate(sigma=1.0, extra=0, **common)
    partial = simulate(sigma=1.0, extra=4, **common)
    assert sync["age_max"] == 0 and partial["age_max"] >= 1
    assert partial["tokens_per_time"] > 1.3 * sync["tokens_per_time"]
    # responses of one length: partial gains only what the larger batch gives a synchronous step
    even, wide = (
        simulate(sigma=0.0, extra=4, **common),
        simulate(sigma=0.0, extra=0, **{**common, "groups": 8}),
    )
    assert even["tokens_per_time"] == pytest.approx(wide["tokens_per_time"])
    # an engine whose iterations cost only per running request gains nothing: sync trains every token it
    # pays for, partial pays too for the tokens still in flight when the run ends
    per_token = {**common, "fixed": 0.0, "per_request": 1.0}
    assert simulate(sigma=1.0, extra=0, **per_token)["tokens_per_time"] == pytest.approx(1.0)
    assert simulate(sigma=1.0, extra=4, **per_token)["tokens_per_time"] < 1.0


def test_a_run_resumed_from_the_saved_state_continues_the_paused_requests_exactly():
    import pickle

    sampling = SamplingConfig(max_tokens=TR)
    steps = [([2, 3, 9, 10, 3, 2], 2), ([4, 4], 1), ([12, 12], 1), ([1, 1], 1)]

    def run(pr: PartialRollout, todo) -> list:
        outs = []
        for k, (lengths, quota) in todo:
            out = pr.generate_partial(_batch(lengths, seed0=10 * k), sampling, version=k, quota=quota)
            outs.append((out.responses, out.rollout_log_probs, out.token_versions, out.ground_truth, out.uid))
        return outs

    whole = run(_rollout(), enumerate(steps))
    first = _rollout()
    head = run(first, enumerate(steps[:2]))
    saved = pickle.loads(pickle.dumps(first.state()))  # what a checkpoint keeps
    assert saved["groups"] and saved["groups"][0][0]["ids"]  # paused requests are in it
    resumed = _rollout()  # a new process: a new engine, nothing queued
    resumed.load_state(saved)
    tail = run(resumed, list(enumerate(steps))[2:])
    for a, b in zip(whole, head + tail, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3], strict=True)) and a[3:] == b[3:]


def test_the_benchmark_sets_max_resumes_on_the_partial_runs_only_when_asked():
    from benchmarks.partial_rollout import overrides

    def keys(mode: str, max_resumes: int | None) -> list[str]:
        args = overrides("m", "r.py", "out", 0, 5, mode, 1.0, max_resumes=max_resumes)
        return [a for a in args if a.startswith("async_training.partial_rollout_max_resumes")]

    assert keys("partial", 4) == ["async_training.partial_rollout_max_resumes=4"]
    assert keys("partial", None) == []  # the config's default
    assert keys("sync", 4) == []  # nothing is paused in a synchronous run
