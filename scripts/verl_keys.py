"""Write the list of verl's ``ppo_trainer`` config keys that `fusedrl.verl_compat` classifies.

Usage::

    python scripts/verl_keys.py VERL                # VERL: a verl checkout (work tree or bare git directory)
    python scripts/verl_keys.py VERL --rev v0.7.0   # another revision of a git checkout (default HEAD)
    python scripts/verl_keys.py FILE.yaml --commit SHA   # a copy of verl's flattened config

The keys are read from verl's flattened reference config, ``verl/trainer/config/_generated_ppo_trainer.yaml``
(the FSDP engine's: ``model_engine=dp``). Leaf keys are written one per line, sorted, to
``trainer/config/verl_ppo_trainer_keys.txt``, under a header naming the verl commit and its date; verl's
``_target_`` entries (its dataclass names) are left out. Rerun when verl adds keys;
`tests/unit/test_verl_compat.py` then names every key without a status.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

OUT = Path(__file__).resolve().parent.parent / "trainer" / "config" / "verl_ppo_trainer_keys.txt"
GENERATED = "verl/trainer/config/_generated_ppo_trainer.yaml"


def leaf_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Dotted names of the non-mapping values under ``node`` (a mapping value is walked, not listed)."""
    keys: list[str] = []
    for name in node:
        if str(name) == "_target_":
            continue
        full = f"{prefix}{name}"
        child = node._get_node(name)
        if isinstance(child, DictConfig) and len(child) > 0:
            keys.extend(leaf_keys(child, full + "."))
        else:
            keys.append(full)
    return keys


def _git(source: Path, *args: str) -> str:
    """``git`` on ``source``: a work tree (``-C``) or a bare repository (``--git-dir``)."""
    where = ["-C", str(source)] if (source / ".git").exists() else ["--git-dir", str(source)]
    return subprocess.run(["git", *where, *args], check=True, capture_output=True, text=True).stdout


def read_verl(source: Path, rev: str) -> tuple[str, str]:
    """``(generated YAML text, "commit date")`` from a verl checkout at ``rev``."""
    commit = _git(source, "rev-parse", f"{rev}^{{commit}}").strip()
    date = _git(source, "show", "-s", "--format=%cs", commit).strip()
    return _git(source, "show", f"{commit}:{GENERATED}"), f"{commit} ({date})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "source", help="a verl checkout (work tree or bare git dir), or its generated YAML file"
    )
    parser.add_argument("--rev", default="HEAD", help="revision of a git checkout (default HEAD)")
    parser.add_argument("--commit", default=None, help="with a YAML file: the verl commit it comes from")
    args = parser.parse_args()
    source = Path(args.source).expanduser()
    if source.is_file():
        text, revision = source.read_text(encoding="utf-8"), args.commit or "unknown"
    else:
        text, revision = read_verl(source, args.rev)
    cfg = OmegaConf.create(text)
    assert isinstance(cfg, DictConfig)
    keys = sorted(set(leaf_keys(cfg)))
    header = [
        f"# Every leaf key of verl's ppo_trainer config ({GENERATED}),",
        f"# verl commit {revision}, written by scripts/verl_keys.py.",
        "# fusedrl.verl_compat gives each a status (docs/verl_compat.md).",
    ]
    OUT.write_text("\n".join([*header, *keys]) + "\n", encoding="utf-8")
    print(f"wrote {len(keys)} keys of verl {revision} to {OUT}")


if __name__ == "__main__":
    main()
