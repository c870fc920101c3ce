"""Local Ray workers preload tcmalloc where the machine has it (`fusedrl.trainer.runtime.tcmalloc_path`).

The choice is read from ``FUSEDRL_TCMALLOC``; the check is on the worker itself: the library is mapped into
a Ray worker's address space when chosen, and absent when switched off, and the worker still runs torch.
"""

from __future__ import annotations

import os

import pytest


def test_tcmalloc_choice(monkeypatch, tmp_path):
    from fusedrl.trainer.runtime import tcmalloc_path

    monkeypatch.setenv("FUSEDRL_TCMALLOC", "0")
    assert tcmalloc_path() is None
    monkeypatch.setenv("FUSEDRL_TCMALLOC", str(tmp_path / "missing.so"))
    with pytest.raises(FileNotFoundError, match="FUSEDRL_TCMALLOC=.*missing.so"):
        tcmalloc_path()
    given = tmp_path / "libtcmalloc_minimal.so.4"
    given.write_bytes(b"")
    monkeypatch.setenv("FUSEDRL_TCMALLOC", str(given))
    assert tcmalloc_path() == str(given)


def test_tcmalloc_preload_keeps_the_callers_preloads(monkeypatch, tmp_path):
    from fusedrl.trainer.runtime import tcmalloc_preload

    given = tmp_path / "libtcmalloc_minimal.so.4"
    given.write_bytes(b"")
    monkeypatch.setenv("FUSEDRL_TCMALLOC", str(given))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert tcmalloc_preload() == str(given)
    monkeypatch.setenv("LD_PRELOAD", "/opt/libother.so")
    assert tcmalloc_preload() == f"{given}:/opt/libother.so"
    monkeypatch.setenv("FUSEDRL_TCMALLOC", "0")
    assert tcmalloc_preload() is None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("choice", ["auto", "0"])
def test_local_workers_preload_tcmalloc(monkeypatch, choice):
    import ray

    from fusedrl.config import load_config
    from fusedrl.trainer.runtime import init_ray, tcmalloc_path

    def worker_view() -> (
        dict
    ):  # defined here: Ray ships it by value (the test module is not importable there)
        import torch

        x = torch.randn(256, 256)
        with open("/proc/self/maps") as f:
            maps = f.read()
        return {"maps": maps, "preload": os.environ.get("LD_PRELOAD", ""), "sum": float((x @ x.T).trace())}

    monkeypatch.setenv("FUSEDRL_TCMALLOC", choice)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    wanted = tcmalloc_path()
    if choice == "0":
        assert wanted is None
    assert not ray.is_initialized()
    init_ray(load_config(["trainer.ray_object_store_gb=0.25"], validate_config=False))
    try:
        view = ray.get(ray.remote(worker_view).remote())
    finally:
        ray.shutdown()
    assert view["sum"] > 0
    if wanted is None:
        assert "tcmalloc" not in view["maps"]
    else:
        assert wanted in view["preload"].split(":")
        assert os.path.realpath(wanted) in view["maps"] or wanted in view["maps"]
