"""What a fused worker tells the driver about itself while it is busy: its memory and its stacks.

The two methods run in their own Ray concurrency group (`HEALTH_GROUP`), on a thread of their own, so
the driver gets an answer while the worker's main work is blocked (in a collective, a hung kernel, a
sleep). The driver polls `health_report` during every remote wait (see ``WorkerGroup``), so when a worker
later dies it can say how much memory that worker held last; `dump_stacks` is asked for when a phase
times out, so the error shows where the worker hangs.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

from fusedrl.workers.memory import peak_rss_gb, rss_gb

HEALTH_GROUP = "health"


class HealthReporter:
    """What a worker the driver's ``WorkerGroup`` monitors answers, as an object the worker holds: its
    ``health_report`` / ``dump_stacks`` remote methods (in the `HEALTH_GROUP` concurrency group) delegate
    here. ``owner``: the worker, whose running methods `dump_stacks` looks for."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def health_report(self) -> dict[str, Any]:
        """pid, node, host RSS now and at its peak (GB = 1e9 bytes), wall-clock time of the report."""
        return {
            "pid": os.getpid(),
            "node": socket.gethostname(),
            "rss_gb": rss_gb(),
            "peak_rss_gb": peak_rss_gb(),
            "time": time.time(),
        }

    def dump_stacks(self) -> str:
        """The Python stacks of the threads running this worker's methods (all other threads when none is:
        the hang is then outside a method). The reporting thread itself is left out."""
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        frames = {tid: f for tid, f in sys._current_frames().items() if tid != me}

        def runs_a_method(frame: Any) -> bool:
            while frame is not None:
                if frame.f_locals.get("self") is self.owner:
                    return True
                frame = frame.f_back
            return False

        busy = {tid: f for tid, f in frames.items() if runs_a_method(f)} or frames
        parts = []
        for tid, frame in busy.items():
            stack = "".join(traceback.format_stack(frame))
            parts.append(f"Thread {names.get(tid) or tid} (pid {os.getpid()}):\n{stack}")
        return "\n".join(parts)
