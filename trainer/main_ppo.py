"""Entry point: ``python -m fusedrl.trainer.main_ppo key=value ...`` (Hydra-style overrides).

The config is validated before Ray starts; every problem is printed at once and the exit code is 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from omegaconf import DictConfig

from fusedrl.config import cli_main, load_config
from fusedrl.run_config import RunConfig


def run_ppo(config: RunConfig | DictConfig, trainer_cls: type | None = None) -> dict[str, float]:
    """Start Ray, build the trainer (``trainer_cls`` lets a user plug in a subclass), train, clean up.
    ``config``: `load_config`'s typed run (a composed DictConfig is typed first)."""
    from fusedrl.trainer.runtime import started_trainer

    with started_trainer(config, trainer_cls=trainer_cls) as trainer:
        return trainer.fit()


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(argv, load_config, lambda config: run_ppo(config))


if __name__ == "__main__":
    sys.exit(main())
