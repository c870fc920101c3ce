"""The config checks that read two sections or more (the batch arithmetic against the workers, the
estimator against the rollout and the reward, the engine against the actor, placement, asynchronous
training, LoRA, the model's architecture, ...): `cross_section_problems`, called by
`fusedrl.config_checks.validate` after every section's own ``problems()``. A number one of them combines
is read quietly (`valid_positive`): its own section reports it.

Every check reads the typed sections (`fusedrl.role_config.RunSections`: ``run.<section>.<field>``), not the
DictConfig; the one fact they take from the raw tree is which token budgets interpolate another key
(`fusedrl.config_sections.budget_interpolations`, passed in by `fusedrl.config_checks.validate`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fusedrl.config_sections import (
    auto_key_problems,
    compile_layers_problems,
    positive,
    token_budget_problems,
    valid_positive,
)
from fusedrl.model_sections import attn_problems
from fusedrl.placement_config import actor_world, placement_problems, rollout_world


def _batches(run: Any, found: list[str]) -> None:
    """Each Ulysses size divides the workers; the samples of a step and of a mini-batch split across the
    actor's pool; the mini-batch divides the batch (checked only when every number in it is valid)."""
    slots, nnodes = valid_positive(run.trainer.n_gpus_per_node), valid_positive(run.trainer.nnodes)
    for sp_key, sp_value in (
        ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", run.actor.ulysses_sequence_parallel_size),
        ("critic.ulysses_sequence_parallel_size", run.critic.ulysses_sequence_parallel_size),
        ("reward_model.ulysses_sequence_parallel_size", run.reward_model.ulysses_sequence_parallel_size),
    ):
        sp = valid_positive(sp_value)
        if slots is not None and nnodes is not None and sp is not None and (slots * nnodes) % sp:
            found.append(
                f"`{sp_key}`={sp} does not divide the {slots * nnodes} workers (trainer.n_gpus_per_node x "
                "trainer.nnodes): each sequence-parallel group is sp workers."
            )
    n, bsz = valid_positive(run.rollout.n), valid_positive(run.data.train_batch_size)
    mini = valid_positive(run.actor.ppo_mini_batch_size)
    if slots is None or nnodes is None or n is None or bsz is None or mini is None:
        return
    world = actor_world(run) or slots * nnodes  # the actor's pool (trainer.placement)
    if (bsz * n) % world:
        found.append(
            f"`data.train_batch_size` x `actor_rollout_ref.rollout.n` = {bsz * n} samples do not divide across "
            f"{world} workers. Make train_batch_size * n a multiple of {world}."
        )
    if bsz % mini:
        found.append(
            f"`actor_rollout_ref.actor.ppo_mini_batch_size`={mini} does not divide `data.train_batch_size`={bsz}. "
            "Use a divisor of train_batch_size."
        )
    if (mini * n) % world:
        found.append(
            f"`actor_rollout_ref.actor.ppo_mini_batch_size` x n = {mini * n} samples per mini-batch do not divide "
            f"across {world} workers. Make ppo_mini_batch_size * n a multiple of {world}."
        )


def _estimator(run: Any, found: list[str]) -> None:
    """What the estimator's traits ask of the rollout (group size) and of the reward (named components);
    dynamic sampling's generation batch against the training batch."""
    from fusedrl.algorithms import get_adv_traits, list_adv_estimators

    alg = run.algorithm
    est = alg.adv_estimator
    traits = get_adv_traits(est) if est in list_adv_estimators() else None
    n = valid_positive(run.rollout.n)
    # GRPO / RLOO with n=1 run as in verl: a one-sample group has baseline 0 (and std 1), so the
    # advantage is the raw score.
    min_group = traits.min_group_size if traits is not None else 1
    if n is not None and n < min_group:
        found.append(
            f"`actor_rollout_ref.rollout.n`={n}: `{est}` compares samples of the same prompt, so every advantage "
            f"would be 0. Use n >= {min_group}."
        )
    if traits is not None and traits.needs_reward_components and run.reward_model.enable:
        found.append(
            f"`algorithm.adv_estimator`={est}: reads named components of a rule reward's dict, which a reward "
            "model does not give; set reward_model.enable=false."
        )
    gen = (
        positive(run.data.gen_batch_size, "data.gen_batch_size", found) if alg.filter_groups.enable else None
    )
    bsz = valid_positive(run.data.train_batch_size)
    if gen is not None and bsz is not None and gen < bsz:
        found.append(
            f"`data.gen_batch_size`={gen} < `data.train_batch_size`={bsz}: dynamic sampling generates "
            "gen_batch_size prompts a round and keeps train_batch_size groups; use gen_batch_size >= "
            "train_batch_size."
        )


def _engine(run: Any, found: list[str]) -> None:
    """The rollout's tensor-parallel size against its workers; an engine that generates with the actor's
    own parameters against parameter offload; the critic's attention implementation when it is not the
    actor's (the actor's: `ModelConfig.problems`)."""
    from fusedrl.config_sections import check_number
    from fusedrl.workers.rollout.registry import engines_with

    r = run.rollout
    tp = check_number(r.tensor_model_parallel_size, "", [])
    slots, nnodes = run.trainer.n_gpus_per_node, run.trainer.nnodes
    workers = slots * nnodes if isinstance(slots, int) and isinstance(nnodes, int) else None
    workers = rollout_world(run) or workers  # the rollout's pool (trainer.placement)
    if tp is not None and not (tp >= 1 and (workers is None or workers % tp == 0)):
        found.append(
            f"`actor_rollout_ref.rollout.tensor_model_parallel_size`={tp}: must divide the number of rollout "
            f"workers ({workers}: trainer.n_gpus_per_node x trainer.nnodes = {slots} x {nnodes}, or the rollout's "
            f"trainer.placement pool); each group of {tp} consecutive workers runs one tensor-parallel engine."
        )
    elif tp is not None and tp > 1 and not _traits(r.name).tensor_parallel:
        found.append(
            f"`actor_rollout_ref.rollout.tensor_model_parallel_size`={tp} needs a tensor-parallel engine "
            f"(rollout.name={' or '.join(engines_with('tensor_parallel'))}); rollout.name={r.name} runs one "
            "engine per worker: set tensor_model_parallel_size=1."
        )
    if _traits(r.name).shares_actor_module and run.actor.fsdp_config.param_offload:
        found.append(
            f"`actor_rollout_ref.actor.fsdp_config.param_offload`=true with `rollout.name={r.name}`: that "
            "engine generates with the actor's own parameters, so they cannot leave the device during rollout. "
            "Use rollout.name=vllm or set param_offload=false."
        )
    if run.critic.model.attn_implementation != run.model.attn_implementation:  # else reported once
        found.extend(attn_problems(run.critic.model.attn_implementation, "critic.model.attn_implementation"))
    if r.calculate_log_probs is False:
        found.extend(no_log_probs_problems(run))


def no_log_probs_problems(run: Any) -> list[str]:
    """``actor_rollout_ref.rollout.calculate_log_probs=false`` against what reads the rollout's log-probs: the
    rollout correction, a numeric rollout check, the asynchronous and partial-rollout trainers."""
    key, rc = "`actor_rollout_ref.rollout.calculate_log_probs`=false", run.algorithm.rollout_correction
    found: list[str] = []
    if rc.reads_rollout_log_probs:
        found.append(
            f"{key} with algorithm.rollout_correction (rollout_is / rollout_rs / bypass_mode): the correction "
            "reads the rollout's log-probs of every sample. Set calculate_log_probs=auto (or true)."
        )
    tol = run.trainer.rollout_check_tol
    if tol is not None and tol != "auto":
        found.append(
            f"{key} with `trainer.rollout_check_tol`={tol}: the check compares the rollout's log-probs with the "
            "actor's. Set calculate_log_probs=auto (the check's steps) or rollout_check_tol=null."
        )
    from fusedrl.async_config import max_staleness

    if run.async_training.partial_rollout is True or max_staleness(run) > 0:
        found.append(
            f"{key} with asynchronous training / partial rollout (async_training.*): their updates weight each "
            "sample by the policy that generated it, from the rollout's log-probs. Set calculate_log_probs=auto."
        )
    return found


def _traits(name: Any) -> Any:
    """The traits of engine ``name``; none for an unknown name (`RolloutConfig.problems` reports it)."""
    from fusedrl.workers.rollout.registry import EngineTraits, engine_names, engine_traits

    return engine_traits(name) if str(name) in engine_names() else EngineTraits()


def _modules(run: Any, follows: Mapping[str, str], found: list[str]) -> None:
    """The checks of their own modules, each reading several sections: token budgets, ``auto`` keys, layer
    compilation, the model's architecture, the chat template, LoRA against a critic, vision-language models, routing replay,
    placement, asynchronous training and partial rollout, expert parallelism. ``follows``: the token
    budgets that interpolate another key (`fusedrl.config_sections.budget_interpolations`)."""
    from fusedrl.architecture_config import architecture_problems
    from fusedrl.async_config import async_problems, partial_rollout_problems
    from fusedrl.chat_config import chat_template_problems
    from fusedrl.expert_parallel_checks import expert_parallel_problems
    from fusedrl.lora import lora_critic_problems
    from fusedrl.routing_replay_checks import routing_replay_problems
    from fusedrl.vision_language_checks import vision_language_problems

    roles = run.needed_roles()
    found.extend(token_budget_problems(run, roles, follows))
    found.extend(auto_key_problems(run))
    found.extend(compile_layers_problems(run, with_critic=bool(roles["critic"])))
    found.extend(architecture_problems(run, roles))
    found.extend(chat_template_problems(run))
    found.extend(lora_critic_problems(run.model, run.algorithm.adv_estimator, bool(roles["critic"])))
    found.extend(vision_language_problems(run, roles))
    found.extend(routing_replay_problems(run))
    placement = placement_problems(run, ["actor", "rollout", *[r for r, on in roles.items() if on]], found)
    async_problems(run, placement, found)
    partial_rollout_problems(run, placement, found)
    found.extend(expert_parallel_problems(run))


def cross_section_problems(run: Any, follows: Mapping[str, str] | None = None) -> list[str]:
    """Every problem that takes two sections to see; ``run``: the typed sections (`RunSections`, or a
    `fusedrl.run_config.RunConfig`), which every check reads; ``follows``: the token budgets that
    interpolate another key (`fusedrl.config_sections.budget_interpolations` of the composed config; none
    given: the budgets' problems do not say which key they follow)."""
    found: list[str] = []
    _batches(run, found)
    _estimator(run, found)
    _engine(run, found)
    _modules(run, follows or {}, found)
    return found
