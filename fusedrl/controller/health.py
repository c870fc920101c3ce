"""Driver-side diagnosis of a failed worker: was it killed for memory, how much did it hold last, how to
resume. Used by ``WorkerGroup`` when a worker dies or a phase times out."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Any


def resume_command() -> str:
    """The command line that started this driver, to rerun it (``trainer.resume_mode=auto`` resumes)."""
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    if "-c" in argv:  # an inline script: its text is not a command a user can paste
        return f"{shlex.quote(sys.executable)} <the same script> {shlex.join(sys.argv[1:])}".rstrip()
    return shlex.join(argv)


def resume_hint(ckpt_root: str | None) -> str:
    """Two lines: what will be resumed from, and the command that does it."""
    from fusedrl.checkpoint import find_latest_checkpoint

    latest = find_latest_checkpoint(ckpt_root) if ckpt_root else None
    where = f"from {latest}" if latest else "from scratch (no complete checkpoint yet; set trainer.save_freq)"
    return (
        f"To continue, rerun the same command; with trainer.resume_mode=auto it resumes {where}:\n"
        f"  {resume_command()}"
    )


def describe_report(report: dict[str, Any] | None) -> str:
    """``last reported RSS 1.20 GB (peak 1.35 GB) 3 s before ...`` from a worker's `health_report`."""
    if not report:
        return "it reported no memory figures before it died"
    age = max(0.0, time.time() - float(report["time"]))
    return (
        f"its last reported RSS was {report['rss_gb']:.2f} GB (peak {report['peak_rss_gb']:.2f} GB), "
        f"{age:.0f} s before the failure was seen (pid {report['pid']} on {report['node']})"
    )


# Ray's own words when its memory monitor kills a worker (the generic "worker died" text merely lists the
# OOM killer among possible causes, so it is not matched).
_RAY_OOM = re.compile(r"OUT_OF_MEMORY|OutOfMemory|memory monitor|memory pressure|out of memory", re.I)
_KERNEL_OOM = re.compile(
    r"(Out of memory|Memory cgroup out of memory): Killed process (\d+)|oom-kill:.*?pid=(\d+)"
)


def kernel_oom_kill(pid: int) -> bool | None:
    """Whether the kernel log names an OOM kill of ``pid``; ``None`` when the log cannot be read here."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return pid in oom_killed_pids(out.stdout)


def oom_killed_pids(kernel_log: str) -> set[int]:
    """The pids the kernel log says its OOM killer killed (global or cgroup OOM)."""
    return {int(m.group(2) or m.group(3)) for m in _KERNEL_OOM.finditer(kernel_log)}


def memory_diagnosis(err: BaseException, report: dict[str, Any] | None) -> str:
    """Whether a dead worker was killed for memory, from Ray's error and the kernel log, plus its last RSS."""
    text = f"{type(err).__name__}: {err}"
    pid = int(report["pid"]) if report else None
    if pid is None:
        m = re.search(r"\bpid: (\d+)", text)
        pid = int(m.group(1)) if m else None
    if _RAY_OOM.search(text.replace("killed by the OOM killer due to high memory usage", "")):
        verdict = "Ray's memory monitor killed it: the node ran out of host memory."
    else:
        kernel = kernel_oom_kill(pid) if pid is not None and _local(report) else None
        if kernel:
            verdict = f"The kernel's OOM killer killed it (dmesg: OOM kill of pid {pid})."
        elif kernel is None:
            verdict = (
                "Whether it was killed for memory is unknown: Ray reports no OOM kill and the kernel log is not "
                f"readable from here (check `dmesg | grep -i oom` on {report['node'] if report else 'its node'})."
            )
        else:
            verdict = (
                f"Not killed for memory: neither Ray's memory monitor nor the kernel's OOM killer (dmesg) killed "
                f"pid {pid}; it crashed or was killed by a signal (e.g. SIGKILL from outside)."
            )
    return f"{verdict} Memory: {describe_report(report)}."


def _local(report: dict[str, Any] | None) -> bool:
    import socket

    return report is None or report.get("node") == socket.gethostname()


def kill_pids(pids: list[int]) -> None:
    """SIGKILL local worker processes (the second-signal path, where there is no time to ask Ray)."""
    import signal

    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def wait_pids_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until these local processes have exited (zombies count as gone); returns those still alive."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive:
        alive = [p for p in alive if _running(p)]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return alive


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
