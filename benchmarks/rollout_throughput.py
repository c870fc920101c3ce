"""Rollout throughput: fusedrl's in-process vLLM rollout vs Hugging Face ``generate``.

Same random-init Qwen2, same prompts (left-padded arithmetic chat prompts), same number of new tokens
(``--max-tokens``, EOS disabled so every row generates the full length), sampling at temperature 1.
vLLM runs twice: compiled (``enforce_eager=False``, the default: torch.compile on CPU) and eager; the
engine's start-up time (``init_s``, which includes the compile) is recorded next to the throughput.

    python -m benchmarks.rollout_throughput                   # tiny, small, mid; records to RESULTS.md
    python -m benchmarks.rollout_throughput --one small vllm  # one measurement (internal)
"""

from __future__ import annotations

import argparse
import json
import os
import time

PROMPTS = 64
MAX_TOKENS = 128


def _prompt_ids(tokenizer, n: int) -> list[list[int]]:
    from fusedrl.data.arithmetic import make_arithmetic_rows

    rows = make_arithmetic_rows(n, seed=0)
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for r in rows
    ]


def measure(preset: str, engine: str, reps: int, prompts: int, max_tokens: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from benchmarks.common import model_dir

    path = model_dir(preset)
    tok = AutoTokenizer.from_pretrained(path)
    ids = _prompt_ids(tok, prompts)
    times = []
    init_s = 0.0
    if engine in ("vllm", "vllm-eager"):
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29611"
        )
        dist.init_process_group("gloo", rank=0, world_size=1)
        from fusedrl.third_party.vllm import EngineConfig, SampleParams, VLLMEngine

        t_init = time.perf_counter()
        eng = VLLMEngine(
            EngineConfig(
                model_path=path,
                dtype="float32",
                max_model_len=64 + max_tokens,
                kv_cache_memory_bytes=1 << 30,
                enforce_eager=engine == "vllm-eager",
            )
        )
        init_s = time.perf_counter() - t_init
        params = SampleParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)  # full length
        eng.generate(ids[:4], SampleParams(max_tokens=4))  # warm-up
        for _ in range(reps):
            t0 = time.perf_counter()
            out = eng.generate(ids, params)
            times.append(time.perf_counter() - t0)
        tokens = sum(len(o[0]) for o in out)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        width = max(map(len, ids))
        input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])
        mask = (torch.arange(width) >= torch.tensor([width - len(x) for x in ids]).unsqueeze(1)).long()
        kwargs = dict(
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            pad_token_id=0,
        )
        with torch.no_grad():
            model.generate(
                input_ids[:4], attention_mask=mask[:4], max_new_tokens=4, do_sample=True, pad_token_id=0
            )
            for _ in range(reps):
                t0 = time.perf_counter()
                out = model.generate(input_ids, **kwargs)
                times.append(time.perf_counter() - t0)
        tokens = int((out.shape[1] - width) * out.shape[0])
    return {
        "preset": preset,
        "engine": engine,
        "tokens": tokens,
        "seconds": times,
        "tok_per_s": [tokens / t for t in times],
        "init_s": init_s,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=2, metavar=("PRESET", "ENGINE"))
    ap.add_argument("--presets", default="tiny,small,mid")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=PROMPTS)
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = ap.parse_args()
    if args.one:
        print(
            "RESULT " + json.dumps(measure(*args.one, args.reps, args.prompts, args.max_tokens)), flush=True
        )
        return

    from benchmarks.common import fmt, record, run_in_subprocess, summary

    rows, payload = [], []
    for preset in args.presets.split(","):
        reps = args.reps if preset != "mid" else max(1, args.reps - 1)
        res = {
            eng: run_in_subprocess(
                "benchmarks.rollout_throughput",
                [
                    "--one",
                    preset,
                    eng,
                    "--reps",
                    str(reps),
                    "--prompts",
                    str(args.prompts),
                    "--max-tokens",
                    str(args.max_tokens),
                ],
                # Same threads for both: without OMP_NUM_THREADS vLLM drops torch to 1 thread "for serving".
                env={"OMP_NUM_THREADS": str(os.cpu_count() or 1)},
            )
            for eng in ("vllm", "vllm-eager", "hf")
        }
        v, e, h = (summary(res[k]["tok_per_s"]) for k in ("vllm", "vllm-eager", "hf"))
        rows.append(
            f"| {preset} | {fmt(v, digits=0)} | {fmt(e, digits=0)} | {fmt(h, digits=0)} "
            f"| {v['median'] / h['median']:.2f}x | {v['median'] / e['median']:.2f}x "
            f"| {res['vllm']['init_s']:.1f} / {res['vllm-eager']['init_s']:.1f} |"
        )
        payload.append({"preset": preset, **res, "speedup": v["median"] / h["median"]})
    table = "\n".join(
        [
            f"{args.prompts} prompts x {args.max_tokens} new tokens, sampling, float32, 1 process, "
            f"OMP_NUM_THREADS={os.cpu_count()} for both engines",
            "",
            "| model | vLLM tok/s (compiled) | vLLM eager tok/s | HF generate tok/s | vLLM / HF "
            "| compiled / eager | engine start s, compiled / eager |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    record("Rollout throughput", "python -m benchmarks.rollout_throughput", table, {"rollout": payload})


if __name__ == "__main__":
    main()
