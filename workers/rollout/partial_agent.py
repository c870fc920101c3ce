"""Partial rollout of agent loops in the fused pool (``async_training.partial_rollout`` with
``actor_rollout_ref.rollout.multi_turn.enable``; docs/placement.md, "Partial rollout").

`PartialAgentRollout.generate_partial` is `fusedrl.workers.rollout.partial.PartialRollout`'s call for
multi-turn trajectories: it takes the step's new prompt groups (``n`` consecutive rows each) beside the
groups it carries, runs their agent loops on a `fusedrl.agent.resumable.ResumableRunner` until ``quota``
groups have finished, and returns those. Trajectories still running are suspended: mid-turn (the engine
request paused, its tokens, log-probs and versions kept) or between turns (waiting on a tool or an
environment, whose call keeps running while the engine sleeps). The next call continues them under the new
weights.

Rules (as single-turn):
- A group returns only whole, in the order groups finished; groups finished in an earlier call come first.
- A trajectory carried over ``max_resumes`` calls after it sampled its first token must finish in the call
  that resumes it: the call does not stop before its group has finished.
- Every response token carries the version that sampled it (``token_versions``; observation tokens and
  padding 0: they are out of the loss); ``policy_version`` is the oldest version a row's sampled tokens carry.

Checkpoints. A suspended coroutine, its tool calls and its environment cannot be saved. ``drain=True`` (the
trainer passes it on every step that saves a checkpoint, `trainer.partial_trainer`) runs every trajectory
in flight to its end under the call's weights before the call returns; the groups beyond the quota are
then carried finished, as plain rows, and `state` holds no suspended trajectory. The uninterrupted run
drains at the same steps, so a run resumed from such a checkpoint equals it. `state` at a call that did not
drain (a preemption's save) keeps each unfinished group's prompts only: the resumed run restarts those
trajectories from their prompts (a valid run, not equal to the uninterrupted one), with a warning.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from fusedrl.agent import Trajectory
from fusedrl.agent.resumable import ResumableRunner
from fusedrl.batch import RolloutBatch, concat
from fusedrl.workers.rollout.agent_rollout import AgentRollout, agent_rows, attach_trajectories
from fusedrl.workers.rollout.base import SamplingConfig, turn_sampling
from fusedrl.workers.rollout.partial import PartialRollout, check_partial_call

log = logging.getLogger(__name__)


@dataclass
class _Group:
    """``n`` rows of one prompt: as sent, their trajectories and tasks, or (finished) the rows to train on."""

    rows: RolloutBatch  # [n] as the driver sent them
    trajs: list[Trajectory] = field(default_factory=list)
    tasks: list[asyncio.Task] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)  # per trajectory: calls it was carried over, started
    out: RolloutBatch | None = None  # [n] finished, with responses and versions

    @property
    def done(self) -> bool:
        return self.out is not None


class PartialAgentRollout:
    """Agent loops on the engine of ``rollout`` (the worker's `AgentRollout`), whose `generate_partial`
    returns the first groups to finish (module docstring)."""

    def __init__(self, rollout: AgentRollout, *, n: int, max_resumes: int) -> None:
        if n < 1 or max_resumes < 0:
            raise ValueError(f"PartialAgentRollout: n={n} must be >= 1 and max_resumes={max_resumes} >= 0")
        self.n, self.max_resumes = int(n), int(max_resumes)
        self.max_response_length = rollout.max_response_length
        self.eos_token_id, self.pad_token_id = rollout.eos_token_id, rollout.pad_token_id
        self.runner = ResumableRunner(rollout.engine, rollout.renderer, rollout.tools, rollout.multi_turn)
        self.groups: list[_Group] = []  # in flight, finished or not, in the order they were sent
        self.finished: list[_Group] = []  # finished and not returned yet, in the order they finished
        self._index = itertools.count()  # trajectory ids (request ids, tool instances): unique per worker
        self.next_index = 0

    def generate_partial(
        self, batch: RolloutBatch, sampling: SamplingConfig, *, version: int, quota: int, drain: bool = False
    ) -> RolloutBatch:
        """``quota`` whole groups, the first to finish among the carried ones and the new ones of ``batch``,
        sampled by policy ``version`` from here on; ``drain``: every trajectory runs to its end first."""
        check_partial_call(batch.num_samples, self.n, len(self.groups), quota)
        budget = min(sampling.max_tokens, self.max_response_length)
        for k in range(batch.num_samples // self.n):
            self._start(batch[k * self.n : (k + 1) * self.n], budget)
        overdue = [g for g in self.groups if not g.done and any(r >= self.max_resumes for r in g.resumes)]

        def enough() -> bool:
            self._collect()
            if drain:
                return all(g.done for g in self.groups)
            return len(self.finished) >= quota and all(g.done for g in overdue)

        self.runner.drive(enough, turn_sampling(sampling, stop_token_id=self.eos_token_id), version)
        taken, self.finished = self.finished[:quota], self.finished[quota:]
        self.groups = [g for g in self.groups if not any(g is t for t in taken)]
        for g in self.groups:
            if not g.done:
                g.resumes = [
                    r + int(not task.done() and self.runner.sampled_or_waiting(t))
                    for r, t, task in zip(g.resumes, g.trajs, g.tasks)
                ]
        return concat([g.out for g in taken if g.out is not None])

    def close(self) -> None:
        """Cancel every suspended trajectory (the worker's end, or a test's)."""
        self.runner.close()

    # ------------------------------------------------------------------ groups
    def _start(self, rows: RolloutBatch, budget: int) -> _Group:
        group = _Group(rows)
        for row in agent_rows(rows):
            index = next(self._index)
            self.next_index = index + 1
            traj = Trajectory(
                prompt_ids=list(row["prompt_ids"]), budget=budget, index=index, seed=row["seed"]
            )
            group.trajs.append(traj)
            group.resumes.append(0)
            group.tasks.append(self.runner.start(row, traj))
        self.groups.append(group)
        return group

    def _collect(self) -> None:
        """Raise the first trajectory failure; mark the groups whose trajectories have all ended finished
        (in the order they were sent, among those ending at one engine step)."""
        for g in self.groups:
            for task in g.tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        for g in self.groups:
            if not g.done and all(t.done() for t in g.tasks):
                self._ended(g)

    def _ended(self, group: _Group) -> None:
        out = attach_trajectories(
            group.rows.clone(),
            group.trajs,
            max_response_length=self.max_response_length,
            pad_token_id=self.pad_token_id,
        )
        versions = torch.zeros_like(out.responses)  # [n, Tr]; 0 on observations and padding
        for i, t in enumerate(group.trajs):
            versions[i, : len(t.versions)] = torch.as_tensor(t.versions, dtype=torch.long)
        out.token_versions = versions
        out.policy_version = torch.tensor(
            [
                min((v for v, m in zip(t.versions, t.mask) if m), default=self.runner.version)
                for t in group.trajs
            ],
            dtype=torch.long,
        )
        group.out = out
        self.finished.append(group)

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """The carried groups as plain values: finished ones whole, unfinished ones as their prompts (after a
        call that drained there are none; otherwise they restart from their prompts on resume, warned)."""
        live = [g for g in self.groups if not g.done]
        if live:
            log.warning(
                "partial rollout with multi_turn: this checkpoint is saved at a step that did not drain (a "
                "preemption?); %d agent trajectory group(s) in flight cannot be saved mid-way and restart from "
                "their prompts when the run resumes (checkpoints of trainer.save_freq steps drain and resume "
                "exactly)",
                len(live),
            )
        done = [{"finished": True, "rows": g.out.to_dict()} for g in self.finished if g.out is not None]
        return {
            "groups": done + [{"finished": False, "rows": g.rows.to_dict()} for g in live],
            "next_index": self.next_index,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Carry the groups of `state` (what a checkpoint saved), replacing any carried now."""
        self.runner.close()
        self.runner = ResumableRunner(
            self.runner.engine, self.runner.renderer, self.runner.tools, self.runner.cfg
        )
        self.groups, self.finished = [], []
        self._index = itertools.count(int(state.get("next_index", 0)))
        self.next_index = int(state.get("next_index", 0))
        budget = self.max_response_length
        for entry in state["groups"]:
            rows = RolloutBatch.from_dict(entry["rows"], batch_size=[len(entry["rows"]["prompts"])])
            if entry["finished"]:
                group = _Group(rows, out=rows)
                self.groups.append(group)
                self.finished.append(group)
            else:
                self._start(rows, budget)


def partial_rollout_for(rollout: Any, cfg: Any) -> PartialRollout | PartialAgentRollout:
    """The worker's partial rollout on the engine of ``rollout``: agent loops under ``multi_turn`` (an
    `AgentRollout`), else single-turn requests; ``cfg`` is the worker's typed config."""
    resumes = cfg.async_training.partial_rollout_max_resumes
    if isinstance(rollout, AgentRollout):
        return PartialAgentRollout(rollout, n=cfg.rollout.n, max_resumes=resumes)
    return PartialRollout(
        rollout.engine,
        n=cfg.rollout.n,
        max_resumes=resumes,
        max_response_length=cfg.data.max_response_length,
        eos_token_id=cfg.tokens.eos,
        pad_token_id=cfg.tokens.pad,
    )
