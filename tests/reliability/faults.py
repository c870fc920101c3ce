"""Faults injected into real fused workers, for the in-process reliability tests (importable as ``faults``).

`ray_with_faults` starts Ray with a worker set-up hook (`install`) that patches ``WorkerDict`` inside every
worker process according to environment variables, so the fault happens in the real worker, in the real
phase, deterministically:

* ``FUSEDRL_FAULT_HANG=<method>:<rank>``: that rank's ``<method>`` sleeps for an hour instead of running
  (after writing the time it started hanging to ``FUSEDRL_FAULT_MARK``);
* ``FUSEDRL_FAULT_HOG_MB=<rank>:<mb>``: that rank holds ``<mb>`` MB of touched host memory after
  ``init_roles``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator


def _hang_forever(method: str) -> None:
    """Where a hung worker sits (its name shows up in the worker's stack dump)."""
    mark = os.environ.get("FUSEDRL_FAULT_MARK")
    if mark:
        with open(mark, "w") as f:
            f.write(f"{time.time()}\n")
    time.sleep(3600)


def install() -> None:
    """Ray worker set-up hook: patch ``WorkerDict`` per the FUSEDRL_FAULT_* variables."""
    from fusedrl.workers.worker_dict import WorkerDict

    hang = os.environ.get("FUSEDRL_FAULT_HANG")
    if hang:
        method, rank = hang.split(":")
        real = getattr(WorkerDict, method)

        def hanging(self, *args, **kwargs):
            if self.rank == int(rank):
                _hang_forever(method)
            return real(self, *args, **kwargs)

        setattr(WorkerDict, method, hanging)
    hog = os.environ.get("FUSEDRL_FAULT_HOG_MB")
    if hog:
        rank, mb = (int(x) for x in hog.split(":"))
        real_init = WorkerDict.init_roles

        def init_and_hog(self, *args, **kwargs):
            out = real_init(self, *args, **kwargs)
            if self.rank == rank:
                self._fault_hog = b"\x01" * (mb << 20)  # touched pages: they count in RSS
            return out

        WorkerDict.init_roles = init_and_hog


@contextlib.contextmanager
def ray_with_faults(**env: str) -> Iterator[None]:
    """A local Ray whose workers run `install` with ``env`` (FUSEDRL_FAULT_* variables) set."""
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this file
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=512 << 20,
        logging_level="WARNING",
        runtime_env={"env_vars": dict(env), "worker_process_setup_hook": install},
    )
    try:
        yield
    finally:
        ray.shutdown()
