"""How the driver explains a dead worker: killed for memory or not, and the memory it held last."""

from __future__ import annotations

import os
import time

from fusedrl.controller.health import memory_diagnosis, oom_killed_pids

# The text Ray gives for any worker that vanished: it lists the OOM killer as one *possible* cause.
RAY_GENERIC = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: WorkerDict\n\tpid: {pid}\n"
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
    "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the "
    "process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called"
)


def _report(pid: int) -> dict:
    import socket

    return {
        "pid": pid,
        "node": socket.gethostname(),
        "rss_gb": 3.21,
        "peak_rss_gb": 4.5,
        "time": time.time() - 2,
    }


def test_kernel_log_lines_of_global_and_cgroup_oom_kills():
    log = "\n".join(
        [
            "[ 812.1] python invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0",
            "[ 812.2] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,"
            "task_memcg=/user.slice,task=ray::WorkerDict,pid=4242,uid=0",
            "[ 812.3] Out of memory: Killed process 4242 (ray::WorkerDict) total-vm:9000kB, anon-rss:8000kB",
            "[ 900.0] Memory cgroup out of memory: Killed process 777 (python) total-vm:1kB",
            "[ 901.0] python[999]: segfault at 0 ip 0 sp 0 error 4",
        ]
    )
    assert oom_killed_pids(log) == {4242, 777}


def test_ray_memory_monitor_kill_is_named():
    err = RuntimeError(
        "Task was killed due to the node running low on memory. Worker exit type: NODE_OUT_OF_MEMORY"
    )
    text = memory_diagnosis(err, _report(123))
    assert (
        text.startswith("Ray's memory monitor killed it")
        and "last reported RSS was 3.21 GB (peak 4.50 GB)" in text
    )


def test_signal_kill_is_not_called_an_oom_and_rss_is_named():
    pid = os.getpid()  # a pid the kernel log names in no OOM kill
    text = memory_diagnosis(RuntimeError(RAY_GENERIC.format(pid=pid)), _report(pid))
    assert "memory monitor killed it" not in text and "OOM killer killed it" not in text, text
    # dmesg is readable as root (CI); elsewhere the verdict says the log could not be read.
    assert text.startswith(("Not killed for memory", "Whether it was killed for memory is unknown")), text
    assert f"pid {pid}" in text and "3.21 GB" in text


def test_no_report_says_so():
    text = memory_diagnosis(RuntimeError(RAY_GENERIC.format(pid=1)), None)
    assert "reported no memory figures" in text
