"""`workers.phase.EnginePhase`: the rollout engine's phase, moves recorded once, repeats harmless, an
illegal move refused."""

from __future__ import annotations

import pytest

from fusedrl.workers.phase import EnginePhase, IllegalMove

pytestmark = pytest.mark.unit


def test_level2_sleep_needs_a_full_stream():
    p = EnginePhase()
    assert not p.needs_stream and not p.asleep
    assert p.sleep(discards_weights=True)
    assert not p.sleep(discards_weights=True)  # repeated: no change, not recorded
    assert p.asleep and p.weights == "discarded" and p.needs_stream
    p.wake()
    with pytest.raises(IllegalMove, match="only a full stream"):
        p.streamed(full=False)  # LoRA modules alone cannot restore discarded weights
    assert p.weights == "discarded"
    p.streamed(full=True)
    assert not p.needs_stream
    assert list(p.moves) == [
        "sleep -> asleep, weights discarded",
        "wake -> awake, weights discarded",
        "stream -> awake, weights current",
    ]


def test_update_makes_weights_stale_and_a_partial_stream_refreshes_them():
    p = EnginePhase()
    p.sleep(discards_weights=False)  # level 1 keeps the weights
    assert not p.needs_stream
    assert p.actor_changed() and not p.actor_changed()
    assert p.weights == "stale"
    p.wake()
    p.streamed(full=False)
    assert p.weights == "current"


def test_an_update_after_a_discard_keeps_it_discarded():
    p = EnginePhase()
    p.sleep(discards_weights=True)
    assert not p.actor_changed()
    assert p.weights == "discarded"


def test_two_syncs_in_a_row_stream_once():
    """The worker decides (no driver flag): after an update the first sync streams, the second is skipped."""
    p = EnginePhase()
    p.actor_changed()
    assert p.actor_version == 1 and p.wants() and p.skipped == 0
    p.streamed(full=True)
    assert p.engine_version == 1 and p.streams == 1
    assert not p.wants()  # current: skipped, counted
    assert (p.streams, p.skipped) == (1, 1)
    p.sleep(discards_weights=True)  # a level-2 sleep forces the next stream, with no actor change
    assert p.wants() and p.actor_version == 1


def test_a_rollout_pool_compares_versions():
    """A rollout on a pool of its own never sees the actor change: the sync tells it the actor's version."""
    p = EnginePhase()
    assert not p.wants(0)  # built from the same files as the actor
    assert p.wants(2) and p.weights == "stale"
    assert p.moves[-1] == "actor_changed -> awake, weights stale"
    p.streamed(full=True, version=2)
    assert not p.wants(2) and p.engine_version == 2
    p.sleep(discards_weights=True)
    assert p.wants(2)  # same version, but the weights were thrown away
    assert p.report()["needs_stream"] and p.report()["engine_version"] == 2
