"""Supervised fine-tuning driver: a single controller feeding data-parallel FSDP2 workers.

Each step the driver collates ``data.train_batch_size`` conversations, cuts them into one shard per rank
(`fusedrl.data.sft_dataset.shard_batch`) and calls every `SFTWorker.train_step` at once; the workers
all-reduce the step's loss-token count so the loss is the token mean over the whole step. Checkpoints use
the same atomic layout as the RL trainer (``global_step_N/actor/rank_r.*`` + ``trainer_state.json``), and
the run ends by writing a Hugging Face folder to ``trainer.export_dir``.

    python -m fusedrl.trainer.main_sft data.train_files=train.parquet model.path=/tmp/tiny \\
        trainer.total_training_steps=20 optim.lr=1e-4
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TextIO

import ray
import torch
from omegaconf import DictConfig, OmegaConf

from fusedrl.auto_defaults import announce_resolved
from fusedrl.checkpoint import RESUME_MODES, load_run_checkpoint, save_run_checkpoint
from fusedrl.config import ConfigError, compose_config, logger_names, to_plain_dict
from fusedrl.config_sections import check_number
from fusedrl.controller import WorkerGroup
from fusedrl.controller.placement import slot_pool
from fusedrl.data.sft_dataset import (
    SFT_TRUNCATION_MODES,
    SFTDataset,
    SFTLoader,
    eval_batches,
    shard_batch,
)
from fusedrl.sft_role_config import build_sft_role_configs
from fusedrl.tracking import KNOWN_LOGGERS, Tracker, format_duration, timer
from fusedrl.workers.fsdp import DTYPES
from fusedrl.workers.sft_worker import LR_SCHEDULERS, SFTWorker

Metrics = dict[str, float]
Batch = dict[str, torch.Tensor]
CONFIG_NAME = "sft_trainer"


# ---------------------------------------------------------------------- config
def validate_sft(cfg: DictConfig) -> None:
    """Check a composed SFT config; raise one `ConfigError` listing every problem."""
    problems: list[str] = []

    def get(key: str) -> Any:
        return OmegaConf.select(cfg, key, throw_on_missing=False)

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)

    missing = set(OmegaConf.missing_keys(cfg))
    for key in sorted(missing):
        problems.append(f"`{key}`: required, not set. Pass `{key}=...` on the command line.")

    def number(key: str, kind: type = int, optional: bool = False) -> Any:
        """``key``'s value as ``kind`` (None when unset and ``optional``), or None plus one problem."""
        if key in missing:
            return None
        return check_number(get(key), key, problems, kind, optional=optional)  # PPO's check too

    def at_least(key: str, low: int, optional: bool = False) -> int | None:
        value = number(key, int, optional)
        if value is not None and value < low:
            problems.append(f"`{key}`={value}: must be >= {low}.")
            return None
        return value

    # --- paths
    for key, required in (("data.train_files", True), ("data.val_files", False)):
        if key in missing:
            continue
        files = get(key)
        if files is None:
            continue
        listed = [files] if isinstance(files, str) else list(files)
        need(not required or bool(listed), f"`{key}`: empty file list.")
        for f in listed:
            need(
                os.path.isfile(str(f)),
                f"`{key}`: file `{f}` does not exist. Write the parquet file first or fix the path.",
            )
    if "model.path" not in missing:
        path = get("model.path")
        need(
            os.path.isfile(os.path.join(str(path), "config.json")),
            f"`model.path`: `{path}` is not a Hugging Face model folder (no config.json). Point it at a local "
            "folder; build a tiny one with `python -m fusedrl.utils.tiny_model --out DIR`.",
        )

    # --- sizes
    at_least("data.max_length", 2)
    bsz = at_least("data.train_batch_size", 1)
    at_least("data.val_batch_size", 1, optional=True)
    at_least("data.micro_batch_size_per_gpu", 1)
    slots, nnodes = at_least("trainer.n_gpus_per_node", 1), at_least("trainer.nnodes", 1)
    at_least("trainer.total_epochs", 1)
    at_least("trainer.total_training_steps", 1, optional=True)
    number("trainer.save_freq")
    number("trainer.test_freq")
    number("trainer.seed")
    at_least("trainer.max_ckpt_to_keep", 1, optional=True)
    if bsz is not None and slots is not None and nnodes is not None:
        world = slots * nnodes
        need(
            bsz % world == 0,
            f"`data.train_batch_size`={bsz} does not divide across {world} workers "
            "(trainer.n_gpus_per_node x trainer.nnodes). Use a multiple of the worker count.",
        )
    need(
        get("data.truncation") in SFT_TRUNCATION_MODES,
        f"`data.truncation`={get('data.truncation')!r}: use one of {', '.join(SFT_TRUNCATION_MODES)}.",
    )
    for key in ("data.messages_key", "data.prompt_key", "data.response_key"):
        need(isinstance(get(key), str) and bool(get(key)), f"`{key}`={get(key)!r}: must be a column name.")

    # --- optimizer
    lr = number("optim.lr", float)
    need(lr is None or lr > 0, f"`optim.lr`={lr}: must be > 0.")
    wd = number("optim.weight_decay", float)
    need(wd is None or wd >= 0, f"`optim.weight_decay`={wd}: must be >= 0.")
    warmup = number("optim.warmup_steps_ratio", float)
    need(
        warmup is None or 0 <= warmup < 1,
        f"`optim.warmup_steps_ratio`={warmup}: must be in [0, 1) (a fraction of the total steps).",
    )
    min_ratio = number("optim.min_lr_ratio", float)
    need(min_ratio is None or 0 <= min_ratio <= 1, f"`optim.min_lr_ratio`={min_ratio}: must be in [0, 1].")
    clip = number("optim.clip_grad", float)
    need(clip is None or clip > 0, f"`optim.clip_grad`={clip}: must be > 0.")
    need(
        get("optim.lr_scheduler") in LR_SCHEDULERS,
        f"`optim.lr_scheduler`={get('optim.lr_scheduler')!r}: use one of {', '.join(LR_SCHEDULERS)}.",
    )
    betas = get("optim.betas")
    ok_betas = False
    with contextlib.suppress(TypeError, ValueError):
        ok_betas = len(betas) == 2 and all(0 <= float(b) < 1 for b in betas)
    need(ok_betas, f"`optim.betas`={betas!r}: must be two numbers in [0, 1), e.g. [0.9, 0.95].")

    # --- model / trainer
    for key in ("model.fsdp_config.model_dtype", "model.fsdp_config.param_dtype"):
        value = get(key)
        compute = key.endswith("param_dtype")  # also null (model_dtype) or auto (fusedrl.auto_defaults)
        need(
            (compute and value in (None, "auto")) or value in DTYPES,
            f"`{key}`={value!r}: use {'auto, null or ' if compute else ''}one of {', '.join(sorted(DTYPES))}.",
        )
    mode = get("trainer.resume_mode")
    need(
        mode in RESUME_MODES,
        f"`trainer.resume_mode`={mode!r}: use auto, disable or resume_path.",
    )
    if mode == "resume_path":
        need(
            bool(get("trainer.resume_from_path")),
            "`trainer.resume_from_path`: required with resume_mode=resume_path.",
        )
    for name in logger_names(cfg):
        need(
            name in KNOWN_LOGGERS,
            f"`trainer.logger`: unknown logger {name!r}. Known: {', '.join(KNOWN_LOGGERS)}.",
        )
    if problems:
        raise ConfigError(problems)


def load_sft_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose ``sft_trainer.yaml`` with ``key=value`` overrides and validate it, reporting every problem
    (unknown keys included) in one `ConfigError`."""
    problems: list[str] = []
    try:
        cfg = compose_config(overrides, config_name=CONFIG_NAME, validate_config=False)
    except ConfigError as err:
        unknown = {p.split("`")[1] for p in err.problems if "unknown key" in p}
        if len(unknown) != len(err.problems):  # a parse error: nothing to validate
            raise
        problems.extend(err.problems)
        usable = [ov for ov in overrides if ov.split("=", 1)[0] not in unknown]
        cfg = compose_config(usable, config_name=CONFIG_NAME, validate_config=False)
    try:
        validate_sft(cfg)
    except ConfigError as err:
        problems.extend(err.problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def export_dir_of(config: DictConfig) -> str:
    """``trainer.export_dir``, or ``<trainer.default_local_dir>/hf`` when it is null."""
    out = config.trainer.export_dir
    return str(out) if out else os.path.join(str(config.trainer.default_local_dir), "hf")


# ---------------------------------------------------------------------- console
CONSOLE_FIELDS = (
    ("train/loss", "loss", "{:.4f}"),
    ("val/loss", "val_loss", "{:.4f}"),
    ("train/lr", "lr", "{:.3g}"),
    ("train/grad_norm", "grad_norm", "{:.3f}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
    ("timing_s/step", "step_time", "{:.2f}s"),
)


def format_sft_console(
    step: int, metrics: Mapping[str, float], *, total_steps: int | None = None, eta_s: float | None = None
) -> str:
    """``[step/total pct%] step N | loss ... | val_loss ... | lr ... | ... | eta ...``."""
    parts = [f"step {step}"]
    parts += [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in CONSOLE_FIELDS if key in metrics]
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    line = " | ".join(parts)
    return f"[{step}/{total_steps} {100.0 * step / total_steps:.0f}%] {line}" if total_steps else line


# ---------------------------------------------------------------------- trainer
class SFTTrainer:
    """SFT over a group of `SFTWorker` ranks: ``init_workers()``, ``fit()``, ``close()``."""

    def __init__(self, config: DictConfig, *, stream: TextIO | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config
        data = config.data
        self.tokenizer = AutoTokenizer.from_pretrained(str(config.model.path))

        def dataset(files: Any) -> SFTDataset:
            return SFTDataset(
                str(files) if isinstance(files, str) else [str(f) for f in files],
                self.tokenizer,
                int(data.max_length),
                messages_key=str(data.messages_key),
                prompt_key=str(data.prompt_key),
                response_key=str(data.response_key),
                truncation=str(data.truncation),
            )

        self.train_dataset = dataset(data.train_files)
        self.val_dataset = dataset(data.val_files) if data.val_files else None
        self.train_loader = SFTLoader(
            self.train_dataset,
            int(data.train_batch_size),
            shuffle=bool(data.shuffle),
            seed=int(config.trainer.seed),
        )
        tr = config.trainer
        self.total_steps = int(tr.total_training_steps or len(self.train_loader) * int(tr.total_epochs))
        loggers = logger_names(config)
        self.console = "console" in loggers
        self.stream = stream or sys.stdout
        # The console line is SFT's own (`format_sft_console`); every other backend goes through Tracker.
        self.tracker = Tracker(
            [b for b in loggers if b != "console"],
            run_dir=str(tr.default_local_dir),
            project_name=str(tr.project_name),
            experiment_name=str(tr.experiment_name),
            config=to_plain_dict(config),
            total_steps=self.total_steps,
        )
        self._clock: tuple[int, float] | None = None  # (step, time) of the first logged step, for the ETA
        self.global_step = 0
        self.group: WorkerGroup | None = None
        self._data_iter: Iterator[Batch] | None = None

    # ------------------------------------------------------------------ setup
    def init_workers(self) -> None:
        """Reserve the device slots, start one `SFTWorker` per slot and build the model (collective)."""
        pool = slot_pool(self.config.trainer)
        worker_config = build_sft_role_configs(to_plain_dict(self.config), total_steps=self.total_steps)
        self.group = WorkerGroup.start(
            SFTWorker, pool, worker_config, init=lambda w, addr, port: w.init.remote(addr, port)
        )
        announce_resolved([self.group])  # what `model.fsdp_config.param_dtype=auto` became, printed once

    @property
    def workers(self) -> WorkerGroup:
        if self.group is None:
            raise RuntimeError("call init_workers() first")
        return self.group

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        self.tracker.close()

    def run_split(self, call: Callable[[Any, Batch], ray.ObjectRef], batch: Batch) -> list[Any]:
        """Shard a dict batch by DP rank (padding rows carry loss_mask 0), call each rank on its shard."""
        return self.workers.run_shards(call, shard_batch(batch, self.workers.world_size))

    # ------------------------------------------------------------------ the loop
    def fit(self) -> Metrics:
        """Train until ``total_steps``, then export the HF folder; returns the last step's metrics."""
        last: Metrics = {}
        self.load_checkpoint()
        tr = self.config.trainer
        if tr.val_before_train and self.val_dataset is not None:
            self.log(self.validate(), self.global_step)
        save_freq, test_freq = int(tr.save_freq), int(tr.test_freq)
        while self.global_step < self.total_steps:
            self.global_step += 1
            is_last = self.global_step == self.total_steps
            last = self.train_step(self.next_batch())
            if save_freq > 0 and (self.global_step % save_freq == 0 or is_last):
                with timer("save_checkpoint", last):
                    self.save_checkpoint()
            if (
                self.val_dataset is not None
                and test_freq > 0
                and (self.global_step % test_freq == 0 or is_last)
            ):
                with timer("validate", last):
                    last.update(self.validate())
            self.log(last, self.global_step)
        self.export_hf()
        return last

    def train_step(self, batch: Batch) -> Metrics:
        """One optimizer step on ``batch`` (all ranks). Every rank returns the same reduced metrics."""
        metrics: Metrics = {}
        mbs = int(self.config.data.micro_batch_size_per_gpu)
        with timer("step", metrics):
            per_rank = self.run_split(lambda w, shard: w.train_step.remote(shard, mbs), batch)
        metrics.update(per_rank[0])
        metrics["train/epoch"] = float(self.train_loader.epoch)
        metrics["perf/tokens_per_s"] = float(batch["attention_mask"].sum()) / max(
            metrics["timing_s/step"], 1e-9
        )
        return metrics

    def evaluate_batch(self, batch: Batch) -> Metrics:
        """Token-mean loss of one batch under the current model: ``{"loss", "nll_sum", "num_tokens"}``."""
        mbs = int(self.config.data.micro_batch_size_per_gpu)
        return dict(self.run_split(lambda w, shard: w.eval_loss.remote(shard, mbs), batch)[0])

    def validate(self) -> Metrics:
        """Token-mean loss over the whole validation set: ``{"val/loss", "val/num_tokens"}``."""
        if self.val_dataset is None:
            return {}
        size = int(self.config.data.val_batch_size or self.config.data.train_batch_size)
        nll = tokens = 0.0
        for batch in eval_batches(self.val_dataset, size):
            out = self.evaluate_batch(batch)
            nll += out["nll_sum"]
            tokens += out["num_tokens"]
        return {"val/loss": nll / max(tokens, 1.0), "val/num_tokens": tokens}

    def next_batch(self) -> Batch:
        """The next training batch; epochs roll over (the loader's position is checkpointed)."""
        if self._data_iter is None:
            self._data_iter = self._endless(self.train_loader)
        return next(self._data_iter)

    @staticmethod
    def _endless(loader: SFTLoader) -> Iterator[Batch]:
        while True:
            yield from loader

    def log(self, metrics: Metrics, step: int) -> None:
        if self.console:
            now = time.monotonic()
            if self._clock is None:
                self._clock = (step, now)
            eta = None
            if self._clock[0] < step < self.total_steps:
                eta = (now - self._clock[1]) / (step - self._clock[0]) * (self.total_steps - step)
            line = format_sft_console(step, metrics, total_steps=self.total_steps, eta_s=eta)
            print(line, file=self.stream, flush=True)
        self.tracker.log(metrics, step)

    # ------------------------------------------------------------------ checkpoints / export
    def save_checkpoint(self) -> str:
        """Every rank's shards + the driver's state into a temp folder, then one atomic rename."""
        tr = self.config.trainer
        state = {
            "global_step": self.global_step,
            "dataloader": self.train_loader.state_dict(),
        }
        return save_run_checkpoint(
            str(tr.default_local_dir), self.global_step, self.workers, state, max_to_keep=tr.max_ckpt_to_keep
        )

    def load_checkpoint(self) -> str | None:
        """Resume per ``trainer.resume_mode`` (``auto``: newest complete checkpoint in default_local_dir)."""
        tr = self.config.trainer
        resumed = load_run_checkpoint(
            str(tr.default_local_dir),
            str(tr.resume_mode),
            tr.resume_from_path,
            self.workers,
            self.train_loader,
        )
        if resumed is None:
            return None
        path, state = resumed
        self.global_step = int(state["global_step"])
        self._data_iter = None
        print(f"fusedrl: resumed from {path} at step {self.global_step}", file=self.stream, flush=True)
        return path

    def export_hf(self, out_dir: str | None = None) -> str:
        """Write the current model as a Hugging Face folder (``trainer.export_dir`` by default)."""
        out = out_dir or export_dir_of(self.config)
        self.workers.run_all(lambda w: w.export_hf.remote(out))
        return out


def run_sft(config: DictConfig) -> Metrics:
    """Start Ray (unless already running), train, export, clean up; returns the last step's metrics.

    ``config`` is a composed SFT config, e.g. ``load_sft_config(["data.train_files=...", ...])``.
    """
    from fusedrl.trainer.runtime import init_ray

    validate_sft(config)
    init_ray(config)
    trainer = SFTTrainer(config)
    try:
        trainer.init_workers()
        return trainer.fit()
    finally:
        trainer.close()
