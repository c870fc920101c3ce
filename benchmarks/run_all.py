"""``make bench``: every benchmark in turn; each appends its table to benchmarks/RESULTS.md."""

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
    print(f"all benchmarks done in {time.time() - t0:.0f}s; results appended to benchmarks/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
