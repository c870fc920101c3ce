"""Entry point: ``python -m fusedrl.trainer.main_sft key=value ...`` (Hydra-style overrides of sft_trainer.yaml).

The config is validated before Ray starts; every problem is printed at once and the exit code is 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from omegaconf import OmegaConf

from fusedrl.config import ConfigError


def main(argv: Sequence[str] | None = None) -> int:
    from fusedrl.trainer.sft_trainer import load_sft_config, run_sft

    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        config = load_sft_config(overrides)
    except ConfigError as err:
        print(f"fusedrl: {err}", file=sys.stderr)
        return 2
    print(OmegaConf.to_yaml(config), flush=True)
    run_sft(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
