"""How fusedrl treats each key of verl's ``ppo_trainer`` config, so a verl command line runs unchanged.

Both of verl's layouts load: the one of verl commit b178a3cd5 (2026-01, ``reward_model.*``,
``custom_reward_function.*``, ``critic.model.fsdp_config.*``) and the one of verl main (``reward.*``,
``critic.fsdp.*``, ``trainer.v1.*``, ``model_engine``, ``ray_kwargs.ray_init.*``). A verl key is, in fusedrl:

- **in the YAML** (``trainer/config/ppo_trainer.yaml``): implemented or passed to the component it
  configures; the command line sets it as usual;
- **mapped** (`LAYOUT_RENAMES`, `LAYOUT_KEYS`, `RENAMED`, `translate`): verl's other name of a fusedrl
  key, rewritten before anything else. A command line that sets one setting under both names
  (``reward.reward_manager.name`` and ``reward_model.reward_manager``) is a problem naming the two keys;
- **accepted with no effect** (`NO_EFFECT`, each with the reason): the override is dropped, and the loader
  prints one console line naming every such key and why;
- **refused** (`REFUSED`, `rejected_value`): a value fusedrl cannot honour (Megatron, sglang, distillation,
  QAT, another config name) is a config problem, reported with the others before anything starts.

``+key`` overrides that nothing reads are kept and named in the same console line; ``+`` keys under the
open mappings (`OPEN_MAPPINGS`: reward keyword arguments, ``ray.init`` keyword arguments) are read. The
list of verl's keys lives in ``trainer/config/verl_ppo_trainer_keys.txt`` (``scripts/verl_keys.py``
writes it from a verl checkout); ``docs/verl_compat.md`` is generated from it and from this module
(``scripts/gen_verl_compat_docs.py``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from fusedrl.verl_key_status import NO_EFFECT, REFUSED

# verl main's layout -> the older one fusedrl's YAML follows. A key under the first prefix is read as the
# same key under the second, then classified as that key is (the console and problems name the key as given).
LAYOUT_RENAMES: tuple[tuple[str, str], ...] = (
    ("critic.fsdp.", "critic.model.fsdp_config."),
    ("reward.custom_reward_function.", "custom_reward_function."),
    ("reward.reward_kwargs.", "reward_model.reward_kwargs."),
    ("reward.sandbox_fusion.", "reward_model.sandbox_fusion."),
    ("ray_kwargs.ray_init.", "trainer.ray_init."),
)
LAYOUT_KEYS: dict[str, str] = {
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.num_workers": "reward_model.num_workers",
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.reward_model.enable_resource_pool": "reward_model.enable_resource_pool",
    "reward.reward_model.n_gpus_per_node": "reward_model.n_gpus_per_node",
    "reward.reward_model.nnodes": "reward_model.nnodes",
}

# verl key -> fusedrl key it sets (same meaning, another name).
RENAMED: dict[str, str] = {
    "ray_kwargs.ray_init.num_cpus": "trainer.ray_num_cpus",
    # verl's loop names (single_turn_agent, tool_agent) are loop names in fusedrl too
    "actor_rollout_ref.rollout.agent.default_agent_loop": "actor_rollout_ref.rollout.multi_turn.default_agent_name",
    "reward_model.reward_kwargs.max_resp_len": "reward_model.overlong_buffer.max_resp_len",
}

# verl's DAPO scripts pass the overlong shaping as extra reward keyword arguments.
_OVERLONG_PREFIX = "reward_model.reward_kwargs.overlong_buffer_cfg."
_OVERLONG_KEYS = {"enable": "enable", "len": "len", "penalty_factor": "penalty_factor"}
_OVERLONG_NO_EFFECT = {
    "log": "the overlong penalty is always logged (reward/overlong_penalty)",
}

# Open mappings whose `+key` entries are read by fusedrl: keyword arguments of every scoring call, of
# ray.init (each name checked against ray.init's parameters before Ray starts).
OPEN_MAPPINGS = ("reward_model.reward_kwargs.", "trainer.ray_init.")

# Engines verl selects with `model_engine=...` (a Hydra config group); fusedrl's is FSDP2 (verl's `dp`).
ENGINES = {"megatron": "Megatron", "veomni": "VeOmni", "torchtitan": "TorchTitan"}


_TRAINER_MODES = {"sync": 0, "separate_async": 1}

# The docs' status of the keys `map_overrides` reads together (not one fusedrl key each).
COMBINED_STATUS: dict[str, tuple[str, str]] = {
    "trainer.v1.trainer_mode": (
        "maps to",
        "`async_training.max_staleness`: sync 0, separate_async 1 (one-step-off); colocate_async is refused",
    ),
    "actor_rollout_ref.rollout.nnodes": (
        "maps to",
        "`trainer.placement`: > 0 gives the rollout a pool of its own (nnodes x rollout.n_gpus_per_node); "
        "0 (verl's default): the rollout runs in the fused workers",
    ),
}


def verl_keys() -> list[str]:
    """Every leaf key of verl's ``ppo_trainer`` config (from ``verl_ppo_trainer_keys.txt``)."""
    from fusedrl.config_base import config_dir

    path = Path(config_dir()) / "verl_ppo_trainer_keys.txt"
    return [
        line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]


def verl_revision() -> str:
    """The verl commit ``verl_ppo_trainer_keys.txt`` was written from (its header says)."""
    from fusedrl.config_base import config_dir

    for line in (Path(config_dir()) / "verl_ppo_trainer_keys.txt").read_text().splitlines():
        if line.startswith("# verl commit "):
            return line[len("# verl commit ") :].split(", written")[0]
    return "unknown"


def legacy_key(key: str) -> str:
    """``key`` in the layout fusedrl's YAML follows (verl main's new names rewritten; others unchanged)."""
    if key in LAYOUT_KEYS:
        return LAYOUT_KEYS[key]
    for new, old in LAYOUT_RENAMES:
        if key.startswith(new):
            return old + key[len(new) :]
    return key


def no_effect_reason(key: str) -> str | None:
    """Why ``key`` has no effect in fusedrl, or None when it is not in `NO_EFFECT`."""
    key = legacy_key(key)
    for pattern, reason in NO_EFFECT:
        if fnmatch.fnmatchcase(key, pattern):
            return reason
    return None


def translate(key: str) -> tuple[str | None, str | None]:
    """``(fusedrl key, None)`` for a verl route fusedrl maps onto its own key; ``(None, reason)`` for a
    route it accepts with no effect; ``(None, None)`` when ``key`` is neither."""
    if key in RENAMED:
        return RENAMED[key], None
    old = legacy_key(key)
    if old in RENAMED:
        return RENAMED[old], None
    if old.startswith(_OVERLONG_PREFIX):
        leaf = old[len(_OVERLONG_PREFIX) :]
        if leaf in _OVERLONG_KEYS:
            return f"reward_model.overlong_buffer.{_OVERLONG_KEYS[leaf]}", None
        return None, _OVERLONG_NO_EFFECT.get(
            leaf, "not an overlong-buffer setting (enable, len, penalty_factor)"
        )
    if old != key:
        return old, None
    return None, None


def refused_when(key: str) -> list[str]:
    """The values of ``key`` that `rejected_value` refuses, as the docs state them."""
    return [when for pattern, _, when, _ in REFUSED if fnmatch.fnmatchcase(key, pattern)]


def engine_of(key: str) -> str | None:
    """The engine a ``*.megatron.*`` / ``*.veomni.*`` / ``*.torchtitan.*`` key configures, else None."""
    return next((ENGINES[part] for part in key.split(".") if part in ENGINES), None)


def engine_problem(engine: str, how: str) -> str:
    return (
        f"{how}: {engine} is not supported; fusedrl trains with FSDP2 (verl's model_engine=dp). Drop "
        f"model_engine and the {engine} keys, and pass the FSDP keys (actor_rollout_ref.actor.fsdp_config.*, "
        "critic.fsdp.*) instead."
    )


def rejected_value(key: str, value: str) -> str | None:
    """A problem line when ``key=value`` asks for something fusedrl cannot run; None otherwise."""
    v = value.strip().strip("'\"").lower()
    old = legacy_key(key)
    for pattern, refused, _, text in REFUSED:
        if fnmatch.fnmatchcase(key, pattern) and refused(v):
            return f"`{key}`={value}: {text}"
    if old.endswith("strategy") and v.startswith("megatron"):
        return (
            f"`{key}`={value}: Megatron is not supported; fusedrl trains with FSDP2 "
            "(drop the key, or set it to fsdp / fsdp2)."
        )
    # verl's FSDP-turbo engine is FSDP2 with plans: fusedrl reads its expert-parallel size (and names the rest)
    if old.endswith("strategy") and v not in ("fsdp", "fsdp2", "fsdp_turbo"):
        return f"`{key}`={value}: use fsdp, fsdp2 or fsdp_turbo (all mean FSDP2 in fusedrl)."
    if old == "critic.model.lora_rank" and v not in ("0", "null", "none"):
        return (
            f"`{key}`={value}: fusedrl's critic has no LoRA. Drop the key (actor LoRA runs with critic-free "
            "estimators such as grpo), or set it to 0."
        )
    unset = v in ("", "null", "none", "~")
    if key == "actor_rollout_ref.rollout.multi_turn.interaction_config_path" and not unset:
        return (
            f"`{key}`={value}: verl's interactions (removed from verl main) are not supported. For a simulated "
            "user or environment subclass fusedrl.agent.Environment, register it with "
            "fusedrl.agent.register_environment in a module listed in algorithm.custom_modules and name it in "
            "the rows' agent_name (docs/agentic.md)."
        )
    if key == "actor_rollout_ref.rollout.multi_turn.function_tool_path" and not unset:
        return (
            f"`{key}`={value}: not supported yet. List each function in the tool YAML instead "
            "(actor_rollout_ref.rollout.multi_turn.tool_config_path, `- class_name: /path/tools.py:my_function`; "
            "the schema comes from its type hints and docstring) and drop verl's @function_tool decorator."
        )
    if key == "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template" and v in (
        "true",
        "1",
        "yes",
    ):
        return (
            f"`{key}`={value}: fusedrl trains on exactly the ids the engine sampled and the observations "
            "rendered once (verl's false); re-rendering turns with the inference template is not supported. "
            "Drop the key or set false."
        )
    if old == "actor_rollout_ref.rollout.name" and v in ("sglang", "trtllm"):
        return (
            f"`{key}`={value}: fusedrl's rollout engines are vllm (in-process) and hf; "
            f"{v} is not supported. Use actor_rollout_ref.rollout.name=vllm."
        )
    return None


def format_no_effect(entries: list[tuple[str, str]]) -> str:
    """One console line: every ignored key, grouped by reason."""
    by_reason: dict[str, list[str]] = {}
    for key, reason in entries:
        by_reason.setdefault(reason, []).append(key)
    groups = "; ".join(f"{', '.join(keys)} ({reason})" for reason, keys in by_reason.items())
    return f"fusedrl: accepted with no effect in fusedrl: {groups}"


def config_name_flags(overrides: list[str]) -> tuple[list[str], list[str]]:
    """Drop verl's ``--config-name ppo_trainer`` / ``--config-path DIR`` flags (fusedrl has one PPO config);
    another config name is a problem."""
    kept: list[str] = []
    problems: list[str] = []
    it = iter(overrides)
    for ov in it:
        flag, eq, value = ov.partition("=")
        if flag not in ("--config-name", "--config-path", "-cn", "-cp"):
            kept.append(ov)
            continue
        if not eq:
            value = next(it, "")
        if flag in ("--config-name", "-cn"):
            name = value.strip("'\"").removesuffix(".yaml")
            engine = next((label for part, label in ENGINES.items() if part in name), None)
            if engine is not None:
                problems.append(
                    engine_problem(engine, f"--config-name {name}").replace(
                        "Drop model_engine",
                        "Use --config-name ppo_trainer (or drop the flag), drop model_engine",
                    )
                )
            elif name not in ("ppo_trainer", "_generated_ppo_trainer"):
                problems.append(
                    f"--config-name {name}: fusedrl's PPO entry point has one config, ppo_trainer. Drop the flag "
                    "and pass that config's keys on the command line."
                )
    return kept, problems


def map_overrides(
    base: DictConfig, overrides: list[str]
) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """Map a verl command line onto fusedrl's keys: ``(overrides to compose, (key, why it has no effect)
    pairs, problems)``. See `fusedrl.verl_compat` for the classification."""
    from fusedrl.config_base import all_keys

    known = set(all_keys(base))
    kept: list[str] = []
    ignored: list[tuple[str, str]] = []
    problems: list[str] = []
    setters: dict[str, str] = {}  # fusedrl key -> the key of the command line that set it
    engine_keys: dict[str, list[str]] = {}  # engine -> its keys on the command line
    combined: dict[str, str] = {}  # keys read together after the loop (model_engine, v1 mode, rollout pool)

    def sets(target: str, key: str) -> None:
        """``key`` sets ``target``: a problem when another key of the command line set it already."""
        other = setters.setdefault(target, key)
        if other != key:
            problems.append(
                f"`{other}` and `{key}` both set `{target}` (verl's two layouts name the same setting); keep one."
            )

    for ov in overrides:
        if ov.startswith(("~", "hydra.")) or "=" not in ov:
            kept.append(ov)
            continue
        lhs, value = ov.split("=", 1)
        plus = lhs[: len(lhs) - len(lhs.lstrip("+"))]
        key = lhs[len(plus) :]
        if key in _COMBINED:
            combined[key] = value
            continue
        engine = engine_of(key)
        if engine is not None:
            engine_keys.setdefault(engine, []).append(key)
            continue
        bad = rejected_value(key, value)
        if bad:
            problems.append(bad)
            continue
        target, reason = translate(key)
        old = target if target is not None and target != key else key
        if target is not None and target in known:
            sets(target, key)
            kept.append(f"{target}={value}")
            continue
        if reason is None and old not in known:
            reason = next((r for r in map(no_effect_reason, _key_and_parents(old)) if r is not None), None)
        if reason is not None:
            ignored.append((key, reason))
            continue
        if old in known:
            sets(old, key)
            kept.append(
                f"{old}={value}" if plus == "+" or old != key else ov
            )  # `+` on a YAML key: just set it
            continue
        if plus or old.startswith(OPEN_MAPPINGS):
            sets(old, key)
            kept.append(f"+{old}={value}")
            if not old.startswith(OPEN_MAPPINGS):
                ignored.append((key, "added with +, but nothing in fusedrl reads it"))
            continue
        kept.append(f"{old}={value}")  # unknown: reported by _unknown_override_keys with a suggestion
    extra_kept, extra_problems = _combine(combined, engine_keys, ignored, sets)
    return [*kept, *extra_kept], ignored, [*problems, *extra_problems]


# Keys map_overrides reads together: verl's engine choice, v1 trainer mode and the rollout's own pool.
_COMBINED = (
    "model_engine",
    "trainer.v1.trainer_mode",
    "actor_rollout_ref.rollout.nnodes",
    "actor_rollout_ref.rollout.n_gpus_per_node",
)


def _combine(
    values: dict[str, str],
    engine_keys: dict[str, list[str]],
    ignored: list[tuple[str, str]],
    sets: Callable[[str, str], None],
) -> tuple[list[str], list[str]]:
    """The overrides and problems of the `_COMBINED` keys and of engine-specific keys."""
    kept: list[str] = []
    problems: list[str] = []

    def plain(key: str) -> str:
        return values[key].strip().strip("'\"").lower()

    engine_named = None
    if "model_engine" in values:
        choice = plain("model_engine")
        if choice in ENGINES:
            engine_named = ENGINES[choice]
            problems.append(engine_problem(engine_named, f"`model_engine`={values['model_engine']}"))
        elif choice in ("dp", "fsdp", "fsdp2"):
            ignored.append(("model_engine", "dp is fusedrl's engine (FSDP2)"))
        else:
            problems.append(f"`model_engine`={values['model_engine']}: use dp (FSDP2, fusedrl's engine).")
    for engine, keys in engine_keys.items():
        if engine != engine_named:  # the model_engine problem covers its own engine's keys
            shown = ", ".join(f"`{k}`" for k in keys[:3]) + (
                f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            )
            problems.append(engine_problem(engine, f"{shown} ({engine} settings)"))

    if "trainer.v1.trainer_mode" in values:
        value = values["trainer.v1.trainer_mode"]
        bad = rejected_value("trainer.v1.trainer_mode", value)
        if bad:
            problems.append(bad)
        else:
            sets("async_training.max_staleness", "trainer.v1.trainer_mode")
            kept.append(f"async_training.max_staleness={_TRAINER_MODES[plain('trainer.v1.trainer_mode')]}")

    nnodes_key, slots_key = "actor_rollout_ref.rollout.nnodes", "actor_rollout_ref.rollout.n_gpus_per_node"
    own_pool = False
    if nnodes_key in values:
        try:
            nnodes = int(plain(nnodes_key))
        except ValueError:
            problems.append(
                f"`{nnodes_key}`={values[nnodes_key]}: use an integer (0: the rollout shares the fused workers)."
            )
            nnodes = 0
        if nnodes > 0:  # verl's standalone rollout: fusedrl's rollout pool of its own (trainer.placement)
            own_pool = True
            slots = values.get(slots_key, "${trainer.n_gpus_per_node}")
            sets("trainer.placement.pools", nnodes_key)
            sets("trainer.placement.roles", nnodes_key)
            kept.append(
                f"trainer.placement.pools={{rollout: {{nnodes: {nnodes}, n_gpus_per_node: {slots}}}}}"
            )
            kept.append("trainer.placement.roles={rollout: rollout}")
        else:
            ignored.append((nnodes_key, "0: the rollout runs in the fused workers"))
    if slots_key in values and not own_pool:
        ignored.append((slots_key, no_effect_reason(slots_key) or ""))
    return kept, problems


def _key_and_parents(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
