"""The engine registry: names, traits, and the config checks that read the traits (never an engine's name)."""

from __future__ import annotations

import pytest
from verl_lines import problems_of

from fusedrl.workers.rollout.registry import (
    BUILTIN,
    EngineSpec,
    EngineTraits,
    engine_names,
    engine_spec,
    engines_with,
    register_engine,
    requirement_fails,
)

ARR = "actor_rollout_ref"


@pytest.fixture
def base(tiny_model_dir, arithmetic_data) -> list[str]:
    return [f"data.train_files={arithmetic_data[0]}", f"{ARR}.model.path={tiny_model_dir}"]


def test_builtin_engines_and_their_traits():
    assert engine_names()[:3] == ["vllm", "hf", "fake"]
    builtin = {spec.name for spec in BUILTIN}  # other tests of this process may have registered more

    def with_trait(trait):
        return [name for name in engines_with(trait) if name in builtin]

    assert with_trait("request_queue") == ["vllm", "fake"]
    assert with_trait("tensor_parallel") == ["vllm"]
    assert with_trait("shares_actor_module") == ["hf"]
    assert dict(engine_spec("vllm").traits.worker_env) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for spec in BUILTIN:  # every builder path names a function that exists
        module, func = spec.build.split(":")
        assert func == "build" and module.startswith("fusedrl.workers.rollout.")


def test_registering_again_is_idempotent_and_a_clash_is_refused():
    spec = EngineSpec(name="test_registry_engine", traits=EngineTraits(), build="x.y:build")
    assert register_engine(spec) is spec and register_engine(spec) is spec
    with pytest.raises(ValueError, match="already registered"):
        register_engine(
            EngineSpec(name="test_registry_engine", traits=EngineTraits(can_sleep=True), build="x.y:build")
        )
    with pytest.raises(KeyError, match=r"`actor_rollout_ref.rollout.name`='nope': no such rollout engine"):
        engine_spec("nope")


def test_a_missing_requirement_is_said_with_its_error():
    assert requirement_fails(EngineTraits()) is None
    assert "ModuleNotFoundError" in requirement_fails(EngineTraits(requires="no_such_module_fusedrl"))


def test_config_checks_read_the_traits(base):
    (unknown,) = problems_of([*base, f"{ARR}.rollout.name=nope"])
    assert "no such rollout engine" in unknown and "'vllm', 'hf', 'fake'" in unknown
    tp = problems_of(
        [
            *base,
            f"{ARR}.rollout.name=fake",
            f"{ARR}.rollout.tensor_model_parallel_size=2",
            "trainer.n_gpus_per_node=2",
        ]
    )
    assert len(tp) == 1 and "needs a tensor-parallel engine (rollout.name=vllm)" in tp[0], tp
    offload = problems_of([*base, f"{ARR}.rollout.name=hf", f"{ARR}.actor.fsdp_config.param_offload=true"])
    assert len(offload) == 1 and "generates with the actor's own parameters" in offload[0], offload
    # the fake engine has its own copy of the weights: the actor's may leave the device during rollout
    from fusedrl.config import load_config

    load_config([*base, f"{ARR}.rollout.name=fake", f"{ARR}.actor.fsdp_config.param_offload=true"])
