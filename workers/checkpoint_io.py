"""Checkpoint I/O inside a fused worker: this rank's FSDP2 shards + optimizer state, and HF export.

Per rank, `save_fsdp_state` writes two files next to each other (no pickle anywhere):

* ``{prefix}.safetensors``: ``model.{name}`` local shard of every state-dict entry (``DTensor.to_local()``;
  plain buffers as they are), ``optim.{name}.{key}`` every optimizer state tensor of parameter ``name``
  (DTensor states as local shards, scalar ``step`` counters as they are), ``rng.torch_cpu`` (and
  ``rng.torch_cuda``) as uint8 tensors.
* ``{prefix}.json``: the sidecar: world size and rank, the entries in state-dict order with full shape,
  local shape, dtype and placement (so an offline tool can reassemble full tensors exactly), tied-weight
  aliases, optimizer class, param-group hyperparameters with parameter names, python/numpy RNG, ``extra``.

FSDP2 shards a parameter on dim 0 with ``torch.chunk`` semantics: every rank but the last few holds
``ceil(n / W)`` rows, the rest hold what is left (possibly nothing). ``to_local()`` returns exactly those rows
(the padding lives outside the view), so concatenating the ranks' local shards in rank order gives the full
tensor; the recorded full shape lets the reassembly check itself.

Saving and loading are local (no collectives); `export_hf` is collective.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from fusedrl.checkpoint import CheckpointError, capture_rng_state, fsync_file, restore_rng_state, shard_prefix

SHARD_FORMAT = "fusedrl.fsdp_shard"
SHARD_FORMAT_VERSION = 1
MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
RNG_CPU_KEY = "rng.torch_cpu"
RNG_CUDA_KEY = "rng.torch_cuda"


# ---------------------------------------------------------------------- helpers
def _placement_record(t: torch.Tensor) -> dict[str, Any]:
    """How ``t`` is laid out across ranks: ``{"kind": "shard", "dim": d}`` or ``{"kind": "replicate"}``."""
    if not isinstance(t, DTensor):
        return {"kind": "replicate"}
    placements = tuple(t.placements)
    if len(placements) != 1:
        raise NotImplementedError(
            f"checkpointing supports a 1-D FSDP mesh; got placements {placements} (HSDP is not supported)"
        )
    p = placements[0]
    if isinstance(p, Shard):
        return {"kind": "shard", "dim": int(p.dim)}
    if isinstance(p, Replicate):
        return {"kind": "replicate"}
    raise NotImplementedError(f"cannot checkpoint a DTensor with placement {p}")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def tied_aliases(model: nn.Module, names: Iterable[str]) -> dict[str, str]:
    """``{alias: first name}`` for state-dict entries that are the same parameter (tied weights)."""
    wanted = set(names)
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name not in wanted:
            continue
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _param_names(model: nn.Module) -> dict[int, str]:
    """``{id(param): fqn}`` (first name of tied parameters), the names optimizer state is keyed by."""
    return {id(p): name for name, p in reversed(list(model.named_parameters(remove_duplicate=False)))}


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share storage; clone the second and later users of a storage."""
    seen: set[int] = set()
    out = {}
    for key, t in tensors.items():
        if t.numel() == 0:
            out[key] = t
            continue
        ptr = t.untyped_storage().data_ptr()
        out[key] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def _json_value(key: str, value: Any, where: str) -> Any:
    if isinstance(value, tuple):
        value = list(value)
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where}: {key}={value!r} is not JSON-serialisable; cannot checkpoint it") from e
    return value


def save_safetensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    save_file(_unshare(tensors), path, metadata={"format": "pt"})
    fsync_file(path)


def write_json(obj: Any, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ---------------------------------------------------------------------- save
def save_fsdp_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path_prefix: str,
    extra: dict[str, Any] | None = None,
    *,
    trainable_only: bool = False,
) -> dict[str, int]:
    """Write this rank's local shards, optimizer state and RNG to ``{path_prefix}.safetensors`` + ``.json``.

    Local only (no collectives); every rank calls it with its own prefix. ``extra`` must be JSON-serialisable
    and comes back from `load_fsdp_state`. ``trainable_only``: only the parameters that require gradients
    (LoRA adapters; the frozen base is rebuilt from the model folder). Returns ``{"bytes": size of the
    tensor file}``.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path_prefix)), exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    entries = []
    state = _saved_state(model, trainable_only)
    aliases = tied_aliases(model, state.keys())
    for name, value in state.items():
        if name in aliases:
            continue
        local = _to_cpu(_local(value))
        tensors[MODEL_PREFIX + name] = local
        entries.append(
            {
                "name": name,
                "full_shape": list(value.shape),
                "local_shape": list(local.shape),
                "dtype": str(value.dtype).removeprefix("torch."),
                "placement": _placement_record(value),
            }
        )
    del state

    optim_meta: dict[str, Any] | None = None
    if optimizer is not None:
        names = _param_names(model)
        groups = []
        state_keys: dict[str, dict[str, Any]] = {}
        for gi, group in enumerate(optimizer.param_groups):
            params = []
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(
                        "save_fsdp_state: the optimizer holds a parameter that is not in the model"
                    )
                params.append(names[id(p)])
            hyper = {
                k: _json_value(k, v, f"optimizer param_groups[{gi}]")
                for k, v in group.items()
                if k != "params"
            }
            groups.append({"params": params, **hyper})
        for p, pstate in optimizer.state.items():
            name = names[id(p)]
            kinds: dict[str, Any] = {}
            for key, value in pstate.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{OPTIM_PREFIX}{name}.{key}"] = _to_cpu(_local(value))
                    kinds[key] = {"kind": "dtensor" if isinstance(value, DTensor) else "tensor"}
                else:
                    kinds[key] = {
                        "kind": "json",
                        "value": _json_value(key, value, f"optimizer state of {name}"),
                    }
            state_keys[name] = kinds
        optim_meta = {"class": type(optimizer).__name__, "param_groups": groups, "state": state_keys}

    tensors[RNG_CPU_KEY] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors[RNG_CUDA_KEY] = torch.cuda.get_rng_state()
    rng = capture_rng_state()
    sidecar = {
        "format": SHARD_FORMAT,
        "format_version": SHARD_FORMAT_VERSION,
        "rank": _rank(),
        "world_size": _world_size(),
        "entries": entries,
        "trainable_only": trainable_only,
        "aliases": aliases,
        "optimizer": optim_meta,
        "rng": {"python": rng["python"], "numpy": rng["numpy"]},
        "extra": dict(extra or {}),
    }
    json.dumps(sidecar)  # fail before writing anything if ``extra`` is not JSON
    tensor_path = path_prefix + ".safetensors"
    save_safetensors(tensors, tensor_path)
    write_json(sidecar, path_prefix + ".json")
    return {"bytes": os.path.getsize(tensor_path)}


# ---------------------------------------------------------------------- load
def read_sidecar(path_prefix: str) -> dict[str, Any]:
    path = path_prefix + ".json"
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint shard sidecar {path} is missing") from e
    except ValueError as e:
        raise CheckpointError(f"checkpoint shard sidecar {path} is not valid JSON: {e}") from e
    if meta.get("format") != SHARD_FORMAT:
        raise CheckpointError(f"{path} is not a {SHARD_FORMAT} sidecar (format={meta.get('format')!r})")
    if int(meta.get("format_version", -1)) > SHARD_FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {meta['format_version']}; this fusedrl reads up to {SHARD_FORMAT_VERSION}"
        )
    return meta


def _saved_state(model: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """The state-dict entries a checkpoint holds: all, or only trainable parameters."""
    state = model.state_dict()
    if not trainable_only:
        return state
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: value for name, value in state.items() if name in trainable}


def _check_layout(
    model: nn.Module, meta: dict[str, Any], where: str, trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """Raise a `CheckpointError` naming ``where`` unless the checkpoint matches ``model`` on this rank."""
    world, rank = _world_size(), _rank()
    if int(meta["world_size"]) != world or int(meta["rank"]) != rank:
        raise CheckpointError(
            f"{where} was saved by rank {meta['rank']} of {meta['world_size']}; this is rank {rank} of {world}. "
            "Resume with the same number of workers, or export it (python -m fusedrl.trainer.export) and "
            "start a new run from the exported model"
        )
    if bool(meta.get("trainable_only", False)) != trainable_only:
        saved_kind = "only the LoRA adapter" if meta.get("trainable_only") else "every parameter"
        raise CheckpointError(
            f"{where} holds {saved_kind}; this run "
            + ("trains a LoRA adapter" if trainable_only else "trains every parameter (lora_rank=0)")
            + ". Resume with the actor_rollout_ref.model.lora_* settings of the run that wrote it"
        )
    state = _saved_state(model, trainable_only)
    aliases = tied_aliases(model, state.keys())
    expected = [n for n in state if n not in aliases]
    saved = [e["name"] for e in meta["entries"]]
    if saved != expected:
        missing = sorted(set(expected) - set(saved))
        unexpected = sorted(set(saved) - set(expected))
        raise CheckpointError(
            f"{where} does not match the model's parameters: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
            + ("" if missing or unexpected else " (same names, different order)")
        )
    for entry in meta["entries"]:
        value = state[entry["name"]]
        local = _local(value)
        dtype = str(value.dtype).removeprefix("torch.")
        if (
            list(value.shape) != entry["full_shape"]
            or list(local.shape) != entry["local_shape"]
            or dtype != entry["dtype"]
        ):
            raise CheckpointError(
                f"{where}: {entry['name']} was saved as {entry['dtype']} {entry['full_shape']} "
                f"(local {entry['local_shape']}); the model has {dtype} {list(value.shape)} (local {list(local.shape)})"
            )
    return state


@torch.no_grad()
def load_fsdp_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path_prefix: str,
    *,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Load what `save_fsdp_state` wrote into ``model``/``optimizer`` in place; restore RNG; return ``extra``.

    Local only (no collectives). Checks world size, rank, parameter names, shapes and dtypes first and raises
    a `CheckpointError` naming the file on any mismatch, before touching the model.
    """
    meta = read_sidecar(path_prefix)
    tensor_path = path_prefix + ".safetensors"
    if not os.path.isfile(tensor_path):
        raise CheckpointError(f"checkpoint shard {tensor_path} is missing")
    state = _check_layout(model, meta, tensor_path, trainable_only)
    optim_meta = meta.get("optimizer")
    if optimizer is not None and optim_meta is None:
        raise CheckpointError(f"{tensor_path} holds no optimizer state")
    if optimizer is not None and optim_meta["class"] != type(optimizer).__name__:
        raise CheckpointError(
            f"{tensor_path} holds {optim_meta['class']} state; the optimizer is {type(optimizer).__name__}"
        )

    with safe_open(tensor_path, framework="pt", device="cpu") as f:
        keys = set(f.keys())
        _check_tensors(model, optimizer, meta, f, keys, tensor_path)  # everything, before any copy
        for entry in meta["entries"]:
            name = entry["name"]
            _local(state[name]).copy_(f.get_tensor(MODEL_PREFIX + name))
        del state
        if optimizer is not None:
            _load_optimizer(model, optimizer, optim_meta, f)
        torch.set_rng_state(f.get_tensor(RNG_CPU_KEY))
        if RNG_CUDA_KEY in keys and torch.cuda.is_available():
            torch.cuda.set_rng_state(f.get_tensor(RNG_CUDA_KEY))
    restore_rng_state(meta.get("rng", {}))
    return dict(meta.get("extra", {}))


def _check_tensors(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    meta: dict[str, Any],
    f: Any,
    keys: set[str],
    where: str,
) -> None:
    """Every tensor the load needs is in the file with the right shape; optimizer groups match."""

    def shape(key: str) -> list[int]:
        if key not in keys:
            raise CheckpointError(f"{where} lacks tensor {key}")
        return list(f.get_slice(key).get_shape())

    for entry in meta["entries"]:
        key = MODEL_PREFIX + entry["name"]
        if shape(key) != entry["local_shape"]:
            raise CheckpointError(
                f"{where}: {key} has shape {shape(key)}, the sidecar says {entry['local_shape']}"
            )
    shape(RNG_CPU_KEY)
    if optimizer is None:
        return
    optim_meta = meta["optimizer"]
    names = _param_names(model)
    current = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    saved = [list(g["params"]) for g in optim_meta["param_groups"]]
    if current != saved:
        raise CheckpointError(
            f"{where}: the optimizer's parameter groups differ from the saved ones "
            f"({[len(g) for g in saved]} saved vs {[len(g) for g in current]} parameters per group)"
        )
    by_name = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
    for name, kinds in optim_meta["state"].items():
        if name not in by_name:
            raise CheckpointError(
                f"{where} has optimizer state for {name}, which the optimizer does not hold"
            )
        param = by_name[name]
        for key, kind in kinds.items():
            if kind["kind"] == "json":
                continue
            tkey = f"{OPTIM_PREFIX}{name}.{key}"
            got = shape(tkey)
            if kind["kind"] == "dtensor":
                if not isinstance(param, DTensor):
                    raise CheckpointError(f"{where}: {tkey} is a sharded state but {name} is not a DTensor")
                want = list(param.to_local().shape)
                if got != want:
                    raise CheckpointError(
                        f"{where}: {tkey} has local shape {got}, the parameter's shard is {want}"
                    )


def _load_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, optim_meta: dict[str, Any], f: Any
) -> None:
    """Rebuild ``optimizer.state_dict()`` from the file (DTensor states from local shards) and load it."""
    names = _param_names(model)
    by_name = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
    index = {
        name: i for i, name in enumerate(names[id(p)] for g in optimizer.param_groups for p in g["params"])
    }
    opt_state: dict[int, dict[str, Any]] = {}
    for name, kinds in optim_meta["state"].items():
        param = by_name[name]
        entry: dict[str, Any] = {}
        for key, kind in kinds.items():
            if kind["kind"] == "json":
                entry[key] = kind["value"]
                continue
            value = f.get_tensor(f"{OPTIM_PREFIX}{name}.{key}")
            if kind["kind"] == "dtensor":
                value = DTensor.from_local(
                    value.to(param.device),
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
            entry[key] = value
        opt_state[index[name]] = entry
    groups = []
    for g_saved, g_now in zip(optim_meta["param_groups"], optimizer.param_groups):
        group = {k: v for k, v in g_saved.items() if k != "params"}
        for k, v in group.items():  # JSON turned tuples (betas) into lists
            if isinstance(g_now.get(k), tuple) and isinstance(v, list):
                group[k] = tuple(v)
        group["params"] = [index[n] for n in g_saved["params"]]
        groups.append(group)
    optimizer.load_state_dict({"state": opt_state, "param_groups": groups})


def save_role_shards(actor: Any, critic: Any, ckpt_dir: str, rank: int) -> dict[str, float]:
    """This rank's shards of the ``actor`` (and ``critic``, if not None) with their optimizer state and the RNG
    state, under ``ckpt_dir`` (`WorkerDict.save_checkpoint`; the models must be on the device). No
    collectives. Under LoRA the actor's trainable parameters only (the base is ``model.path``)."""
    info = save_fsdp_state(
        actor.model,
        actor.optimizer,
        shard_prefix(ckpt_dir, rank, "actor"),
        extra={"num_skipped_steps": actor.stepper.num_skipped},
        trainable_only=actor.lora,
    )
    nbytes = info["bytes"]
    if critic is not None:
        prefix = shard_prefix(ckpt_dir, rank, "critic")
        nbytes += save_fsdp_state(critic.model, critic.optimizer, prefix)["bytes"]
    return {"checkpoint/shard_mb": nbytes / 1e6}


def load_role_shards(actor: Any, critic: Any, ckpt_dir: str, rank: int) -> None:
    """Restore what `save_role_shards` wrote, the actor's count of skipped steps included."""
    extra = load_fsdp_state(
        actor.model, actor.optimizer, shard_prefix(ckpt_dir, rank, "actor"), trainable_only=actor.lora
    )
    actor.stepper.num_skipped = int(extra.get("num_skipped_steps", 0))
    if critic is not None:
        load_fsdp_state(critic.model, critic.optimizer, shard_prefix(ckpt_dir, rank, "critic"))
