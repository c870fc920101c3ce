"""The typed configs an SFT worker receives (the sections of `sft_trainer.yaml`), built the same way
as the RL roles' (`fusedrl.role_config.build_section`)."""

from __future__ import annotations

from dataclasses import dataclass

from fusedrl.role_config import Section, build_section


@dataclass(frozen=True, kw_only=True)
class SFTDataConfig:
    """``data`` (SFT): conversations and batch sizes."""

    train_files: str | tuple[str, ...]
    val_files: str | tuple[str, ...] | None
    messages_key: str
    prompt_key: str
    response_key: str
    max_length: int
    truncation: str
    train_batch_size: int
    val_batch_size: int | None
    micro_batch_size_per_gpu: int
    shuffle: bool


@dataclass(frozen=True, kw_only=True)
class SFTFsdpConfig:
    """``model.fsdp_config`` (SFT)."""

    model_dtype: str
    param_dtype: str | None  # or "auto" until the worker resolves it (fusedrl.auto_defaults)


@dataclass(frozen=True, kw_only=True)
class SFTModelConfig:
    """``model`` (SFT)."""

    path: str
    enable_gradient_checkpointing: bool
    fsdp_config: SFTFsdpConfig


@dataclass(frozen=True, kw_only=True)
class SFTOptimConfig:
    """``optim`` (SFT): AdamW, its schedule and gradient clipping."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    warmup_steps_ratio: float
    lr_scheduler: str
    min_lr_ratio: float
    clip_grad: float


@dataclass(frozen=True, kw_only=True)
class SFTTrainerConfig:
    """``trainer`` (SFT)."""

    project_name: str
    experiment_name: str
    nnodes: int
    n_gpus_per_node: int
    total_epochs: int
    total_training_steps: int | None
    save_freq: int
    test_freq: int
    val_before_train: bool
    logger: tuple[str, ...]
    seed: int
    default_local_dir: str
    export_dir: str | None
    resume_mode: str
    resume_from_path: str | None
    max_ckpt_to_keep: int | None
    ray_num_cpus: int | None
    ray_object_store_gb: float


@dataclass(frozen=True, kw_only=True)
class SFTRoleConfigs:
    """What an `SFTWorker` reads: the SFT YAML's sections plus the run's optimizer-step count (which the
    learning-rate schedule spans), counted by the driver from the data."""

    data: SFTDataConfig
    model: SFTModelConfig
    optim: SFTOptimConfig
    trainer: SFTTrainerConfig
    total_steps: int


_SFT_SECTIONS = {
    "data": SFTDataConfig,
    "model": SFTModelConfig,
    "optim": SFTOptimConfig,
    "trainer": SFTTrainerConfig,
}


def build_sft_role_configs(config: Section, *, total_steps: int) -> SFTRoleConfigs:
    """The SFT workers' configs from the resolved SFT config as a plain dict."""
    sections = {name: build_section(cls, config[name], name) for name, cls in _SFT_SECTIONS.items()}
    return SFTRoleConfigs(**sections, total_steps=int(total_steps))
