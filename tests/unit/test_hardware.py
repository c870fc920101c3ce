"""CPU facts the workers are sized by: cores per CPU slot, and the bf16 instruction flags."""

from __future__ import annotations

from fusedrl.utils.hardware import BF16_CPU_FLAGS, cpu_flags, cpus_per_cpu_slot, native_bf16


def test_cores_are_shared_evenly_by_the_slots():
    assert cpus_per_cpu_slot(1, 2) == 2  # one worker on a 2-core box: both cores, not Ray's default 1
    assert cpus_per_cpu_slot(2, 2) == 1
    assert cpus_per_cpu_slot(3, 8) == 2
    assert cpus_per_cpu_slot(4, 2) == 1  # more slots than cores: still one each
    assert cpus_per_cpu_slot(1) >= 1


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse avx2 fma\n\nprocessor\t: 1\n")
    bf16 = tmp_path / "bf16"
    bf16.write_text("flags\t\t: avx2 avx512f avx512_bf16 amx_bf16\n")
    assert cpu_flags(str(avx2)) == {"fpu", "sse", "avx2", "fma"}
    assert not cpu_flags(str(avx2)) & set(BF16_CPU_FLAGS)
    assert cpu_flags(str(bf16)) & set(BF16_CPU_FLAGS) == {"avx512_bf16", "amx_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()


def test_native_bf16_names_the_device_and_agrees_with_the_flags():
    import torch

    ok, what = native_bf16()
    if torch.cuda.is_available():
        return
    has_flag = bool(cpu_flags() & set(BF16_CPU_FLAGS))
    assert ok == (has_flag and torch.backends.cpu.get_cpu_capability().startswith("AVX512"))
    assert what.startswith("CPU ")


def test_inductor_cache_folder_per_instruction_set(monkeypatch, tmp_path):
    """Each instruction set compiles into a cache folder of its own under Inductor's default (a graph cached
    under an AVX2 cap crashed a native compiled engine: tests/integration/test_compiled_engine.py); a
    folder the user chose is kept."""
    import os

    from fusedrl.utils.hardware import ISA_ENV, cpu_isa_signature, isolate_inductor_cache

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # Inductor's default folder: <TMPDIR>/torchinductor_<user>
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    for key in ISA_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    native = isolate_inductor_cache()
    assert native is not None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == native
    assert native.startswith(str(tmp_path)) and os.path.basename(native) == f"cpu-{cpu_isa_signature()}"
    # Inductor writes its default folder into the environment when it first looks: not a user's choice.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.dirname(native))
    assert isolate_inductor_cache() == native
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    capped = isolate_inductor_cache()
    assert capped is not None and capped != native and os.path.dirname(capped) == os.path.dirname(native)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert isolate_inductor_cache() is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(
        tmp_path / "mine"
    )
