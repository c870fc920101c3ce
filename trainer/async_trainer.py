"""Off-policy asynchronous RL with bounded staleness (``async_training.max_staleness`` K; docs/placement.md).

With the rollout on a pool of its own, the generations of the next K steps are sent to the rollout workers
(Ray object refs, not awaited) before step k's training phases run, so the engine generates while the actor
scores, updates and checkpoints:

    step k:   take batch k  ->  send generation k+K  ->  reward, log-probs, advantages, update (version k)
              ->  wait for the generations in flight  ->  sync version k into the engine  ->  (save, validate)

Generation k+K runs on the weights the engine holds when it starts (version k-1, synced after step k-1's
update); the sync after step k's update reaches the engine after it (the driver waits for every generation
in flight first, and Ray runs one caller's calls to a worker in order). Batch k+K is trained on by the actor
at version k+K-1: K updates after the weights that generated it. With K=1 (one-step-off) generation k+1
overlaps step k's training; a larger K buffers finished batches (the engine may run further ahead of a slow
step, at the cost of staler samples). Every sample carries ``policy_version``, the number of actor updates
behind the weights that generated it; each step checks that ``actor version - policy_version`` is within
``[0, max_staleness]`` and raises otherwise.

The loss: ``old_log_probs`` come from the actor's own pass (the policy before this step's update), and
``algorithm.rollout_correction.rollout_is`` (required by the config check) weighs every token by the
truncated ratio ``min(pi_old / pi_rollout, threshold)`` against the rollout's own log-probs (the behaviour
policy, one update older) before the PPO update.

With ``max_staleness=0`` the same code sends each step's generation and waits for it at once: the run is
the synchronous one, step for step. A checkpoint saves the finished next batches with their policy versions
(``async_batch.safetensors`` / ``async_batch.json``); a resumed run trains on them instead of regenerating
them (the weights that generated them are gone), so a resumed run equals the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

from fusedrl.async_config import max_staleness
from fusedrl.batch import NON_TENSOR_FIELDS, RolloutBatch, concat
from fusedrl.controller.worker_group import Submitted
from fusedrl.metrics import Metrics
from fusedrl.rollout_request import RolloutRequest
from fusedrl.tracking import timer
from fusedrl.trainer import step_plan
from fusedrl.trainer.ppo_trainer import PPOTrainer

BATCH_TENSORS = "async_batch.safetensors"
BATCH_META = "async_batch.json"
# The fields a finished generation holds, and those multi-turn agent loops add.
SAVED_TENSORS = (
    "prompts",
    "prompt_mask",
    "responses",
    "response_mask",
    "rollout_log_probs",
    "sample_seeds",
    "policy_version",
)
AGENT_TENSORS = ("response_attention_mask", "agent_stats")


@dataclass
class InFlight:
    """One step's generation sent to the rollout workers: the rows, and the calls not awaited yet (or,
    once finished, the generated batch)."""

    step: int
    batch: RolloutBatch
    to_send: RolloutRequest | None = None  # what the rollout workers were sent (`fusedrl.rollout_request`)
    calls: list[Submitted] = field(default_factory=list)
    submitted_at: float = 0.0
    done_at: list[float] = field(default_factory=list)  # when each generate call answered (driver clock)
    result: RolloutBatch | None = None


class AsyncPPOTrainer(PPOTrainer):
    """`PPOTrainer` whose generation of the next step overlaps this step's training (module docstring)."""

    def __init__(self, config: DictConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.max_staleness = max_staleness(self.run)
        self.actor_version = 0  # actor updates so far
        self.engine_version = 0  # the actor version whose weights the engine holds
        self.queue: list[InFlight] = []  # generations sent, by step (at most max_staleness after this step's)
        self.last_staleness_max = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ generation in flight
    def submit_generation(self, prompts: RolloutBatch, step: int) -> InFlight:
        """Send step ``step``'s generation (seeds of that step) to the rollout workers without waiting."""
        batch, to_send = self.generation_request(prompts, False, 0, step)
        # The rollout workers decide whether their engines need the weights (`sync_weights`), answering
        # for now: with generations queued only an engine whose sleep discards them can need a stream, and
        # then the stream (the actor pool takes part) waits for them, as `sync_weights` does.
        if not self.queue or self.rollout_discards_weights:
            self.sync_weights()
        batch.policy_version = torch.full((batch.num_samples,), self.engine_version, dtype=torch.long)  # [B]
        rollout = self.group_for("rollout")
        tp = self.run.rollout.tensor_model_parallel_size
        sampling = self.sampling(False)
        flight = InFlight(step=step, batch=batch, to_send=to_send, submitted_at=time.monotonic())
        wake = rollout.submit_all(lambda w: w.rollout_wake_up.remote(["weights", "kv_cache"]))
        fields = self.response_fields
        gen = rollout.submit_split(
            lambda w, s: w.rollout_generate_fields.remote(s, sampling, fields), to_send, replicas=tp
        )
        sleep = rollout.submit_all(lambda w: w.rollout_sleep.remote())
        flight.calls = [wake, gen, sleep]
        for ref in gen.refs:
            ref.future().add_done_callback(lambda _f, fl=flight: self._answered(fl))
        return flight

    def _answered(self, flight: InFlight) -> None:
        with self._lock:
            flight.done_at.append(time.monotonic())

    @property
    def in_flight(self) -> InFlight | None:
        """The oldest generation sent and not taken yet (None when none is)."""
        return self.queue[0] if self.queue else None

    def finish_in_flight(self) -> Metrics:
        """Wait for every generation in flight and keep its batch; the overlap metrics of the newest (`finish`)."""
        metrics: Metrics = {}
        for flight in self.queue:
            metrics = self.finish(flight) or metrics
        return metrics

    def finish(self, flight: InFlight) -> Metrics:
        """Wait for ``flight`` (if not done yet) and keep its batch; the overlap metrics: how long it ran
        (``async/gen_s``), how much of it the driver spent on other phases (``async/overlap_s``) and how long
        the driver then waited for it (``async/gen_wait_s``)."""
        if flight.result is not None:
            return {}
        assert flight.to_send is not None
        rollout = self.group_for("rollout")
        wait_from = time.monotonic()
        rollout.wait(flight.calls[0])
        shards = rollout.wait(flight.calls[1])
        rollout.wait(flight.calls[2])
        waited = time.monotonic()
        if rollout is self.group_for("actor"):  # a fused engine: the actor's parameters come back
            rollout.run_all(lambda w: w.load_actor.remote())
        flight.result = flight.batch.set_fields(rollout.gather_fields(shards, flight.to_send))
        with self._lock:  # the answer callbacks run on Ray's thread; one may not have run yet
            answered = list(flight.done_at)
        complete = len(answered) == len(flight.calls[1].refs)
        done = min(max(answered), waited) if complete else waited
        flight.calls, flight.to_send = [], None
        return {
            "async/gen_s": done - flight.submitted_at,
            "async/overlap_s": max(0.0, min(done, wait_from) - flight.submitted_at),
            "async/gen_wait_s": waited - wait_from,
        }

    def take_in_flight(self, metrics: Metrics) -> RolloutBatch:
        """This step's generated batch (waiting for it if needed), taken off the queue."""
        flight = self.queue.pop(0)
        metrics.update(self.finish(flight))
        assert flight.result is not None
        if flight.step != self.global_step:
            raise RuntimeError(
                f"step {self.global_step}: the batch in flight was generated for step {flight.step}"
            )
        return flight.result

    # ------------------------------------------------------------------ the step's phases
    def collect_batch(self, metrics: Metrics) -> RolloutBatch:
        """This step's samples (generated during earlier steps, or now on the first step and with
        ``max_staleness=0``); then the generations of the next ``max_staleness`` steps are in flight (sent
        before this step trains)."""
        if not self.queue:
            self.queue.append(self.submit_generation(self.next_prompts(), self.global_step))
        with timer("gen", metrics):
            batch = self.take_in_flight(metrics)
        ahead = min(self.global_step + self.max_staleness, self.total_steps)
        for step in range(self.global_step + 1 + len(self.queue), ahead + 1):
            self.queue.append(self.submit_generation(self.next_prompts(), step))
        metrics.update(self.check_staleness(batch))
        with timer("reward", metrics):
            batch = self.compute_rewards(batch, metrics)
        return batch

    def check_staleness(self, batch: RolloutBatch) -> Metrics:
        """Raise unless every sample's policy is at most ``max_staleness`` updates behind the actor that
        trains on it (and not ahead of it); the staleness metrics."""
        assert batch.policy_version is not None
        staleness = self.actor_version - batch.policy_version  # [B]
        low, high = int(staleness.min()), int(staleness.max())
        if low < 0 or high > self.max_staleness:
            raise RuntimeError(
                f"step {self.global_step}: samples generated by policy versions "
                f"{sorted(set(batch.policy_version.tolist()))} for the actor at version {self.actor_version}: "
                f"staleness {low}..{high} is outside [0, async_training.max_staleness={self.max_staleness}]."
            )
        self.last_staleness_max = high
        return {
            "async/staleness_max": float(high),
            "async/staleness_mean": float(staleness.float().mean()),
            "async/policy_version_min": float(batch.policy_version.min()),
            "async/actor_version": float(self.actor_version),
        }

    def update_actor(self, batch: RolloutBatch) -> Metrics:
        metrics = super().update_actor(batch)
        self.actor_version += 1
        return metrics

    def sync_weights(self, force: bool = False) -> Metrics:
        """The generation in flight finishes on the weights it started with; then the actor's new weights
        go into the engine where the rollout workers need them (``engine_version`` follows)."""
        metrics = self.finish_in_flight()
        metrics.update(super().sync_weights(force))
        self.engine_version = self.actor_version
        return metrics

    def batch_metrics(self, batch: RolloutBatch, step_time: float) -> Metrics:
        """As the synchronous trainer's; on a stale batch the rollout-vs-actor log-prob gap measures the
        policy's move, not the sync, so it is reported as ``async/behaviour_log_prob_abs_diff_*`` and the
        sync health check (``trainer.rollout_check_tol``) only judges fresh batches."""
        metrics = super().batch_metrics(batch, step_time)
        if self.last_staleness_max > 0:
            for stat in ("mean", "max"):
                value = metrics.pop(f"rollout/log_prob_abs_diff_{stat}")
                metrics[f"async/behaviour_log_prob_abs_diff_{stat}"] = value
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> str:
        self.finish_in_flight()  # the next batch is saved finished, with its policy version
        return super().save_checkpoint()

    def save_driver_files(self, folder: str) -> None:
        """The finished next batches, one after the other (tensors as safetensors; their steps, row counts
        and per-row strings as JSON), if there are any."""
        if not self.queue:
            return
        from safetensors.torch import save_file

        batches = [flight.result for flight in self.queue]
        assert all(b is not None for b in batches)
        batch = concat(batches)  # type: ignore[arg-type]
        names = [*SAVED_TENSORS, *(n for n in AGENT_TENSORS if getattr(batch, n) is not None)]
        save_file(
            {name: getattr(batch, name).contiguous() for name in names}, os.path.join(folder, BATCH_TENSORS)
        )
        meta = {
            "steps": [flight.step for flight in self.queue],
            "rows": [b.num_samples for b in batches],  # type: ignore[union-attr]
            **{
                name: batch.field_list(name) for name in NON_TENSOR_FIELDS if getattr(batch, name) is not None
            },
        }
        with open(os.path.join(folder, BATCH_META), "w", encoding="utf-8") as f:
            json.dump(meta, f)

    def load_checkpoint(self) -> str | None:
        """Resume as the synchronous trainer does, then the actor version and the saved next batch."""
        path = super().load_checkpoint()
        if path is None:
            return None
        steps = range(1, self.global_step + 1)
        self.actor_version = sum(step_plan.actor_trains(self.run, s) for s in steps)
        self.engine_version = self.actor_version  # the engine was re-synced to the restored actor
        self.queue = []
        # Saved next batches are older than the restored actor: used when the run is asynchronous (as many as
        # its bound keeps ahead), else regenerated.
        if self.max_staleness > 0 and os.path.exists(os.path.join(path, BATCH_META)):
            self.queue = load_in_flight(path)[: self.max_staleness]
        return path


def load_in_flight(path: str) -> list[InFlight]:
    """The finished batches a checkpoint saved (`AsyncPPOTrainer.save_driver_files`), oldest first."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(path, BATCH_TENSORS))
    with open(os.path.join(path, BATCH_META), encoding="utf-8") as f:
        meta = json.load(f)
    rows = int(tensors["prompts"].shape[0])
    fields: dict[str, Any] = {**tensors, **{name: meta[name] for name in NON_TENSOR_FIELDS if name in meta}}
    whole = RolloutBatch(**fields, batch_size=[rows])
    steps, counts = meta.get("steps", [meta.get("step")]), meta.get("rows", [rows])
    flights, start = [], 0
    for step, count in zip(steps, counts):
        batch = whole[start : start + count]
        flights.append(InFlight(step=int(step), batch=batch, result=batch))
        start += count
    return flights
