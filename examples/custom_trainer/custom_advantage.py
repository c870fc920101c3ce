"""Change one step of the RL loop by subclassing PPOTrainer: clip the advantages to [-1, 1].

    python examples/custom_trainer/custom_advantage.py key=value ...   (the same overrides as main_ppo)

`ClippedAdvantageTrainer` overrides only ``compute_advantages``: it lets the configured estimator
(``algorithm.adv_estimator``: grpo, reinforce_plus_plus, ...) compute the advantages as usual, then
clamps them to ``[-ADV_CLIP, ADV_CLIP]`` so a few outlying samples cannot dominate an update. Every other
step (generation, rewards, log-probs, the PPO update, the weight sync, checkpoints) is the stock one, and
``run_ppo(config, trainer_cls=...)`` runs it exactly as ``python -m fusedrl.trainer.main_ppo`` would.

The other overridable steps: ``generate``, ``compute_rewards``, ``compute_log_probs``,
``compute_ref_log_probs``, ``compute_values``, ``update_critic``, ``update_actor``, ``sync_weights``,
``validate``. For a new estimator that other runs can name in the config instead, see
``fusedrl.algorithms.register_adv_estimator``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from fusedrl.batch import RolloutBatch
from fusedrl.config import cli_main, load_config
from fusedrl.trainer.main_ppo import run_ppo
from fusedrl.trainer.ppo_trainer import PPOTrainer


class ClippedAdvantageTrainer(PPOTrainer):
    """PPOTrainer whose advantages are clipped to ``[-ADV_CLIP, ADV_CLIP]`` after the estimator."""

    ADV_CLIP = 1.0

    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        batch = super().compute_advantages(batch)
        valid = batch.response_mask.bool()  # [B, Tr]
        clipped = (batch.advantages.abs() > self.ADV_CLIP) & valid  # [B, Tr]
        batch.advantages = batch.advantages.clamp(-self.ADV_CLIP, self.ADV_CLIP)  # [B, Tr]
        fraction = float(clipped.sum()) / max(int(valid.sum()), 1)
        print(
            f"advantage clip (step {self.global_step}): {fraction:.1%} of response tokens clipped to "
            f"[-{self.ADV_CLIP:g}, {self.ADV_CLIP:g}]",
            flush=True,
        )
        return batch


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(
        argv,
        load_config,
        lambda config: run_ppo(config, trainer_cls=ClippedAdvantageTrainer),
        prog="custom_advantage",
        show_config=False,
    )


if __name__ == "__main__":
    sys.exit(main())
