"""Write the list of verl's ``ppo_trainer`` config keys that `fusedrl.verl_compat` classifies.

Usage: ``python scripts/verl_keys.py PATH/TO/verl/trainer/config/_generated_ppo_trainer.yaml [--commit SHA]``
(verl's flattened reference config). Leaf keys are written one per line, sorted, to
``trainer/config/verl_ppo_trainer_keys.txt``; verl's ``_target_`` entries (its dataclass names) are left
out. Rerun when verl adds keys; `tests/unit/test_verl_compat.py` then names any key without a status.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

OUT = Path(__file__).resolve().parent.parent / "trainer" / "config" / "verl_ppo_trainer_keys.txt"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("yaml", help="verl's _generated_ppo_trainer.yaml")
    parser.add_argument("--commit", default="unknown", help="the verl commit the file comes from")
    args = parser.parse_args()
    cfg = OmegaConf.load(args.yaml)
    assert isinstance(cfg, DictConfig)
    keys = sorted(set(leaf_keys(cfg)))
    header = [
        "# Every leaf key of verl's ppo_trainer config (verl/trainer/config/_generated_ppo_trainer.yaml,",
        f"# verl commit {args.commit}), written by scripts/verl_keys.py. fusedrl.verl_compat gives each a status.",
    ]
    OUT.write_text("\n".join([*header, *keys]) + "\n")
    print(f"wrote {len(keys)} keys to {OUT}")


if __name__ == "__main__":
    main()
