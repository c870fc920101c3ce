"""Multi-turn agent rollouts on the real in-process vLLM engine (one spawned process with a gloo group).

Shown here: token in / token out (the engine's request of turn k+1 is exactly prompt + sampled ids +
rendered observation ids; the mask is 1 exactly on sampled ids, whose engine log-probs are kept),
continuous and turn-synchronous scheduling give the same seeded trajectories, tools that raise / hang /
get malformed calls / answer too much become error or truncated observations while the step completes,
and the strict tokenization check catches a template that rewrites earlier turns.
"""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch.multiprocessing as mp
from support import free_port

from fusedrl.agent import (
    AgentLoop,
    Environment,
    ToolResult,
    parse_hermes,
    register_agent_loop,
    register_environment,
)

HANG_S = 20.0
TIMEOUT_S = 1.0
MAX_RESPONSE = 96
TURN_TOKENS = 16  # a random tiny model rarely samples its stop token: cut turns so trajectories have 3


@register_environment("test_two_step_env")
class TwoStepEnv(Environment):
    """Answers every turn with a user message; done after the third turn; reward 1 per step."""

    def reset(self, row):
        self.steps = 0

    def step(self, text):
        self.steps += 1
        return (
            [{"role": "user", "content": f"step {self.steps} seen {len(text)} chars"}],
            1.0,
            self.steps >= 3,
        )


@register_agent_loop("test_scripted_tools")
class ScriptedToolLoop(AgentLoop):
    """Turn 1 by the engine, then the calls written in ``extra_info.script`` (a random tiny model does not
    write tool calls), their responses appended once, then turn 2 by the engine."""

    async def run(self, row, traj, ctx):
        from fusedrl.agent.loops import append_observation, assistant_turn

        _, stopped = await assistant_turn(traj, ctx)
        results = await ctx.call_tools(traj, parse_hermes(row["extra_info"]["script"]), row)
        traj.results = results
        if append_observation(
            traj, ctx, [{"role": "tool", "content": r} for r in results], after_stop=stopped
        ):
            await assistant_turn(traj, ctx)


def boom(x: int) -> str:
    """Always fails.

    Args:
        x: ignored.
    """
    raise ValueError(f"boom {x}")


def sleepy(x: int) -> str:
    """Hangs far past the timeout.

    Args:
        x: ignored.
    """
    time.sleep(HANG_S)
    return "late"


def big(n: int) -> str:
    """Answers far too much.

    Args:
        n: characters.
    """
    return "x" * n


def add(a: int, b: int) -> ToolResult:
    """Adds.

    Args:
        a: first.
        b: second.
    """
    return ToolResult(str(a + b), reward=0.25)


SCRIPT = (
    '<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>'
    '<tool_call>{"name": "sleepy", "arguments": {"x": 1}}</tool_call>'
    "<tool_call>{broken json</tool_call>"
    '<tool_call>{"name": "big", "arguments": {"n": 5000}}</tool_call>'
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
)


class Recorder:
    """The real engine, with every submitted request and finished output written down."""

    def __init__(self, engine):
        self.engine = engine
        self.submitted: dict[str, list[int]] = {}
        self.finished: dict[str, tuple[list[int], list[float]]] = {}

    def submit(self, request_id, ids, params):
        self.submitted[request_id] = list(ids)
        self.engine.submit(request_id, ids, params)

    def step(self):
        out = self.engine.step()
        for rid, ids, lps, _ in out:
            self.finished[rid] = (list(ids), list(lps))
        return out

    def num_unfinished(self):
        return self.engine.num_unfinished()


def _dump(trajs):
    return [
        dict(
            prompt_ids=t.prompt_ids,
            response_ids=t.response_ids,
            mask=t.mask,
            log_probs=t.log_probs,
            messages=t.messages,
            stats=t.stats,
            results=getattr(t, "results", None),
        )
        for t in trajs
    ]


def _job(model_dir: str, out_path: str) -> None:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from fusedrl.agent import AgentRunner, ChatRenderer, MultiTurnConfig, ToolSet, TurnSampling
    from fusedrl.third_party.vllm.engine import EngineConfig, VLLMEngine

    dist.init_process_group("gloo", rank=0, world_size=1)
    engine = VLLMEngine(
        EngineConfig(
            model_path=model_dir, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20
        )
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    renderer = ChatRenderer(tok)
    sampling = TurnSampling(temperature=1.0, stop_token_id=tok.eos_token_id)
    questions = ["What is 2 + 3?", "Compute 7 times 8.", "Say hi"]
    rows = []
    for k, q in enumerate(questions):
        messages = [{"role": "user", "content": q}]
        ids = tok.encode(renderer.render(messages, add_generation_prompt=True), add_special_tokens=False)
        rows.append(dict(prompt_ids=ids, messages=messages, seed=100 + k, uid=f"r{k}", extra_info={}))
    out: dict = {}

    for schedule in ("continuous", "turn_sync"):
        rec = Recorder(engine)
        cfg = MultiTurnConfig(
            default_agent_name="test_two_step_env",
            schedule=schedule,
            tokenization_check="strict",
            max_tokens_per_turn=TURN_TOKENS,
        )
        trajs = AgentRunner(rec, renderer, ToolSet(), cfg).run(
            rows, sampling, max_response_length=MAX_RESPONSE
        )
        out[schedule] = dict(trajs=_dump(trajs), submitted=rec.submitted, finished=rec.finished)

    tools = ToolSet([boom, sleepy, big, add])
    cfg = MultiTurnConfig(
        default_agent_name="test_scripted_tools",
        max_parallel_calls=6,
        tool_timeout_s=TIMEOUT_S,
        max_tool_response_length=160,
        max_tokens_per_turn=TURN_TOKENS,
        tool_response_truncate_side="right",  # the end is cut: the beginning is kept
    )
    tool_rows = [dict(r, extra_info={"script": SCRIPT}) for r in rows[:2]]
    t0 = time.perf_counter()
    trajs = AgentRunner(engine, renderer, tools, cfg).run(tool_rows, sampling, max_response_length=800)
    out["tools"] = dict(trajs=_dump(trajs), wall_s=time.perf_counter() - t0)

    # A template that renders earlier turns differently once the conversation has 4+ messages: the probe
    # used for deltas (3 messages) cannot see it; the strict re-render check must.
    tok.chat_template = (
        "{% for m in messages %}{% if loop.index0 == 0 and messages|length > 3 %}"
        "{{ '<|im_start|>' + m['role'] + '\\nEDITED ' + m['content'] + '<|im_end|>\\n' }}{% else %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    cfg = MultiTurnConfig(
        default_agent_name="test_two_step_env", tokenization_check="strict", max_tokens_per_turn=TURN_TOKENS
    )
    try:
        AgentRunner(engine, ChatRenderer(tok), ToolSet(), cfg).run(
            rows[:1], sampling, max_response_length=MAX_RESPONSE
        )
        out["strict_error"] = None
    except RuntimeError as exc:
        out["strict_error"] = str(exc)
    # The failed run left nothing queued: the engine serves the next run normally.
    out["unfinished_after_error"] = engine.num_unfinished()
    cfg = MultiTurnConfig(default_agent_name="test_two_step_env", max_tokens_per_turn=TURN_TOKENS)
    again = AgentRunner(engine, ChatRenderer(tok), ToolSet(), cfg).run(
        rows, sampling, max_response_length=MAX_RESPONSE
    )
    out["after_error_turns"] = [t.stats["assistant_turns"] for t in again]
    with open(out_path, "wb") as f:
        pickle.dump(out, f)
    os._exit(0)  # the engine cannot be torn down cleanly (it owns the default process group)


def _entry(_rank: int, model_dir: str, out_path: str, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    _job(model_dir, out_path)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    out_path = str(tmp_path_factory.mktemp("agent") / "out.pkl")
    mp.spawn(_entry, args=(tiny_model_dir, out_path, free_port()), nprocs=1, join=True)
    with open(out_path, "rb") as f:
        return pickle.load(f)


def test_token_in_token_out(runs, tiny_model_dir):
    from transformers import AutoTokenizer

    from fusedrl.agent import ChatRenderer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    run = runs["continuous"]
    multi = 0
    for i, t in enumerate(run["trajs"]):
        ids, mask, lps = t["response_ids"], t["mask"], t["log_probs"]
        assert len(ids) == len(mask) == len(lps) <= MAX_RESPONSE
        # Rebuild the response from the engine's own outputs and the observations rendered once.
        expected_ids, expected_mask, expected_lps = [], [], []
        turn = 0
        obs_msgs = [m for m in t["messages"] if m["role"] != "assistant"]
        while f"{i}.{turn}" in run["finished"]:
            rid = f"{i}.{turn}"
            # The engine was asked to continue exactly prompt + everything so far.
            assert run["submitted"][rid] == t["prompt_ids"] + expected_ids
            sampled, sampled_lps = run["finished"][rid]
            expected_ids += sampled
            expected_mask += [1] * len(sampled)
            expected_lps += sampled_lps
            if turn < len(obs_msgs):
                stopped = sampled[-1] == renderer.tokenizer.eos_token_id
                obs = renderer.observation_ids([obs_msgs[turn]], after_stop=stopped)
                expected_ids += obs
                expected_mask += [0] * len(obs)
                expected_lps += [0.0] * len(obs)
            turn += 1
        assert ids == expected_ids and mask == expected_mask and lps == expected_lps
        assert t["stats"]["assistant_turns"] == turn and t["stats"]["observation_tokens"] == mask.count(0)
        multi += turn >= 2
        assert mask[-1] == 1  # the trajectory ends on a sampled token (the outcome reward's position)
        assert t["stats"]["reward"] == t["stats"]["assistant_turns"] or t["stats"]["hit_length_limit"]
    assert multi >= 2


def test_schedules_agree(runs):
    # Per-request seeds: the trajectories do not depend on how requests were interleaved.
    for a, b in zip(runs["continuous"]["trajs"], runs["turn_sync"]["trajs"]):
        assert a["response_ids"] == b["response_ids"] and a["mask"] == b["mask"]
        assert a["log_probs"] == pytest.approx(b["log_probs"], abs=1e-4)


def test_broken_tools_become_observations(runs):
    run = runs["tools"]
    assert run["wall_s"] < HANG_S  # the hanging tool was abandoned at its timeout, not waited for
    for t in run["trajs"]:
        r = t["results"]
        assert len(r) == 7
        assert r[0] == "Error: boom raised ValueError: boom 1"
        assert r[1] == f"Error: tool 'sleepy' timed out after {TIMEOUT_S:g} s"
        assert r[2].startswith("Error: malformed tool call: tool call is not valid JSON")
        assert len(r[3]) == 160 and r[3].startswith("xxx") and r[3].endswith("...(truncated)...")
        assert r[4] == "5"
        assert r[5].startswith("Error: unknown tool 'nope'")
        assert r[6] == "Error: skipped; at most 6 tool calls are run per turn"
        s = t["stats"]
        assert (s["tool_calls"], s["tool_errors"], s["tool_timeouts"], s["truncated_responses"]) == (
            6,
            4,
            1,
            1,
        )
        assert s["reward"] == 0.25 and s["tool_wall_s"] >= TIMEOUT_S
        assert t["mask"].count(0) == s["observation_tokens"] > 0 and s["assistant_turns"] == 2


def test_strict_check_catches_rewriting_template(runs, tiny_model_dir):
    from transformers import AutoTokenizer

    err = runs["strict_error"]
    assert err is not None and "tokenization_check=strict" in err, err
    # The first difference is where the re-render inserted "EDITED": right after the first role header.
    header = len(
        AutoTokenizer.from_pretrained(tiny_model_dir).encode("<|im_start|>user\n", add_special_tokens=False)
    )
    assert f"conversation at token {header}:" in err, err
    assert runs["unfinished_after_error"] == 0 and len(runs["after_error_turns"]) == 3
