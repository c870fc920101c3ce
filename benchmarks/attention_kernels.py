"""Attention forward+backward on CPU by kernel and length: the measurement behind
`fusedrl.workers.cpu_attention` (which kernel a training forward uses for which inputs).

Compared on one thread, best of ``--reps``, for bf16 and float32, at the small preset's head layout (8 query
heads, 4 key/value heads, head dim 64) with half the rows left-padded by a third of the length:

- ``flash``: SDPA restricted to its flash kernel (what SDPA picks on CPU);
- ``math``: SDPA restricted to its math kernel;
- ``matmul``: `fusedrl.workers.cpu_attention.matmul_attention` (two batched matmuls around a softmax that accumulates in float32);
- ``auto``: `fusedrl.workers.cpu_attention.attention`, what ``attn_implementation=auto`` runs on CPU.

A packed row (``use_remove_padding``) of the same sequences is timed two ways: SDPA over the whole row with
the block-diagonal mask Transformers builds (``packed_sdpa``), and `packed_attention` (``packed_auto``).

    python -m benchmarks.attention_kernels [--reps 3] [--shapes 32x64,32x128,16x256,8x512,4x1024,2x2048]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedrl.workers import cpu_attention

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64


class _Layer(torch.nn.Module):
    """What a Transformers attention function reads from its attention module."""

    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def _inputs(rows: int, length: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    qkv = [
        torch.randn(rows, n, length, HEAD_DIM, generator=g).to(dtype).requires_grad_()
        for n in (HEADS, KV_HEADS, KV_HEADS)
    ]
    keep = torch.ones(rows, length, dtype=torch.bool)
    keep[: rows // 2, : length // 3] = False
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = (causal[None] & keep[:, None, :])[:, None] | torch.eye(length, dtype=torch.bool)  # no empty row
    return qkv, mask


def _time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def padded(kind: str, rows: int, length: int, dtype: torch.dtype, reps: int) -> float:
    (q, k, v), mask = _inputs(rows, length, dtype)
    scale = HEAD_DIM**-0.5

    def run() -> None:
        if kind == "matmul":
            out = cpu_attention.matmul_attention(q, k, v, mask, scaling=scale, causal=True)
        elif kind == "auto":
            out = cpu_attention.attention(_Layer(), q, k, v, mask, scaling=scale)[0]
        else:
            backend = SDPBackend.FLASH_ATTENTION if kind == "flash" else SDPBackend.MATH
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out.float().sum().backward()

    return _time(run, reps)


def packed(kind: str, rows: int, length: int, dtype: torch.dtype, reps: int) -> float:
    """The same rows' real tokens end to end in one row (lengths: full, or two thirds for padded rows)."""
    lengths = [length - (length // 3 if i < rows // 2 else 0) for i in range(rows)]
    n = sum(lengths)
    (q, k, v), _ = _inputs(1, n, dtype)
    position_ids = torch.cat([torch.arange(x) for x in lengths])[None]  # [1, N]
    seg = torch.repeat_interleave(torch.arange(rows), torch.tensor(lengths))
    idx = torch.arange(n)
    mask = ((seg[:, None] == seg[None]) & (idx[None] <= idx[:, None]))[None, None]  # [1, 1, N, N]
    scale = HEAD_DIM**-0.5

    def run() -> None:
        if kind == "packed_auto":
            out = cpu_attention.attention(_Layer(), q, k, v, mask, scaling=scale, position_ids=position_ids)[
                0
            ]
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out.float().sum().backward()

    return _time(run, reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shapes", default="32x64,32x128,16x256,8x512,4x1024,2x2048")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from benchmarks.common import record
    from fusedrl.utils.hardware import native_bf16

    kinds = ("flash", "math", "matmul", "auto", "packed_sdpa", "packed_auto")
    rows_out, payload = [], {}
    for dtype in (torch.bfloat16, torch.float32):
        for shape in a.shapes.split(","):
            rows, length = (int(x) for x in shape.split("x"))
            ms = {}
            for kind in kinds:
                fn = packed if kind.startswith("packed") else padded
                ms[kind] = 1000 * fn(kind, rows, length, dtype, a.reps)
            name = str(dtype).removeprefix("torch.")
            payload[f"{name}/{shape}"] = ms
            rows_out.append(
                f"| {name} | {rows} x {length} | " + " | ".join(f"{ms[k]:.1f}" for k in kinds) + " |"
            )
            print(rows_out[-1], flush=True)
    table = "\n".join(
        [
            f"Attention forward+backward on CPU, one thread, ms (best of {a.reps}); {HEADS} query heads, "
            f"{KV_HEADS} key/value heads, head dim {HEAD_DIM}; half the rows left-padded by a third; "
            f"{native_bf16()[1]}. `auto` = what `attn_implementation=auto` runs on CPU; `packed_*` = the same "
            "sequences' real tokens in one packed row.",
            "",
            "| dtype | rows x tokens | " + " | ".join(kinds) + " |",
            "|" + "---|" * (len(kinds) + 2),
            *rows_out,
        ]
    )
    cmd = f"python -m benchmarks.attention_kernels --reps {a.reps} --shapes {a.shapes}"
    if a.no_record:
        print(table)
    else:
        record("Attention kernels on CPU", cmd, table, payload)


if __name__ == "__main__":
    main()
