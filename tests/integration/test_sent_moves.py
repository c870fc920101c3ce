"""Memory moves sent without a round trip (`WorkerGroup.send_all`): run in order before the group's next call,
their failures reported by that call's wait, every move awaited where the run has several groups.

Real Ray actors with the fused worker's health concurrency group (the conditions of `WorkerDict`); the worker
class below only records what it ran.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.integration
ray = pytest.importorskip("ray")


def recorder_class(carrier: bool = False) -> type:
    """Defined in a function so that Ray ships the class by value (the tests folder is no package the
    workers import). ``carrier``: the class takes moves along with its next call, as the fused workers do."""
    from fusedrl.workers.carried_moves import MoveCarrier

    class Recorder(MoveCarrier if carrier else object):  # type: ignore[misc]
        """A worker that logs its calls; ``slow_move`` takes a while so a call not waiting for it would overtake it."""

        def __init__(self, config, rank: int, world_size: int) -> None:
            self.rank, self.log = rank, []

        def health_report(self) -> dict:  # puts the actor in the health concurrency group, as `WorkerDict`
            return {"rank": self.rank}

        def slow_move(self, name: str) -> None:
            time.sleep(0.3)
            self.log.append(name)

        def failing_move(self) -> None:
            raise ValueError("the device ran out of memory")

        def compute(self) -> list[str]:
            return [*self.log, "compute"]

    return Recorder


@pytest.fixture(params=[False, True], ids=["sent", "carried"])
def group(request):
    from fusedrl.controller.worker_group import ResourcePool, WorkerGroup

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = SimpleNamespace(trainer=SimpleNamespace(step_timeout_s=None, default_local_dir=None))
    g = WorkerGroup(recorder_class(request.param), ResourcePool(slots_per_node=2, cpus_per_slot=0.5), config)
    assert g.carries == request.param
    try:
        yield g
    finally:
        g.shutdown()
        ray.shutdown()


def test_sent_moves_run_in_order_before_the_next_call(group):
    group.defer_moves = True
    start = time.monotonic()
    group.send_all(lambda w: w.slow_move.remote("load"))
    group.send_all(lambda w: w.slow_move.remote("wake"))
    sent_s = time.monotonic() - start
    assert sent_s < 0.3  # not awaited: the moves take 0.6 s a worker
    assert group.run_all(lambda w: w.compute.remote()) == [["load", "wake", "compute"]] * 2
    assert group._unawaited == [] and group._carried == [[], []]
    # Carried: no call of their own (the moves were kept on the driver and went with `compute`).
    group.send_all(lambda w: w.slow_move.remote("sleep"))
    assert bool(group._unawaited) != group.carries
    assert group.run_rank0(lambda w: w.compute.remote()) == ["load", "wake", "sleep", "compute"]
    # Rank 1 still has its move to run (carried) or has run it (sent) before its next call.
    assert group.run_all(lambda w: w.compute.remote())[1] == ["load", "wake", "sleep", "compute"]


def test_a_failed_move_is_reported_by_the_next_wait(group):
    from fusedrl.controller.worker_group import WorkerDiedError

    group.defer_moves = True
    group.send_all(lambda w: w.failing_move.remote())  # returns at once
    # Sent, the move's own call fails; carried, the call it went with fails, naming the move.
    where = "compute" if group.carries else "failing_move"
    with pytest.raises(WorkerDiedError, match=rf"rank [01] .*raised an error in `{where}`") as err:
        group.run_all(lambda w: w.compute.remote())
    assert "ran out of memory" in str(err.value)
    if group.carries:
        assert "the memory move `failing_move` (sent before `compute`) failed" in str(err.value)


@pytest.mark.parametrize("group", [False], ids=["sent"], indirect=True)
def test_moves_are_awaited_where_the_run_has_several_groups(group):
    assert not group.defer_moves  # the default; `RoleGroups.start_placed` sets it for a run's only group
    start = time.monotonic()
    group.send_all(lambda w: w.slow_move.remote("load"))
    assert time.monotonic() - start >= 0.3 and group._unawaited == []
