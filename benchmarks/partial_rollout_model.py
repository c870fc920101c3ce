"""When partial rollout pays: a model of the gain from the response-length distribution.

No model and no engine: `fusedrl.workers.rollout.partial.PartialRollout` itself (its real pause / resume /
quota logic) drives `ScriptedEngine`, a request engine whose responses have lengths drawn in advance and
whose every iteration costs ``fixed + per_request x running requests`` time units (an engine step's cost:
on a GPU nearly flat in the batch, on a CPU growing with it). Both schedules train on the same number of
prompt groups a step:

- ``sync`` (``extra`` 0): each step queues its groups and waits for the longest response (today's fused
  pool);
- ``partial``: each step queues its new groups beside those carried over (the first step sends
  ``extra`` groups more), returns the first ``groups`` to finish and pauses the rest until the next step.

Lengths are lognormal (median ``--median`` tokens, log-sd ``--sigma``: 1.0 puts one response in 20 past
5x the median, 1.5 past 12x), capped at ``--max-len``. Reported per setting: trained tokens per time unit
(sync and partial) and their ratio; the ratio a synchronous step training on as many groups as partial
keeps in flight would reach (the larger engine batch alone, apart from pausing); the mean and largest age (in steps) of the tokens a step trains on,
and the share of engine iterations that ran under 1/4 of the queue's peak (the tail). Prints a table; with
``--record`` it also rewrites its block of benchmarks/RESULTS.md::

    python -m benchmarks.partial_rollout_model [--steps 40] [--groups 8] [--n 4] [--sigmas 0.5,1.0,1.5]
        [--extras 0,4,8] [--fixed 1.0] [--per-request 0.03] [--record]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

import torch

from fusedrl.batch import RolloutBatch
from fusedrl.workers.rollout.base import SampleParams, SamplingConfig
from fusedrl.workers.rollout.partial import PartialRollout

EOS, PAD = 2, 0


class ScriptedEngine:
    """A request engine of known lengths: a prompt ``[L, P, ...]`` of ``P`` tokens wants a response of ``L``
    tokens in all; tokens past ``P`` (a resumed request) count as sampled. Each `step` samples one token for
    every queued request (``100 + position``, log-prob ``-(position + 1) / 100``, EOS at ``L``) and adds
    ``fixed + per_request x queued`` to ``clock``."""

    def __init__(self, fixed: float = 0.0, per_request: float = 0.0) -> None:
        self.queue: dict[str, list] = {}  # id -> [prompt, params, new ids]
        self.submitted: list[tuple[str, list[int], SampleParams]] = []
        self.steps = 0
        self.clock = 0.0
        self.fixed, self.per_request = fixed, per_request
        self.batch_sizes: list[int] = []

    def submit(self, request_id: str, prompt: list[int], params: SampleParams) -> None:
        self.submitted.append((request_id, list(prompt), params))
        self.queue[request_id] = [list(prompt), params, []]

    @staticmethod
    def _pos(prompt: list[int], new: list[int]) -> int:
        return len(prompt) - prompt[1] + len(new)  # response tokens sampled so far

    def _log_probs(self, prompt: list[int], new: list[int]) -> list[float]:
        return [-(self._pos(prompt, []) + k + 1) / 100 for k in range(len(new))]

    def step(self) -> list[tuple[str, list[int], list[float], str]]:
        self.steps += 1
        self.batch_sizes.append(len(self.queue))
        self.clock += self.fixed + self.per_request * len(self.queue)
        done = []
        for rid, (prompt, params, new) in list(self.queue.items()):
            pos = self._pos(prompt, new)
            new.append(EOS if pos + 1 == prompt[0] else 100 + pos)
            if new[-1] == EOS or len(new) == params.max_tokens:
                del self.queue[rid]
                done.append((rid, new, self._log_probs(prompt, new), "stop" if new[-1] == EOS else "length"))
        return done

    def pause(self, request_ids=None) -> list[tuple[str, list[int], list[float]]]:
        ids = list(self.queue) if request_ids is None else list(request_ids)
        out = []
        for rid in ids:
            prompt, _, new = self.queue.pop(rid)
            out.append((rid, new, self._log_probs(prompt, new)))
        return out

    def num_unfinished(self) -> int:
        return len(self.queue)


def scripted_batch(lengths: list[int], seed0: int = 0) -> RolloutBatch:
    """One row per wanted response length (groups of n consecutive rows); prompts [L, 3, 7], left-padded
    to 5 tokens."""
    b = len(lengths)
    prompts = torch.zeros(b, 5, dtype=torch.long)  # [B, Tp]
    mask = torch.zeros(b, 5, dtype=torch.long)  # [B, Tp]
    for i, length in enumerate(lengths):
        prompts[i, 2:] = torch.tensor([length, 3, 7])
        mask[i, 2:] = 1
    batch = RolloutBatch.from_prompts(
        prompts,
        mask,
        uid=[f"u{seed0 + i}" for i in range(b)],
        data_source=["x"] * b,
        ground_truth=[str(x) for x in lengths],
    )
    batch.sample_seeds = torch.arange(seed0, seed0 + b)
    return batch


def simulate(
    *,
    steps: int,
    groups: int,
    n: int,
    median: float,
    sigma: float,
    max_len: int,
    extra: int,
    max_resumes: int,
    fixed: float,
    per_request: float,
    seed: int = 0,
    pool: list[int] | None = None,
) -> dict:
    """One schedule's figures; lengths lognormal (``median``, ``sigma``), or drawn with replacement from
    ``pool`` (measured lengths) when given."""
    rng = random.Random(seed)

    def lengths(k: int) -> list[int]:
        if pool:
            return [min(max_len, rng.choice(pool)) for _ in range(k * n)]
        return [min(max_len, max(1, round(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(k * n)]

    engine = ScriptedEngine(fixed, per_request)
    pr = PartialRollout(
        engine, n=n, max_resumes=max_resumes, max_response_length=max_len, eos_token_id=EOS, pad_token_id=PAD
    )
    sampling = SamplingConfig(max_tokens=max_len)
    trained = 0
    ages: list[int] = []
    for step in range(steps):
        # extra=0 is the synchronous schedule: nothing more in flight than a step trains on
        batch = scripted_batch(lengths(groups + (extra if step == 0 else 0)), seed0=step * 10_000)
        out = pr.generate_partial(batch, sampling, version=step, quota=groups)
        mask = out.response_mask.bool()
        trained += int(mask.sum())
        ages += (step - out.token_versions[mask]).tolist()
    peak = max(engine.batch_sizes)
    return {
        "tokens_per_time": trained / engine.clock,
        "age_mean": statistics.fmean(ages),
        "age_max": max(ages),
        "tail_share": sum(b < peak / 4 for b in engine.batch_sizes) / len(engine.batch_sizes),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--groups", type=int, default=8, help="prompt groups trained on per step")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--median", type=float, default=64)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--sigmas", default="0.5,1.0,1.5")
    ap.add_argument("--extras", default="0,4,8", help="groups in flight beyond a step's own (partial)")
    ap.add_argument("--max-resumes", type=int, default=4)
    ap.add_argument("--fixed", type=float, default=1.0, help="an engine iteration's fixed cost")
    ap.add_argument("--per-request", type=float, default=0.03, help="its cost per running request")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    common = dict(
        steps=args.steps,
        groups=args.groups,
        n=args.n,
        median=args.median,
        max_len=args.max_len,
        max_resumes=args.max_resumes,
        fixed=args.fixed,
        per_request=args.per_request,
    )
    rows, payload = [], []
    for sigma in [float(x) for x in args.sigmas.split(",")]:
        sync = simulate(sigma=sigma, extra=0, **common)
        for extra in [int(x) for x in args.extras.split(",")]:
            part = simulate(sigma=sigma, extra=extra, **common)
            # sync training on as many groups as partial keeps in flight: what the larger engine batch
            # alone gives (a larger train batch, so another algorithm), apart from the pauses
            wide = simulate(sigma=sigma, extra=0, **{**common, "groups": args.groups + extra})
            gain = part["tokens_per_time"] / sync["tokens_per_time"]
            payload.append(
                {
                    "sigma": sigma,
                    "extra": extra,
                    "sync": sync,
                    "partial": part,
                    "sync_wide": wide,
                    "gain": gain,
                }
            )
            rows.append(
                f"| {sigma} | {extra} | {sync['tokens_per_time']:.2f} ({sync['tail_share']:.0%}) | "
                f"{part['tokens_per_time']:.2f} ({part['tail_share']:.0%}) | **{gain:.2f}x** | "
                f"{wide['tokens_per_time'] / sync['tokens_per_time']:.2f}x | "
                f"{part['age_mean']:.2f} / {part['age_max']} |"
            )
    table = "\n".join(
        [
            f"{args.steps} steps of {args.groups} groups x {args.n} samples; lengths lognormal, median "
            f"{args.median:g}, capped at {args.max_len}; an engine iteration costs {args.fixed:g} + "
            f"{args.per_request:g} x running requests; resume cap {args.max_resumes}. A model, not a measured "
            "run: fusedrl's `PartialRollout` drives a scripted engine; the gain comes from the iterations' fixed "
            "cost (an engine whose iteration costs only per running request gains nothing), so it is an upper "
            "bound for a CPU engine and close to a GPU's, where an iteration's cost is nearly flat in the batch.",
            "",
            "| length log-sd | extra groups in flight | sync tokens / time (tail iterations) | partial tokens / time "
            "(tail) | partial / sync | sync on groups + extra / sync | token age, steps: mean / max |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if args.record:
        from benchmarks.common import record

        record(
            "Partial rollout, modelled",
            "python -m benchmarks.partial_rollout_model --record",
            table,
            {"runs": payload},
            block="partial_rollout_model",
        )


if __name__ == "__main__":
    main()
