"""Runs every trajectory of a step at once through one in-process engine, with tools on a thread pool.

Each trajectory is an asyncio task running its agent loop. A generate call queues a request on the
engine (``submit``) and waits; one pump coroutine steps the engine (vLLM's continuous batching) and hands
finished requests back. While a trajectory waits for a tool, the others keep generating. Everything runs in
the fused worker's own process and thread, so the in-place weight stream is untouched.

``schedule="turn_sync"`` exists for comparison (benchmarks): the engine only runs once every live
trajectory has queued its next turn, and results are handed out only when the whole batch has finished, as
a loop that batches each turn across trajectories would.

Tools run on a thread pool: a call that raises becomes an error observation; one that runs past
``tool_timeout_s`` is abandoned (its thread cannot be killed and finishes in the background) and becomes a
timeout observation. Environments' ``reset`` / ``step`` / ``close`` run on the same threads under
``env_timeout_s`` (one past it ends its trajectory, with a warning naming the environment and the key). Engine interface (`fusedrl.workers.rollout.base.RequestEngine`): ``submit(request_id,
prompt_ids, params)``, ``step() -> [(request_id, ids, log_probs, finish_reason)]``, ``num_unfinished()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fusedrl.agent.loops import agent_loop_names, get_agent_loop
from fusedrl.agent.parser import ToolCall
from fusedrl.agent.render import ChatRenderer, tokenization_mismatch
from fusedrl.agent.tools import ToolResult
from fusedrl.agent.toolset import ToolSet
from fusedrl.agent.trajectory import Trajectory
from fusedrl.sampling import SampleParams

TRUNCATE_SIDES = ("left", "right", "middle")
TOOL_CALL_FORMATS = ("hermes",)  # verl's multi_turn.format names; fusedrl.agent.parse_hermes parses these
SCHEDULES = ("continuous", "turn_sync")

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class MultiTurnConfig:
    """``actor_rollout_ref.rollout.multi_turn`` (see docs/agentic.md): the one definition of the section, the
    field of the workers' typed `fusedrl.role_config.RolloutConfig` and what the agent runner reads. The
    defaults (the YAML's) serve code that builds one directly (tests, benchmarks)."""

    enable: bool = False
    tool_config_path: str | None = None
    default_agent_name: str = "single_turn"
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_tokens_per_turn: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    format: str = "hermes"
    tool_timeout_s: float = 30.0
    env_timeout_s: float = 30.0
    tool_workers: int = 16
    tokenization_check: str = "off"
    schedule: str = "continuous"
    env_config: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tokenization_check, bool):  # YAML reads a bare off / on as a boolean
            object.__setattr__(self, "tokenization_check", "strict" if self.tokenization_check else "off")
        for k in ("max_assistant_turns", "max_user_turns", "max_tokens_per_turn"):
            if getattr(self, k) is not None:
                object.__setattr__(self, k, int(getattr(self, k)))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> MultiTurnConfig:
        """From the section as a mapping (the driver's config check); keys it does not define are left to
        the config's unknown-key check."""
        keys = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in dict(d or {}).items() if k in keys})

    def problems(self, prefix: str = "actor_rollout_ref.rollout.multi_turn") -> list[str]:
        """Every invalid value, as config-error lines (key=value: what to use)."""
        checks = [
            (
                "tool_response_truncate_side",
                self.tool_response_truncate_side in TRUNCATE_SIDES,
                "use left, right or middle",
            ),
            ("tokenization_check", self.tokenization_check in ("strict", "off"), "use strict or off"),
            (
                "format",
                self.format in TOOL_CALL_FORMATS,
                "the tool loop parses Hermes / Qwen calls only (<tool_call>{json}</tool_call>); use hermes",
            ),
            (
                "default_agent_name",
                self.default_agent_name in agent_loop_names(),
                f"not a registered agent loop; use one of {', '.join(agent_loop_names())} (or register yours "
                "with fusedrl.agent.register_agent_loop in a module listed in algorithm.custom_modules)",
            ),
            ("schedule", self.schedule in SCHEDULES, "use continuous or turn_sync"),
            ("max_parallel_calls", int(self.max_parallel_calls) >= 1, "must be >= 1"),
            ("tool_timeout_s", float(self.tool_timeout_s) > 0, "must be > 0"),
            ("env_timeout_s", float(self.env_timeout_s) > 0, "must be > 0"),
            ("max_tool_response_length", int(self.max_tool_response_length) >= 1, "must be >= 1"),
            ("tool_workers", int(self.tool_workers) >= 1, "must be >= 1"),
        ]
        for k in ("max_assistant_turns", "max_user_turns", "max_tokens_per_turn"):
            v = getattr(self, k)
            checks.append((k, v is None or v >= 1, "must be >= 1 or null"))
        return [f"`{prefix}.{k}`={getattr(self, k)!r}: {msg}." for k, ok, msg in checks if not ok]


def _row_seed(row: dict[str, Any], index: int) -> int | None:
    seed = row.get("seed", index)
    return None if seed is None else int(seed)


def truncate(text: str, limit: int, side: str) -> tuple[str, bool]:
    """``text`` cut to ``limit`` characters on its ``side`` (``left``: the beginning is dropped and the end
    kept, ``right``: the end is dropped, ``middle``: the middle is dropped and both ends kept), with a marker
    where text was dropped; and whether it was cut."""
    if len(text) <= limit:
        return text, False
    marker = "...(truncated)..."
    keep = max(limit - len(marker), 0)
    # verl's convention since its tool-loop fix of 2026-05 (#6313): the side named is the side cut.
    if side == "left":
        return marker + text[len(text) - keep :], True
    if side == "right":
        return text[:keep] + marker, True
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :], True


@dataclass(frozen=True, kw_only=True)
class TurnSampling:
    """Sampling of every turn; ``max_tokens`` is capped by what is left of the response budget."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_id: int = 0
    log_probs: bool = True  # False: the engine computes none (`fusedrl.sampling.SampleParams.log_probs`)


def turn_seed(row_seed: int | None, turn: int) -> int | None:
    """The sampling seed of a row's turn ``turn``, a function of (row seed, turn) only, so resumed runs
    resample the same tokens whatever the interleaving. The first turn takes the row's seed itself: a one-turn
    loop samples exactly what one batch ``engine.generate`` call with the rows' seeds samples (single-turn
    generation runs as that loop). None (no row seed): the engine's own generator."""
    if row_seed is None:
        return None
    if turn == 0:
        return int(row_seed)
    return (int(row_seed) * 1_000_003 + turn * 7919) % (2**31 - 1)


class AgentRunner:
    """Builds trajectories for a list of rows on ``engine`` (see the module docstring). ``renderer`` None:
    loops that read no text and append no observation only (the one-turn loop of plain generation)."""

    def __init__(
        self, engine: Any, renderer: ChatRenderer | None, tools: ToolSet, cfg: MultiTurnConfig
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.tools = tools
        self.cfg = cfg
        self.max_assistant_turns = cfg.max_assistant_turns
        self.max_user_turns = cfg.max_user_turns
        self.env_config = dict(cfg.env_config or {})
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._env_timeouts_logged: set[str] = set()  # environment methods already reported in this run

    # ------------------------------------------------------------------ public
    def run(
        self, rows: list[dict[str, Any]], sampling: TurnSampling, *, max_response_length: int
    ) -> list[Trajectory]:
        """One trajectory per row (``row["seed"]`` seeds its turns, `turn_seed`; absent: its position; None:
        the engine's own generator). Blocks until all are done."""
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.cfg.tool_workers)
        self._env_timeouts_logged = set()
        try:
            return asyncio.run(self._run_all(rows, sampling, max_response_length))
        finally:
            # Abandoned (timed-out) calls finish in the background; nobody waits for them.
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # ------------------------------------------------------------------ scheduling
    async def _run_all(
        self, rows: list[dict[str, Any]], sampling: TurnSampling, budget: int
    ) -> list[Trajectory]:
        self._sampling = sampling
        self._waiting: dict[str, asyncio.Future] = {}
        self._held: list[tuple[str, list[int], list[float], str]] = []
        self._wake = asyncio.Event()
        self._live = len(rows)
        trajs = [
            Trajectory(prompt_ids=list(r["prompt_ids"]), budget=budget, index=i, seed=_row_seed(r, i))
            for i, r in enumerate(rows)
        ]
        pump = asyncio.create_task(self._pump())
        tasks = [asyncio.create_task(self._one(r, t)) for r, t in zip(rows, trajs)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one trajectory failed (e.g. the strict check): stop the others
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            self._live = 0
            self._wake.set()
            await pump
        return trajs

    async def _one(self, row: dict[str, Any], traj: Trajectory) -> None:
        name = str(row.get("agent_name") or self.cfg.default_agent_name)
        loop = get_agent_loop(name)()
        try:
            await loop.run(row, traj, self)
        finally:
            self._release_tools(traj)
            self._live -= 1
            self._wake.set()
        if self.cfg.tokenization_check == "strict" and row.get("messages") is not None and self.renderer:
            self._check(row, traj)

    def _ready(self) -> bool:
        if self.cfg.schedule == "continuous":
            return self.engine.num_unfinished() > 0
        # turn_sync: run only once every live trajectory has queued its turn.
        if self._live <= 0:
            return self.engine.num_unfinished() > 0
        return len(self._waiting) > 0 and len(self._waiting) + len(self._held) >= self._live

    async def _pump(self) -> None:
        # Runs until every trajectory is done and the engine holds no request of this run (after a failure
        # the requests of cancelled trajectories are finished and dropped, so the next run starts clean).
        while self._live > 0 or self.engine.num_unfinished() > 0:
            if not self._ready():
                self._wake.clear()
                await self._wake.wait()
                continue
            for request_id, ids, lps, reason in self.engine.step():
                if self.cfg.schedule == "turn_sync":
                    self._held.append((request_id, ids, lps, reason))
                else:
                    self._deliver(request_id, (ids, lps, reason))
            if self.cfg.schedule == "turn_sync" and self.engine.num_unfinished() == 0:
                held, self._held = self._held, []
                for request_id, ids, lps, reason in held:
                    self._deliver(request_id, (ids, lps, reason))
            await asyncio.sleep(0)  # let finished trajectories parse, call tools, queue their next turn

    def _deliver(self, request_id: str, result: tuple[list[int], list[float], str]) -> None:
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():  # None / done: its trajectory was cancelled
            future.set_result(result)

    # ------------------------------------------------------------------ AgentContext
    async def generate(
        self, traj: Trajectory, max_tokens: int | None = None
    ) -> tuple[list[int], list[float], str]:
        """One assistant turn continuing ``traj``: ``(sampled ids, their log-probs, "stop" | "length")``.
        At most ``max_tokens`` (and ``max_tokens_per_turn``, and what is left of the response budget)."""
        # never paused: the engine builds only the final output (as its batch generate)
        request_id, params = self.turn_request(traj, max_tokens, pausable=False)
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        self.engine.submit(request_id, traj.context_ids(), params)
        self._wake.set()
        return await future

    def turn_request(
        self, traj: Trajectory, max_tokens: int | None, *, pausable: bool
    ) -> tuple[str, SampleParams]:
        """The request id and sampling of ``traj``'s next turn (counted as requested): at most ``max_tokens``,
        ``max_tokens_per_turn`` and what is left of the budget; seeded by `turn_seed`."""
        index, turn = traj.index, traj.turns_requested
        traj.turns_requested += 1
        traj.turn_starts.append(len(traj.response_ids))
        s = self._sampling
        params = SampleParams(
            max_tokens=min(
                traj.remaining, self.cfg.max_tokens_per_turn or traj.remaining, max_tokens or traj.remaining
            ),
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            stop_token_ids=(s.stop_token_id,),
            seed=turn_seed(traj.seed, turn),
            pausable=pausable,
            log_probs=s.log_probs,
        )
        return f"{index}.{turn}", params

    async def call_tools(self, traj: Trajectory, calls: list[ToolCall], row: dict[str, Any]) -> list[str]:
        limit = self.cfg.max_parallel_calls
        jobs = [self._call(traj, c, row) for c in calls[:limit]]
        results = list(await asyncio.gather(*jobs))
        for _ in calls[limit:]:
            traj.stats["tool_errors"] += 1
            results.append(f"Error: skipped; at most {limit} tool calls are run per turn")
        out = []
        for text in results:
            cut, was_cut = truncate(
                text, self.cfg.max_tool_response_length, self.cfg.tool_response_truncate_side
            )
            traj.stats["truncated_responses"] += float(was_cut)
            out.append(cut)
        return out

    async def _call(self, traj: Trajectory, call: ToolCall, row: dict[str, Any]) -> str:
        traj.stats["tool_calls"] += 1
        if call.error is not None:
            traj.stats["tool_errors"] += 1
            return f"Error: malformed tool call: {call.error}"
        if call.name not in self.tools:
            traj.stats["tool_errors"] += 1
            return f"Error: unknown tool {call.name!r}; available tools: {sorted(self.tools.tools)}"
        tool = self.tools[call.name]
        kwargs = ((row.get("extra_info") or {}).get("tools_kwargs") or {}).get(call.name) or {}
        instance_id = f"{traj.index}:{call.name}"
        created = traj.created_tools

        def work() -> ToolResult | str:
            if call.name not in created:
                tool.create(instance_id, **dict(kwargs.get("create_kwargs") or {}))
                created.add(call.name)
            return tool.execute(instance_id, dict(call.arguments), **dict(kwargs.get("execute_kwargs") or {}))

        assert self._pool is not None
        t0 = time.perf_counter()
        try:
            result = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self._pool, work), self.cfg.tool_timeout_s
            )
        except asyncio.TimeoutError:
            traj.stats["tool_timeouts"] += 1
            return f"Error: tool {call.name!r} timed out after {self.cfg.tool_timeout_s:g} s"
        except Exception as exc:  # a tool's own failure is the model's observation, never the step's crash
            traj.stats["tool_errors"] += 1
            return f"Error: {call.name} raised {type(exc).__name__}: {exc}"
        finally:
            traj.stats["tool_wall_s"] += time.perf_counter() - t0
        if isinstance(result, ToolResult):
            traj.stats["reward"] += float(result.reward)
            return result.text
        return str(result)

    async def call_env(self, traj: Trajectory, fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
        """``fn(*args)`` (an environment's reset / step / close) on the tool threads, never on this loop, which
        steps the engine: ``(True, result)``, or ``(False, None)`` when it ran past ``env_timeout_s`` (abandoned
        like a tool call, counted in ``env_timeouts``, and logged once per environment method and run). An
        environment's exception is raised: it is the task's bug, not the model's move."""
        assert self._pool is not None
        limit = float(self.cfg.env_timeout_s)
        try:
            result = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args)), limit
            )
        except asyncio.TimeoutError:
            traj.stats["env_timeouts"] += 1
            owner = getattr(fn, "__self__", None)
            what = f"{type(owner).__name__}.{getattr(fn, '__name__', 'call')}" if owner else repr(fn)
            if what not in self._env_timeouts_logged:
                self._env_timeouts_logged.add(what)
                log.warning(
                    "environment %s() of row %d ran past actor_rollout_ref.rollout.multi_turn.env_timeout_s="
                    "%g s: the call is abandoned and the trajectory ends there (counted in agent/env_timeouts; "
                    "further timeouts of this method in this rollout are only counted). Raise the key or make "
                    "the environment faster.",
                    what,
                    traj.index,
                    limit,
                )
            return False, None
        return True, result

    def _release_tools(self, traj: Trajectory) -> None:
        for name in sorted(traj.created_tools):
            try:
                self.tools[name].release(f"{traj.index}:{name}")
            except Exception:  # noqa: BLE001 - a failing release must not lose the trajectory
                traj.stats["tool_errors"] += 1

    def _check(self, row: dict[str, Any], traj: Trajectory) -> None:
        """``tokenization_check: strict``: the trajectory must equal a full re-render of its conversation."""
        messages = [*row["messages"], *traj.messages]
        ids = traj.prompt_ids + traj.response_ids
        ends_open = bool(traj.mask) and traj.mask[-1] == 0
        problem = tokenization_mismatch(self.renderer, messages, ids, ends_with_generation_prompt=ends_open)
        if problem is not None:
            raise RuntimeError(
                f"multi_turn.tokenization_check=strict: row {traj.index} (uid {row.get('uid')!r}) differs from "
                f"the chat template's rendering of its conversation at {problem}. The template is not "
                "prefix-preserving (or the prompt was truncated); fix the template or set tokenization_check=off"
            )
