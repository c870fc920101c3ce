"""CPU binding of the fused workers on one machine (`fusedrl.utils.hardware.slot_cpu_sets` /
`bind_process_cpus`)."""

from __future__ import annotations

import os
import threading

import pytest

from fusedrl.utils.hardware import bind_process_cpus, slot_cpu_sets


def test_slot_cpu_sets_are_disjoint_runs_per_pool_and_rank():
    assert slot_cpu_sets([2], 1, [0, 1]) == [[[0], [1]]]
    assert slot_cpu_sets([1], 2, [1, 0]) == [[[0, 1]]]
    # two pools (e.g. actor and rollout): the second starts where the first ends
    assert slot_cpu_sets([2, 1], 2, [4, 5, 6, 7, 8, 9, 10]) == [[[4, 5], [6, 7]], [[8, 9]]]
    assert slot_cpu_sets([3], 1, [0, 1]) is None  # more slots than cores: left unbound
    assert slot_cpu_sets([1], 0, [0, 1]) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding to one of several cores needs two")
def test_bind_process_cpus_binds_every_thread_and_later_ones():
    """Run in a child process: binding is for the whole process."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        seen = pool.apply(_bind_and_report, (min(os.sched_getaffinity(0)),))
    cpu = min(os.sched_getaffinity(0))
    assert seen == {"main": [cpu], "earlier_thread": [cpu], "later_thread": [cpu]}


def _bind_and_report(cpu: int) -> dict[str, list[int]]:
    started, release = threading.Event(), threading.Event()
    seen: dict[str, list[int]] = {}

    def earlier() -> None:
        started.set()
        release.wait()
        seen["earlier_thread"] = sorted(os.sched_getaffinity(0))

    t = threading.Thread(target=earlier)
    t.start()
    started.wait()
    seen["main"] = bind_process_cpus([cpu])
    release.set()
    t.join()
    later = threading.Thread(target=lambda: seen.__setitem__("later_thread", sorted(os.sched_getaffinity(0))))
    later.start()
    later.join()
    return seen
