"""Agentic RL on 2 CPU cores: a tiny model learns to use a lookup tool (SFT warm start, then GRPO with the
``tool`` agent loop), beside a same-model no-tool baseline.

The task: ``What is the code of room "KQZ"?``. Every room AAA-ZZZ has a 3-digit door code from a fixed
pseudo-random table (examples/agentic/lookup.py) that no prompt shows; the verifier (the built-in
``arithmetic`` rule) gives reward 1 when the LAST integer the model sampled is the room's code (tool
responses are observations, never scored). Held-out test rooms never occur in training, and every SFT
demonstration is about a different room, so no model can answer from memory; with the tool it only has to
copy: the room's three letters into the call, the tool's answer into its final turn (rooms are named by
letters, so the code is the only number in the conversation)::

    user:      What is the code of room "KQZ"?
    assistant: <tool_call>{"name": "lookup", "arguments": {"room": "KQZ"}}</tool_call>
    tool:      736
    assistant: 736.

The SFT demonstrations (a few hundred) come from two "annotators": one uses the tool as above, the other
answers at once with a made-up code (``I think it is 512.``), which the verifier rejects. Which one wrote a
demonstration depends on the phrasing: two phrasings use the tool 80% of the time, the other two 20%. The
SFT model imitates that mix, so greedy decoding calls the tool on about half the phrasings and guesses on
the rest (the quickstart's device, examples/quickstart/echo_smoke.py). GRPO samples 8 trajectories per
prompt through the fused workers' engines and the ``tool`` loop; the ones that look the code up win, and the
policy learns to call the tool on every phrasing. The no-tool baseline is the same model trained by SFT, for
the same number of steps, on the same rooms answered directly with their true codes: it can learn the
training rooms, not unseen ones.

Stages (all local, nothing downloaded): 1. data, 2. model + tokenizer, 3. SFT warm start (2 FSDP2 workers),
4. GRPO (2 fused workers, multi-turn tool rollouts), 5. the no-tool baseline (SFT), 6. greedy held-out
evaluation of the three models with one multi-turn evaluator (Hugging Face generate, the same tool).

    python examples/agentic/tool_use_cpu.py [--seed 0] [--grpo-steps 20] [--out runs/agentic] [--no-baseline]
        [--async-staleness K | --partial-rollout X]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import string
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "examples", "quickstart"))
sys.path.insert(0, HERE)
import echo_smoke as qs  # noqa: E402 - the echo smoke run's SFT / GRPO stage runners, reused
from lookup import room_code  # noqa: E402 - the hidden table, to write ground truths

TOOLS_YAML = os.path.join(HERE, "lookup_tools.yaml")  # lists lookup.py:lookup
DATA_SOURCE = "arithmetic"  # the reward rule: last integer in the (sampled) response == ground truth
# (phrasing, probability that the demonstration uses the tool rather than guessing). The room's name is
# quoted as in the call's JSON, so it is the same tokens in the question and in the call.
TEMPLATES = (
    ('What is the code of room "{k}"?', 0.8),
    ('Room "{k}": what is its code?', 0.8),
    ('Tell me the code for room "{k}".', 0.2),
    ('Code of room "{k}"?', 0.2),
)
N_TEST = 64


# ---------------------------------------------------------------------- 1. data
def all_rooms() -> list[str]:
    """Every room name, AAA-ZZZ (17,576)."""
    return ["".join(t) for t in itertools.product(string.ascii_uppercase, repeat=3)]


def split_rooms(seed: int, n_test: int = N_TEST) -> tuple[list[str], list[str]]:
    """(held-out test rooms, training rooms): a seeded shuffle of all rooms."""
    rooms = all_rooms()
    random.Random(seed).shuffle(rooms)
    return rooms[:n_test], rooms[n_test:]


def call_text(room: str) -> str:
    return f'<tool_call>{{"name": "lookup", "arguments": {{"room": "{room}"}}}}</tool_call>'


def tool_conversation(question: str, room: str) -> list[dict]:
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": call_text(room)},
        {"role": "tool", "content": str(room_code(room))},
        {"role": "assistant", "content": f"{room_code(room)}."},
    ]


def direct_conversation(question: str, answer: int) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": f"{answer}."}]


def guess_conversation(question: str, guess: int) -> list[dict]:
    """The guessing annotator: no tool, a made-up code. Its answers all start alike (``I think``), so after
    SFT that start competes as one choice with ``<tool_call>`` (a bare guess's first digit would be spread
    over nine tokens and lose to the tool call even where most demonstrations guess)."""
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"I think it is {guess}."},
    ]


def _rl_row(room: str, template: str, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "agent_name": "tool",
        "prompt": [{"role": "user", "content": template.format(k=room)}],
        "ability": "tool_use",
        "reward_model": {"style": "rule", "ground_truth": str(room_code(room))},
        "extra_info": {"split": split, "index": index},
    }


def write_data(out_dir: str, seed: int, n_sft: int, n_rl: int = 1024) -> dict[str, str]:
    """Tool SFT demos (messages), direct-answer SFT demos (the no-tool baseline), RL train/test (verl schema).

    Every SFT demonstration is about a different room (so the codes cannot be learnt by heart, only copied
    from the tool), and the test rooms are held out of the SFT demonstrations and the RL prompts alike."""
    import pandas as pd

    test, train = split_rooms(seed)
    rng = random.Random(seed + 2)
    tool_rows, direct_rows = [], []
    for room in rng.sample(train, n_sft):
        template, p_tool = rng.choice(TEMPLATES)
        q = template.format(k=room)
        made_up = rng.choice([c for c in range(100, 1000) if c != room_code(room)])
        use_tool = rng.random() < p_tool
        tool_rows.append(
            {"messages": tool_conversation(q, room) if use_tool else guess_conversation(q, made_up)}
        )
        direct_rows.append({"messages": direct_conversation(q, room_code(room))})
    rl_rooms = rng.sample(train, n_rl)
    rl_train = [_rl_row(room, rng.choice(TEMPLATES)[0], "train", i) for i, room in enumerate(rl_rooms)]
    # Test: every phrasing equally often.
    rl_test = [_rl_row(room, TEMPLATES[i % len(TEMPLATES)][0], "test", i) for i, room in enumerate(test)]
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        name: os.path.join(out_dir, f"{name}.parquet") for name in ("sft", "sft_direct", "train", "test")
    }
    pd.DataFrame(tool_rows).to_parquet(paths["sft"])
    pd.DataFrame(direct_rows).to_parquet(paths["sft_direct"])
    pd.DataFrame(rl_train).to_parquet(paths["train"])
    pd.DataFrame(rl_test).to_parquet(paths["test"])
    used = sum(len(r["messages"]) == 4 for r in tool_rows) / len(tool_rows)
    print(
        f"[data] {len(tool_rows)} SFT demonstrations ({used:.0%} use the tool), {len(rl_train)} RL prompts, "
        f"{len(rl_test)} held-out test prompts (rooms never seen in training)",
        flush=True,
    )
    return paths


def tokenizer_corpus(seed: int) -> list[str]:
    """The tiny tokenizer's default corpus plus tool-call text (training rooms only), so the call syntax gets
    BPE merges."""
    from fusedrl.utils.tiny_model import default_corpus

    _, train = split_rooms(seed)
    rng = random.Random(seed + 1)
    extra = []
    for _ in range(400):
        room = rng.choice(train)
        template = rng.choice(TEMPLATES)[0]
        extra.append(
            f"user\n{template.format(k=room)}\nassistant\n{call_text(room)}\ntool\n{room_code(room)}"
        )
    return [*default_corpus(), *extra]


# ---------------------------------------------------------------------- 6. evaluation
def greedy_tool_accuracy(
    model_dir: str, test_path: str, max_turns: int = 3, max_new_tokens: int = 32
) -> tuple[float, float, list[str]]:
    """Greedy held-out evaluation with the tool, multi-turn, token in / token out like the trainer:
    each turn generates (Hugging Face generate, left-padded batch) until the stop token; a turn with a
    ``<tool_call>`` gets the tool's answer rendered once as the chat template's delta and appended.

    Returns (accuracy: the verifier on the sampled text, tool-use rate: share of first turns that call the
    tool, the sampled text of every row)."""
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fusedrl.agent import ChatRenderer, ToolSet, load_tool_config, parse_hermes
    from fusedrl.rewards.arithmetic import compute_score

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tools = ToolSet(load_tool_config(TOOLS_YAML))
    renderer = ChatRenderer(tok)
    df = pd.read_parquet(test_path)
    seqs = [
        tok.encode(
            renderer.render([dict(m) for m in p], add_generation_prompt=True), add_special_tokens=False
        )
        for p in df["prompt"]
    ]
    sampled: list[list[int]] = [[] for _ in seqs]
    first_call = [False] * len(seqs)
    active = list(range(len(seqs)))
    eos, pad = tok.eos_token_id, tok.pad_token_id
    for turn in range(max_turns):
        if not active:
            break
        width = max(len(seqs[i]) for i in active)
        ids = torch.tensor([[pad] * (width - len(seqs[i])) + seqs[i] for i in active])
        attn = torch.tensor([[0] * (width - len(seqs[i])) + [1] * len(seqs[i]) for i in active])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=attn,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        still = []
        for row, i in enumerate(active):
            new = out[row, width:].tolist()
            new = new[: new.index(eos) + 1] if eos in new else new
            sampled[i] += new
            calls = parse_hermes(renderer.decode_turn(new))
            if turn == 0:
                first_call[i] = bool(calls)
            if not calls or not new or new[-1] != eos:
                continue
            results = []
            for call in calls:
                try:
                    results.append(str(tools[call.name].execute("eval", dict(call.arguments))))
                except Exception as exc:  # noqa: BLE001 - a bad call is an error observation, as in training
                    results.append(f"Error: {type(exc).__name__}: {exc}")
            obs = renderer.observation_ids([{"role": "tool", "content": r} for r in results])
            seqs[i] = seqs[i] + new + obs
            still.append(i)
        active = still
    texts = [str(tok.decode(s, skip_special_tokens=True)) for s in sampled]  # decode is typed str | list[str]
    truths = [rm["ground_truth"] for rm in df["reward_model"]]
    scores = [compute_score(t, g) for t, g in zip(texts, truths)]
    return sum(scores) / len(scores), sum(first_call) / len(first_call), texts


# ---------------------------------------------------------------------- stages
def replace_keys(base: list[str], extra: list[str]) -> list[str]:
    """``base`` overrides with the keys of ``extra`` replaced (Hydra refuses a key given twice)."""
    keys = {ov.split("=", 1)[0] for ov in extra}
    return [ov for ov in base if ov.split("=", 1)[0] not in keys] + extra


def sft_overrides(train_file: str, model_dir: str, run_dir: str, args: argparse.Namespace) -> list[str]:
    base = qs.sft_overrides({"sft": train_file}, model_dir, run_dir, args.sft_lr, "cosine")
    return replace_keys(
        base,
        [
            "data.max_length=96",
            f"trainer.total_training_steps={args.sft_steps}",
            f"trainer.seed={args.seed}",
        ],
    )


def grpo_overrides(data: dict[str, str], model_dir: str, run_dir: str, args: argparse.Namespace) -> list[str]:
    base = qs.grpo_overrides(data, model_dir, run_dir, args.grpo_steps, args.test_freq)
    mt = "actor_rollout_ref.rollout.multi_turn"
    return replace_keys(
        base,
        [
            "data.max_prompt_length=24",
            "data.max_response_length=48",  # a call (~20 tokens), the tool's answer (~13), the final turn (~6)
            f"actor_rollout_ref.actor.optim.lr={args.grpo_lr}",
            f"{mt}.enable=true",
            f"{mt}.tool_config_path={TOOLS_YAML}",
            f"{mt}.max_assistant_turns=3",
            f"{mt}.max_tokens_per_turn=32",
            f"data.seed={args.seed}",
            f"actor_rollout_ref.rollout.seed={args.seed}",
            *async_overrides(args.async_staleness),
            *partial_overrides(args.partial_rollout),
        ],
    )


def async_overrides(staleness: int) -> list[str]:
    """``--async-staleness K`` > 0: one training worker and the engine on a pool of its own (one slot),
    the next K steps' tool-loop trajectories generated while a step trains (docs/placement.md)."""
    if staleness <= 0:
        return []
    return [
        "trainer.n_gpus_per_node=1",
        "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}",
        "trainer.placement.roles={rollout: gen}",
        "algorithm.rollout_correction.rollout_is=token",
        f"async_training.max_staleness={staleness}",
    ]


def partial_overrides(threshold: float) -> list[str]:
    """``--partial-rollout X`` > 0: partial rollout in the fused pool (2 fused workers), X of a batch more
    tool-loop trajectories in flight; those still running when a step's groups have finished continue under
    the next step's weights (docs/placement.md, "Multi-turn agent loops")."""
    if threshold <= 0:
        return []
    return [
        "algorithm.rollout_correction.rollout_is=token",
        "async_training.partial_rollout=true",
        f"async_training.staleness_threshold={threshold}",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "agentic"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="quick", help="fusedrl.utils.tiny_model preset")
    p.add_argument("--sft-demos", type=int, default=600)
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--sft-lr", type=float, default=2e-3)
    p.add_argument("--grpo-steps", type=int, default=20)
    p.add_argument("--grpo-lr", type=float, default=3e-4)
    p.add_argument("--test-freq", type=int, default=5)
    p.add_argument("--no-baseline", action="store_true", help="skip the no-tool baseline (tests)")
    p.add_argument(
        "--async-staleness",
        type=int,
        default=0,
        help="K > 0: GRPO with the engine on a pool of its own, K steps ahead (async_training.max_staleness)",
    )
    p.add_argument(
        "--partial-rollout",
        type=float,
        default=0.0,
        help="X > 0: GRPO with partial rollout in the fused pool, X of a batch more trajectories in flight "
        "(async_training.partial_rollout, staleness_threshold)",
    )
    args = p.parse_args(argv)
    if args.async_staleness and args.partial_rollout:
        p.error("--async-staleness and --partial-rollout are two schedules; choose one")

    import ray

    from fusedrl.utils.tiny_model import build_tiny_model, count_parameters

    t_start = time.monotonic()
    out = os.path.abspath(args.out)
    if os.path.isdir(out):
        shutil.rmtree(out)  # a fresh run every time: no resumed checkpoints, no appended metrics
    os.makedirs(out)
    data = write_data(os.path.join(out, "data"), args.seed, args.sft_demos)
    model_dir = build_tiny_model(
        os.path.join(out, "model"), preset=args.preset, seed=args.seed, corpus=tokenizer_corpus(args.seed)
    )
    print(f"[model] {args.preset}: {count_parameters(model_dir) / 1e6:.2f}M parameters", flush=True)

    print(f"[sft] warm start on tool demonstrations: {args.sft_steps} steps", flush=True)
    sft_dir, sft_s, _ = qs.run_sft_stage(
        sft_overrides(data["sft"], model_dir, os.path.join(out, "sft"), args)
    )
    sft_acc, sft_tool, sft_texts = greedy_tool_accuracy(sft_dir, data["test"])
    print(f"[sft] {sft_s:.0f}s; held-out accuracy {sft_acc:.1%}, calls the tool {sft_tool:.0%}", flush=True)
    print(f"[sft] e.g. {sft_texts[:4]}", flush=True)

    print(
        f"[grpo] {args.grpo_steps} steps, 16 prompts x 8 tool-loop trajectories, "
        + (
            f"1 training + 1 rollout worker, {args.async_staleness} step(s) ahead"
            if args.async_staleness
            else f"2 fused workers, partial rollout ({args.partial_rollout:g} of a batch more in flight)"
            if args.partial_rollout
            else "2 fused workers"
        ),
        flush=True,
    )
    grpo_run = os.path.join(out, "grpo")
    grpo_dir, grpo_s = qs.run_grpo_stage(
        grpo_overrides(data, sft_dir, grpo_run, args), os.path.join(grpo_run, "hf")
    )
    grpo_acc, grpo_tool, grpo_texts = greedy_tool_accuracy(grpo_dir, data["test"])
    print(
        f"[grpo] {grpo_s:.0f}s; held-out accuracy {grpo_acc:.1%}, calls the tool {grpo_tool:.0%}", flush=True
    )
    print(f"[grpo] e.g. {grpo_texts[:4]}", flush=True)

    base_acc = base_tool = base_s = None
    if not args.no_baseline:
        print(f"[no-tool] SFT on direct answers (the true codes): {args.sft_steps} steps", flush=True)
        base_dir, base_s, _ = qs.run_sft_stage(
            sft_overrides(data["sft_direct"], model_dir, os.path.join(out, "no_tool"), args)
        )
        base_acc, base_tool, base_texts = greedy_tool_accuracy(base_dir, data["test"])
        print(f"[no-tool] {base_s:.0f}s; held-out accuracy {base_acc:.1%}; e.g. {base_texts[:4]}", flush=True)
    ray.shutdown()

    metrics = qs.read_jsonl(os.path.join(grpo_run, "metrics.jsonl"))
    vllm_val = [m["val/test_score/mean"] for m in metrics if "val/test_score/mean" in m]
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    results: dict[str, Any] = {
        "seed": args.seed,
        "preset": args.preset,
        "sft_demos": args.sft_demos,
        "sft_steps": args.sft_steps,
        "sft_s": sft_s,
        "sft_acc": sft_acc,
        "sft_tool_rate": sft_tool,
        "grpo_steps": args.grpo_steps,
        "grpo_s": grpo_s,
        "grpo_acc": grpo_acc,
        "grpo_tool_rate": grpo_tool,
        "grpo_val_curve_vllm": vllm_val,
        "no_tool_s": base_s,
        "no_tool_acc": base_acc,
        "gain_over_sft_points": 100 * (grpo_acc - sft_acc),
        "total_s": time.monotonic() - t_start,
        "cpus": os.cpu_count(),
        "uptime_at_end": uptime,
    }
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)

    print("\n=== fusedrl agentic example: held-out greedy accuracy (64 rooms never seen in training) ===")
    print(f"{'model':<40}{'accuracy':>10}{'calls tool':>12}{'train time':>12}")
    rows = (
        *(
            ()
            if base_acc is None
            else ((f"no-tool baseline (SFT, {args.sft_steps} steps)", base_acc, base_tool, base_s),)
        ),
        (f"SFT warm start ({args.sft_steps} steps)", sft_acc, sft_tool, sft_s),
        (f"+ GRPO with the tool loop ({args.grpo_steps} steps)", grpo_acc, grpo_tool, grpo_s),
    )
    for name, acc, tool_rate, secs in rows:
        print(f"{name:<40}{acc:>10.1%}{tool_rate:>12.0%}{secs:>11.0f}s")
    print(
        f"GRPO held-out accuracy during training (vLLM greedy, tool loop): {' '.join(f'{v:.2f}' for v in vllm_val)}"
    )
    print(f"GRPO - SFT: {results['gain_over_sft_points']:+.1f} points")
    print(f"total: {results['total_s']:.0f}s; {uptime}\nsummary: {os.path.join(out, 'summary.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
