"""Config checks of expert parallelism (``fsdp_config.turbo_config.distributed.expert_parallel_size`` of the
actor and of the reference; `fusedrl.workers.expert_parallel`), run by `fusedrl.config_checks.validate`
before Ray starts. A size above 1 is accepted only where it takes effect as tested: a mixture-of-experts
model whose experts split evenly, over the whole data-parallel group of the actor's workers, and none of the
features the expert-parallel layers have not been run with."""

from __future__ import annotations

import json
import os
from typing import Any

from fusedrl.config_sections import check_number
from fusedrl.placement_config import actor_world

KEY = "actor_rollout_ref.{}.fsdp_config.turbo_config.distributed.expert_parallel_size"
# config.json names of the routed-expert count (Qwen2/3-MoE, Mixtral, DeepSeek)
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def num_experts(model_path: str) -> int | None:
    """Routed experts per MoE layer from ``model_path``'s config.json; 0 for a dense model, None when there
    is no local config.json to read."""
    config = _model_config(model_path)
    if config is None:
        return None
    config = config.get("text_config", config)
    return next((int(config[k]) for k in _EXPERT_COUNT_KEYS if config.get(k)), 0)


def _model_config(model_path: str) -> dict[str, Any] | None:
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return dict(json.load(f))


def expert_parallel_problems(run: Any) -> list[str]:
    """The problems of the actor's and the reference's expert-parallel sizes (each names the key and fix);
    ``run``: the typed sections."""
    problems: list[str] = []
    for role, fsdp in (("actor", run.actor.fsdp_config), ("ref", run.ref.fsdp_config)):
        key = KEY.format(role)
        ep = check_number(fsdp.turbo_config.distributed.expert_parallel_size, key, problems)
        if ep is None or ep == 1:
            continue
        if ep < 1:
            problems.append(f"`{key}`={ep}: must be >= 1.")
            continue
        problems.extend(_role_problems(run, key, ep))
    return problems


def _role_problems(run: Any, key: str, ep: int) -> list[str]:
    out: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            out.append(f"`{key}`={ep}: {msg}")

    model_path = str(run.model.path)
    experts = num_experts(model_path)
    if experts is None:
        need(False, f"the model's config.json (`{model_path}`) must be a local file to check its experts.")
    elif experts == 0:
        need(False, "the model has no experts (a dense model). Drop the key or set 1.")
    else:
        need(experts % ep == 0, f"does not divide the model's {experts} experts. Use a divisor of {experts}.")
        vision = "vision_config" in (_model_config(model_path) or {})
        need(not vision, "a vision-language model's experts are not spread (its own FSDP2 wrap). Set 1.")
    slots, nnodes = run.trainer.n_gpus_per_node, run.trainer.nnodes
    world = actor_world(run) or (int(slots) * int(nnodes) if slots and nnodes else None)
    if world is not None:
        need(
            world % ep == 0,
            f"does not divide the actor's data-parallel size ({world} workers). Use {world} or 1.",
        )
        need(
            world % ep != 0 or ep == world,
            f"a group smaller than the actor's {world} workers (experts replicated over several groups) is "
            f"not implemented. Use {world} or 1.",
        )
    lora = run.model.lora_rank
    need(
        not lora,
        "LoRA (`actor_rollout_ref.model.lora_rank` > 0) on expert-parallel experts is not supported. Set "
        "lora_rank=0 or the key to 1.",
    )
    sp = run.actor.ulysses_sequence_parallel_size
    need(
        sp in (None, 1),
        "Ulysses sequence parallelism (`actor_rollout_ref.actor.ulysses_sequence_parallel_size` > 1) has "
        "not been run with expert parallelism. Set it to 1.",
    )
    need(
        run.model.compile_layers is not True,
        "compiled decoder layers (`actor_rollout_ref.model.compile_layers`=true) have not been run with "
        "expert parallelism. Set it to false (or auto).",
    )
    engine = run.rollout.name
    need(
        engine == "vllm",
        f"`actor_rollout_ref.rollout.name`={engine}: expert parallelism is run with the vLLM engine only "
        "(hf and fake generate with the sharded actor itself). Use rollout.name=vllm.",
    )
    return out
