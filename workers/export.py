"""Export a trained policy as a Hugging Face model folder (weights as safetensors + config/tokenizer files).

Collective for FSDP2 models: every rank iterates the full tensors (one all-gather each); rank 0 writes, at
most one shard of gathered tensors in memory at a time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from fusedrl.lora import base_name
from fusedrl.workers.checkpoint_io import save_safetensors, tied_aliases, write_json
from fusedrl.workers.fsdp import stream_full_tensors
from fusedrl.workers.lora import save_adapter

DEFAULT_MAX_SHARD_BYTES = 1 << 30

# Files copied next to the exported weights so the folder is a complete HF model.
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tokenizer.model",
)


# ---------------------------------------------------------------------- HF export
class HFShardWriter:
    """Writes ``(name, tensor)`` pairs into HF safetensors shards of at most ``max_shard_bytes`` each.

    Holds at most one shard's worth of tensors: when the next tensor would overflow the current shard, the
    shard is saved and freed. `close` names the files ``model.safetensors`` (one shard) or
    ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``.
    """

    def __init__(
        self, out_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: torch.dtype | None = None
    ) -> None:
        self.out_dir = out_dir
        self.max_shard_bytes = int(max_shard_bytes)
        self.dtype = dtype
        os.makedirs(out_dir, exist_ok=True)
        for name in os.listdir(out_dir):  # never mix with weights of an earlier export
            if name.startswith("model") and (name.endswith(".safetensors") or name.endswith(".index.json")):
                os.remove(os.path.join(out_dir, name))
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach()
        if self.dtype is not None and t.is_floating_point():
            t = t.to(self.dtype)
        t = t.to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = t
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        if not self._buffer:
            return
        path = os.path.join(self.out_dir, f"model.part{len(self._files):05d}.safetensors")
        save_safetensors(self._buffer, path)
        self._files.append((path, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> list[str]:
        """Save the last shard, give the files their final names and write the index. Returns the files."""
        self._flush()
        if not self._files:
            raise ValueError("HFShardWriter: no tensors were written")
        n = len(self._files)
        if n == 1:
            final = os.path.join(self.out_dir, "model.safetensors")
            os.replace(self._files[0][0], final)
            return [final]
        weight_map: dict[str, str] = {}
        finals = []
        for k, (path, names) in enumerate(self._files, start=1):
            fname = f"model-{k:05d}-of-{n:05d}.safetensors"
            os.replace(path, os.path.join(self.out_dir, fname))
            finals.append(os.path.join(self.out_dir, fname))
            weight_map.update(dict.fromkeys(names, fname))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(index, os.path.join(self.out_dir, "model.safetensors.index.json"))
        return finals


def copy_hf_side_files(src_model_dir: str, out_dir: str, dtype: torch.dtype | None = None) -> list[str]:
    """Copy config, generation config and tokenizer files (those present) from ``src_model_dir``."""
    copied = []
    for name in HF_SIDE_FILES:
        src = os.path.join(src_model_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out_dir, name))
            copied.append(name)
    if "config.json" not in copied:
        raise FileNotFoundError(f"{src_model_dir} has no config.json; pass the original HF model folder")
    if dtype is not None:
        path = os.path.join(out_dir, "config.json")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        dtype_name = str(dtype).removeprefix("torch.")
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = dtype_name
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
    return copied


_STACKED_EXPERTS = re.compile(r"^(?P<block>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def _source_tensor_names(model_dir: str) -> frozenset[str]:
    """The tensor names of the source checkpoint's safetensors files (empty when there are none)."""
    from safetensors import safe_open

    names: set[str] = set()
    if os.path.isdir(model_dir):
        for fname in sorted(os.listdir(model_dir)):
            if fname.endswith(".safetensors"):
                with safe_open(os.path.join(model_dir, fname), framework="pt") as f:
                    names.update(f.keys())
    return frozenset(names)


def _checkpoint_layout(
    name: str, tensor: torch.Tensor, source: frozenset[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` as the source checkpoint stores it. transformers 5 holds a mixture of experts' experts
    stacked (``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows first; ``mlp.experts.down_proj`` [E, H, I]) and
    ``save_pretrained`` writes them one expert at a time (``mlp.experts.{e}.gate_proj.weight`` ...): when the
    source checkpoint does, so does the export (copies of one expert's slices); anything else passes through."""
    m = _STACKED_EXPERTS.match(name)
    if m is None or tensor.dim() != 3 or f"{m['block']}.0.down_proj.weight" not in source:
        yield name, tensor
        return
    block, experts = m["block"], tensor.shape[0]
    if m["proj"] == "down_proj":
        for e in range(experts):
            yield f"{block}.{e}.down_proj.weight", tensor[e].clone()
        return
    half = tensor.shape[1] // 2
    for e in range(experts):
        yield f"{block}.{e}.gate_proj.weight", tensor[e, :half].clone()
        yield f"{block}.{e}.up_proj.weight", tensor[e, half:].clone()


def export_hf(
    model: nn.Module,
    out_dir: str,
    *,
    src_model_dir: str,
    rank: int,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> list[str]:
    """Write the full model as a HF folder in ``out_dir`` (rank 0 writes; returns its files, [] elsewhere).
    ``tensors``: the named full tensors to write instead of the model's own (a LoRA actor's merged
    stream, named as in the base model).

    Collective: every rank iterates `stream_full_tensors` (one all-gather per tensor). Rank 0 keeps at most
    one shard (``max_shard_bytes``) of gathered tensors on CPU before writing it out. Tied aliases are
    skipped (HF re-ties them on load). ``dtype`` casts floating tensors (e.g. ``torch.bfloat16``).
    """
    names = list(model.state_dict().keys())
    aliases = {base_name(a) for a in tied_aliases(model, names)}
    writer = HFShardWriter(out_dir, max_shard_bytes, dtype) if rank == 0 else None
    source = _source_tensor_names(src_model_dir) if rank == 0 else frozenset()
    for name, tensor in stream_full_tensors(model) if tensors is None else tensors:
        if writer is not None and name not in aliases:
            for out_name, out in _checkpoint_layout(name, tensor, source):
                writer.add(out_name, out)
        del tensor
    if writer is None:
        return []
    files = writer.close()
    copy_hf_side_files(src_model_dir, out_dir, dtype)
    return files


def export_policy(
    actor: Any, out_dir: str, src_model_dir: str, rank: int, adapter_dir: str | None = None
) -> list[str]:
    """`export_hf` of the ``actor``'s policy (under LoRA the adapted modules merged) and, under LoRA with
    ``adapter_dir``, its adapter as a PEFT folder (`WorkerDict.export_hf`; the model must be on the device).
    Collective."""
    files = export_hf(
        actor.model,
        out_dir,
        src_model_dir=src_model_dir,
        rank=rank,
        tensors=actor.stream_weights() if actor.lora else None,
    )
    if adapter_dir is not None:
        if not actor.lora:
            raise ValueError("export_hf(adapter_dir=...): this run trains no LoRA adapter")
        files += save_adapter(actor.model, adapter_dir, rank=rank)
    return files
