"""Single-controller cost: one round trip to the fused workers, empty and with realistic batches.

Two fused workers (no models: only the Ray actor and the batch's serialisation are measured). A GRPO
step makes about 6 such split/gather round trips (generate, old log-prob, ref, update, sync, + rewards on
the driver), so 6 x the per-call cost at the step's batch size is the controller's share of a step.

    python -m benchmarks.controller_overhead
"""

from __future__ import annotations

import time

import torch


def realistic_batch(rows: int, prompt_len: int = 64, response_len: int = 128):
    from fusedrl.batch import RolloutBatch

    b = RolloutBatch.from_prompts(
        torch.randint(0, 500, (rows, prompt_len)),
        torch.ones(rows, prompt_len, dtype=torch.long),
        uid=[f"u{i}" for i in range(rows)],
        data_source=["arithmetic"] * rows,
        ground_truth=["42"] * rows,
    )
    b.responses = torch.randint(0, 500, (rows, response_len))
    b.response_mask = torch.ones(rows, response_len, dtype=torch.long)
    b.old_log_probs = torch.randn(rows, response_len)
    b.ref_log_probs = torch.randn(rows, response_len)
    b.advantages = torch.randn(rows, response_len)
    return b.select_fields(
        "prompts", "prompt_mask", "responses", "response_mask", "old_log_probs", "ref_log_probs", "advantages"
    )


def main() -> None:
    import ray

    from benchmarks.common import fmt, record, summary
    from fusedrl.config import role_configs_from_overrides
    from fusedrl.controller import ResourcePool, WorkerGroup
    from fusedrl.workers.worker_dict import WorkerDict

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", object_store_memory=512 << 20)
    config = role_configs_from_overrides(["data.train_files=unused", "actor_rollout_ref.model.path=unused"])
    group = WorkerGroup(WorkerDict, ResourcePool(slots_per_node=2), config)
    try:
        group.run_all(lambda w: w.ping.remote())
        reps = 20
        empty = []
        for _ in range(reps):
            t0 = time.perf_counter()
            group.run_all(lambda w: w.ping.remote())
            empty.append((time.perf_counter() - t0) * 1000)
        rows = [f"| empty (ping) | - | {fmt(summary(empty), ' ms', 2)} |"]
        payload = {"empty_ms": empty, "batch": {}}
        for n in (16, 64, 256, 1024):
            batch = realistic_batch(n)
            mb = (
                sum(
                    t.numel() * t.element_size()
                    for t in (
                        batch.prompts,
                        batch.prompt_mask,
                        batch.responses,
                        batch.response_mask,
                        batch.old_log_probs,
                        batch.ref_log_probs,
                        batch.advantages,
                    )
                )
                / 1e6
            )
            times = []
            for _ in range(reps // 2):
                t0 = time.perf_counter()
                group.run_split(lambda w, shard: w.echo_rows.remote(shard), batch)
                times.append((time.perf_counter() - t0) * 1000)
            rows.append(f"| {n} rows | {mb:.2f} | {fmt(summary(times), ' ms', 2)} |")
            payload["batch"][n] = times
    finally:
        group.shutdown()
        ray.shutdown()
    table = "\n".join(
        [
            "2 fused workers; split by rank, send, return; batch = an update batch (Tp=64, Tr=128, 7 fields)",
            "",
            "| call | payload MB | round trip |",
            "|---|---|---|",
            *rows,
        ]
    )
    record("Controller overhead", "python -m benchmarks.controller_overhead", table, payload)


if __name__ == "__main__":
    main()
