"""The prepared GPU check's config (`benchmarks.gpu_check`): ``ppo_trainer.yaml`` plus the check's overrides,
resolved without omegaconf (the GPU machine has none; a test checks the result equals the real loader's),
and the model-name variants (``half_b+packed+compiled``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# A model name may carry variants after ``+``: the config keys they set on top of the check's overrides.
VARIANTS = {
    "packed": ["actor_rollout_ref.model.use_remove_padding=true"],
    "compiled": ["actor_rollout_ref.model.compile_layers=true"],
    # The vLLM rollout (in-process engine, weights streamed in place); sleep level as a user's run resolves it.
    "vllm": ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.sleep_level=auto"],
}


_REF = re.compile(r"^\$\{(\.*[A-Za-z0-9_.]+)\}$")
_EMBEDDED = re.compile(r"\$\{(\.*[A-Za-z0-9_.]+)\}")


def _lookup(cfg: dict[str, Any], dotted: str, where: tuple[str, ...]) -> tuple[Any, tuple[str, ...]]:
    """The node ``dotted`` names and its path: absolute, or relative to the folder of the key at ``where``
    when it starts with dots (OmegaConf's ``${.sibling}``, ``${..uncle}``)."""
    if dotted.startswith("."):
        ups = len(dotted) - len(dotted.lstrip("."))
        parts = (*where[: len(where) - ups], *dotted[ups:].split("."))
    else:
        parts = tuple(dotted.split("."))
    node: Any = cfg
    for part in parts:
        node = node[part]
    return node, parts


def _resolve(node: Any, root: dict[str, Any], where: tuple[str, ...] = ()) -> Any:
    if isinstance(node, dict):
        return {k: _resolve(v, root, (*where, k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, root, where) for v in node]
    if isinstance(node, str) and (m := _REF.match(node)):
        target, path = _lookup(root, m.group(1), where)
        return _resolve(target, root, path)  # a whole-value reference keeps its type
    if isinstance(node, str) and "${" in node:
        return _EMBEDDED.sub(lambda m: str(_resolve(_lookup(root, m.group(1), where)[0], root)), node)
    return node


def _set(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    if leaf not in node:
        raise KeyError(f"gpu_check override `{dotted}`: no such key in ppo_trainer.yaml")
    node[leaf] = value


def compiles_layers(name: str) -> bool:
    """Whether the model name's variants compile the training layers (more steps, a longer timeout)."""
    return "compiled" in name.split("+")[1:]


def split_variants(name: str) -> tuple[str, list[str]]:
    """``"half_b+packed+compiled"`` -> ``("half_b", [overrides of each variant])``."""
    preset, *variants = name.split("+")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"gpu_check: unknown variant(s) {unknown} in {name!r}; known: {sorted(VARIANTS)}")
    return preset, [o for v in variants for o in VARIANTS[v]]


def check_overrides(model_dir: str, *, cuda: bool, response_length: int, n: int) -> list[str]:
    """The check's ``key=value`` overrides of the PPO defaults (every algorithm key set explicitly)."""
    bf16 = "bfloat16" if cuda else "null"  # CPUs without native bf16 emulate it very slowly
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.attn_implementation=sdpa",
        "actor_rollout_ref.rollout.name=hf",
        # The vLLM engine (`+vllm`) in the training dtype: float32 on a CPU (the check's config skips the
        # driver's bf16 -> float32 switch for CPUs without native bf16, where a bf16 engine aborts)
        f"actor_rollout_ref.rollout.dtype={'bfloat16' if cuda else 'float32'}",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.free_cache_engine=true",
        "actor_rollout_ref.rollout.sleep_level=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.actor.fsdp_config.param_offload=false",  # the HF rollout uses the actor's params
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        f"actor_rollout_ref.actor.fsdp_config.param_dtype={bf16}",
        "actor_rollout_ref.ref.fsdp_config.param_offload=true",
        f"actor_rollout_ref.ref.fsdp_config.param_dtype={bf16}",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=true",
        "algorithm.use_kl_in_reward=false",
        "data.train_batch_size=4",
        "data.max_prompt_length=64",
        f"data.max_response_length={response_length}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
    ]


def _yaml_loader() -> Any:
    """PyYAML's safe loader, reading ``1e-4`` as a float as omegaconf and Hydra do (YAML 1.1 does not)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    float_re = r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"""
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(float_re, re.X), list("-+0123456789."))
    return Loader


def resolved_config(overrides: list[str]) -> dict[str, Any]:
    """``ppo_trainer.yaml`` + overrides, interpolations resolved: what `to_plain_dict(load_config(...))`
    gives, without omegaconf (a test checks the two agree)."""
    import yaml

    loader = _yaml_loader()
    cfg = yaml.load((ROOT / "trainer" / "config" / "ppo_trainer.yaml").read_text(), Loader=loader)
    for item in overrides:
        key, value = item.split("=", 1)
        _set(cfg, key, yaml.load(value, Loader=loader))
    return _resolve(cfg, cfg)
