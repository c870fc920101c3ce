"""phase_timers: per-phase CPU time of an in-process engine's step, and the engine left as it was after."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from fusedrl.third_party.vllm.iteration_phases import PHASES, phase_timers


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Obj:
    def __init__(self, **costs: float) -> None:
        self.costs = costs

    def __getattr__(self, name: str):
        costs = self.__dict__["costs"]
        if name not in costs:
            raise AttributeError(name)
        return lambda *a, **k: (_spin(costs[name]), name)[1]


def _fake_llm():
    scheduler = _Obj(schedule=0.004, update_from_output=0.002)
    executor = _Obj(execute_model=0.010, sample_tokens=0.003)
    core = SimpleNamespace(scheduler=scheduler, model_executor=executor)
    processor = _Obj(process_outputs=0.001)

    class Engine:
        def __init__(self):
            self.engine_core = SimpleNamespace(engine_core=core)
            self.output_processor = processor

        def step(self):
            core.scheduler.schedule()
            core.model_executor.execute_model()
            core.model_executor.sample_tokens()
            core.scheduler.update_from_output()
            return self.output_processor.process_outputs()

    return SimpleNamespace(llm_engine=Engine()), scheduler


def test_phases_add_up_per_call_and_the_engine_is_restored():
    llm, scheduler = _fake_llm()
    with phase_timers(llm) as (secs, calls):
        for _ in range(3):
            assert llm.llm_engine.step() == "process_outputs"  # results pass through
    assert calls == dict.fromkeys(PHASES, 3)
    assert secs["execute_model"] == pytest.approx(0.030, abs=0.006)
    assert secs["schedule"] == pytest.approx(0.012, abs=0.004)
    inner = sum(secs[p] for p in PHASES if p != "step")
    assert inner <= secs["step"] <= inner + 0.01
    # wrappers were instance attributes; after the block the original methods answer again, untimed
    assert "step" not in vars(llm.llm_engine) and "schedule" not in vars(scheduler)
    llm.llm_engine.step()
    assert calls["step"] == 3


def test_an_engine_core_in_another_process_is_refused():
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(), output_processor=None))
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"), phase_timers(llm):
        pass
