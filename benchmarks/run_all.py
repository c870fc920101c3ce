"""``make bench``: every benchmark below in turn.

Each run (`benchmarks.common.record`) appends its full section to this month's
``benchmarks/results_archive/YYYY-MM.md`` and rewrites its own block of ``benchmarks/RESULTS.md`` (between
``<!-- bench:NAME -->`` markers), so the page shows the figures of the last run of each benchmark and the
blocks of benchmarks not run here (the TRL side-by-side, training passes, ...) stay as they were.
"""

from __future__ import annotations

import subprocess
import sys
import time

BENCHES = [
    ["benchmarks.controller_overhead"],
    ["benchmarks.weight_sync", "--reps", "3"],
    ["benchmarks.rollout_throughput", "--reps", "2"],
    ["benchmarks.step_breakdown", "--steps", "3"],
]


def main() -> int:
    t0 = time.time()
    for cmd in BENCHES:
        print(f"== {' '.join(cmd)}", flush=True)
        rc = subprocess.call([sys.executable, "-m", *cmd])
        if rc != 0:
            print(f"benchmark {cmd[0]} failed with exit code {rc}", file=sys.stderr)
            return rc
    names = ", ".join(cmd[0].removeprefix("benchmarks.") for cmd in BENCHES)
    print(
        f"all benchmarks done in {time.time() - t0:.0f}s; blocks {names} rewritten in benchmarks/RESULTS.md, "
        "full runs appended to benchmarks/results_archive/"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
