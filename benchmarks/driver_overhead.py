"""The driver's own work per GRPO step, without workers or a model, at 256 / 1024 / 4096 rows x 1k / 8k
response tokens (issue 39, item 3): does the driver's cost grow with the batch, or faster?

Synthetic batches (left-padded prompts of 64 to 512 tokens, responses of random length up to ``Tr``, 8
data-parallel ranks, groups of 8 rows); the driver-side functions a step calls, timed directly:

* ``split``: the generation request cut into engine shards, its prompts packed with their mask
  (`fusedrl.rollout_request`), and the update's one tensor, the advantages as ``[B]`` (`fusedrl.resident`);
* ``gather``: the rollout's answers (responses packed with their mask) back in row order, unpacked;
* ``balance``: `balance_over_ranks` (reordering the rows by real tokens);
* ``advantages``: GRPO's group normalisation; ``metrics``: `batch_metrics` and the log-prob gap the workers
  answer as numbers (`fusedrl.log_prob_gap`).

The reference's and the old log-probs stay on the workers (no driver work). Also the tensors and bytes that
cross Ray per step (`TensorTraffic`, counted on the shards), now and before (3a7124e: the request's three
fields, the answer's three, the advantages ``[B, Tr]`` and the old log-probs). Ray's serialisation is not
included (see `benchmarks.controller_overhead` for a round trip's cost).

    python -m benchmarks.driver_overhead [--reps 3] [--rows 256,1024,4096] [--tokens 1024,8192]
"""

from __future__ import annotations

import argparse
import copy
import pickle
import time
from collections.abc import Callable

import torch

PROMPT_LEN = 512
RANKS = 8
GROUP = 8


def synthetic_batch(rows: int, tr: int, gen: torch.Generator):
    """A step's batch after rewards: prompts (left-padded, 64 to 512 tokens), responses, masks, old / ref
    log-probs, scores (the rollout's log-probs stay on the workers: the batch has none)."""
    from fusedrl.batch import RolloutBatch

    prompt_lengths = torch.randint(64, PROMPT_LEN + 1, (rows,), generator=gen)
    prompt_mask = (torch.arange(PROMPT_LEN)[None, :] >= PROMPT_LEN - prompt_lengths[:, None]).long()
    b = RolloutBatch.from_prompts(
        torch.randint(1, 32000, (rows, PROMPT_LEN), generator=gen) * prompt_mask,
        prompt_mask,
        uid=[f"p{i // GROUP}" for i in range(rows)],
        data_source=["synthetic"] * rows,
        ground_truth=["0"] * rows,
    )
    lengths = torch.randint(1, tr + 1, (rows,), generator=gen)
    mask = (torch.arange(tr)[None, :] < lengths[:, None]).long()  # [B, Tr]
    b.responses = torch.randint(0, 32000, (rows, tr), generator=gen) * mask
    b.response_mask = mask
    b.sample_seeds = torch.arange(rows)
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
    """ms per phase of the driver's work on one step's batch, and what crosses Ray (now / before)."""
    from fusedrl.algorithms import get_adv_estimator
    from fusedrl.balance import balance_over_ranks
    from fusedrl.batch import split_for_ranks
    from fusedrl.controller.worker_group import TensorTraffic, WorkerGroup
    from fusedrl.log_prob_gap import gap_metrics, gap_stats
    from fusedrl.metrics import batch_metrics
    from fusedrl.resident import row_values
    from fusedrl.rollout_request import RolloutRequest, SeedRows, wire_answer

    gen = torch.Generator().manual_seed(rows + tr)
    batch = synthetic_batch(rows, tr, gen)
    group = WorkerGroup.__new__(WorkerGroup)  # the gathers read nothing of a started group
    request = RolloutRequest(
        batch.select_fields("prompts", "prompt_mask"), ("prompts", "prompt_mask"), SeedRows(0, 1, 0, rows)
    )
    shards, _ = split_for_ranks(batch, RANKS)
    rollout_lp = [-torch.rand(s.responses.shape, generator=gen) * s.response_mask for s in shards]
    # What each worker answers: its responses packed with their mask (the log-probs stay there).
    answers = [wire_answer({"responses": s.responses, "response_mask": s.response_mask}) for s in shards]
    gaps = [gap_stats(lp, s.old_log_probs, s.response_mask) for lp, s in zip(rollout_lp, shards)]
    grpo = get_adv_estimator("grpo")
    adv, _ = grpo(batch.token_level_rewards, batch.response_mask, index=batch.field_list("uid"))
    batch.advantages = adv

    def split() -> None:
        request.shards_for(RANKS)
        values, _ = row_values(batch.advantages, batch.response_mask)  # the update's one tensor, [B]
        values.tensor_split(RANKS)

    def gather() -> None:
        group.gather_fields(answers, request)

    # Before (3a7124e): the request's fields and the update's advantages split as views, the three answer
    # fields and the old log-probs gathered padded, the gap taken on the driver from the two tensors.
    sent = batch.select_fields("prompts", "prompt_mask", "sample_seeds")
    padded = [
        {"responses": s.responses, "response_mask": s.response_mask, "rollout_log_probs": lp}
        for s, lp in zip(shards, rollout_lp)
    ]
    with_lp = copy.copy(batch)
    with_lp.rollout_log_probs = torch.cat(rollout_lp)[:rows]

    def split_before() -> None:
        split_for_ranks(sent, RANKS)
        split_for_ranks(batch.select_fields("advantages"), RANKS)

    def gather_before() -> None:
        group.gather_fields(padded, request)
        group.gather_tensors([s.old_log_probs for s in shards], request)

    def advantages() -> None:
        grpo(batch.token_level_rewards, batch.response_mask, index=batch.field_list("uid"))

    def metrics() -> None:
        batch_metrics(batch, 1.0, 1, gap=gap_metrics(gaps))

    out = {
        "split": _timed(split, reps),
        "gather": _timed(gather, reps),
        "balance": _timed(lambda: balance_over_ranks(batch, RANKS, reorder=True, groups_whole=False), reps),
        "advantages": _timed(advantages, reps),
        "metrics": _timed(metrics, reps),
        "split (before)": _timed(split_before, reps),
        "gather (before)": _timed(gather_before, reps),
        "metrics (before)": _timed(lambda: batch_metrics(with_lp, 1.0, 1), reps),
    }
    now, before = TensorTraffic(), TensorTraffic()
    now.add(request.shards_for(RANKS), "rollout out")
    now.add(answers, "rollout back")
    now.add(list(row_values(batch.advantages, batch.response_mask)[0].tensor_split(RANKS)), "update out")
    # Before (3a7124e: 8 crossings): the request's three fields out, responses, mask and rollout log-probs
    # back, the advantages [B, Tr] to the update and its old log-probs back.
    before.add(split_for_ranks(sent, RANKS)[0], "rollout out")
    before.add([[s.responses, s.response_mask, lp] for s, lp in zip(shards, rollout_lp)], "rollout back")
    before.add([s.advantages for s in split_for_ranks(batch, RANKS)[0]], "update out")
    before.add([s.old_log_probs for s in shards], "update back")
    out["MB crossed"], out["MB crossed (before)"] = now.bytes / 1e6, before.bytes / 1e6
    out["crossings"], out["crossings (before)"] = now.crossings, before.crossings
    # Ray pickles what crosses: one round trip of each side's shards and answers through pickle.
    now_objs = (request.shards_for(RANKS), answers, row_values(batch.advantages, batch.response_mask)[0])
    before_objs = (
        split_for_ranks(sent, RANKS)[0],
        padded,
        [s.advantages for s in split_for_ranks(batch.select_fields("advantages"), RANKS)[0]],
        [s.old_log_probs for s in shards],
    )
    out["pickle"] = _timed(lambda: pickle.loads(pickle.dumps(now_objs, protocol=5)), reps)
    out["pickle (before)"] = _timed(lambda: pickle.loads(pickle.dumps(before_objs, protocol=5)), reps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rows", default="256,1024,4096")
    parser.add_argument("--tokens", default="1024,8192")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the driver's share of a node; also steadier on a shared machine
    phases = ["split", "gather", "balance", "advantages", "metrics"]
    changed = ["split", "gather", "metrics"]
    print(
        "| rows x Tr | " + " | ".join(f"{p} ms" for p in phases) + " | driver ms | ns / response token "
        "| driver ms (before) | pickle ms (before) | crossings (before) | MB crossed (before) |"
    )
    print("|---" * (len(phases) + 7) + "|")
    for tr in (int(t) for t in args.tokens.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            m = measure(rows, tr, args.reps)
            total = sum(m[p] for p in phases)
            before = total + sum(m[f"{p} (before)"] - m[p] for p in changed)
            per_token = total * 1e6 / (rows * tr)
            cells = " | ".join(f"{m[p]:.1f}" for p in phases)
            print(
                f"| {rows} x {tr} | {cells} | {total:.1f} | {per_token:.1f} | {before:.1f} "
                f"| {m['pickle']:.1f} ({m['pickle (before)']:.1f}) "
                f"| {m['crossings']} ({m['crossings (before)']}) | {m['MB crossed']:.0f} "
                f"({m['MB crossed (before)']:.0f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
