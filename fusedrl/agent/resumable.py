"""An agent runner whose trajectories outlive one engine run: partial rollout of agent loops in the fused
pool (``async_training.partial_rollout`` with ``multi_turn``; `fusedrl.workers.rollout.partial_agent`).

`AgentRunner.run` runs a step's trajectories to the end in one ``asyncio.run``. `ResumableRunner` keeps one
event loop for the life of the worker instead: `start` turns rows into trajectory tasks on it, and `drive`
runs the loop (stepping the engine) only until the caller's condition holds (e.g. enough groups finished).
Then every request on the engine is paused: the tokens it sampled so far, their log-probs and the policy
version of each are kept with the request, and the coroutine that asked for the turn stays suspended,
waiting for it. The loop stops; the engine sleeps, the policy trains and its weights are synced. The next
`drive` resubmits each paused request on its context + the tokens sampled so far (the rest of its turn's
budget, a seed of its own derived from the turn's seed and the pause count) under the new weights, and
hands the turn to its coroutine only when it has finished, with the version of every token.

A trajectory waiting on a tool or an environment when the loop stops is paused between turns: its call
keeps running on the tool threads while the engine sleeps (its timeout counts wall-clock time, the sync
included), and the trajectory takes its result when the loop runs again.

Only this runner's pump touches the engine: a turn asked for is queued and submitted at the pump's next
iteration, so nothing reaches the engine while the loop is stopped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fusedrl.agent.render import ChatRenderer
from fusedrl.agent.runner import AgentRunner, MultiTurnConfig, TurnSampling
from fusedrl.agent.toolset import ToolSet
from fusedrl.agent.trajectory import Trajectory
from fusedrl.sampling import SampleParams

SEED_STRIDE = 0x9E3779B1  # a resumed request's seed: the turn's seed + pauses x this (mod 2**63)


@dataclass
class _Request:
    """One assistant turn asked for: its context and sampling, and what it sampled before pauses."""

    prompt: list[int]
    params: SampleParams
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    pauses: int = 0
    on_engine: bool = False


class ResumableRunner(AgentRunner):
    """`AgentRunner` on a persistent event loop whose trajectories may be suspended between `drive` calls
    (module docstring). ``schedule`` must be ``continuous``."""

    def __init__(
        self, engine: Any, renderer: ChatRenderer | None, tools: ToolSet, cfg: MultiTurnConfig
    ) -> None:
        super().__init__(engine, renderer, tools, cfg)
        if cfg.schedule != "continuous":
            raise ValueError(f"ResumableRunner: schedule={cfg.schedule!r}; partial rollout needs continuous")
        self.loop = asyncio.new_event_loop()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=cfg.tool_workers)
        self._waiting: dict[str, asyncio.Future] = {}
        self._requests: dict[str, _Request] = {}
        self._wake = asyncio.Event()  # bound to self.loop on first use (it is only awaited there)
        self._live = 0
        self.version = 0  # the policy version the engine samples with now
        self._sampling = TurnSampling()

    # ------------------------------------------------------------------ public
    def start(self, row: dict[str, Any], traj: Trajectory) -> asyncio.Task:
        """A task running ``row``'s agent loop into ``traj`` on this runner's loop (it runs during `drive`)."""
        self._live += 1
        return self.loop.create_task(self._one(row, traj))

    def drive(self, enough: Callable[[], bool], sampling: TurnSampling, version: int) -> None:
        """Run the trajectories, sampling with policy ``version``, until ``enough()`` (checked after every
        engine step, once the trajectories it served have run: it reads their tasks' ``done()``); then pause
        every request on the engine (module docstring)."""
        self._sampling, self.version = sampling, int(version)
        self.loop.run_until_complete(self._drive(enough))

    def close(self) -> None:
        """Cancel every suspended trajectory and stop the loop and the tool threads."""
        tasks = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._waiting.clear()
        self._requests.clear()
        self._live = 0
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self.loop.close()

    # ------------------------------------------------------------------ the pump
    async def _drive(self, enough: Callable[[], bool]) -> None:
        while not enough():
            for rid, r in self._requests.items():
                if not r.on_engine:
                    self._submit(rid, r)
            if self.engine.num_unfinished() == 0:
                if self._live <= 0:
                    raise RuntimeError(
                        "ResumableRunner.drive: no trajectory left, but the condition is unmet"
                    )
                self._wake.clear()
                await self._wake.wait()  # a trajectory asks for a turn or ends (tool / environment results)
                continue
            for rid, ids, lps, reason in self.engine.step():
                r = self._requests.pop(rid)
                self._extend(r, ids, lps)
                self._finish(rid, r, reason)
            await asyncio.sleep(0)  # let finished turns parse, call tools, ask for their next turn
        running = [rid for rid, r in self._requests.items() if r.on_engine]
        for rid, ids, lps in self.engine.pause(running) if running else []:
            r = self._requests[rid]
            r.on_engine = False
            if ids:  # a request paused before its first token has not started: nothing to resume
                self._extend(r, ids, lps)
                r.pauses += 1
            if len(r.ids) >= r.params.max_tokens:  # paused on its last token: the turn is complete
                self._finish(rid, self._requests.pop(rid), "length")

    def _submit(self, rid: str, r: _Request) -> None:
        params = r.params
        if r.ids:
            seed = None if params.seed is None else (params.seed + r.pauses * SEED_STRIDE) % (1 << 63)
            params = replace(params, max_tokens=params.max_tokens - len(r.ids), seed=seed)
        self.engine.submit(rid, r.prompt + r.ids, params)
        r.on_engine = True

    def _extend(self, r: _Request, ids: list[int], lps: list[float]) -> None:
        r.ids += list(ids)
        r.log_probs += list(lps)
        r.versions += [self.version] * len(ids)

    def _finish(self, rid: str, r: _Request, reason: str) -> None:
        future = self._waiting.pop(rid, None)
        if future is not None and not future.done():  # None / done: its trajectory was cancelled
            future.set_result((r.ids, r.log_probs, r.versions, reason))

    # ------------------------------------------------------------------ AgentContext
    async def generate(
        self, traj: Trajectory, max_tokens: int | None = None
    ) -> tuple[list[int], list[float], str]:
        """One assistant turn continuing ``traj``, possibly across pauses; the version of each of its tokens
        goes to ``traj.turn_versions`` (read by the loop's `Trajectory.add_sampled`)."""
        rid, params = self.turn_request(traj, max_tokens, pausable=True)
        future = self.loop.create_future()
        self._waiting[rid] = future
        self._requests[rid] = _Request(traj.context_ids(), params)
        self._wake.set()
        ids, lps, versions, reason = await future
        traj.turn_versions = list(versions)
        return list(ids), list(lps), reason

    def sampled_or_waiting(self, traj: Trajectory) -> bool:
        """Whether ``traj`` has sampled a token (in its response or in a paused turn): a trajectory carried
        over a sync then counts a resume."""
        if traj.response_ids:
            return True
        prefix = f"{traj.index}."
        return any(rid.startswith(prefix) and r.ids for rid, r in self._requests.items())
