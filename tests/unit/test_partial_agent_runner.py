"""Partial rollout of agent loops (`fusedrl.workers.rollout.partial_agent.PartialAgentRollout` on
`fusedrl.agent.resumable.ResumableRunner`) on the scripted request engine of the single-turn tests
(`benchmarks.partial_rollout_model.ScriptedEngine`: a prompt ``[L, 3, 7]`` wants ``L`` response tokens in
all; each step samples token ``100 + position`` with log-prob ``-(position + 1) / 100``, EOS at position
``L - 1``; observation tokens count as positions). The loop below takes turns of at most 4 tokens with a
2-token observation ``[9, 9]`` between them, so every pause (mid-turn, or between turns on a gated
environment call), resumed request, per-token version and returned group is hand-checked.
"""

from __future__ import annotations

import threading
import types

import pytest

from benchmarks.partial_rollout_model import ScriptedEngine, scripted_batch
from fusedrl.agent import AgentLoop, MultiTurnConfig, ToolSet, register_agent_loop
from fusedrl.agent.resumable import SEED_STRIDE
from fusedrl.agent.runner import turn_seed
from fusedrl.workers.rollout.base import SamplingConfig
from fusedrl.workers.rollout.partial_agent import PartialAgentRollout

EOS, PAD, TR, OBS = 2, 0, 16, [9, 9]
GATES: dict[int, threading.Event] = {}  # wanted length L -> an event its environment call waits for
RAN: list[int] = []  # the lengths whose gated call has returned (in the tool thread)


@register_agent_loop("test_partial_turns")
class Turns(AgentLoop):
    """Turns of <= 4 tokens, observation [9, 9] between them, until EOS or the budget; a row whose L is in
    GATES waits on its environment call after the first turn (between turns)."""

    async def run(self, row, traj, ctx):
        length = row["prompt_ids"][0]
        while True:
            ids, lps, finish = await ctx.generate(traj)
            traj.add_sampled(ids, lps, "")
            if finish == "stop" or traj.remaining <= len(OBS):
                return
            if length in GATES and traj.stats["assistant_turns"] == 1:
                await ctx.call_env(traj, lambda: (GATES[length].wait(10), RAN.append(length)))
            traj.add_observation(list(OBS), [{"role": "user", "content": "go on"}])


ENDED: list[int] = []  # the lengths whose loop has left (finished or cancelled), in that order


@register_agent_loop("test_partial_turns_ended")
class TurnsEnded(Turns):
    """`Turns`, recording its row's L when the loop leaves, as an environment's ``close`` in a ``finally``."""

    async def run(self, row, traj, ctx):
        try:
            await super().run(row, traj, ctx)
        finally:
            ENDED.append(row["prompt_ids"][0])


def _rollout(n: int = 1, max_resumes: int = 3, agent: str = "test_partial_turns") -> PartialAgentRollout:
    cfg = MultiTurnConfig(enable=True, default_agent_name=agent, max_tokens_per_turn=4)
    inner = types.SimpleNamespace(
        engine=ScriptedEngine(),
        renderer=None,
        tools=ToolSet([]),
        multi_turn=cfg,
        max_response_length=TR,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return PartialAgentRollout(inner, n=n, max_resumes=max_resumes)  # type: ignore[arg-type]


SAMPLING = SamplingConfig(max_tokens=TR)


def _row(out, i: int) -> tuple[list[int], list[int], list[int]]:
    """Row ``i``'s response tokens, sampled mask and token versions (padding cut)."""
    k = int(out.response_attention_mask[i].sum())
    return (
        out.responses[i, :k].tolist(),
        out.response_mask[i, :k].tolist(),
        out.token_versions[i, :k].tolist(),
    )


def test_a_trajectory_paused_mid_turn_resumes_under_the_next_version():
    pr = _rollout()
    # L=8: [100..103] obs [106, EOS]: done after 6 engine steps. L=14 is then 2 tokens into its second turn.
    out = pr.generate_partial(scripted_batch([8, 14]), SAMPLING, version=0, quota=1)
    assert out.ground_truth == ["8"]
    assert _row(out, 0) == ([100, 101, 102, 103, *OBS, 106, EOS], [1, 1, 1, 1, 0, 0, 1, 1], [0] * 8)
    assert out.rollout_log_probs[0, 4:6].tolist() == [0.0, 0.0]  # observations: no log-prob
    assert out.policy_version.tolist() == [0]
    (group,) = pr.groups
    assert group.resumes == [1]  # sampled before the pause: one resume counted

    out2 = pr.generate_partial(scripted_batch([20], seed0=5), SAMPLING, version=1, quota=1)
    # the paused turn resubmitted on its context + the 2 tokens it sampled, for the rest of its 4, reseeded
    rid, prompt, params = next(s for s in pr.runner.engine.submitted if s[0] == "1.1" and len(s[1]) > 9)
    assert prompt == [14, 3, 7, 100, 101, 102, 103, *OBS, 106, 107] and params.max_tokens == 2
    assert params.seed == (turn_seed(1, 1) + SEED_STRIDE) % (1 << 63)
    assert out2.ground_truth == ["14"]
    ids, mask, versions = _row(out2, 0)
    assert ids == [100, 101, 102, 103, *OBS, 106, 107, 108, 109, *OBS, 112, EOS]
    assert versions == [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1]  # two versions in one trajectory
    assert mask == [1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1]
    assert out2.rollout_log_probs[0, :14].tolist() == pytest.approx(
        [-(p + 1) / 100 if m else 0.0 for p, m in enumerate(mask)]
    )
    assert out2.policy_version.tolist() == [0]  # its oldest token
    pr.close()


def test_a_trajectory_waiting_on_its_environment_is_carried_and_the_call_runs_on():
    GATES[9] = threading.Event()
    RAN.clear()
    pr = _rollout()
    # L=9 waits on its gated call after turn 1; L=7 finishes ([100..103] obs [EOS]) while it waits
    out = pr.generate_partial(scripted_batch([9, 7]), SAMPLING, version=0, quota=1)
    assert out.ground_truth == ["7"] and RAN == []
    GATES[9].set()  # the call finishes while the engine sleeps: no engine step runs meanwhile
    for _ in range(100):
        if RAN:
            break
        threading.Event().wait(0.05)
    assert RAN == [9] and pr.runner.engine.num_unfinished() == 0
    out2 = pr.generate_partial(scripted_batch([30], seed0=4), SAMPLING, version=1, quota=1)
    assert out2.ground_truth == ["9"]
    ids, mask, versions = _row(out2, 0)
    assert ids == [100, 101, 102, 103, *OBS, 106, 107, EOS] and versions == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert out2.agent_stats is not None
    pr.close()


def test_a_group_at_its_resume_cap_finishes_before_the_call_returns():
    pr = _rollout(max_resumes=1)
    pr.generate_partial(scripted_batch([8, 16]), SAMPLING, version=0, quota=1)
    # the L=16 trajectory was carried once: the next call waits for it (2 + 4 more steps), though the new
    # L=4 group finishes after 4
    out = pr.generate_partial(scripted_batch([4], seed0=3), SAMPLING, version=1, quota=1)
    assert out.ground_truth == ["4"] and pr.runner.engine.num_unfinished() == 0
    assert [g.rows.ground_truth for g in pr.finished] == [["16"]]  # finished in this call, carried finished
    out = pr.generate_partial(scripted_batch([8], seed0=6), SAMPLING, version=2, quota=1)
    assert out.ground_truth == ["16"]  # finished groups come first
    assert _row(out, 0)[2] == [0] * 8 + [1] * 2 + [0, 0] + [1] * 4
    pr.close()


def test_draining_runs_everything_in_flight_and_the_saved_state_resumes_exactly():
    def run(pr, version, lengths, seed0, drain=False):
        out = pr.generate_partial(
            scripted_batch(lengths, seed0=seed0), SAMPLING, version=version, quota=1, drain=drain
        )
        return [(g, _row(out, i)) for i, g in enumerate(out.ground_truth)]

    a = _rollout()
    run(a, 0, [8, 14, 15], 0)
    # a state saved now (not drained) keeps the unfinished groups' prompts only
    saved = a.state()
    assert [e["finished"] for e in saved["groups"]] == [False, False]
    drained = run(a, 1, [12], 3, drain=True)
    assert all(g.done for g in a.groups) and len(a.groups) == 2
    state = a.state()
    assert [e["finished"] for e in state["groups"]] == [True, True]
    b = _rollout()
    b.load_state(state)
    assert drained and run(a, 2, [9], 4) == run(b, 2, [9], 4)
    assert run(a, 3, [10], 5) == run(b, 3, [10], 5)
    a.close(), b.close()
    # the state saved without a drain (a preemption's): the unfinished groups restart from their prompts
    c = _rollout()
    c.load_state(saved)
    restarted = run(c, 7, [13], 9, drain=True)
    # L=14 and L=15 start over (in `a` L=14 was 8 positions in): the new L=13 finishes first
    assert [g for g, _ in restarted] == ["13"]
    assert [g.rows.ground_truth for g in c.finished] == [["14"], ["15"]]
    for group in c.finished:
        assert group.out is not None
        sampled = group.out.response_mask.bool()
        assert (group.out.token_versions[sampled] == 7).all()  # every token sampled again, by version 7
    c.close()


def test_the_workers_close_at_the_runs_end_cancels_suspended_trajectories():
    """`WorkerDict.rollout_close_partial` (called by `PartialRolloutTrainer.close` before the workers are
    killed) cancels the trajectories still suspended: their loops' ``finally`` run (environments close)."""
    from fusedrl.workers.worker_dict import WorkerDict

    worker = WorkerDict.__new__(WorkerDict)  # the method reads ``partial`` only
    worker.partial = None
    worker.rollout_close_partial()  # nothing built yet: nothing to close
    worker.partial = pr = _rollout(agent="test_partial_turns_ended")
    ENDED.clear()
    out = pr.generate_partial(scripted_batch([8, 14]), SAMPLING, version=0, quota=1)
    assert out.ground_truth == ["8"] and ENDED == [8]  # L=14 is suspended mid-turn
    worker.rollout_close_partial()
    assert ENDED == [8, 14] and pr.runner.loop.is_closed()
