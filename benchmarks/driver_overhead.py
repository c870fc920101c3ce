"""The driver's own work per GRPO step, without workers or a model, at 256 / 1024 / 4096 rows x 1k / 8k
response tokens (issue 39, item 3): does the driver's cost grow with the batch, or faster?

Synthetic batches (prompts of 512 tokens, responses of random length up to ``Tr``, 8 data-parallel ranks,
groups of 8 rows); the driver-side functions a step calls, timed directly:

* ``split``: the generation request, the reference's inputs and the update's inputs cut into rank shards;
* ``gather``: the rollout's answers and two log-prob tensors (reference, old from the update) back in row
  order; ``gather (before)``: the rollout's answers as whole batches echoing their request, as the driver
  gathered them before `rollout_generate_fields`;
* ``balance``: `balance_over_ranks` (reordering the rows by real tokens);
* ``advantages``: GRPO's group normalisation; ``metrics``: `batch_metrics`.

Also the bytes that cross Ray per step (`TensorTraffic`, counted on the shards), before and after. Ray's
serialisation is not included (see `benchmarks.controller_overhead` for a round trip's cost).

    python -m benchmarks.driver_overhead [--reps 3] [--rows 256,1024,4096] [--tokens 1024,8192]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

PROMPT_LEN = 512
RANKS = 8
GROUP = 8


def synthetic_batch(rows: int, tr: int, gen: torch.Generator):
    """A step's batch after rewards: prompts, responses, masks, rollout / old / ref log-probs, scores."""
    from fusedrl.batch import RolloutBatch

    b = RolloutBatch.from_prompts(
        torch.randint(0, 32000, (rows, PROMPT_LEN), generator=gen),
        torch.ones(rows, PROMPT_LEN, dtype=torch.long),
        uid=[f"p{i // GROUP}" for i in range(rows)],
        data_source=["synthetic"] * rows,
        ground_truth=["0"] * rows,
    )
    lengths = torch.randint(1, tr + 1, (rows,), generator=gen)
    mask = (torch.arange(tr)[None, :] < lengths[:, None]).long()  # [B, Tr]
    b.responses = torch.randint(0, 32000, (rows, tr), generator=gen) * mask
    b.response_mask = mask
    b.sample_seeds = torch.arange(rows)
    b.rollout_log_probs = -torch.rand(rows, tr, generator=gen) * mask
    b.old_log_probs = -torch.rand(rows, tr, generator=gen) * mask
    b.ref_log_probs = -torch.rand(rows, tr, generator=gen) * mask
    scores = torch.zeros(rows, tr)
    scores[torch.arange(rows), lengths - 1] = torch.rand(rows, generator=gen)
    b.token_level_scores = scores
    b.token_level_rewards = scores.clone()
    return b


def _timed(fn: Callable[[], object], reps: int) -> float:
    """Median ms of ``reps`` calls."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


def measure(rows: int, tr: int, reps: int) -> dict[str, float]:
    """ms per phase of the driver's work on one step's batch, and the MB that cross Ray (before / after)."""
    from fusedrl.algorithms import get_adv_estimator
    from fusedrl.balance import balance_over_ranks
    from fusedrl.batch import split_for_ranks
    from fusedrl.controller.worker_group import TensorTraffic, WorkerGroup
    from fusedrl.metrics import batch_metrics

    batch = synthetic_batch(rows, tr, torch.Generator().manual_seed(rows + tr))
    group = WorkerGroup.__new__(WorkerGroup)  # the gathers read nothing of a started group
    response = ["responses", "response_mask", "rollout_log_probs"]
    request = batch.select_fields("prompts", "prompt_mask", "sample_seeds")
    inputs = batch.select_fields(*batch.model_input_fields())
    update = batch.select_fields(*batch.model_input_fields(), "token_level_rewards", "ref_log_probs")
    echoed, _ = split_for_ranks(
        batch.select_fields("prompts", "prompt_mask", "sample_seeds", *response), RANKS
    )
    answers = [{name: getattr(s, name) for name in response} for s in echoed]
    log_probs = [s.old_log_probs for s in split_for_ranks(batch, RANKS)[0]]
    grpo = get_adv_estimator("grpo")

    def split() -> None:
        for b in (request, inputs, update):
            split_for_ranks(b, RANKS)

    def gather() -> None:
        group.gather_fields(answers, request)
        group.gather_tensors(log_probs, inputs)
        group.gather_tensors(log_probs, inputs)

    def gather_before() -> None:
        group.gather_batches(echoed, request)
        group.gather_tensors(log_probs, inputs)
        group.gather_tensors(log_probs, inputs)

    def advantages() -> None:
        adv, _ = grpo(batch.token_level_rewards, batch.response_mask, index=batch.field_list("uid"))
        batch.advantages = adv

    out = {
        "split": _timed(split, reps),
        "gather": _timed(gather, reps),
        "gather (before)": _timed(gather_before, reps),
        "balance": _timed(lambda: balance_over_ranks(batch, RANKS, reorder=True, groups_whole=False), reps),
        "advantages": _timed(advantages, reps),
        "metrics": _timed(lambda: batch_metrics(batch, 1.0, 1), reps),
    }
    after, before = TensorTraffic(), TensorTraffic()
    for traffic, back in ((after, answers), (before, echoed)):
        traffic.add(split_for_ranks(request, RANKS)[0], "rollout out")
        traffic.add(back, "rollout back")
        traffic.add(split_for_ranks(inputs, RANKS)[0], "ref out")
        traffic.add(log_probs, "ref back")
        traffic.add(split_for_ranks(update, RANKS)[0], "update out")
        traffic.add(log_probs, "update back")
    out["MB crossed"], out["MB crossed (before)"] = after.bytes / 1e6, before.bytes / 1e6
    out["crossings"], out["crossings (before)"] = after.crossings, before.crossings
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rows", default="256,1024,4096")
    parser.add_argument("--tokens", default="1024,8192")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the driver's share of a node; also steadier on a shared machine
    phases = ["split", "gather", "balance", "advantages", "metrics"]
    print(
        "| rows x Tr | " + " | ".join(f"{p} ms" for p in phases) + " | driver ms | ns / response token "
        "| gather (before) ms | MB crossed (before) |"
    )
    print("|---" * (len(phases) + 5) + "|")
    for tr in (int(t) for t in args.tokens.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            m = measure(rows, tr, args.reps)
            total = sum(m[p] for p in phases)
            per_token = total * 1e6 / (rows * tr)
            cells = " | ".join(f"{m[p]:.1f}" for p in phases)
            print(
                f"| {rows} x {tr} | {cells} | {total:.1f} | {per_token:.1f} | {m['gather (before)']:.1f} "
                f"| {m['MB crossed']:.0f} ({m['MB crossed (before)']:.0f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
