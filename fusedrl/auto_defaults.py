"""Keys whose best value depends on the hardware: their ``auto`` default, resolved on the worker.

A user who writes verl's keys with their defaults should get the fast path of the machine the models run on,
not float32 and padded rows because those are safe everywhere. These keys default to ``auto``:

* ``fsdp_config.param_dtype`` (actor, ref, critic; SFT's ``model.fsdp_config``): bfloat16 mixed precision
  where the device computes bf16 natively (CUDA, or a CPU with AVX-512 BF16 / AMX:
  `fusedrl.utils.hardware.native_bf16`); elsewhere null, the model dtype (emulated bf16 runs 5-20x slower).
* ``model.use_remove_padding`` (actor and reference; the critic's follows it): packed rows where the role's
  attention runs each packed sequence on its own (fusedrl's CPU attention, FlashAttention-2), padded rows
  where it would attend a packed row through a dense block-diagonal mask (SDPA on CUDA: the update took 1.6x
  as long on an H200; ``sdpa`` / ``eager`` named explicitly).
* ``model.compile_layers`` (and the critic's): on only where the compile is repaid (`COMPILE_RULE`).
* ``rollout.sleep_level``: 2 on CUDA (the engine's weights are discarded while it sleeps: the next stream
  overwrites every one of them anyway, so a host copy is bytes moved twice for nothing), 1 under LoRA (the
  base weights stay, so each sync streams the adapted modules only) and on CPU (vLLM has no sleep mode there:
  nothing is released at either level).

They resolve **in the worker process that holds the model**, not on the driver: a Ray head node may have
another CPU, or no GPU. The ranks of a worker group agree first (`agreed_facts`: bf16 only where every rank
has it), because FSDP2's shards must have one dtype. An explicit value always wins and is never changed
here; ``auto`` is never touched by the driver's switch of explicit bf16 keys (`fusedrl.cpu_dtype`).
The worker keeps one line naming what it chose and why (`describe`); the trainer prints it once at start
(`announce_resolved`) and keeps the values for the few driver decisions that depend on them (batch
balancing, the rollout check's bound); before the workers report, the driver treats ``auto`` conservatively.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fusedrl.role_config import RoleConfigs, expert_parallel_size, records_routed_experts
from fusedrl.sft_role_config import SFTRoleConfigs

logger = logging.getLogger(__name__)

AUTO = "auto"
ARR = "actor_rollout_ref"
# Half-precision dtype names (`fusedrl.workers.fsdp.DTYPES`): the compute dtypes compiled layers pay off in.
HALF_DTYPES = ("bfloat16", "bf16", "float16", "fp16")
# Compiled decoder layers: measured on a 2-core AVX-512 BF16 EPYC (benchmarks/results_archive/2026-12.md,
# 2026-12-04), the first GRPO step took 32.8 s compiled against 1.95 s warm and the dynamic-shape recompile
# ~2 s more, while a warm packed bf16 step gained ~0.25 s (update 0.88 vs 1.05 s, reference 0.27 vs 0.35 s):
# even at about 130 steps. Padded bf16 rows gained nothing on a 135M model and float32 under an AVX2 cap gained
# nothing, hence packed half precision only, and twice the break-even (a slower machine gains less a step).
COMPILE_MIN_STEPS = 300
COMPILE_RULE = (
    f"compile_layers=auto compiles with packed rows, bf16/fp16 compute and >= {COMPILE_MIN_STEPS} planned "
    "steps (not with LoRA, Ulysses, expert parallelism, or without a C++ compiler on CPU)"
)


@dataclass(frozen=True, kw_only=True)
class DeviceFacts:
    """What the resolution reads about the device a worker computes on."""

    device: str  # e.g. "CPU <name> (avx512_bf16, ...)" or "CUDA device <name>" (`native_bf16`'s words)
    cuda: bool
    native_bf16: bool
    flash_attn: bool  # a CUDA device and the flash-attn package
    missing_cxx: str | None  # on CPU: the C++ compiler Inductor would call, when it is not on PATH


def local_facts(detect: Callable[[], tuple[bool, str]] | None = None) -> DeviceFacts:
    """This process's `DeviceFacts`; ``detect`` replaces `fusedrl.utils.hardware.native_bf16` (tests)."""
    import importlib.util

    import torch

    from fusedrl.utils.hardware import missing_cxx, native_bf16

    cuda = torch.cuda.is_available()
    native, device = (detect or native_bf16)()
    return DeviceFacts(
        device=device,
        cuda=cuda,
        native_bf16=bool(native),
        flash_attn=cuda and importlib.util.find_spec("flash_attn") is not None,
        missing_cxx=None if cuda else missing_cxx(),
    )


def agreed_facts(facts: Sequence[DeviceFacts]) -> DeviceFacts:
    """The facts every rank of a group can act on: a capability only where all ranks have it (one rank
    without native bf16 makes the group float32; FSDP2 gathers one dtype)."""
    devices = sorted({f.device for f in facts})
    return DeviceFacts(
        device=devices[0] if len(devices) == 1 else " / ".join(devices),
        cuda=all(f.cuda for f in facts),
        native_bf16=all(f.native_bf16 for f in facts),
        flash_attn=all(f.flash_attn for f in facts),
        missing_cxx=next((f.missing_cxx for f in facts if f.missing_cxx), None),
    )


def group_facts() -> DeviceFacts:
    """`agreed_facts` of every rank of the default process group (collective), or this process's alone
    when no group is running."""
    import torch.distributed as dist

    mine = local_facts()
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return agreed_facts(every)


# ---------------------------------------------------------------------- the rules, one key each
def param_dtype_for(value: str | None, facts: DeviceFacts) -> tuple[str | None, str]:
    """``fsdp_config.param_dtype``: ``(value, why)``; an explicit value comes back as it is."""
    if value != AUTO:
        return value, "explicit"
    if facts.native_bf16:
        return "bfloat16", "native bf16"
    return None, "no native bf16: the model dtype"


def packs_for(value: Any, attn_implementation: str | None, facts: DeviceFacts) -> tuple[bool, str]:
    """``model.use_remove_padding``: packed where the role's attention runs each packed sequence on its own
    (mirrors `fusedrl.workers.fsdp.resolve_attn_implementation`)."""
    if value != AUTO:
        return bool(value), "explicit"
    name = attn_implementation or AUTO
    if name == "flash_attention_2" or (name == AUTO and facts.flash_attn):
        return True, "FlashAttention-2 attends each packed sequence"
    if name == AUTO and not facts.cuda:
        return True, "fusedrl's CPU attention attends each packed sequence"
    where = "SDPA on CUDA without flash-attn" if name == AUTO else f"attn_implementation={name}"
    return False, f"{where} attends a packed row through a dense mask"


def _is_vision_language(path: str) -> bool:
    from fusedrl.models.qwen_vl import is_vision_language_model  # transformers: only where resolved

    return is_vision_language_model(path)


def compiles_for(
    value: Any,
    *,
    packed: bool,
    half: bool,
    planned_steps: int | None,
    lora: bool,
    ulysses: bool,
    facts: DeviceFacts,
    expert_parallel: bool = False,
    routing_replay: bool = False,
    vision_language: bool = False,
) -> tuple[bool, str]:
    """``model.compile_layers``: on only where `COMPILE_RULE` holds; the reason names the first condition
    that failed."""
    if value != AUTO:
        return bool(value), "explicit"
    reasons = [
        (lora, "LoRA"),
        (vision_language, "a vision-language model"),
        (ulysses, "Ulysses"),
        (expert_parallel, "expert parallelism"),
        (routing_replay, "recorded experts (rollout.enable_rollout_routing_replay / record_routed_experts)"),
        (facts.missing_cxx is not None, f"no C++ compiler ({facts.missing_cxx})"),
        (not packed, "padded rows"),
        (not half, "float32 compute"),
        (planned_steps is None, "run length unknown"),
        (planned_steps is not None and planned_steps < COMPILE_MIN_STEPS, f"{planned_steps} planned steps"),
    ]
    failed = next((why for bad, why in reasons if bad), None)
    return (False, failed) if failed else (True, f"{planned_steps} planned steps")


def sleep_level_for(facts: DeviceFacts, *, lora: bool) -> tuple[int, str]:
    """``rollout.sleep_level=auto`` (module docstring)."""
    if not facts.cuda:
        return 1, "no sleep mode on CPU: nothing is released at either level"
    if lora:
        return 1, "LoRA: the base weights stay, each sync streams the adapted modules only"
    return 2, "every sync overwrites the engine's weights: no host copy kept while it sleeps"


def _is_half(param_dtype: str | None, model_dtype: str) -> bool:
    return str(param_dtype or model_dtype) in HALF_DTYPES


# ---------------------------------------------------------------------- whole configs
Chosen = dict[str, tuple[Any, str]]  # dotted key -> (resolved value, why), for the keys that were auto
# Which resolved keys concern a worker holding each role (a worker with the rollout alone reports none).
ROLE_KEYS = {
    "actor": (
        f"{ARR}.actor.fsdp_config.param_dtype",
        f"{ARR}.model.use_remove_padding",
        f"{ARR}.model.compile_layers",
    ),
    "ref": (
        f"{ARR}.ref.fsdp_config.param_dtype",
        f"{ARR}.model.use_remove_padding",
        f"{ARR}.model.compile_layers",
    ),
    "critic": (
        "critic.model.fsdp_config.param_dtype",
        "critic.model.use_remove_padding",
        "critic.model.compile_layers",
    ),
    "rollout": (f"{ARR}.rollout.sleep_level",),
}


def resolve_configs(cfg: Any, facts: DeviceFacts, roles: Iterable[str] | None = None) -> tuple[Any, Chosen]:
    """``cfg`` (`RoleConfigs` or `SFTRoleConfigs`) with every ``auto`` key resolved for ``facts``, and
    what was chosen for the keys of ``roles`` (every role when None). Configs without ``auto`` come back
    equal, so resolving twice is harmless."""
    if isinstance(cfg, SFTRoleConfigs):
        return _resolve_sft(cfg, facts)
    assert isinstance(cfg, RoleConfigs), type(cfg)
    chosen: Chosen = {}

    def pick(key: str, value: Any, rule: Callable[[], tuple[Any, str]]) -> Any:
        if value != AUTO:
            return value
        chosen[key] = rule()
        return chosen[key][0]

    from fusedrl.lora import lora_enabled

    model, actor, ref, critic = cfg.model, cfg.actor, cfg.ref, cfg.critic
    actor_fsdp, ref_fsdp, critic_fsdp = actor.fsdp_config, ref.fsdp_config, critic.model.fsdp_config
    a_dtype = pick(
        f"{ARR}.actor.fsdp_config.param_dtype", actor_fsdp.param_dtype, lambda: param_dtype_for(AUTO, facts)
    )
    r_dtype = pick(
        f"{ARR}.ref.fsdp_config.param_dtype", ref_fsdp.param_dtype, lambda: param_dtype_for(AUTO, facts)
    )
    c_dtype = pick(
        "critic.model.fsdp_config.param_dtype", critic_fsdp.param_dtype, lambda: param_dtype_for(AUTO, facts)
    )
    m_packed = pick(
        f"{ARR}.model.use_remove_padding",
        model.use_remove_padding,
        lambda: packs_for(AUTO, model.attn_implementation, facts),
    )
    c_packed = pick(
        "critic.model.use_remove_padding",
        critic.model.use_remove_padding,
        lambda: packs_for(AUTO, critic.model.attn_implementation, facts),
    )
    steps = cfg.total_steps if cfg.total_steps is not None else cfg.trainer.total_training_steps
    m_compiled = pick(
        f"{ARR}.model.compile_layers",
        model.compile_layers,
        lambda: compiles_for(
            AUTO,
            packed=bool(m_packed),
            half=_is_half(a_dtype, actor_fsdp.model_dtype),
            planned_steps=steps,
            lora=lora_enabled(model),
            ulysses=int(actor.ulysses_sequence_parallel_size) > 1,
            facts=facts,
            expert_parallel=max(expert_parallel_size(actor_fsdp), expert_parallel_size(ref_fsdp)) > 1,
            routing_replay=records_routed_experts(cfg.rollout),
            vision_language=_is_vision_language(model.path),
        ),
    )
    c_compiled = pick(
        "critic.model.compile_layers",
        critic.model.compile_layers,
        lambda: compiles_for(
            AUTO,
            packed=bool(c_packed),
            half=_is_half(c_dtype, critic_fsdp.model_dtype),
            planned_steps=steps,
            lora=False,
            ulysses=int(critic.ulysses_sequence_parallel_size) > 1,
            facts=facts,
        ),
    )
    sleep = pick(
        f"{ARR}.rollout.sleep_level",
        cfg.rollout.sleep_level,
        lambda: sleep_level_for(facts, lora=lora_enabled(model)),
    )
    replace = dataclasses.replace
    resolved = replace(
        cfg,
        model=replace(model, use_remove_padding=m_packed, compile_layers=m_compiled),
        rollout=replace(cfg.rollout, sleep_level=sleep),
        actor=replace(actor, fsdp_config=replace(actor_fsdp, param_dtype=a_dtype)),
        ref=replace(ref, fsdp_config=replace(ref_fsdp, param_dtype=r_dtype)),
        critic=replace(
            critic,
            model=replace(
                critic.model,
                use_remove_padding=c_packed,
                compile_layers=c_compiled,
                fsdp_config=replace(critic_fsdp, param_dtype=c_dtype),
            ),
        ),
    )
    held = set(ROLE_KEYS) if roles is None else set(roles)
    if lora_enabled(model):
        held.discard("ref")  # the LoRA reference is the actor with its adapters off: no model of its own
    wanted = {key for role in held & set(ROLE_KEYS) for key in ROLE_KEYS[role]}
    return resolved, {key: chosen[key] for key in chosen if key in wanted}


def _resolve_sft(cfg: SFTRoleConfigs, facts: DeviceFacts) -> tuple[SFTRoleConfigs, Chosen]:
    fsdp = cfg.model.fsdp_config
    if fsdp.param_dtype != AUTO:
        return cfg, {}
    value, why = param_dtype_for(AUTO, facts)
    replace = dataclasses.replace
    model = replace(cfg.model, fsdp_config=replace(fsdp, param_dtype=value))
    return replace(cfg, model=model), {"model.fsdp_config.param_dtype": (value, why)}


def require_resolved(where: str, **values: Any) -> None:
    """Refuse ``auto`` where a role reads the value (``bool("auto")`` is True): the worker resolves the
    configs before building its roles, `fusedrl.config.role_configs_from_overrides` for tests."""
    left = [name for name, value in values.items() if value == AUTO]
    if left:
        raise ValueError(
            f"{where}: {', '.join(left)}=auto reached the role unresolved; resolve the configs first "
            "(fusedrl.auto_defaults.resolve_configs)"
        )


# ---------------------------------------------------------------------- the start-up line
def yaml_value(value: Any) -> str:
    """A value as the YAML / command line writes it (null, true, bfloat16)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def describe(chosen: Chosen, facts: DeviceFacts) -> str:
    """The one line naming what ``auto`` became on this device, with the reason of each choice; empty when
    nothing was ``auto``. It states the compile rule once, where compile_layers was auto."""
    if not chosen:
        return ""
    parts = [f"{key}={yaml_value(value)} ({why})" for key, (value, why) in chosen.items()]
    rule = f". {COMPILE_RULE}" if any(key.endswith(".compile_layers") for key in chosen) else ""
    return f"fusedrl: auto defaults on {facts.device}: {', '.join(parts)}{rule}"


def report(chosen: Chosen, facts: DeviceFacts) -> dict[str, Any]:
    """What a worker answers the driver: the resolved values by dotted key, and its line."""
    return {"settings": {key: value for key, (value, _) in chosen.items()}, "line": describe(chosen, facts)}


def merge_reports(reports: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The settings of several worker groups (rank 0 of each) and their distinct lines. A key two groups
    resolved differently (pools on different hardware) stays ``auto``: the driver treats it conservatively."""
    settings: dict[str, Any] = {}
    for rep in reports:
        for key, value in rep["settings"].items():
            settings[key] = value if settings.setdefault(key, value) == value else AUTO
    lines = list(dict.fromkeys(str(rep["line"]) for rep in reports if rep["line"]))
    return settings, lines


def announce_resolved(groups: Iterable[Any], out: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Ask rank 0 of each worker group what its ``auto`` keys became, print each distinct line once, and
    return the merged settings (`merge_reports`)."""
    reports = [group.run_rank0(lambda w: w.resolved_defaults.remote()) for group in groups]
    settings, lines = merge_reports(reports)
    for line in lines:
        (out or _print)(line)
    return settings


def _print(line: str) -> None:
    print(line, flush=True)


def driver_value(value: Any, settings: Mapping[str, Any], key: str) -> Any:
    """``key`` as the workers resolved it (``settings``), else ``value``, the driver's typed config's
    (possibly ``auto``: the workers have not reported, or disagreed)."""
    return settings.get(key, value)
