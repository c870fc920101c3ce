"""The PPO-family trainer: a single controller driving fused workers through a fixed step lifecycle.

    generate -> compute_rewards -> compute_log_probs -> compute_ref_log_probs -> compute_advantages
             -> update_actor -> sync_weights -> (validate)

`fit` is a short loop over those named steps. To change an algorithm, override one step (or register an
advantage estimator / policy loss) in a subclass; never copy `fit`.

Command lines (``python -m fusedrl.trainer.main_ppo key=value ...``, verl's keys and defaults) are in README.md
and docs/quickstart.md; the phases' memory moves are described in docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from omegaconf import DictConfig

from fusedrl.algorithms import get_adv_estimator, get_adv_traits
from fusedrl.algorithms.kl_control import build_kl_controller, penalize_rewards
from fusedrl.algorithms.rollout_correction import correct_batch
from fusedrl.balance import balance_over_ranks
from fusedrl.batch import RolloutBatch
from fusedrl.checkpoint import load_run_checkpoint, save_run_checkpoint, seed_rng
from fusedrl.config import logger_names, to_plain_dict
from fusedrl.controller import WorkerGroup
from fusedrl.controller.health import resume_hint
from fusedrl.controller.placement import RoleGroups
from fusedrl.controller.preemption import PreemptionGuard
from fusedrl.data.dataset import PromptLoader, tokenizer_pad_id
from fusedrl.lr_schedule import scheduled_lr
from fusedrl.metrics import Metrics, batch_metrics, mean_over_ranks
from fusedrl.rewards import build_reward_manager
from fusedrl.role_config import RoleConfigs, TokenIds, records_routed_experts
from fusedrl.rollout_request import RolloutRequest
from fusedrl.run_config import RunConfig, as_run_config
from fusedrl.tracking import Tracker, timer
from fusedrl.trainer import actor_calls, step_plan
from fusedrl.trainer.data_setup import prompt_data
from fusedrl.trainer.dynamic_sampling import GroupCollector, group_metric, informative_groups
from fusedrl.trainer.health_checks import check_step, rollout_check_bound
from fusedrl.trainer.resident import ResidentRows
from fusedrl.trainer.reward_scoring import RewardModelScoring
from fusedrl.trainer.step_plan import due
from fusedrl.trainer.validation import print_generations, validation_metrics
from fusedrl.workers.rollout.base import SamplingConfig
from fusedrl.workers.worker_dict import WorkerDict


class PPOTrainer(RewardModelScoring):
    """GRPO / PPO-family RL over fused workers (lifecycle: module docstring). It reads ``self.run``, typed
    (`RoleConfigs`, also the workers'); ``self.config`` (DictConfig) stays for subclasses reading keys."""

    def __init__(
        self, config: RunConfig | DictConfig, *, compute_score: Any = None, tools: list[Any] | None = None
    ) -> None:
        from transformers import AutoTokenizer

        from fusedrl.config import import_plugin

        typed = as_run_config(config)  # `fusedrl.config.load_config`'s; a composed DictConfig is typed here
        self.config: DictConfig = typed.source
        # Multi-turn agent rollouts (docs/agentic.md): tools given in Python join the YAML's.
        self.agent_tools = list(tools or [])
        run = typed.roles(agent_tools=self.agent_tools)  # tokens and steps: below
        self.multi_turn = run.rollout.multi_turn.enable
        for module in run.algorithm.custom_modules:
            import_plugin(module)  # idempotent with validate(); needed when validation was skipped
        self.tokenizer = AutoTokenizer.from_pretrained(run.model.path)
        self.train_dataset, self.train_loader, self.val_dataset = prompt_data(
            run, self.tokenizer, self.agent_tools if self.multi_turn else None
        )
        self.reward_fn = build_reward_manager(run, self.tokenizer, compute_score)
        self.adv_fn = get_adv_estimator(run.algorithm.adv_estimator)
        self.adv_traits = get_adv_traits(run.algorithm.adv_estimator)
        tr, steps_per_epoch = run.trainer, len(self.train_loader)
        self.total_steps = int(tr.total_training_steps or steps_per_epoch * tr.total_epochs)
        tokens = TokenIds(eos=int(self.tokenizer.eos_token_id), pad=tokenizer_pad_id(self.tokenizer))
        self.run: RoleConfigs = dataclasses.replace(run, tokens=tokens, total_steps=self.total_steps)
        self.tracker = Tracker(
            logger_names(run),
            run_dir=tr.default_local_dir,
            project_name=tr.project_name,
            experiment_name=tr.experiment_name,
            config=to_plain_dict(self.config),
            total_steps=self.total_steps,
        )
        kl = run.algorithm.kl_ctrl
        self.kl_ctrl = build_kl_controller(kl.type, float(kl.kl_coef), kl.target_kl, kl.horizon)
        self.global_step = 0
        self.ckpt_root = tr.default_local_dir
        self.groups, self.resident = RoleGroups(), ResidentRows()  # resident: `fusedrl.resident`
        self._data_iter: Iterator[RolloutBatch] | None = None

    # ------------------------------------------------------------------ setup
    def run_roles(self) -> list[str]:
        """The roles this run needs: actor and rollout always, the rest as the config asks."""
        return ["actor", "rollout", *[role for role, on in self.run.needed_roles().items() if on]]

    def init_workers(self, role_groups: Sequence[Sequence[str]] | None = None) -> None:
        """Reserve the device slots and start the workers, then build their roles (collective per group).

        ``role_groups`` lists the roles each worker group holds (default: one fused group with every role
        on each ``trainer.placement`` pool, docs/placement.md); groups on one pool share its slots. The
        driver's calls are the same whatever the grouping: each goes to the group holding the role
        (`group_for`). A rollout on a pool of its own gets the weights by broadcast, not in place.
        """
        self.groups = RoleGroups.start_placed(WorkerDict, self.run, self.run_roles(), role_groups)

    def group_for(self, role: str) -> WorkerGroup:
        """The worker group holding ``role``."""
        return self.groups.group_for(role)

    @property
    def workers(self) -> WorkerGroup:
        """The group holding the actor (and the rollout): the fused workers."""
        return self.group_for("actor")

    def worker_groups(self) -> list[WorkerGroup]:
        """Each worker group once (several roles may share one)."""
        return self.groups.unique()

    def close(self) -> None:
        self.groups.shutdown()
        self.tracker.close()
        close = getattr(self.reward_fn, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ the loop
    def fit(self) -> Metrics:
        """Train until ``total_steps``; returns the last step's metrics.

        SIGTERM / SIGINT stop the run after the step in flight, with a checkpoint of that step, within
        ``trainer.preemption_save_timeout_s``; `Preempted` is raised (``main_ppo`` exits with 75)."""
        stop = PreemptionGuard(self.run.trainer.preemption_save_timeout_s)
        groups = self.worker_groups()
        for group in groups:
            group.preemption = stop

        def kill_all() -> None:
            for group in groups:
                group.kill_local_processes()

        stop.on_exit_now = kill_all
        with stop:
            return self._fit(stop)

    def _fit(self, stop: PreemptionGuard) -> Metrics:
        last: Metrics = {}
        seed_rng(self.run.data.seed)  # a resumed run then restores the checkpoint's RNG state
        self.load_checkpoint()
        if self.run.trainer.val_before_train and self.val_dataset is not None:
            self.tracker.log(self.validate(), self.global_step)
        while self.global_step < self.total_steps:
            if stop.requested:  # the signal came before this step started: nothing new to save
                raise stop.stopped(self.global_step, None, resume_hint(self.ckpt_root))
            self.global_step += 1
            last = self.train_step()
            self.check_health(last)
            tr, saved = self.run.trainer, None
            if stop.requested or due(tr.save_freq, self.global_step, self.total_steps):
                with timer("save_checkpoint", last):
                    saved = self.save_checkpoint()
            # Preempted: spend the time budget on stopping, not on validation.
            validate = self.val_dataset is not None and not stop.requested
            if validate and due(tr.test_freq, self.global_step, self.total_steps):
                with timer("testing", last):  # verl's name for the validation's time
                    last.update(self.validate())
            self.tracker.log(last, self.global_step)
            if stop.requested:
                raise stop.stopped(self.global_step, saved, resume_hint(self.ckpt_root))
        return last

    def train_step(self) -> Metrics:
        """One RL step, one line per phase; a subclass may override each phase or the methods it calls."""
        m: Metrics = {}
        with timer("step", m):
            batch = self.step_rollout(m)  # generate + reward (+ dynamic sampling), balanced over the ranks
            batch = self.step_log_probs(batch, m)  # old log-probs, unless the update's own forward gives them
            batch = self.step_reference(batch, m)  # ref log-probs, reward-model scores, KL in reward
            batch = self.step_values(batch, m)  # the critic's values (GAE)
            batch = self.step_advantages(batch, m)  # advantages, then the rollout correction
            self.step_update_critic(batch, m)
            self.step_update_actor(batch, m)  # not during trainer.critic_warmup
            self.step_sync(m)  # after an update; the workers stream only where an engine needs it
        m.update(self.batch_metrics(batch, m["timing_s/step"]))
        return m

    # ------------------------------------------------------------------ the step's phases
    def step_rollout(self, metrics: Metrics) -> RolloutBatch:
        batch = self.balance_batch(self.collect_batch(metrics), metrics)
        if self.reward_model_overlaps:  # it scores while the actor computes log-probs
            self.submit_reward_model_scores(batch)
        return batch

    def step_log_probs(self, batch: RolloutBatch, metrics: Metrics) -> RolloutBatch:
        reuse = self.old_log_probs_from_update(batch)
        metrics["actor/old_log_prob_from_update"] = float(reuse)
        if reuse:
            return batch
        with timer("old_log_prob", metrics):
            return self.compute_log_probs(batch)

    def step_reference(self, batch: RolloutBatch, metrics: Metrics) -> RolloutBatch:
        if self.use_reference:
            with timer("ref", metrics):
                batch = self.compute_ref_log_probs(batch, keep=True)  # kept on the workers for the update
        batch = self.await_reward_model_scores(batch, metrics)
        return self.apply_kl_penalty(batch, metrics) if self.run.algorithm.use_kl_in_reward else batch

    def step_values(self, batch: RolloutBatch, metrics: Metrics) -> RolloutBatch:
        if not self.use_critic:
            return batch
        with timer("values", metrics):
            return self.compute_values(batch)

    def step_advantages(self, batch: RolloutBatch, metrics: Metrics) -> RolloutBatch:
        with timer("adv", metrics):
            return self.apply_rollout_correction(self.compute_advantages(batch), metrics)

    def step_update_critic(self, batch: RolloutBatch, metrics: Metrics) -> None:
        if self.use_critic:
            with timer("update_critic", metrics):
                metrics.update(self.update_critic(batch))

    def step_update_actor(self, batch: RolloutBatch, metrics: Metrics) -> None:
        # trainer.critic_warmup: the first N steps train only the critic (the policy stays as it was).
        if self.actor_trains_this_step:
            with timer("update_actor", metrics):
                metrics.update(self.update_actor(batch))

    def step_sync(self, metrics: Metrics) -> None:
        # Only after an update: a warm-up step's engine keeps its weights (or the next rollout restores them).
        if self.actor_trains_this_step:
            with timer("sync_weights", metrics):
                metrics.update(self.sync_weights())

    def check_health(self, metrics: Metrics) -> None:
        """Stop the run, with a report, on non-finite updates or a rollout that diverges from the actor
        (`fusedrl.trainer.health_checks.check_step`; dtypes as the workers resolved them)."""
        bound = rollout_check_bound(self.run, self.groups.auto_settings)
        check_step(self.run, self.global_step, metrics, bound)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> str:
        """Shards from every worker + the driver's state into a temp folder, then one atomic rename."""
        tr = self.run.trainer
        state = {
            "global_step": self.global_step,
            "dataloader": self.train_loader.state_dict(),
            "kl_coef": self.kl_ctrl.value,
        }
        keep, extra = tr.max_actor_ckpt_to_keep, self.save_driver_files
        path = save_run_checkpoint(self.ckpt_root, self.global_step, self.workers, state, keep, extra)
        # verl's actor.checkpoint.save_contents=[..., hf_model]: also a Hugging Face folder of the policy.
        if "hf_model" in self.run.actor.checkpoint.save_contents:
            self.export_hf(os.path.join(path, "huggingface"))
        return path

    def save_driver_files(self, folder: str) -> None:
        """A hook: files of the driver's own into a checkpoint ``folder`` before it is committed."""

    def load_checkpoint(self) -> str | None:
        """Resume per ``trainer.resume_mode``; then re-sync the engine to the restored actor."""
        tr = self.run.trainer
        resumed = load_run_checkpoint(
            self.ckpt_root, tr.resume_mode, tr.resume_from_path, self.workers, self.train_loader
        )
        if resumed is None:
            return None
        path, state = resumed
        self.global_step = int(state["global_step"])
        self._data_iter = None
        self.kl_ctrl.value = float(state.get("kl_coef", self.kl_ctrl.value))
        self.sync_weights()  # the engine still holds the weights it was built from
        print(f"fusedrl: resumed from {path} at step {self.global_step}", flush=True)
        return path

    def export_hf(self, out_dir: str, adapter_dir: str | None = None) -> None:
        """Write the current policy as a Hugging Face folder that transformers and vLLM load (LoRA: merged;
        with ``adapter_dir`` also the adapter as a PEFT folder)."""
        self.workers.run_all(lambda w: w.export_hf.remote(out_dir, adapter_dir))

    def next_prompts(self) -> RolloutBatch:
        """The next batch of prompts; epochs roll over (the loader's position is checkpointed)."""
        if self._data_iter is None:  # one pass of the loader per epoch, endlessly
            self._data_iter = itertools.chain.from_iterable(itertools.repeat(self.train_loader))
        return next(self._data_iter)

    def collect_batch(self, metrics: Metrics) -> RolloutBatch:
        """Generate and score one step's samples. With ``algorithm.filter_groups.enable`` (DAPO's dynamic
        sampling, `GroupCollector`) uninformative groups are dropped and more prompts generated."""
        fg = self.run.algorithm.filter_groups
        collector = GroupCollector(
            want=self.run.data.train_batch_size,
            n=self.run.rollout.n,
            max_rounds=fg.max_num_gen_batches,
            keep=lambda b: self.filter_groups(b, self.filter_metric(b)),
        )
        for round_index in itertools.count():
            prompts = self.next_prompts()
            with timer("gen", metrics), self.resident.staying(self.fields_staying(prompts)):
                batch = self.generate(
                    prompts, seed_offset=round_index, log_probs=self.rollout_log_probs_wanted
                )
            with timer("reward", metrics):
                batch = self.compute_rewards(batch, metrics)
            if self.adv_traits.needs_greedy_baseline:
                with timer("gen_baseline", metrics):
                    batch = self.compute_reward_baselines(prompts, batch)
            if not fg.enable:
                return batch
            metrics["filter_groups/num_gen_batches"] = float(round_index + 1)
            if (done := collector.add(batch)) is not None:
                return done
        raise AssertionError("itertools.count() does not end")

    def balance_batch(self, batch: RolloutBatch, metrics: Metrics) -> RolloutBatch:
        """Reorder rows so each DP rank's contiguous shard carries about the same real tokens
        (``trainer.balance_batch``). Content is unchanged; advantages are computed here on the whole
        batch by ``uid``, so a GRPO group split across ranks is fine; each epoch still uses every row once.
        With shared prompts in packed rows (`step_plan.prompt_groups_whole`) a ``uid``'s rows go to one rank
        together; rows stay on the rank that generated them where that balances about as well (`rows_home`)."""
        whole = step_plan.prompt_groups_whole(self.run, self.groups.auto_settings)
        same = batch.resident_rows is not None and self.group_for("rollout") is self.workers
        batch, spread = balance_over_ranks(
            batch,
            self.workers.world_size,
            reorder=self.run.trainer.balance_batch,
            groups_whole=whole,
            home=step_plan.rows_home(self.run, batch, same_group=same),
        )
        metrics["balance/max_over_mean_rank_tokens"] = spread
        return batch

    def filter_metric(self, batch: RolloutBatch) -> torch.Tensor:
        """Per-sample value that ``algorithm.filter_groups.metric`` names: ``[B]`` (`group_metric`)."""
        extras = getattr(self.reward_fn, "last_sample_extras", None)
        return group_metric(batch, self.run.algorithm.filter_groups.metric, extras)

    def filter_groups(self, batch: RolloutBatch, metric: torch.Tensor | None = None) -> RolloutBatch:
        """Keep only groups (rows sharing a uid) whose ``metric`` values (default: sequence scores) are not
        all equal."""
        return informative_groups(batch, metric)

    # ------------------------------------------------------------------ steps
    @property
    def actor_trains_this_step(self) -> bool:
        """False during ``trainer.critic_warmup`` (`step_plan.actor_trains`)."""
        return step_plan.actor_trains(self.run, self.global_step)

    @property
    def temperature(self) -> float:
        return float(self.run.rollout.temperature)

    @property
    def actor_sp(self) -> int:  # ranks of one Ulysses group get the same rows (replicas of one shard)
        return self.run.actor.ulysses_sequence_parallel_size

    @property
    def use_reference(self) -> bool:
        return self.run.needed_roles()["ref"]

    @property
    def use_critic(self) -> bool:
        return self.run.needed_roles()["critic"]

    def sampling(self, validate: bool = False) -> SamplingConfig:
        return step_plan.sampling(self.run, validate)

    def generate(
        self, prompts: RolloutBatch, *, validate: bool = False, seed_offset: int = 0, log_probs: bool = True
    ) -> RolloutBatch:
        """Repeat each prompt ``n`` times and sample one response per row on the rollout workers.

        The rollout phase's memory moves, in order: `sync_weights` (a no-op unless the engines' weights are
        stale: an update since the last stream, or a level-2 sleep threw them away) -> wake the engine -> generate ->
        the engine sleeps -> the actor's parameters come back for the log-prob passes. Each row gets its
        own sampling seed (`step_plan.sample_seeds`), so a resumed run regenerates the same samples.
        ``log_probs``: the engine's log-probs of its samples (``rollout_log_probs``; never for validation); a
        training step asks for them where it reads them (`rollout_log_probs_wanted`).
        """
        batch, to_send = self.generation_request(prompts, validate, seed_offset, self.global_step)
        tp = self.run.rollout.tensor_model_parallel_size
        rollout = self.group_for("rollout")
        self.sync_weights()  # the rollout workers decide whether their engines need the weights
        rollout.send_all(lambda w: w.rollout_wake_up.remote(["weights", "kv_cache"]))
        log_probs = log_probs and not validate
        sampling = dataclasses.replace(self.sampling(validate), log_probs=log_probs)
        fields = [f for f in self.response_fields if log_probs or f != "rollout_log_probs"]
        keep = self.resident.request(rollout, tp, self.global_step, validate, fields)
        shards = rollout.run_split(
            lambda w, s: w.rollout_generate_fields.remote(s, sampling, fields, keep), to_send, replicas=tp
        )
        rollout.send_all(lambda w: w.rollout_sleep.remote())
        self.group_for("actor").send_all(lambda w: w.load_actor.remote())
        return self.resident.mark(batch.set_fields(rollout.gather_fields(shards, to_send)), keep, len(shards))

    def generation_request(
        self, prompts: RolloutBatch, validate: bool, seed_offset: int, step: int
    ) -> tuple[RolloutBatch, RolloutRequest]:
        """One generation call's rows (prompts ``n`` times, seeds of ``step``) and the request sent."""
        return step_plan.generation_request(self.run, prompts, validate, seed_offset, step, self.multi_turn)

    @property
    def rollout_log_probs_wanted(self) -> bool:
        """Whether this step's rollout asks the engine for log-probs (`step_plan.rollout_log_probs_wanted`)."""
        return step_plan.rollout_log_probs_wanted(self.run, self.global_step)

    @property
    def response_fields(self) -> list[str]:
        extra = ["response_attention_mask", "agent_stats"] if self.multi_turn else []
        extra += ["routed_experts"] if records_routed_experts(self.run.rollout) else []  # MoE routing replay
        return ["responses", "response_mask", "rollout_log_probs", *extra]

    def compute_rewards(self, batch: RolloutBatch, metrics: Metrics) -> RolloutBatch:
        """Score responses: the rule / custom reward on the driver, or the fused reward model when enabled."""
        if self.run.reward_model.enable:  # on a pool of its own: sent in `train_step`, after balancing
            return batch if self.reward_model_overlaps else self.compute_reward_model_scores(batch, metrics)
        scores, reward_metrics = self.score(batch)  # [B, Tr]
        batch.token_level_scores = scores
        batch.token_level_rewards = scores.clone()
        if self.adv_traits.needs_reward_components:  # GDPO: the scorer's named components, per row
            keys = list(self.run.algorithm.gdpo_reward_keys or [])
            extras = getattr(self.reward_fn, "last_sample_extras", None)
            batch.reward_components = step_plan.reward_components(keys, extras, batch.num_samples)
        metrics.update(reward_metrics)
        return batch

    def score(self, batch: RolloutBatch) -> tuple[torch.Tensor, Metrics]:
        """``[B, Tr]`` token-level scores of the reward function, plus the environments' and tools' rewards
        of agent loops on each trajectory's last sampled token; and the reward function's metrics."""
        scores, metrics = self.reward_fn(batch)
        if batch.agent_stats is not None:
            from fusedrl.agent.rewards import add_agent_rewards

            scores = add_agent_rewards(scores, batch.response_mask, batch.agent_stats)
        return scores, metrics

    def compute_reward_baselines(self, prompts: RolloutBatch, batch: RolloutBatch) -> RolloutBatch:
        """ReMax: score one greedy response per prompt and use it as every sample's baseline."""
        greedy = self.generate(prompts, validate=True, seed_offset=-1)  # val_kwargs: greedy, n samples
        scores = self.compute_rewards(
            greedy, {}
        ).token_level_scores  # [P * n_val, Tr], same scorer as samples
        n_val = self.run.rollout.val_kwargs.n
        per_prompt = scores.sum(-1).view(prompts.num_samples, n_val).mean(-1)  # [P]
        n = batch.num_samples // prompts.num_samples
        batch.reward_baselines = per_prompt.repeat_interleave(n).float()  # [B]
        return batch

    def apply_kl_penalty(self, batch: RolloutBatch, metrics: Metrics) -> RolloutBatch:
        """``algorithm.use_kl_in_reward``: rewards = scores - beta * KL(actor || ref); beta adapts."""
        return penalize_rewards(batch, self.kl_ctrl, self.run.algorithm.kl_penalty, metrics)

    def _model_inputs(self, batch: RolloutBatch) -> RolloutBatch:
        return batch.select_fields(*batch.model_input_fields())

    def apply_rollout_correction(self, batch: RolloutBatch, metrics: Metrics) -> RolloutBatch:
        """``algorithm.rollout_correction``: weight / reject the actor's advantages by the rollout-vs-trainer
        log-prob ratio (`fusedrl.algorithms.rollout_correction`); a no-op when both are off, and in bypass mode
        (there pi_old is the rollout policy: the actor's loss measures the current policy against it)."""
        return correct_batch(batch, self.run.algorithm.rollout_correction, metrics)

    def compute_log_probs(self, batch: RolloutBatch) -> RolloutBatch:
        """``old_log_probs``: the actor's log-probs of the samples before this step's update (kept on the
        workers where the rollout's stayed there, `fusedrl.trainer.actor_calls`). In
        ``algorithm.rollout_correction.bypass_mode`` they are the rollout's own (no trainer forward)."""
        return actor_calls.compute_log_probs(self, batch)

    def fields_staying(self, prompts: RolloutBatch) -> list[str]:
        """What a training generation of ``prompts`` leaves on the workers (`step_plan.rollout_log_probs_stay`)."""
        with_actor, images = (
            self.group_for("rollout") is self.group_for("actor"),
            bool(prompts.image_fields()),
        )
        return step_plan.rollout_log_probs_stay(self.run, rollout_with_actor=with_actor, images=images)

    def old_log_probs_from_update(self, batch: RolloutBatch) -> bool:
        """Whether the update's own forward gives ``old_log_probs`` (`step_plan.old_log_probs_reusable`)."""
        return step_plan.old_log_probs_reusable(
            self.run,
            world=self.workers.world_size,
            num_samples=batch.num_samples,
            actor_trains=self.actor_trains_this_step,
        )

    def compute_ref_log_probs(self, batch: RolloutBatch, keep: bool = False) -> RolloutBatch:
        t, sp = self.temperature, self.actor_sp  # the reference splits sequences as the actor does
        ref, kl_in_reward = self.group_for("ref"), self.run.algorithm.use_kl_in_reward  # keep: for the update
        kept = "ref_log_probs" if keep and ref is self.workers and not kl_in_reward else None
        ref.send_all(lambda w: w.load_ref.remote())
        call = lambda w, s: w.ref_compute_log_prob.remote(s, t)  # noqa: E731
        parts = self.resident.run_split(ref, call, batch, batch.model_input_fields(), sp, kept)
        ref.send_all(lambda w: w.offload_ref.remote())
        batch.ref_log_probs = None if parts[0] is None else ref.gather_tensors(parts, batch)  # None: kept
        return batch

    def compute_values(self, batch: RolloutBatch) -> RolloutBatch:
        """Critic values ``V(s_t)`` of every response position (PPO with GAE)."""
        inputs = self._model_inputs(batch)
        critic, sp = self.group_for("critic"), self.run.critic.ulysses_sequence_parallel_size
        critic.send_all(lambda w: w.load_critic.remote())
        parts = critic.run_split(lambda w, s: w.critic_compute_values.remote(s), inputs, replicas=sp)
        batch.critic_values = critic.gather_tensors(parts, inputs)
        return batch

    def update_critic(self, batch: RolloutBatch) -> Metrics:
        """Regress the critic on the GAE returns (clipped value loss)."""
        inputs = batch.select_fields(*batch.model_input_fields(), "critic_values", "returns")
        lr = self.scheduled_lr(self.run.critic.optim)
        critic, sp = self.group_for("critic"), self.run.critic.ulysses_sequence_parallel_size
        critic.send_all(lambda w: w.load_critic.remote(optimizer=True))
        per_rank = critic.run_split(lambda w, s: w.critic_update.remote(s, lr), inputs, replicas=sp)
        critic.send_all(lambda w: w.offload_critic.remote())
        return mean_over_ranks(per_rank)

    def scheduled_lr(self, optim: Any) -> float:
        """This step's learning rate of one optimizer (warmup / decay keys); the schedule is a function of
        ``global_step``, so a resumed run continues it exactly."""
        return scheduled_lr(optim, self.global_step - 1, self.total_steps)

    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        """A registered pure function of the batch (``algorithm.adv_estimator``; `step_plan.advantage_inputs`)."""
        advantages, returns = self.adv_fn(
            batch.token_level_rewards, batch.response_mask, **step_plan.advantage_inputs(self.run, batch)
        )
        batch.advantages = advantages
        batch.returns = returns
        return batch

    def update_actor(self, batch: RolloutBatch) -> Metrics:
        """PPO update of the policy on the fused workers (FSDP2; micro-batches; global loss normaliser;
        `fusedrl.trainer.actor_calls`)."""
        return actor_calls.update_actor(self, batch)

    def sync_weights(self, force: bool = False) -> Metrics:
        """Stream the policy into every rollout engine in place (collective), unless the rollout workers
        say their engines hold it (`RoleGroups.engines_need_stream`; ``force``: stream anyway).
        ``sync/streamed`` says which happened.

        Moves, in order: the engine's allocator is prepared -> the actor's shards are on the device ->
        the engine's weights wake -> one full tensor at a time into the engine -> the shards leave again.
        """
        in_place = self.groups.sync_in_place(force)  # the engines in the actor's workers: one call, or none
        if in_place is not None:
            return in_place
        needed, version = self.groups.engines_need_stream()
        if not (needed or force):
            return {"sync/streamed": 0.0}
        actor, rollout = self.group_for("actor"), self.group_for("rollout")
        rollout.send_all(lambda w: w.prepare_weight_update.remote())
        actor.send_all(lambda w: w.load_actor.remote())
        rollout.send_all(lambda w: w.rollout_wake_up.remote(["weights"]))
        per_rank = self.groups.stream_weights(version)  # in place, or by broadcast to a rollout pool
        actor.send_all(lambda w: w.offload_actor.remote(params=True, optimizer=False))
        return {**mean_over_ranks(per_rank), "sync/streamed": 1.0}

    @property
    def rollout_discards_weights(self) -> bool:
        """Whether the engines' post-rollout sleep discards their weights (`step_plan.rollout_discards_weights`)."""
        return step_plan.rollout_discards_weights(self.run, self.groups.auto_settings)

    def validate(self) -> Metrics:
        """Greedy (``rollout.val_kwargs``) generation on the validation set; mean score per data source."""
        assert self.val_dataset is not None
        loader = PromptLoader(self.val_dataset, len(self.val_dataset), shuffle=False, drop_last=False)
        batch = self.generate(next(iter(loader)), validate=True)
        per_sample = self.score(batch)[0].sum(-1)  # [B]
        count = self.run.trainer.log_val_generations
        print_generations(self.tokenizer, batch, per_sample, count, self.global_step)
        return validation_metrics(batch, per_sample)

    # ------------------------------------------------------------------ metrics
    def batch_metrics(self, batch: RolloutBatch, step_time: float) -> Metrics:
        """Per-step metrics of the finished batch (`fusedrl.metrics.batch_metrics`); a hook to extend. No
        ``rollout/log_prob_abs_diff_*`` on a step whose rollout computed no log-probs."""
        gap = self.resident.log_prob_gap if actor_calls.log_probs_stayed(self, batch) else None
        if gap is None and batch.rollout_log_probs is None:
            gap = {}
        return batch_metrics(batch, step_time, self.global_step, gap)
