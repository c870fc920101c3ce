"""How third_party/vllm/iteration_fastpath.py chooses its parts up front, without an engine: an engine built
otherwise than read (another KV cache manager or block table, another vLLM release) keeps vLLM's own code, and
the parts kept are named in ONE log line. (The parts themselves, on a real engine: tests/integration/
test_iteration_fastpath.py.)"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from fusedrl.third_party.vllm import iteration_fastpath as itf  # noqa: E402


@pytest.fixture
def cpu_kernel(monkeypatch):
    """The slot-mapping kernel as a vLLM-cpu engine's start registers it (vllm/platforms/cpu.py), and vLLM's C++
    operations loaded."""
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm.utils import cpu_triton_utils
    from vllm.v1.worker import block_table

    override = SimpleNamespace(_impl=cpu_triton_utils._compute_slot_mapping_kernel_impl)
    monkeypatch.setattr(block_table.ComputeSlotMappingKernel, "kernel", override)


def test_without_vllm_cpus_kernel_override_the_launch_is_kept():
    from vllm.v1.worker import block_table

    if getattr(block_table.ComputeSlotMappingKernel.kernel, "_impl", None) is None:  # no engine started here
        assert "not vLLM-cpu's override" in itf._slot_mapping_unfit([])


def test_other_managers_and_tables_keep_vllms_code(cpu_kernel):
    assert itf._allocate_unfit(SimpleNamespace()) == "the KV cache manager is a SimpleNamespace"
    assert itf._slot_mapping_unfit([SimpleNamespace()]) == "a block table is a SimpleNamespace"


def test_another_vllm_release_keeps_vllms_code(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    assert itf._allocate_unfit(SimpleNamespace()) == "vLLM 0.33.0 (read against 0.32.x)"
    assert itf._slot_mapping_unfit([]) == "vLLM 0.33.0 (read against 0.32.x)"


def test_parts_kept_are_logged_in_one_line(monkeypatch, caplog, cpu_kernel):
    from vllm.platforms import current_platform

    manager, table = SimpleNamespace(), SimpleNamespace()
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    monkeypatch.setattr(itf, "_kv_cache_manager", lambda llm: manager)
    monkeypatch.setattr(itf, "_block_tables", lambda llm: [table])
    with caplog.at_level(logging.INFO, logger=itf.__name__):
        assert itf.install_iteration_fastpath(object()) == {"allocate": False, "slot_mapping": False}
    lines = [r.getMessage() for r in caplog.records if r.name == itf.__name__]
    assert len(lines) == 1
    assert "slot allocation (the KV cache manager is a SimpleNamespace)" in lines[0]
    assert "slot-mapping launch (a block table is a SimpleNamespace)" in lines[0]
    assert vars(manager) == {} and vars(table) == {}  # nothing was replaced
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=itf.__name__):
        itf.install_iteration_fastpath(object(), allocate=False, slot_mapping=False)
    assert not caplog.records  # parts not asked for are not reported
