"""Trainers and entry points (``fusedrl.trainer``)."""


def __getattr__(name: str):
    # Lazy: `python -m fusedrl.trainer.main_ppo` should not pay for importing Ray twice.
    if name == "PPOTrainer":
        from fusedrl.trainer.ppo_trainer import PPOTrainer

        return PPOTrainer
    raise AttributeError(name)


__all__ = ["PPOTrainer"]
