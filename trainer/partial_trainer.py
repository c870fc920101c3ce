"""Partial rollout in the fused pool (``async_training.partial_rollout``; docs/placement.md).

A synchronous step waits for its longest response. Here each worker keeps more prompt groups in flight
than a step trains on (``data.train_batch_size`` plus ``async_training.staleness_threshold`` of it), and a
step trains on the first ``train_batch_size`` groups to finish (``train_batch_size / workers`` on each
worker, `fusedrl.workers.rollout.partial.PartialRollout`). Requests still running are paused; the engine
sleeps, the actor trains and streams its weights, and the next step resumes them under the new weights
beside the new prompts it sends (as many groups as it took):

    step k:   send new groups  ->  each worker: run carried + new until quota groups finished, pause the
              rest  ->  reward, log-probs, advantages, update (version k)  ->  sync version k

Every response token carries the actor version that sampled it (``token_versions``), its rollout log-prob
is the one that version gave it, and the loss weighs it by the truncated ratio pi_old / pi_rollout
(``algorithm.rollout_correction.rollout_is``, required by the config check), pi_old being the actor before
this step's update. A sample paused ``async_training.partial_rollout_max_resumes`` times finishes in the
step that resumes it, so a token's age is bounded (`age_bound`; checked every step).

Agent loops (``multi_turn``) run the same schedule on `fusedrl.workers.rollout.partial_agent`: a trajectory
is suspended mid-turn or between turns. Their coroutines cannot be saved, so a step that saves a checkpoint
drains first (`drains_this_step`): its rollout runs every trajectory in flight to its end, and the groups
beyond the quota are carried finished.

Prompts come from the loader in its batches; the first step sends the extra groups too, so the driver
keeps the prompts it drew but has not sent (``pending``). A checkpoint saves them and every worker's carried
groups (``partial_rollout.pt``); a resumed run continues the paused requests as the uninterrupted run does.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import ray
import torch
from omegaconf import DictConfig

from fusedrl.async_config import groups_in_flight
from fusedrl.batch import RolloutBatch, concat
from fusedrl.log_prob_gap import gap_metrics, gap_stats
from fusedrl.metrics import Metrics
from fusedrl.tracking import timer
from fusedrl.trainer import step_plan
from fusedrl.trainer.ppo_trainer import PPOTrainer

STATE_FILE = "partial_rollout.pt"
CLOSE_TIMEOUT_S = 30.0  # what `close` waits for the workers to cancel their suspended trajectories


class PartialRolloutTrainer(PPOTrainer):
    """`PPOTrainer` whose steps train on the first groups to finish (module docstring)."""

    def __init__(self, config: DictConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.actor_version = 0  # actor updates so far: the version the engine samples with
        self.carried_groups = 0  # groups the workers hold between steps
        self.pending: RolloutBatch | None = None  # prompts drawn from the loader, not sent yet
        self.rollout_workers = 1  # set by init_workers

    # ------------------------------------------------------------------ schedule
    def init_workers(self, role_groups: Any = None) -> None:
        super().init_workers(role_groups)
        self.rollout_workers = self.group_for("rollout").world_size  # each holds its own carried groups

    def close(self) -> None:
        """Before the workers are killed, cancel the agent trajectories still suspended on them (a run that
        stopped on a step that did not drain): their loops' ``finally`` run, so environments close. Best
        effort: a dead or hung worker is skipped after `CLOSE_TIMEOUT_S`."""
        group = self.groups.by_role.get("rollout")
        if self.multi_turn and group is not None:
            with contextlib.suppress(Exception):
                ray.get([w.rollout_close_partial.remote() for w in group.workers], timeout=CLOSE_TIMEOUT_S)
        super().close()

    @property
    def in_flight(self) -> int:
        """Prompt groups kept in flight (`fusedrl.async_config.groups_in_flight`)."""
        a = self.run.async_training
        return groups_in_flight(self.run.data.train_batch_size, a.staleness_threshold, self.rollout_workers)

    @property
    def age_bound(self) -> int:
        """The largest age (actor versions) a trained token may have: a sample spans at most
        ``max_resumes + 1`` steps, and a finished group waits at most ``ceil(extra / batch)`` more."""
        bsz = self.run.data.train_batch_size
        return self.run.async_training.partial_rollout_max_resumes + math.ceil((self.in_flight - bsz) / bsz)

    @property
    def drains_this_step(self) -> bool:
        """Agent loops (``multi_turn``) on a step that saves a checkpoint (``trainer.save_freq``): every
        trajectory in flight runs to its end before the step returns its batch, so the checkpoint holds no
        suspended coroutine (`fusedrl.workers.rollout.partial_agent`). The uninterrupted run drains at the
        same steps, so a run resumed from the checkpoint equals it."""
        tr = self.run.trainer
        return bool(self.multi_turn) and step_plan.due(tr.save_freq, self.global_step, self.total_steps)

    def take_prompts(self, groups: int) -> RolloutBatch:
        """The next ``groups`` prompts: those drawn and not sent first, then the loader's."""
        parts = [self.pending] if self.pending is not None else []
        while sum(p.num_samples for p in parts) < groups:
            parts.append(self.next_prompts())
        drawn = concat(parts)
        self.pending = drawn[groups:] if drawn.num_samples > groups else None
        return drawn[:groups]

    # ------------------------------------------------------------------ the step's phases
    def collect_batch(self, metrics: Metrics) -> RolloutBatch:
        """This step's ``train_batch_size`` groups: the first to finish among the carried and new ones."""
        with timer("gen", metrics):
            batch = self.generate_partial(metrics)
        metrics.update(self.check_token_ages(batch))
        with timer("reward", metrics):
            batch = self.compute_rewards(batch, metrics)
        return batch

    def generate_partial(self, metrics: Metrics) -> RolloutBatch:
        """Send the groups that bring the workers back to `in_flight`, and take each worker's quota of
        finished groups (rows whole: prompts, fields, responses, log-probs, versions)."""
        new = self.in_flight - self.carried_groups
        batch, _ = self.generation_request(self.take_prompts(new), False, 0, self.global_step)
        rollout = self.group_for("rollout")
        self.sync_weights()  # the rollout workers decide whether their engines need the weights
        rollout.send_all(lambda w: w.rollout_wake_up.remote(["weights", "kv_cache"]))
        sampling, version = self.sampling(False), self.actor_version
        quota = self.run.data.train_batch_size // self.rollout_workers
        drain = self.drains_this_step
        shards = rollout.run_split(
            lambda w, shard: w.rollout_generate_partial.remote(shard, sampling, version, quota, drain), batch
        )
        rollout.send_all(lambda w: w.rollout_sleep.remote())
        self.group_for("actor").send_all(lambda w: w.load_actor.remote())
        self.carried_groups += new - self.run.data.train_batch_size
        metrics["partial/new_groups"] = float(new)
        metrics["partial/drained"] = float(drain)
        metrics["partial/carried_groups"] = float(self.carried_groups)
        return concat(shards)

    def check_token_ages(self, batch: RolloutBatch) -> Metrics:
        """Raise unless every trained token was sampled by a version between `age_bound` updates ago and
        now; the age metrics (``partial/token_age_*``, the share of resumed rows)."""
        assert batch.token_versions is not None and batch.policy_version is not None
        mask = batch.response_mask.bool()  # [B, Tr]
        ages = (self.actor_version - batch.token_versions)[mask]  # [N valid]
        low, high = (int(ages.min()), int(ages.max())) if ages.numel() else (0, 0)
        if low < 0 or high > self.age_bound:
            raise RuntimeError(
                f"step {self.global_step}: tokens sampled {low}..{high} actor updates ago; partial rollout "
                f"bounds their age at 0..{self.age_bound} (async_training.partial_rollout_max_resumes and "
                "staleness_threshold)."
            )
        return {
            "partial/token_age_mean": float(ages.float().mean()) if ages.numel() else 0.0,
            "partial/token_age_max": float(high),
            "partial/stale_rows": float((batch.policy_version < self.actor_version).float().mean()),
        }

    def update_actor(self, batch: RolloutBatch) -> Metrics:
        metrics = super().update_actor(batch)
        self.actor_version += 1
        return metrics

    def batch_metrics(self, batch: RolloutBatch, step_time: float) -> Metrics:
        """As the synchronous trainer's, but the rollout-vs-actor log-prob gap that checks the weight sync
        (``rollout/log_prob_abs_diff_*``, ``trainer.rollout_check_tol``) is taken on the tokens the
        current weights sampled; on older tokens it measures the policy's move
        (``partial/behaviour_log_prob_abs_diff_*``)."""
        metrics = super().batch_metrics(batch, step_time)
        assert batch.token_versions is not None
        # The actor trained since: the version that computed old_log_probs is the one before the update.
        current = self.actor_version - int(self.actor_trains_this_step)
        mask = batch.response_mask.bool()
        fresh = mask & (batch.token_versions == current)
        for name, keep in (
            ("rollout/log_prob_abs_diff", fresh),
            ("partial/behaviour_log_prob_abs_diff", mask & ~fresh),
        ):  # as `fusedrl.metrics.batch_metrics` measures the gap (`fusedrl.log_prob_gap`), on those tokens
            gap = gap_metrics([gap_stats(batch.rollout_log_probs, batch.old_log_probs, keep)])
            metrics[f"{name}_mean"] = gap["rollout/log_prob_abs_diff_mean"]
            metrics[f"{name}_max"] = gap["rollout/log_prob_abs_diff_max"]
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save_driver_files(self, folder: str) -> None:
        """The prompts not sent yet and every rollout worker's carried groups (plain values)."""
        states = self.group_for("rollout").run_all(lambda w: w.rollout_partial_state.remote())
        pending = self.pending.to_dict() if self.pending is not None else None
        state = {"pending": pending, "workers": states}
        torch.save(state, os.path.join(folder, STATE_FILE))

    def load_checkpoint(self) -> str | None:
        """Resume as the synchronous trainer does, then the actor version, the prompts not sent and the
        workers' carried groups (their requests resume on the next step, as in the uninterrupted run)."""
        path = super().load_checkpoint()
        if path is None:
            return None
        steps = range(1, self.global_step + 1)
        self.actor_version = sum(step_plan.actor_trains(self.run, s) for s in steps)
        file = os.path.join(path, STATE_FILE)
        if not os.path.exists(file):
            raise RuntimeError(
                f"{path} has no {STATE_FILE}: it was not written by a partial-rollout run; resume it with "
                "async_training.partial_rollout=false, or start this run in a new trainer.default_local_dir."
            )
        state = torch.load(file, weights_only=True)
        self.carried_groups = sum(len(worker["groups"]) for worker in state["workers"])
        pending = state["pending"]
        self.pending = (
            None if pending is None else RolloutBatch.from_dict(pending, batch_size=[len(pending["prompts"])])
        )
        rollout = self.group_for("rollout")
        rollout.run_shards(lambda w, s: w.rollout_load_partial_state.remote(s), state["workers"])
        return path
