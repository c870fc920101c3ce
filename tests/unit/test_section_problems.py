"""Each typed config section checks its own fields (``problems()`` beside them); the checks that need two
sections are `fusedrl.config_cross_checks`; `validate` reports both (tests/unit/test_config.py: on real files)."""

from __future__ import annotations

import dataclasses

import pytest

from fusedrl.config import load_config
from fusedrl.config_cross_checks import cross_section_problems
from fusedrl.role_config import RunSections

HF = "actor_rollout_ref.rollout.name=hf"


def sections(*overrides: str):
    """The typed sections of a command line, not validated (the data and model keys stay unset)."""
    return load_config([HF, *overrides], validate_config=False)


def test_every_section_defines_its_own_problems():
    run = sections()
    for field in dataclasses.fields(RunSections):
        cls = type(getattr(run, field.name))
        assert "problems" in vars(cls), f"{cls.__name__} ({field.name}) has no problems() of its own"


def test_a_section_reports_its_own_bad_fields_and_no_other():
    run = sections(
        "actor_rollout_ref.actor.loss_agg_mode=not_a_mode",
        "actor_rollout_ref.actor.optim.lr=0",
        "trainer.resume_mode=sometimes",
        "algorithm.kl_penalty=k9",
    )
    actor = run.actor.problems()
    assert len(actor) == 2, actor
    assert actor[0].startswith("`actor_rollout_ref.actor.loss_agg_mode`='not_a_mode': unknown. Known: ")
    assert actor[1] == "`actor_rollout_ref.actor.optim.lr`=0.0: must be > 0."
    assert run.trainer.problems() == ["`trainer.resume_mode`='sometimes': use auto, disable or resume_path."]
    assert run.algorithm.problems() == [
        "`algorithm.kl_penalty`='k9': use kl (k1), mse (k2), low_var_kl (k3) or abs."
    ]
    assert run.rollout.problems() == [] and run.critic.problems() == []
    assert run.data.problems() == []  # train_files unset: reported as required by `validate`, not here


def test_a_number_is_reported_by_its_section_once_and_read_quietly_by_the_cross_checks():
    run = sections("actor_rollout_ref.rollout.n=0", "data.train_batch_size=3", "trainer.n_gpus_per_node=2")
    assert run.rollout.problems() == ["`actor_rollout_ref.rollout.n`=0: must be >= 1."]
    # n=0 is not combined into the batch arithmetic (3 x 0 would "divide"), nor reported again
    assert not [p for p in cross_section_problems(run) if "rollout.n" in p]


def test_a_problem_of_two_sections_is_a_cross_check():
    run = sections("actor_rollout_ref.rollout.tensor_model_parallel_size=3", "trainer.n_gpus_per_node=2")
    assert run.rollout.problems() == [] and run.trainer.problems() == []
    cross = cross_section_problems(run)
    assert [
        p
        for p in cross
        if p.startswith("`actor_rollout_ref.rollout.tensor_model_parallel_size`=3: must divide")
    ]


def test_the_cross_checks_read_the_typed_sections_alone():
    """`cross_section_problems` on plain `RunSections` (no DictConfig behind them to fall back on: a
    `RunConfig` looks unknown attributes up in its ``source``) finds what `validate` finds across the
    checks of several modules: placement, asynchronous training, compiled layers, token budgets, ``auto``
    keys; the one raw fact, which budget interpolates another key, comes from `budget_interpolations`."""
    from fusedrl.config_base import ConfigError
    from fusedrl.config_checks import validate
    from fusedrl.config_sections import budget_interpolations

    overrides = (
        "trainer.placement.roles={critic: nowhere}",
        "async_training.max_staleness=1",
        "actor_rollout_ref.model.compile_layers=true",
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10",
        "critic.model.fsdp_config.param_dtype=bfloat61",
    )
    run = sections("data.train_files=t", "actor_rollout_ref.model.path=/m", *overrides)
    plain = RunSections(**{f.name: getattr(run, f.name) for f in dataclasses.fields(RunSections)})
    follows = budget_interpolations(run.source)
    assert follows["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"] == (
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    )
    cross = cross_section_problems(plain, follows)
    with pytest.raises(ConfigError) as raised:
        validate(run.source)
    reported = str(raised.value)
    for start in (
        "`trainer.placement.roles.critic`='nowhere': no such pool",
        "`async_training.max_staleness`=1: generation overlaps training only with the rollout on a pool",
        "`actor_rollout_ref.model.compile_layers`=true with `actor_rollout_ref.model.lora_rank`=4",
        "`actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu`=10 (it follows "
        "`actor_rollout_ref.actor.ppo_max_token_len_per_gpu`)",
        "`critic.model.fsdp_config.param_dtype`='bfloat61': use auto, null",
    ):
        assert [p for p in cross if p.startswith(start)], (start, cross)
        assert start in reported
    assert cross == cross_section_problems(run, follows)  # the same through a `RunConfig`
