"""Offline export of a training checkpoint to a Hugging Face model folder (one process, no Ray, no GPU).

    python -m fusedrl.trainer.export --ckpt DIR/global_step_N --model_path ORIGINAL_HF_DIR --out OUT_DIR

Reads every ``actor/rank_*.safetensors`` local shard, reassembles each full tensor by concatenating the
ranks' shards along the recorded shard dimension in rank order (FSDP2 splits with ``torch.chunk``
semantics: trailing ranks may hold fewer rows or none) and checks it against the recorded full shape. Full
tensors are written one at a time into bounded safetensors shards, with config, generation config and
tokenizer files copied from the original model folder. The result loads with
``AutoModelForCausalLM.from_pretrained`` and ``vllm.LLM``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import torch
from safetensors import safe_open

from fusedrl.checkpoint import ACTOR_DIR, CheckpointError, checkpoint_problem
from fusedrl.workers.checkpoint_io import MODEL_PREFIX, read_sidecar
from fusedrl.workers.export import DEFAULT_MAX_SHARD_BYTES, HFShardWriter, copy_hf_side_files
from fusedrl.workers.fsdp import to_dtype

_RANK_FILE = re.compile(r"^rank_(\d+)\.safetensors$")


def assemble_full_tensor(
    pieces: Sequence[torch.Tensor], placement: dict[str, Any], full_shape: Sequence[int], name: str = "tensor"
) -> torch.Tensor:
    """The full tensor from the ranks' local pieces (rank order), checked against ``full_shape``."""
    if placement["kind"] == "replicate":
        full = pieces[0]
    elif placement["kind"] == "shard":
        full = torch.cat(list(pieces), dim=int(placement["dim"]))
    else:
        raise CheckpointError(f"{name}: unknown placement {placement!r}")
    if list(full.shape) != list(full_shape):
        raise CheckpointError(
            f"{name}: reassembled shape {list(full.shape)} != recorded full shape {list(full_shape)} "
            f"(local shapes {[list(p.shape) for p in pieces]})"
        )
    return full


def _rank_prefixes(actor_dir: str) -> list[str]:
    if not os.path.isdir(actor_dir):
        raise CheckpointError(f"{actor_dir} does not exist: not a fusedrl checkpoint directory?")
    ranks = sorted(int(m.group(1)) for m in map(_RANK_FILE.match, os.listdir(actor_dir)) if m)
    if not ranks:
        raise CheckpointError(f"{actor_dir} holds no rank_<r>.safetensors files")
    if ranks != list(range(len(ranks))):
        raise CheckpointError(f"{actor_dir}: rank files {ranks} are not 0..{len(ranks) - 1}")
    return [os.path.join(actor_dir, f"rank_{r}") for r in ranks]


def export_checkpoint(
    ckpt_dir: str,
    model_path: str,
    out_dir: str,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: str | None = None,
    allow_incomplete: bool = False,
    role: str = ACTOR_DIR,
) -> list[str]:
    """Export checkpoint ``ckpt_dir`` (a ``global_step_N`` directory) as a HF folder in ``out_dir``.

    ``model_path`` is the original HF folder the run started from (config and tokenizer are copied from it).
    ``dtype`` (e.g. ``"bfloat16"``) casts floating tensors; default: as trained. ``role`` picks the
    sub-directory (``actor``). Returns the weight files.
    """
    ckpt_dir = os.fspath(ckpt_dir)
    problem = checkpoint_problem(ckpt_dir)
    if problem is not None and not allow_incomplete:
        raise CheckpointError(f"{ckpt_dir} is not a complete checkpoint: {problem}")
    prefixes = _rank_prefixes(os.path.join(ckpt_dir, role))
    metas = [read_sidecar(p) for p in prefixes]
    world = len(prefixes)
    for prefix, meta in zip(prefixes, metas):
        if int(meta["world_size"]) != world:
            raise CheckpointError(
                f"{prefix}.json says world size {meta['world_size']} but {world} rank files are present"
            )
        if [e["name"] for e in meta["entries"]] != [e["name"] for e in metas[0]["entries"]]:
            raise CheckpointError(f"{prefix}.json lists different tensors than {prefixes[0]}.json")

    if metas[0].get("trainable_only"):
        raise CheckpointError(
            f"{ckpt_dir} holds only a LoRA adapter (the base weights are the run's model.path): export it "
            "from the run, with actor_rollout_ref.actor.checkpoint.save_contents including hf_model (a merged "
            "folder per checkpoint), or resume it and call PPOTrainer.export_hf(out_dir, adapter_dir)"
        )
    cast = to_dtype(dtype) if dtype else None
    writer = HFShardWriter(out_dir, max_shard_bytes, cast)
    with contextlib.ExitStack() as stack:
        files = [
            stack.enter_context(safe_open(p + ".safetensors", framework="pt", device="cpu")) for p in prefixes
        ]
        for entry in metas[0]["entries"]:
            name = entry["name"]
            pieces = [f.get_tensor(MODEL_PREFIX + name) for f in files]
            writer.add(name, assemble_full_tensor(pieces, entry["placement"], entry["full_shape"], name))
            del pieces
    written = writer.close()
    copy_hf_side_files(model_path, out_dir, cast)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Export a fusedrl checkpoint to a Hugging Face model folder.")
    p.add_argument("--ckpt", required=True, help="checkpoint directory, e.g. .../global_step_100")
    p.add_argument("--model_path", required=True, help="the original HF model folder (config, tokenizer)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--max_shard_gb", type=float, default=DEFAULT_MAX_SHARD_BYTES / (1 << 30))
    p.add_argument("--dtype", default=None, help="cast floating weights, e.g. bfloat16 (default: as trained)")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        files = export_checkpoint(
            args.ckpt,
            args.model_path,
            args.out,
            max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
            dtype=args.dtype,
        )
    except (CheckpointError, FileNotFoundError) as err:
        print(f"fusedrl.export: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(files)} weight file(s) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
