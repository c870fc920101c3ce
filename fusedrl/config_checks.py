"""Checks of a composed trainer config (`validate`): every problem collected into one `ConfigError`, each
naming the key, the bad value and the fix, before Ray starts. `fusedrl.config` loads the config and calls this."""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from fusedrl.config_base import ConfigError, import_plugin, logger_names, missing_keys, needed_roles
from fusedrl.config_sections import (
    FILTER_METRICS,
    auto_key_problems,
    check_number,
    checkpoint_contents_problems,
    compile_layers_problems,
    rollout_correction_problems,
    schedule_problems,
    token_budget_problems,
)
from fusedrl.placement_config import actor_world, placement_problems, rollout_world
from fusedrl.role_config import ATTN_IMPLEMENTATIONS, ROLLOUT_MODES, SLEEP_LEVELS


def _looks_like_hub_id(path: str) -> bool:
    """``org/name`` that is not a local path: transformers and vLLM download it (machines with a network)."""
    import re

    return not os.path.exists(path) and re.fullmatch(r"[\w.-]+/[\w.-]+", path) is not None


def _get(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key, throw_on_missing=False)


class Checks:
    """The config being checked and the problems found so far. Each section's checks append to ``problems``;
    a number read by several sections is checked (and a problem reported) once."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.problems: list[str] = []
        self._numbers: dict[tuple[str, type], Any] = {}

    def need(self, cond: bool, msg: str) -> bool:
        """Record ``msg`` when ``cond`` fails; returns ``cond`` so dependent checks can follow it."""
        if not cond:
            self.problems.append(msg)
        return cond

    def number(self, key: str, kind: type = int) -> Any:
        """``cfg[key]`` as ``kind``, or None (and one problem) when it is not one (2.5 is no integer)."""
        if (key, kind) not in self._numbers:
            self._numbers[(key, kind)] = check_number(_get(self.cfg, key), key, self.problems, kind)
        return self._numbers[(key, kind)]

    def positive(self, key: str) -> int | None:
        value = self.number(key)
        if value is not None and value < 1:
            problem = f"`{key}`={value}: must be >= 1."
            if problem not in self.problems:
                self.problems.append(problem)
            return None
        return value


def _paths(c: Checks) -> None:
    """Data files and the model folder exist (or the model is a hub id)."""
    cfg, need = c.cfg, c.need
    files = _get(cfg, "data.train_files")
    if files is not None and not OmegaConf.is_missing(cfg.data, "train_files"):
        for f in [files] if isinstance(files, str) else list(files):
            need(
                os.path.exists(f),
                f"`data.train_files`: file `{f}` does not exist. Generate it (see examples/data_preprocess/) or fix the path.",
            )
    val_files = _get(cfg, "data.val_files")
    if val_files:
        for f in [val_files] if isinstance(val_files, str) else list(val_files):
            need(os.path.exists(f), f"`data.val_files`: file `{f}` does not exist.")
    if not OmegaConf.is_missing(cfg.actor_rollout_ref.model, "path"):
        path = str(cfg.actor_rollout_ref.model.path)
        need(
            os.path.isfile(os.path.join(path, "config.json")) or _looks_like_hub_id(path),
            f"`actor_rollout_ref.model.path`: `{path}` is neither a Hugging Face model folder (no config.json) "
            "nor a hub id (org/name). Point it at a local folder; build a tiny one with "
            "`python -m fusedrl.utils.tiny_model --out DIR`.",
        )


def _batch_sizes(c: Checks) -> None:
    """Batch sizes, worker counts, Ulysses sizes and lengths: each positive, and the batch arithmetic
    (checked only when every number in it is valid); ``data.truncation``."""
    cfg, need, positive = c.cfg, c.need, c.positive
    from fusedrl.data.dataset import TRUNCATION_MODES

    slots, nnodes = positive("trainer.n_gpus_per_node"), positive("trainer.nnodes")
    positive("trainer.total_epochs")
    n = positive("actor_rollout_ref.rollout.n")
    bsz = positive("data.train_batch_size")
    mini = positive("actor_rollout_ref.actor.ppo_mini_batch_size")
    if _get(cfg, "actor_rollout_ref.actor.ppo_micro_batch_size") is None:  # else derived from it
        positive("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    for sp_key in (
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "critic.ulysses_sequence_parallel_size",
        "reward_model.ulysses_sequence_parallel_size",
    ):
        sp = positive(sp_key)
        if slots is not None and nnodes is not None and sp is not None:
            need(
                (slots * nnodes) % sp == 0,
                f"`{sp_key}`={sp} does not divide the {slots * nnodes} workers (trainer.n_gpus_per_node x "
                "trainer.nnodes): each sequence-parallel group is sp workers.",
            )
    if slots is not None and nnodes is not None and n is not None and bsz is not None and mini is not None:
        world = actor_world(cfg) or slots * nnodes  # the actor's pool (trainer.placement)
        need(
            (bsz * n) % world == 0,
            f"`data.train_batch_size` x `actor_rollout_ref.rollout.n` = {bsz * n} samples do not divide across "
            f"{world} workers. Make train_batch_size * n a multiple of {world}.",
        )
        need(
            bsz % mini == 0,
            f"`actor_rollout_ref.actor.ppo_mini_batch_size`={mini} does not divide `data.train_batch_size`={bsz}. "
            "Use a divisor of train_batch_size.",
        )
        need(
            (mini * n) % world == 0,
            f"`actor_rollout_ref.actor.ppo_mini_batch_size` x n = {mini * n} samples per mini-batch do not divide "
            f"across {world} workers. Make ppo_mini_batch_size * n a multiple of {world}.",
        )
    for key in ("data.max_prompt_length", "data.max_response_length"):
        positive(key)
    need(
        cfg.data.truncation in TRUNCATION_MODES,
        f"`data.truncation`={cfg.data.truncation!r}: use error, left, right or middle (and "
        "`data.filter_overlong_prompts=true` to drop over-long prompts instead).",
    )


def _plugins(c: Checks) -> None:
    """``algorithm.custom_modules`` import (they may register estimators and losses the checks below
    look up); the reward model's folder when it is enabled."""
    cfg, problems, need = c.cfg, c.problems, c.need
    for module in list(cfg.algorithm.get("custom_modules") or []):
        try:
            import_plugin(str(module))
        except Exception as err:
            problems.append(f"`algorithm.custom_modules`: cannot import {module!r}: {err}")
    if cfg.reward_model.enable:
        rm_path = cfg.reward_model.model.path
        need(
            bool(rm_path) and os.path.isfile(os.path.join(str(rm_path), "config.json")),
            f"`reward_model.model.path`={rm_path!r}: not a Hugging Face model folder (reward_model.enable=true).",
        )


def _estimator(c: Checks) -> None:
    """``algorithm.adv_estimator``: known, and what its traits ask of the rest of the config."""
    cfg, problems, need = c.cfg, c.problems, c.need
    from fusedrl.algorithms import get_adv_traits, list_adv_estimators

    est = cfg.algorithm.adv_estimator
    need(
        est in list_adv_estimators(),
        f"`algorithm.adv_estimator`={est!r}: unknown. Known: {', '.join(list_adv_estimators())}.",
    )
    n = c.positive("actor_rollout_ref.rollout.n")  # checked by `_batch_sizes`
    # GRPO / RLOO with n=1 run as in verl: a one-sample group has baseline 0 (and std 1), so the
    # advantage is the raw score.
    min_group = get_adv_traits(est).min_group_size if est in list_adv_estimators() else 1
    if n is not None and n < min_group:
        problems.append(
            f"`actor_rollout_ref.rollout.n`={n}: `{est}` compares samples of the same prompt, so every advantage "
            f"would be 0. Use n >= {min_group}."
        )
    if est in list_adv_estimators() and get_adv_traits(est).needs_reward_components:
        keys = _get(cfg, "algorithm.gdpo_reward_keys")
        weights = _get(cfg, "algorithm.gdpo_reward_weights")
        if need(
            isinstance(keys, ListConfig) and len(keys) > 0,
            f"`algorithm.gdpo_reward_keys`={keys!r}: `{est}` needs the names of the reward components your "
            "compute_score returns in its dict, e.g. +algorithm.gdpo_reward_keys='[accuracy_reward,format_reward]'.",
        ):
            need(
                weights is None or (isinstance(weights, ListConfig) and len(weights) == len(keys)),
                f"`algorithm.gdpo_reward_weights`={weights!r}: give one weight per gdpo_reward_keys entry "
                f"({len(keys)}), or null for all 1.",
            )
        need(
            not cfg.reward_model.enable,
            f"`algorithm.adv_estimator`={est}: reads named components of a rule reward's dict, which a reward "
            "model does not give; set reward_model.enable=false.",
        )
    if est in list_adv_estimators() and get_adv_traits(est).needs_sum_pi_squared:
        need(
            not cfg.algorithm.rollout_correction.bypass_mode,
            f"`algorithm.adv_estimator`={est}: reads the actor's old log-probs and sum_pi_squared, which "
            "`algorithm.rollout_correction.bypass_mode`=true skips; set bypass_mode=false.",
        )


def _actor(c: Checks) -> None:
    """``actor_rollout_ref.actor``: the policy loss, its aggregation and KL kind, the learning rate."""
    cfg, need, number = c.cfg, c.need, c.number
    from fusedrl.algorithms import list_policy_losses
    from fusedrl.algorithms.kl import KL_KINDS
    from fusedrl.algorithms.losses import LOSS_AGG_MODES as AGG_MODES

    actor = cfg.actor_rollout_ref.actor
    mode = actor.policy_loss.loss_mode
    need(
        mode in list_policy_losses(),
        f"`actor_rollout_ref.actor.policy_loss.loss_mode`={mode!r}: unknown. Known: {', '.join(list_policy_losses())}.",
    )
    if mode in ("clip_cov", "kl_cov"):  # the share of tokens the loss selects
        ratio = number(f"actor_rollout_ref.actor.policy_loss.{mode}_ratio", float)
        need(
            ratio is None or 0 < ratio <= 1,
            f"`actor_rollout_ref.actor.policy_loss.{mode}_ratio`={ratio}: use (0, 1].",
        )
    need(
        actor.loss_agg_mode in AGG_MODES,
        f"`actor_rollout_ref.actor.loss_agg_mode`={actor.loss_agg_mode!r}: unknown. Known: {', '.join(AGG_MODES)}.",
    )
    for key in ("actor_rollout_ref.actor.loss_scale_factor", "critic.loss_scale_factor"):
        if _get(cfg, key) is not None and (factor := number(key, float)) is not None:
            need(factor > 0, f"`{key}`={factor}: must be > 0 (or null: the response width).")
    need(
        actor.kl_loss_type in KL_KINDS,
        f"`actor_rollout_ref.actor.kl_loss_type`={actor.kl_loss_type!r}: use k1, k2, k3 (low_var_kl) or abs.",
    )
    lr = number("actor_rollout_ref.actor.optim.lr", float)
    need(lr is None or lr > 0, f"`actor_rollout_ref.actor.optim.lr`={lr}: must be > 0.")


def _algorithm(c: Checks) -> None:
    """``algorithm``: KL control and penalty, dynamic sampling, rollout correction; the checkpoint contents,
    the optimizers' schedules and the trainer's step counts."""
    cfg, problems, need, number, positive = c.cfg, c.problems, c.need, c.number, c.positive
    from fusedrl.algorithms.kl import KL_KINDS
    from fusedrl.algorithms.kl_control import KL_CONTROLLERS

    alg = cfg.algorithm
    need(
        alg.kl_ctrl.type in KL_CONTROLLERS,
        f"`algorithm.kl_ctrl.type`={alg.kl_ctrl.type!r}: use fixed or adaptive.",
    )
    need(
        alg.kl_penalty in KL_KINDS,
        f"`algorithm.kl_penalty`={alg.kl_penalty!r}: use kl (k1), mse (k2), low_var_kl (k3) or abs.",
    )
    need(
        alg.filter_groups.metric in FILTER_METRICS,
        f"`algorithm.filter_groups.metric`={alg.filter_groups.metric!r}: use {', '.join(FILTER_METRICS)} "
        "(score / seq_reward: the sequence's task score; seq_final_reward: after the in-reward KL; acc: the "
        "scorer's `acc` entry, else the score).",
    )
    rollout_correction_problems(cfg, problems)
    checkpoint_contents_problems(cfg, problems)
    gen = positive("data.gen_batch_size") if alg.filter_groups.enable else None  # read by DAPO only
    bsz = positive("data.train_batch_size")  # checked by `_batch_sizes`
    if gen is not None and bsz is not None:
        need(
            gen >= bsz,
            f"`data.gen_batch_size`={gen} < `data.train_batch_size`={bsz}: dynamic sampling generates "
            "gen_batch_size prompts a round and keeps train_batch_size groups; use gen_batch_size >= "
            "train_batch_size.",
        )
    for role in ("actor_rollout_ref.actor", "critic"):
        schedule_problems(cfg, f"{role}.optim", problems)
    for key in ("trainer.critic_warmup", "trainer.log_val_generations"):
        value = number(key)
        need(value is None or value >= 0, f"`{key}`={value}: must be >= 0.")
    if alg.use_kl_in_reward and alg.kl_ctrl.type == "adaptive":
        need(
            float(alg.kl_ctrl.target_kl or 0) > 0 and int(alg.kl_ctrl.horizon or 0) > 0,
            "`algorithm.kl_ctrl`: adaptive needs target_kl > 0 and horizon > 0.",
        )


def _rollout(c: Checks) -> None:
    """``actor_rollout_ref.rollout``: the engine and what it can do (tensor parallelism, agent loops,
    sleeping), the attention implementations, the sampling temperature."""
    cfg, problems, need, number = c.cfg, c.problems, c.need, c.number
    rollout = cfg.actor_rollout_ref.rollout
    from fusedrl.workers.rollout.registry import EngineTraits, engine_spec, engines_with, requirement_fails

    try:
        engine = engine_spec(rollout.name).traits
    except KeyError as err:
        problems.append(str(err.args[0]))
        engine = EngineTraits()
    tp = number("actor_rollout_ref.rollout.tensor_model_parallel_size")
    slots, nnodes = _get(cfg, "trainer.n_gpus_per_node"), _get(cfg, "trainer.nnodes")
    workers = slots * nnodes if isinstance(slots, int) and isinstance(nnodes, int) else None
    workers = rollout_world(cfg) or workers  # the rollout's pool (trainer.placement)
    if tp is not None and need(
        tp >= 1 and (workers is None or workers % tp == 0),
        f"`actor_rollout_ref.rollout.tensor_model_parallel_size`={tp}: must divide the number of rollout "
        f"workers ({workers}: trainer.n_gpus_per_node x trainer.nnodes = {slots} x {nnodes}, or the rollout's "
        f"trainer.placement pool); each group of {tp} consecutive workers runs one tensor-parallel engine.",
    ):
        need(
            tp == 1 or engine.tensor_parallel,
            f"`actor_rollout_ref.rollout.tensor_model_parallel_size`={tp} needs a tensor-parallel engine "
            f"(rollout.name={' or '.join(engines_with('tensor_parallel'))}); rollout.name={rollout.name} runs one "
            "engine per worker: set tensor_model_parallel_size=1.",
        )
    mt = rollout.get("multi_turn")
    if mt is not None and mt.enable:
        from fusedrl.agent.runner import MultiTurnConfig

        problems.extend(MultiTurnConfig.from_dict(dict(mt)).problems())
        need(
            engine.request_queue,
            "`actor_rollout_ref.rollout.multi_turn.enable`=true needs an engine that takes requests one at a "
            f"time, as agent loops queue them (rollout.name={' or '.join(engines_with('request_queue'))}); "
            f"rollout.name={rollout.name} generates whole batches only.",
        )
        need(
            tp is None or tp == 1,
            f"`actor_rollout_ref.rollout.multi_turn.enable`=true with tensor_model_parallel_size={tp}: multi-turn "
            "rollouts run with tensor_model_parallel_size=1 only (every rank of a TP group would have to submit "
            "the same requests in the same order, tool results included; not implemented). Set "
            "tensor_model_parallel_size=1 (data-parallel engines, one per worker).",
        )
        path = mt.get("tool_config_path")
        need(
            not path or os.path.isfile(str(path)),
            f"`actor_rollout_ref.rollout.multi_turn.tool_config_path`: file `{path}` does not exist.",
        )
    need(
        rollout.mode in ROLLOUT_MODES,
        f"`actor_rollout_ref.rollout.mode`={rollout.mode!r}: use sync or async (the in-process engine runs "
        "the same way for both).",
    )
    need(
        rollout.sleep_level in SLEEP_LEVELS,
        f"`actor_rollout_ref.rollout.sleep_level`={rollout.sleep_level!r}: use 1 (keep a host copy of the "
        "engine's weights while asleep), 2 (discard them; they are re-streamed before the next rollout) or "
        "auto (2 on CUDA, 1 under LoRA and on CPU).",
    )
    if engine.shares_actor_module:
        need(
            not cfg.actor_rollout_ref.actor.fsdp_config.param_offload,
            f"`actor_rollout_ref.actor.fsdp_config.param_offload`=true with `rollout.name={rollout.name}`: that "
            "engine generates with the actor's own parameters, so they cannot leave the device during rollout. "
            "Use rollout.name=vllm or set param_offload=false.",
        )
    impls = {
        key: OmegaConf.select(cfg, key)
        for key in ("actor_rollout_ref.model.attn_implementation", "critic.model.attn_implementation")
    }
    if len(set(impls.values())) == 1:  # the critic follows the actor by default: report it once
        impls.pop("critic.model.attn_implementation")
    for key, impl in impls.items():
        need(
            impl in ATTN_IMPLEMENTATIONS,
            f"`{key}`={impl!r}: use auto (flash_attention_2 when available, else sdpa), sdpa, eager or "
            "flash_attention_2.",
        )
    temperature = number("actor_rollout_ref.rollout.temperature", float)
    need(
        temperature is None or temperature > 0,
        f"`actor_rollout_ref.rollout.temperature`={rollout.temperature}: must be > 0 for training rollouts.",
    )
    failure = requirement_fails(engine)
    need(
        failure is None,
        f"`actor_rollout_ref.rollout.name`={rollout.name} but `import {engine.requires}` fails here ({failure}). "
        "Run `make install` or use `rollout.name=hf`.",
    )


def _trainer(c: Checks) -> None:
    """``trainer``: resuming, the rollout check, time limits, the checkpoint folder, the loggers."""
    cfg, problems, need, number = c.cfg, c.problems, c.need, c.number
    from fusedrl.checkpoint import RESUME_MODES

    tr = cfg.trainer
    need(
        tr.resume_mode in RESUME_MODES,
        f"`trainer.resume_mode`={tr.resume_mode!r}: use auto, disable or resume_path.",
    )
    tol = tr.rollout_check_tol
    if tol is not None and tol != "auto":
        try:
            float(tol)
        except (TypeError, ValueError):
            problems.append(f"`trainer.rollout_check_tol`={tol!r}: use auto, null or a number (e.g. 1e-3).")
    for key in ("trainer.step_timeout_s", "trainer.preemption_save_timeout_s"):
        if _get(cfg, key) is not None:
            seconds = number(key, float)
            need(
                seconds is None or seconds >= 0, f"`{key}`={seconds}: must be >= 0 seconds (0 or null: off)."
            )
    save_freq = _get(cfg, "trainer.save_freq")
    if isinstance(save_freq, int) and save_freq > 0 and tr.default_local_dir:
        from fusedrl.checkpoint import check_writable

        problem = check_writable(str(tr.default_local_dir))
        need(
            problem is None,
            f"`trainer.default_local_dir`={tr.default_local_dir!r}: checkpoints cannot be written there ({problem}). "
            "Point it at a writable folder, or set trainer.save_freq=-1 to run without checkpoints.",
        )
    if tr.resume_mode == "resume_path":
        need(bool(tr.resume_from_path), "`trainer.resume_from_path`: required with resume_mode=resume_path.")

    from fusedrl.tracking import KNOWN_LOGGERS

    for name in logger_names(cfg):
        need(
            name in KNOWN_LOGGERS,
            f"`trainer.logger`: unknown logger {name!r}. Known: {', '.join(KNOWN_LOGGERS)}.",
        )


def _reward_model(c: Checks) -> None:
    """``reward_model``: what the reward manager would refuse (`fusedrl.rewards.reward_problems`: the manager,
    on_error, the scoring pool, the overlong buffer's manager), and the overlong buffer's lengths."""
    cfg, need, number = c.cfg, c.need, c.number
    from fusedrl.rewards import reward_problems
    from fusedrl.role_config import RewardModelConfig, build_section

    rm = cfg.reward_model
    section = OmegaConf.to_container(rm, resolve=True)
    c.problems.extend(reward_problems(build_section(RewardModelConfig, section, "reward_model")))  # type: ignore[arg-type]
    if rm.overlong_buffer.enable and rm.overlong_buffer.max_resp_len is not None:
        resp_len = number("reward_model.overlong_buffer.max_resp_len")
        buffer_len = _get(cfg, "reward_model.overlong_buffer.len")
        need(
            resp_len is None or not isinstance(buffer_len, int) or resp_len >= buffer_len,
            f"`reward_model.overlong_buffer.max_resp_len`={resp_len} (verl: reward_kwargs.max_resp_len) < "
            f"`reward_model.overlong_buffer.len`={buffer_len}: the overlong buffer is the last len tokens of "
            "max_resp_len; use max_resp_len >= len.",
        )


def _across_sections(c: Checks) -> None:
    """Checks of their own modules: Ray, the custom reward file, token budgets, ``auto`` keys, layer
    compilation, the model's architecture, the chat template, LoRA, placement, async training, the bf16
    policy."""
    cfg, problems, need = c.cfg, c.problems, c.need
    from fusedrl.ray_config import ray_init_problems

    ray_init = _get(cfg, "trainer.ray_init")
    if ray_init is not None and not isinstance(ray_init, DictConfig):
        problems.append(f"`trainer.ray_init`={ray_init!r}: use a mapping of ray.init keyword arguments.")
    else:
        container = OmegaConf.to_container(ray_init, resolve=True) if ray_init else None
        problems.extend(ray_init_problems(container if isinstance(container, dict) else None))
    cpath = cfg.custom_reward_function.path
    if cpath:
        need(os.path.isfile(str(cpath)), f"`custom_reward_function.path`: file `{cpath}` does not exist.")
    problems.extend(token_budget_problems(cfg))
    problems.extend(auto_key_problems(cfg))
    problems.extend(compile_layers_problems(cfg, with_critic=bool(needed_roles(cfg)["critic"])))
    from fusedrl.architecture_config import architecture_problems

    problems.extend(architecture_problems(cfg, needed_roles(cfg)))
    from fusedrl.chat_config import chat_template_problems

    problems.extend(chat_template_problems(cfg))
    from fusedrl.lora import lora_problems

    problems.extend(lora_problems(cfg))
    from fusedrl.vision_language_checks import vision_language_problems

    problems.extend(vision_language_problems(cfg))
    from fusedrl.routing_replay_checks import routing_replay_problems

    problems.extend(routing_replay_problems(cfg))
    roles = ["actor", "rollout", *[r for r, on in needed_roles(cfg).items() if on]]
    placement = placement_problems(cfg, roles, problems)
    from fusedrl.async_config import async_problems, partial_rollout_problems

    async_problems(cfg, placement, problems)
    partial_rollout_problems(cfg, placement, problems)
    from fusedrl.cpu_dtype import POLICIES

    policy = _get(cfg, "trainer.emulated_bf16")
    need(
        policy is None or str(policy) in POLICIES,
        f"`trainer.emulated_bf16`={policy!r}: must be one of {', '.join(POLICIES)}.",
    )


def _expert_parallel(c: Checks) -> None:
    """The actor's and the reference's expert-parallel sizes (`fusedrl.expert_parallel_checks`)."""
    from fusedrl.expert_parallel_checks import expert_parallel_problems

    c.problems.extend(expert_parallel_problems(c.cfg))


SECTION_CHECKS = (
    _paths,
    _batch_sizes,
    _plugins,
    _estimator,
    _actor,
    _algorithm,
    _rollout,
    _trainer,
    _reward_model,
    _across_sections,
    _expert_parallel,
)


def validate(cfg: DictConfig) -> None:
    """Check a composed config; raise one `ConfigError` listing every problem (every section's)."""
    c = Checks(cfg)
    c.problems.extend(
        f"`{key}`: required, not set. Pass `{key}=...` on the command line." for key in missing_keys(cfg)
    )
    for check in SECTION_CHECKS:
        check(c)
    if c.problems:
        raise ConfigError(c.problems)
