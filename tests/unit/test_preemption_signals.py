"""The driver's signal handling (`PreemptionGuard`), in a real subprocess receiving real signals: the first
SIGTERM / SIGINT is a request honoured between steps, with a time budget; a second one exits at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

# A stand-in for the training loop: "steps" of 0.2 s until the guard says stop; each step polls the deadline
# the way WorkerGroup does during remote waits. Prints what it saw.
LOOP = textwrap.dedent(
    """
    import sys, time
    from fusedrl.controller.preemption import Preempted, PreemptionGuard
    guard = PreemptionGuard(float(sys.argv[1]))
    guard.on_exit_now = lambda: print("ON_EXIT_NOW", flush=True)
    step_s = float(sys.argv[2])
    with guard:
        step = 0
        try:
            while not guard.requested:
                step += 1
                if step == 1:  # ready once a step is in flight (a signal before it would stop at step 0)
                    print("READY", flush=True)
                t = time.monotonic()
                while time.monotonic() - t < step_s:
                    guard.check_deadline("step")
                    time.sleep(0.05)
        except Preempted as err:
            print("ABANDONED", err, flush=True)
            sys.exit(err.exit_code)
        err = guard.stopped(step, "ckpt/global_step_%d" % step, "rerun")
        print("STOPPED", err, flush=True)
        sys.exit(err.exit_code)
    """
)


def _start(timeout_s: float, step_s: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", LOOP, str(timeout_s), str(step_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_finishes_the_step_and_exits_75(sig):
    proc = _start(timeout_s=60, step_s=0.5)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 75, out
    assert f"received {sig.name}: finishing the current step" in out, out
    assert "STOPPED" in out and "stopped after step" in out and "saved ckpt/global_step_" in out, out


def test_deadline_abandons_a_step_that_does_not_finish_in_time():
    proc = _start(timeout_s=1, step_s=600)  # one step would take 10 minutes
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 75, out
    assert time.monotonic() - start < 10
    assert "ABANDONED" in out and "step had not finished: the step was abandoned" in out, out


def test_second_signal_exits_at_once():
    proc = _start(timeout_s=600, step_s=600)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert time.monotonic() - start < 5
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "second signal (SIGTERM): exiting now" in out and "ON_EXIT_NOW" in out, out
