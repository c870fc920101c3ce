"""Peak memory and time of the log-prob passes with whole-vocabulary logits vs the chunked LM head
(`fusedrl.workers.chunked_head`), on a SmolLM2-shaped model.

The model: a random-init ``LlamaForCausalLM`` with SmolLM2-135M's widths (hidden 576, 9 / 3 heads, MLP 1536,
vocabulary 49,152, tied embeddings) and ``--layers`` decoder layers (the head's cost does not depend on
the depth), or with ``--model PATH`` a pretrained folder as it is (``--model smollm2``: SmolLM2-135M-Instruct, all 30
layers, `fusedrl.models.smollm2`), under FSDP2 on a 1-rank gloo group as in a fused worker. The batch: 64 rows, prompts of 15-35
tokens left-padded to 64, responses of up to 32 tokens (three quarters at full length). Two passes, each
in a process of its own per variant and micro-batch size (so that ``ru_maxrss``, the peak resident set,
is this pass's alone):

* ``log_prob``: the no-grad pass of old / reference log-probs (`batched_log_probs`);
* ``update``: the actor update's passes without the optimizer: per micro-batch a forward with entropy,
  a PPO-like loss (advantage-weighted log-probs and an entropy bonus) and its backward, inside one
  `gathered_for_pass`.

Reported: the peak RSS over the RSS after the model was built (MiB; the pass run first, alone in its
process; a figure of that process alone, so other work on a shared machine does not change it), how many
chunked-head forwards and backwards the pass ran (0 for ``whole``: the check that the chunked variant really
took the chunked path, the LM head's backward included), and the pass's seconds, min and median of ``--reps``, from one more process per pass and
micro-batch that runs the two variants alternately on one model (after a warm-up round), so a shared
machine's load falls on both alike (on a shared machine the seconds still move with the other load: compare
the two variants' ratio, not the seconds across runs). Variants: ``whole`` (``chunked_head.ENABLED = False``: the logits of a
micro-batch's response positions at once) and ``chunked``.

    .venv/bin/python -m benchmarks.logprob_memory [--micro 16,64] [--layers 4] [--threads 2] [--reps 3]
        [--rounds 1] [--packed] [--dtype float32|bfloat16] [--model PATH|smollm2] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch

VARIANTS = ("whole", "chunked")
PASSES = ("log_prob", "update")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _model(layers: int, dtype: str, path: str = ""):
    import transformers

    from fusedrl.workers.fsdp import shard_for_training

    param_dtype = None if dtype == "float32" else dtype
    if path:
        if path == "smollm2":
            from fusedrl.models.smollm2 import model_dir

            path = model_dir("float32", quiet=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return shard_for_training(model, gradient_checkpointing=False, param_dtype=param_dtype)

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    return shard_for_training(model, gradient_checkpointing=False, param_dtype=param_dtype)


def _pass(model, batch, which: str, micro: int, packed: bool) -> None:
    from fusedrl.workers.fsdp import gathered_for_pass
    from fusedrl.workers.logprob import batched_log_probs, micro_batches, response_log_probs

    if which == "log_prob":
        model.eval()
        batched_log_probs(model, batch, temperature=0.7, micro_batch_size=micro, remove_padding=packed)
        return
    model.train()
    tokens = batch.response_mask.sum()
    with gathered_for_pass(model):
        for mb in micro_batches(batch, micro):
            lp, ent = response_log_probs(model, mb, temperature=0.7, with_entropy=True, remove_padding=packed)
            mask = mb.response_mask  # [b, Tr]
            loss = -((lp * mb.advantages + 1e-3 * ent) * mask).sum() / tokens  # []
            loss.backward()
    model.zero_grad(set_to_none=True)


def _group(port: int):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)


def _counted_head(chunked_head) -> dict[str, int]:
    """Counts of the chunked head's forwards and backwards from now on (the autograd function wrapped)."""
    calls = {"head_forwards": 0, "head_backwards": 0}
    fn = chunked_head._ChunkedHeadStats
    forward, backward = fn.forward, fn.backward

    def counted_forward(*a, **k):
        calls["head_forwards"] += 1
        return forward(*a, **k)

    def counted_backward(*a, **k):
        calls["head_backwards"] += 1
        return backward(*a, **k)

    fn.forward, fn.backward = staticmethod(counted_forward), staticmethod(counted_backward)
    return calls


def child(args: argparse.Namespace) -> dict:
    """Peak memory of one variant x micro-batch x pass, the first in this process (1-rank gloo group)."""
    import torch.distributed as dist

    import fusedrl.workers.chunked_head as chunked_head
    from benchmarks.train_passes import synthetic_batch

    torch.set_num_threads(args.threads)
    _group(args.port)
    try:
        chunked_head.ENABLED = args.variant == "chunked"
        model = _model(args.layers, args.dtype, args.model)
        batch = synthetic_batch(32, seed=0)
        calls = _counted_head(chunked_head)
        base = _rss_mib()
        _pass(model, batch, args.which, args.micro, args.packed)
        peak = _rss_mib()
        return {"base_mib": base, "peak_mib": peak, "peak_over_base_mib": peak - base, **calls}
    finally:
        dist.destroy_process_group()


def timing_child(args: argparse.Namespace) -> dict:
    """Seconds of one pass x micro-batch, both variants alternating on one model (after one warm-up pass
    each): ``{variant: [seconds, ...]}``."""
    import torch.distributed as dist

    import fusedrl.workers.chunked_head as chunked_head
    from benchmarks.train_passes import synthetic_batch

    torch.set_num_threads(args.threads)
    _group(args.port)
    try:
        model = _model(args.layers, args.dtype, args.model)
        batch = synthetic_batch(32, seed=0)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for rep in range(args.reps + 1):
            for variant in VARIANTS:
                chunked_head.ENABLED = variant == "chunked"
                t0 = time.perf_counter()
                _pass(model, batch, args.which, args.micro, args.packed)
                if rep:  # the first round warms up
                    times[variant].append(time.perf_counter() - t0)
        return times
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro", default="16,64", help="micro-batch sizes (rows)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--packed", action="store_true", help="use_remove_padding: packed rows")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument(
        "--model", default="", help="a pretrained folder, or smollm2 (default: random-init widths)"
    )
    p.add_argument("--passes", default=",".join(PASSES))
    p.add_argument(
        "--record", action="store_true", help="record the run (benchmarks/RESULTS.md and results_archive/)"
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="chunked", help=argparse.SUPPRESS)
    p.add_argument("--which", default="update", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.micro = int(args.micro)
        result = timing_child(args) if args.variant == "timing" else child(args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    from benchmarks.common import record, run_in_subprocess
    from benchmarks.train_passes import _free_port

    results: dict[str, list] = {}
    for _ in range(args.rounds):
        for which in args.passes.split(","):
            for micro in args.micro.split(","):
                for variant in (*VARIANTS, "timing"):
                    flags = ["--child", f"--variant={variant}", f"--which={which}", f"--micro={micro}"]
                    flags += [f"--layers={args.layers}", f"--threads={args.threads}", f"--reps={args.reps}"]
                    flags += [f"--dtype={args.dtype}", f"--model={args.model}", f"--port={_free_port()}"] + (
                        ["--packed"] * args.packed
                    )
                    out = run_in_subprocess("benchmarks.logprob_memory", flags, timeout=3600)
                    results.setdefault(f"{which}/{micro}/{variant}", []).append(out)
                    print(which, micro, variant, json.dumps(out), flush=True)
    lines = [
        "| pass | micro-batch | variant | peak RSS over base (MiB) | chunked head fwd / bwd | seconds, min (median) "
        "| min vs whole |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, runs in results.items():
        which, micro, variant = key.split("/")
        if variant == "timing":
            continue
        peak = statistics.median(r["peak_over_base_mib"] for r in runs)
        secs = [t for r in results[f"{which}/{micro}/timing"] for t in r[variant]]
        ref = min(t for r in results[f"{which}/{micro}/timing"] for t in r["whole"])
        head = f"{runs[0].get('head_forwards', '-')} / {runs[0].get('head_backwards', '-')}"
        lines.append(
            f"| {which} | {micro} | {variant} | {peak:.0f} | {head} | {min(secs):.2f} ({statistics.median(secs):.2f}) "
            f"| {min(secs) / ref:.3f} |"
        )
    layout = "packed" if args.packed else "padded"
    table = "\n".join(lines)
    shape = f"{args.model} (pretrained)" if args.model else f"SmolLM2 widths x {args.layers} layers"
    title = f"Chunked LM head: log-prob passes, {shape}, {layout}, {args.dtype}"
    if args.record:
        command = "python -m benchmarks.logprob_memory " + " ".join(sys.argv[1:] if argv is None else argv)
        record(title, command, table, {"results": results})
    else:
        print(title)
        print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
