"""The rollout engines a run may name (``actor_rollout_ref.rollout.name``), each described by its traits.

Nothing outside an engine's own module asks which engine a run uses; it asks what the engine can do. The
driver checks a config against the traits before Ray starts (this module imports neither torch nor any
engine), and the fused worker builds the engine by the dotted path its entry names.

Adding an engine is two files: the adapter module (a ``build(ctx: EngineContext) -> Rollout`` function,
see `fusedrl.workers.rollout.base`) and its entry in `BUILTIN` below, or, for an engine kept outside this
package, a `register_engine` call in a module named in ``algorithm.custom_modules`` (imported by the
driver and by every worker).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineTraits:
    """What an engine can do; every engine-specific decision of the driver and the worker reads these."""

    shares_actor_module: bool = False
    """Generates with the actor's own FSDP2 module: no weight stream, the actor's parameters stay on the
    device during rollout, and the engine lives in the actor's worker (never on a pool of its own)."""
    can_sleep: bool = False
    """Releases its memory between rollouts (``sleep(level)`` / ``wake_up(tags)``) when
    ``rollout.free_cache_engine`` is set; an engine that cannot treats both as no-ops."""
    level2_discards_weights: bool = False
    """``sleep(2)`` throws the weights away: the next weight stream must be complete."""
    tensor_parallel: bool = False
    """Runs one engine across ``rollout.tensor_model_parallel_size`` consecutive workers."""
    request_queue: bool = False
    """Takes requests one at a time (``engine.submit`` / ``step`` / ``num_unfinished``, the
    `fusedrl.workers.rollout.base.RequestEngine` interface): what multi-turn agent loops need."""
    bf16_kernels_from_cpu_flags: bool = False
    """On a CPU it picks its bf16 kernels from the CPU's flags, not from PyTorch's dispatch level, so a bf16
    engine aborts on an AMX CPU whose instruction set is capped (`fusedrl.utils.hardware.capped_amx_bf16`)."""
    requires: str | None = None
    """A module that must import for the engine to run (checked before Ray starts)."""
    worker_env: tuple[tuple[str, str], ...] = ()
    """Environment variables the workers need before the engine is imported (set in Ray's runtime env)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSpec:
    """A registered engine: its name, its traits, ``build`` (``"package.module:function"``, called in the
    worker with an `EngineContext`) and one line for the docs and error messages."""

    name: str
    traits: EngineTraits
    build: str
    summary: str = ""


BUILTIN: tuple[EngineSpec, ...] = (
    EngineSpec(
        name="vllm",
        traits=EngineTraits(
            can_sleep=True,
            level2_discards_weights=True,
            tensor_parallel=True,
            request_queue=True,
            bf16_kernels_from_cpu_flags=True,
            requires="vllm",
            worker_env=(("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),),
        ),
        build="fusedrl.workers.rollout.vllm_rollout:build",
        summary="vLLM in the worker's own process; weights streamed into it in place (the default)",
    ),
    EngineSpec(
        name="hf",
        traits=EngineTraits(shares_actor_module=True),
        build="fusedrl.workers.rollout.hf_rollout:build",
        summary="Hugging Face generate on the actor's own FSDP2 module (debugging, any architecture)",
    ),
    EngineSpec(
        name="fake",
        traits=EngineTraits(can_sleep=True, level2_discards_weights=True, request_queue=True),
        build="fusedrl.workers.rollout.fake_engine:build",
        summary="a copy of the policy sampled with plain PyTorch: the seam's reference engine for tests",
    ),
)

_ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in BUILTIN}


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Make ``spec`` a valid ``rollout.name`` in this process (the same spec again is a no-op)."""
    known = _ENGINES.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"rollout engine {spec.name!r} is already registered with other traits or builder")
    _ENGINES[spec.name] = spec
    return spec


def engine_names() -> list[str]:
    """Every registered engine name, built-ins first."""
    return list(_ENGINES)


def engine_spec(name: str) -> EngineSpec:
    """The registered engine ``name``; a `KeyError` naming the key and the choices otherwise."""
    spec = _ENGINES.get(str(name))
    if spec is None:
        raise KeyError(
            f"`actor_rollout_ref.rollout.name`={name!r}: no such rollout engine; use one of {engine_names()} "
            "(or register one: fusedrl.workers.rollout.registry.register_engine in a module named in "
            "algorithm.custom_modules)"
        )
    return spec


def engine_traits(name: str) -> EngineTraits:
    """The traits of the registered engine ``name`` (see `engine_spec`)."""
    return engine_spec(name).traits


def engines_with(trait: str) -> list[str]:
    """The registered engines that have ``trait`` (an `EngineTraits` field), for error messages."""
    return [name for name, spec in _ENGINES.items() if getattr(spec.traits, trait)]


def requirement_fails(traits: EngineTraits) -> str | None:
    """Why the engine's ``requires`` module does not import here (None when it does, or needs nothing).
    An import, not a lookup: a broken binary companion fails too."""
    if traits.requires is None:
        return None
    import importlib

    try:
        importlib.import_module(traits.requires)
    except Exception as err:  # ImportError, or a broken binary companion (torchcodec, ...)
        return f"{type(err).__name__}: {err}"
    return None
