"""The typed sections the driver and the reward read: ``algorithm``, ``async_training``, ``reward_model``,
``custom_reward_function``, ``data`` and ``trainer``. Part of `fusedrl.role_config` (which re-exports every
name); each section's own checks sit beside its fields (``problems()``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


# ---------------------------------------------------------------------- algorithm
@dataclass(frozen=True, kw_only=True)
class KLControlConfig:
    """``algorithm.kl_ctrl``."""

    type: str
    kl_coef: float
    target_kl: float
    horizon: int


@dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction``."""

    rollout_is: str | None
    rollout_is_threshold: float
    rollout_is_batch_normalize: bool
    rollout_rs: str | None
    rollout_rs_threshold: float | str | None
    bypass_mode: bool
    loss_type: str

    @property
    def weighs(self) -> bool:
        """Whether the correction weights or rejects samples (``rollout_is`` / ``rollout_rs`` set)."""
        return self.rollout_is is not None or self.rollout_rs is not None

    @property
    def reads_rollout_log_probs(self) -> bool:
        """Whether every training step reads every sample's rollout log-probs: a weighing correction, or
        bypass mode (they are the old log-probs)."""
        return self.bypass_mode or self.weighs


@dataclass(frozen=True, kw_only=True)
class FilterGroupsConfig:
    """``algorithm.filter_groups`` (DAPO's dynamic sampling)."""

    enable: bool
    metric: str
    max_num_gen_batches: int


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """``algorithm``: the estimator, KL in reward, rollout correction, dynamic sampling."""

    custom_modules: tuple[str, ...]
    adv_estimator: str
    norm_adv_by_std_in_grpo: bool
    gamma: float
    lam: float
    use_kl_in_reward: bool
    kl_penalty: str
    kl_ctrl: KLControlConfig
    rollout_correction: RolloutCorrectionConfig
    filter_groups: FilterGroupsConfig
    gdpo_reward_keys: tuple[str, ...] | None
    gdpo_reward_weights: tuple[float, ...] | None

    def problems(self) -> list[str]:
        """``custom_modules`` import (they may register the estimators and losses the checks look up: run
        first); the estimator and what its traits ask of this section; KL control and penalty, dynamic
        sampling's metric, rollout correction."""
        from fusedrl.algorithms import get_adv_traits, list_adv_estimators
        from fusedrl.algorithms.kl import KL_KINDS
        from fusedrl.algorithms.kl_control import KL_CONTROLLERS
        from fusedrl.config_base import import_plugin
        from fusedrl.config_sections import one_of, rollout_correction_problems, shown
        from fusedrl.trainer.dynamic_sampling import FILTER_METRICS

        found: list[str] = []
        for module in list(self.custom_modules or []):
            try:
                import_plugin(str(module))
            except Exception as err:
                found.append(f"`algorithm.custom_modules`: cannot import {module!r}: {err}")
        est = self.adv_estimator
        if est not in list_adv_estimators():
            found.append(
                f"`algorithm.adv_estimator`={est!r}: unknown. Known: {', '.join(list_adv_estimators())}."
            )
        traits = get_adv_traits(est) if est in list_adv_estimators() else None
        if traits is not None and traits.needs_reward_components:
            keys, weights = self.gdpo_reward_keys, self.gdpo_reward_weights
            if not (isinstance(keys, tuple) and len(keys) > 0):
                found.append(
                    f"`algorithm.gdpo_reward_keys`={shown(keys)!r}: `{est}` needs the names of the reward "
                    "components your compute_score returns in its dict, e.g. "
                    "+algorithm.gdpo_reward_keys='[accuracy_reward,format_reward]'."
                )
            elif not (weights is None or (isinstance(weights, tuple) and len(weights) == len(keys))):
                found.append(
                    f"`algorithm.gdpo_reward_weights`={shown(weights)!r}: give one weight per gdpo_reward_keys "
                    f"entry ({len(keys)}), or null for all 1."
                )
        if traits is not None and traits.needs_sum_pi_squared and self.rollout_correction.bypass_mode:
            found.append(
                f"`algorithm.adv_estimator`={est}: reads the actor's old log-probs and sum_pi_squared, which "
                "`algorithm.rollout_correction.bypass_mode`=true skips; set bypass_mode=false."
            )
        if self.kl_ctrl.type not in KL_CONTROLLERS:
            found.append(f"`algorithm.kl_ctrl.type`={self.kl_ctrl.type!r}: use {one_of(KL_CONTROLLERS)}.")
        if self.kl_penalty not in KL_KINDS:
            found.append(
                f"`algorithm.kl_penalty`={self.kl_penalty!r}: use kl (k1), mse (k2), low_var_kl (k3) or abs."
            )
        if self.filter_groups.metric not in FILTER_METRICS:
            found.append(
                f"`algorithm.filter_groups.metric`={self.filter_groups.metric!r}: use {', '.join(FILTER_METRICS)} "
                "(score / seq_reward: the sequence's task score; seq_final_reward: after the in-reward KL; acc: "
                "the scorer's `acc` entry, else the score)."
            )
        rollout_correction_problems(self.rollout_correction, found)
        ctrl = self.kl_ctrl
        adaptive = self.use_kl_in_reward and ctrl.type == "adaptive"
        if adaptive and not (float(ctrl.target_kl or 0) > 0 and int(ctrl.horizon or 0) > 0):
            found.append("`algorithm.kl_ctrl`: adaptive needs target_kl > 0 and horizon > 0.")
        return found


@dataclass(frozen=True, kw_only=True)
class AsyncTrainingConfig:
    """``async_training``: one-step-off-policy asynchronous training (``trainer/async_trainer.py``) and
    partial rollout in the fused pool (``trainer/partial_trainer.py``)."""

    max_staleness: int
    partial_rollout: bool
    staleness_threshold: float
    partial_rollout_max_resumes: int

    def problems(self) -> list[str]:
        """Each key's type and range; the partial-rollout settings only with ``partial_rollout``=true. What
        they ask of the rest of the run: `fusedrl.async_config` (cross-section checks)."""
        from fusedrl.async_config import KEY, MAX_RESUMES, PARTIAL, THRESHOLD

        found: list[str] = []
        value = self.max_staleness
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            found.append(f"`{KEY}`={value!r}: must be an integer >= 0 (0: synchronous, 1: one-step-off).")
        on, threshold, resumes = (
            self.partial_rollout,
            self.staleness_threshold,
            self.partial_rollout_max_resumes,
        )
        if not isinstance(on, bool):
            found.append(f"`{PARTIAL}`={on!r}: must be true or false.")
            return found
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold < 0:
            found.append(
                f"`{THRESHOLD}`={threshold!r}: must be a number >= 0 (0.5: half a batch more in flight)."
            )
            threshold = None
        if isinstance(resumes, bool) or not isinstance(resumes, int) or resumes < 0:
            found.append(f"`{MAX_RESUMES}`={resumes!r}: must be an integer >= 0.")
        if not on:
            # the defaults of trainer/config/ppo_trainer.yaml
            for key, setting, default in ((THRESHOLD, threshold, 0.1), (MAX_RESUMES, resumes, 4)):
                if setting is not None and setting != default:
                    found.append(
                        f"`{key}`={setting} is read only with `{PARTIAL}`=true; set {PARTIAL}=true or drop the key."
                    )
        return found


# ---------------------------------------------------------------------- reward
@dataclass(frozen=True, kw_only=True)
class OverlongBufferConfig:
    """``reward_model.overlong_buffer`` (DAPO's soft overlong penalty)."""

    enable: bool
    len: int
    penalty_factor: float
    max_resp_len: int | None


@dataclass(frozen=True, kw_only=True)
class RewardModelPath:
    """``reward_model.model``."""

    path: str | None


@dataclass(frozen=True, kw_only=True)
class RewardModelFsdpConfig:
    """``reward_model.fsdp_config``."""

    model_dtype: str


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """``reward_model``: the reward manager (function scoring) and the optional reward-model role."""

    reward_manager: str
    num_workers: int
    timeout_s: float | None
    on_error: str
    mp_context: str
    reward_kwargs: Mapping[str, Any]
    overlong_buffer: OverlongBufferConfig
    enable: bool
    model: RewardModelPath
    fsdp_config: RewardModelFsdpConfig
    micro_batch_size_per_gpu: int
    ulysses_sequence_parallel_size: int

    def problems(self) -> list[str]:
        """What the reward manager would refuse (`fusedrl.rewards.checks.reward_problems`), the Ulysses size, the
        model's folder when the reward-model role is on, the overlong buffer's lengths."""
        import os

        from fusedrl.config_sections import check_number, positive
        from fusedrl.rewards.checks import reward_problems

        found = reward_problems(self)
        positive(self.ulysses_sequence_parallel_size, "reward_model.ulysses_sequence_parallel_size", found)
        if self.enable:
            path = self.model.path
            if not (bool(path) and os.path.isfile(os.path.join(str(path), "config.json"))):
                found.append(
                    f"`reward_model.model.path`={path!r}: not a Hugging Face model folder (reward_model.enable=true)."
                )
        buffer = self.overlong_buffer
        if buffer.enable and buffer.max_resp_len is not None:
            resp_len = check_number(buffer.max_resp_len, "reward_model.overlong_buffer.max_resp_len", found)
            if resp_len is not None and isinstance(buffer.len, int) and resp_len < buffer.len:
                found.append(
                    f"`reward_model.overlong_buffer.max_resp_len`={resp_len} (verl: reward_kwargs.max_resp_len) < "
                    f"`reward_model.overlong_buffer.len`={buffer.len}: the overlong buffer is the last len tokens "
                    "of max_resp_len; use max_resp_len >= len."
                )
        return found


@dataclass(frozen=True, kw_only=True)
class CustomRewardFunctionConfig:
    """``custom_reward_function``: a user's scoring function file and name."""

    path: str | None
    name: str

    def problems(self) -> list[str]:
        """The scoring file exists."""
        import os

        if self.path and not os.path.isfile(str(self.path)):
            return [f"`custom_reward_function.path`: file `{self.path}` does not exist."]
        return []


# ---------------------------------------------------------------------- data, trainer
@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """``data`` (PPO): prompts and their lengths."""

    train_files: str | tuple[str, ...]
    val_files: str | tuple[str, ...] | None
    prompt_key: str
    train_batch_size: int
    val_batch_size: int | None
    max_prompt_length: int
    max_response_length: int
    filter_overlong_prompts: bool
    truncation: str
    gen_batch_size: int
    return_raw_chat: bool
    image_key: str
    shuffle: bool
    seed: int

    def problems(self) -> list[str]:
        """The data files exist; the batch size and the lengths are integers >= 1; the truncation mode."""
        import os

        from fusedrl.config_sections import one_of, positive
        from fusedrl.data.dataset import TRUNCATION_MODES

        found: list[str] = []
        for key, files in (("data.train_files", self.train_files), ("data.val_files", self.val_files)):
            for f in [] if not files else [files] if isinstance(files, str) else list(files):
                if not os.path.exists(f):
                    fix = (
                        " Generate it (see examples/data_preprocess/) or fix the path."
                        if key == "data.train_files"
                        else ""
                    )
                    found.append(f"`{key}`: file `{f}` does not exist.{fix}")
        positive(self.train_batch_size, "data.train_batch_size", found)
        positive(self.max_prompt_length, "data.max_prompt_length", found)
        positive(self.max_response_length, "data.max_response_length", found)
        if self.truncation not in TRUNCATION_MODES:
            found.append(
                f"`data.truncation`={self.truncation!r}: use {one_of(TRUNCATION_MODES)} (and "
                "`data.filter_overlong_prompts=true` to drop over-long prompts instead)."
            )
        return found


@dataclass(frozen=True, kw_only=True)
class PlacementSection:
    """``trainer.placement`` as written (``fusedrl.placement_config`` reads it into pools)."""

    pools: Mapping[str, Any] | None
    roles: Mapping[str, Any] | None
    weight_sync_bucket_mb: float


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """``trainer`` (PPO): the run's size, schedule, checkpoints and guards."""

    project_name: str
    experiment_name: str
    nnodes: int
    n_gpus_per_node: int
    placement: PlacementSection
    total_epochs: int
    total_training_steps: int | None
    balance_batch: bool
    test_freq: int
    val_before_train: bool
    log_val_generations: int
    critic_warmup: int
    logger: tuple[str, ...]
    default_local_dir: str
    save_freq: int
    resume_mode: str
    resume_from_path: str | None
    max_actor_ckpt_to_keep: int | None
    max_consecutive_skipped_steps: int
    rollout_check_tol: float | str | None
    rollout_check_freq: int
    step_timeout_s: float | None
    preemption_save_timeout_s: float | None
    ray_num_cpus: int | None
    ray_init: Mapping[str, Any]
    emulated_bf16: str
    ray_object_store_gb: float

    def problems(self) -> list[str]:
        """The run's size and counts, resuming, the rollout check, time limits, the checkpoint folder, the
        loggers, ``ray_init``, the bf16 policy (the placement: `fusedrl.placement_config`, against the roles)."""
        from fusedrl.checkpoint import RESUME_MODES, check_writable
        from fusedrl.config_sections import check_number, one_of, positive
        from fusedrl.cpu_dtype import POLICIES
        from fusedrl.ray_config import ray_init_problems
        from fusedrl.tracking import KNOWN_LOGGERS

        found: list[str] = []
        positive(self.n_gpus_per_node, "trainer.n_gpus_per_node", found)
        positive(self.nnodes, "trainer.nnodes", found)
        positive(self.total_epochs, "trainer.total_epochs", found)
        for key, value in (
            ("critic_warmup", self.critic_warmup),
            ("log_val_generations", self.log_val_generations),
        ):
            number = check_number(value, f"trainer.{key}", found)
            if number is not None and number < 0:
                found.append(f"`trainer.{key}`={number}: must be >= 0.")
        if self.resume_mode not in RESUME_MODES:
            found.append(f"`trainer.resume_mode`={self.resume_mode!r}: use {one_of(RESUME_MODES)}.")
        tol = self.rollout_check_tol
        if tol is not None and tol != "auto":
            try:
                float(tol)
            except (TypeError, ValueError):
                found.append(f"`trainer.rollout_check_tol`={tol!r}: use auto, null or a number (e.g. 1e-3).")
        freq = check_number(self.rollout_check_freq, "trainer.rollout_check_freq", found)
        if freq is not None and freq < 1:
            found.append(f"`trainer.rollout_check_freq`={freq}: must be >= 1 (1: every step).")
        for key, limit in (
            ("step_timeout_s", self.step_timeout_s),
            ("preemption_save_timeout_s", self.preemption_save_timeout_s),
        ):
            if limit is not None:
                seconds = check_number(limit, f"trainer.{key}", found, float)
                if seconds is not None and seconds < 0:
                    found.append(f"`trainer.{key}`={seconds}: must be >= 0 seconds (0 or null: off).")
        save_freq = self.save_freq
        if isinstance(save_freq, int) and save_freq > 0 and self.default_local_dir:
            problem = check_writable(str(self.default_local_dir))
            if problem is not None:
                found.append(
                    f"`trainer.default_local_dir`={self.default_local_dir!r}: checkpoints cannot be written there "
                    f"({problem}). Point it at a writable folder, or set trainer.save_freq=-1 to run without "
                    "checkpoints."
                )
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            found.append("`trainer.resume_from_path`: required with resume_mode=resume_path.")
        loggers = [str(self.logger)] if isinstance(self.logger, str) else [str(v) for v in self.logger]
        for name in loggers:
            if name not in KNOWN_LOGGERS:
                found.append(f"`trainer.logger`: unknown logger {name!r}. Known: {', '.join(KNOWN_LOGGERS)}.")
        ray_init = self.ray_init
        if ray_init is not None and not isinstance(ray_init, Mapping):
            found.append(f"`trainer.ray_init`={ray_init!r}: use a mapping of ray.init keyword arguments.")
        else:
            found.extend(ray_init_problems(dict(ray_init) if ray_init else None))
        policy = self.emulated_bf16
        if policy is not None and str(policy) not in POLICIES:
            found.append(f"`trainer.emulated_bf16`={policy!r}: must be one of {', '.join(POLICIES)}.")
        return found
