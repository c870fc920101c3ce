"""Entry point: ``python -m fusedrl.trainer.main_sft key=value ...`` (Hydra-style overrides of sft_trainer.yaml).

The config is validated before Ray starts; every problem is printed at once and the exit code is 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from fusedrl.config import cli_main


def main(argv: Sequence[str] | None = None) -> int:
    from fusedrl.trainer.sft_trainer import load_sft_config, run_sft

    return cli_main(argv, load_sft_config, run_sft)


if __name__ == "__main__":
    sys.exit(main())
