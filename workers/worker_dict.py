"""The fused worker: one process per device slot holding actor, reference and rollout side by side.

It is a plain class; the worker group wraps it with ``ray.remote``. Construction is two-phase because
torch.distributed needs the rank-0 address before any rank can join: ``__init__`` only records who it
is, `init_roles` joins the process group and builds the roles (collectively, on all ranks at once).

Every method the driver calls is written out here (no generated methods), so grep finds each call site.
The memory choreography is visible in `init_roles`, `sync_weights` and `rollout_generate`:

    init_roles:       build the training roles -> offload what the rollout does not use (per config) ->
                      build the engine (vLLM checks free memory against gpu_memory_utilization here) ->
                      engine sleeps (level 2: the driver re-streams before the first rollout)
    sync_weights:     empty cache -> (reload actor params if offloaded) -> engine wakes its weights ->
                      stream weights in place -> offload actor params
    rollout_generate: engine wakes its KV cache -> generate -> engine sleeps (level 1 or 2) ->
                      reload actor params
    checkpoints:      an awake engine sleeps before offloaded state comes back to the device
    log-probs / update: each role's params (and optimizer state) are loaded for its phase and offloaded
                      after it, per its ``fsdp_config.param_offload`` / ``optimizer_offload``.

On CPU the moves are no-ops but the calls happen in the same order and are recorded in ``events``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fusedrl.batch import RolloutBatch
from fusedrl.checkpoint import shard_prefix
from fusedrl.workers.actor import ActorRole, RefRole
from fusedrl.workers.checkpoint_io import export_hf, load_fsdp_state, save_fsdp_state
from fusedrl.workers.critic import CriticRole
from fusedrl.workers.device import local_device_index
from fusedrl.workers.fsdp import StreamStats, device_type
from fusedrl.workers.logprob import token_budget
from fusedrl.workers.memory import (
    Offloader,
    empty_cache,
    memory_metrics,
    peak_rss_gb,
    rss_gb,
)
from fusedrl.workers.reward_model import RewardModelRole
from fusedrl.workers.rollout.base import SamplingConfig
from fusedrl.workers.rollout.hf_rollout import HFRollout


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _to_device(batch: RolloutBatch) -> RolloutBatch:
    """Batches travel between processes on the CPU; the models compute on the worker's device."""
    return batch if device_type() == "cpu" else batch.to(device_type())


class WorkerDict:
    """Roles of one device slot. ``config`` is the whole resolved run config as a plain dict."""

    def __init__(self, config: dict[str, Any], *, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.actor: ActorRole | None = None
        self.ref: RefRole | None = None
        self.critic: CriticRole | None = None
        self.reward_model: RewardModelRole | None = None
        self.rollout: Any = None
        # Names of memory moves in call order, so tests can check the choreography.
        self.events: list[str] = []
        self.actor_mem: Offloader | None = None
        self.ref_mem: Offloader | None = None
        self.critic_mem: Offloader | None = None
        self.last_rollout_memory: dict[str, float] = {}
        self.rollout_asleep = False  # the engine released its memory (until the next wake_up)

    # ------------------------------------------------------------------ setup
    def master_address(self) -> tuple[str, int]:
        """Rank 0 is asked for the rendezvous address of torch.distributed."""
        return "127.0.0.1" if self.config["trainer"]["nnodes"] == 1 else socket.gethostbyname(
            socket.gethostname()
        ), _free_port()

    def init_roles(self, master_addr: str, master_port: int) -> dict[str, float]:
        """Join the process group, then build actor, reference and rollout. Collective."""
        t0 = time.perf_counter()
        local = local_device_index(
            self.rank, int(self.config["trainer"]["n_gpus_per_node"]), device_count=torch.cuda.device_count()
        )
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            LOCAL_RANK=str(local),
            WORLD_SIZE=str(self.world_size),
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            TOKENIZERS_PARALLELISM="false",
        )
        if device_type() == "cuda":
            torch.cuda.set_device(local)
        backend = "nccl" if device_type() == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(minutes=30),
            # NCCL binds the group to this worker's device up front (no guessing from the rank).
            device_id=torch.device("cuda", local) if backend == "nccl" else None,
        )
        seed = int(self.config["actor_rollout_ref"]["rollout"].get("seed", 0))
        torch.manual_seed(seed)  # identical init on every rank (FSDP2 shards the same weights)

        arr = self.config["actor_rollout_ref"]
        model_cfg = arr["model"]
        for module in self.config["algorithm"].get("custom_modules") or []:
            from fusedrl.config import import_plugin  # only here: the GPU check runs without omegaconf

            import_plugin(str(module))  # user losses / estimators must be registered in this process too
        roles = self.config["_roles"]
        self.actor = ActorRole(model_cfg, arr["actor"], rollout_n=int(arr["rollout"]["n"]))
        if roles["ref"]:
            self.ref = RefRole(model_cfg, arr["ref"])
        if roles["critic"]:
            self.critic = CriticRole(self.config["critic"], rollout_n=int(arr["rollout"]["n"]))
        if roles["reward_model"]:
            self.reward_model = RewardModelRole(self.config["reward_model"])
        # vLLM refuses to start unless gpu_memory_utilization x total is free: the training state the rollout
        # does not use leaves the device first, and the engine gives its memory back as soon as it is built.
        self._build_offloaders()
        self._offload_idle_state()
        self.events.append("rollout.build")
        self.rollout = self._build_rollout()
        # The engine starts from the checkpoint on disk, the actor from the same files: already in sync.
        self._sleep_rollout()
        return {
            "timing_s/init_roles": time.perf_counter() - t0,
            "memory/cpu_rss_gb": rss_gb(),
            **memory_metrics("init"),
        }

    def _uses_hf_rollout(self) -> bool:
        return self.config["actor_rollout_ref"]["rollout"].get("name", "vllm") == "hf"

    def _sleep_rollout(self) -> None:
        """Put the engine to sleep (``rollout.free_cache_engine``) at ``rollout.sleep_level``."""
        rcfg = self.config["actor_rollout_ref"]["rollout"]
        if not rcfg.get("free_cache_engine", True) or self.rollout_asleep:
            return
        level = int(rcfg.get("sleep_level", 1))
        self.events.append(f"rollout.sleep(level={level})")
        self.rollout.sleep(level)
        self.rollout_asleep = True
        empty_cache()

    def _wake_rollout(self, tag: str) -> None:
        self.events.append(f"rollout.wake_up({tag})")
        self.rollout.wake_up([tag])
        self.rollout_asleep = False

    def _build_offloaders(self) -> None:
        arr = self.config["actor_rollout_ref"]
        assert self.actor is not None
        self.actor_mem = Offloader.from_fsdp_config(
            "actor", self.actor.model, self.actor.optimizer, arr["actor"].get("fsdp_config"), self.events
        )
        # The HF rollout generates with the actor's own parameters: they stay (validated at start-up).
        self.actor_mem.param_offload &= not self._uses_hf_rollout()
        if self.ref is not None:
            self.ref_mem = Offloader.from_fsdp_config(
                "ref", self.ref.model, None, arr["ref"].get("fsdp_config"), self.events
            )
        if self.critic is not None:
            self.critic_mem = Offloader.from_fsdp_config(
                "critic",
                self.critic.model,
                self.critic.optimizer,
                self.config["critic"]["model"].get("fsdp_config"),
                self.events,
            )

    def _offload_idle_state(self) -> None:
        """Everything the rollout does not use leaves the device (per the offload flags)."""
        assert self.actor_mem is not None
        self.actor_mem.offload_all()
        if self.ref_mem is not None:
            self.ref_mem.offload_params()
        if self.critic_mem is not None:
            self.critic_mem.offload_all()
        empty_cache()

    @contextmanager
    def _resident(self, *, engine_sleeps: bool = False) -> Iterator[None]:
        """Every offloaded model and optimizer on the device inside the block (checkpoints, export).

        ``engine_sleeps``: an awake engine sleeps first, as at start-up, so the state coming back fits
        (at level 2 its weights are gone: the driver re-streams them before the next rollout)."""
        if engine_sleeps:
            self._sleep_rollout()
        with ExitStack() as stack:
            for mem in (self.actor_mem, self.ref_mem, self.critic_mem):
                if mem is not None:
                    stack.enter_context(mem.resident())
            yield

    def _build_rollout(self) -> Any:
        arr = self.config["actor_rollout_ref"]
        rcfg = dict(arr["rollout"])
        data = self.config["data"]
        rcfg.setdefault("response_length", data["max_response_length"])
        tokens = self.config["_tokens"]  # resolved by the driver from the tokenizer
        assert self.actor is not None
        if rcfg.get("name", "vllm") == "hf":
            return HFRollout(
                self.actor.model,
                max_response_length=int(data["max_response_length"]),
                eos_token_id=tokens["eos_token_id"],
                pad_token_id=tokens["pad_token_id"],
            )
        from fusedrl.workers.rollout.vllm_rollout import VLLMRollout

        return VLLMRollout(
            rcfg,
            model_path=arr["model"]["path"],
            # The ranks of one tensor-parallel engine must sample alike: one seed per rollout (DP) group.
            seed=int(rcfg.get("seed", 0)) + self.rank // int(rcfg.get("tensor_model_parallel_size", 1)),
            max_model_len=int(data["max_prompt_length"]) + int(data["max_response_length"]),
            eos_token_id=tokens["eos_token_id"],
            pad_token_id=tokens["pad_token_id"],
        )

    # ------------------------------------------------------------------ rollout
    def rollout_generate(self, batch: RolloutBatch, sampling: SamplingConfig) -> RolloutBatch:
        """Sample one response per row of this rank's shard, then put the engine to sleep and bring the
        actor's parameters back. The engine's weights must be current (`sync_weights` after every update,
        and after every level-2 sleep: the driver tracks both)."""
        self._wake_rollout("weights")  # a no-op after sync_weights woke them
        self._wake_rollout("kv_cache")
        self.events.append("rollout.generate")
        out = self.rollout.generate(_to_device(batch), sampling).cpu()
        self._sleep_rollout()
        self.last_rollout_memory = memory_metrics("rollout")
        assert self.actor_mem is not None
        self.actor_mem.load_params()
        return out

    # ------------------------------------------------------------------ log-probs
    def actor_compute_log_prob(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        assert self.actor is not None and self.actor_mem is not None
        rollout_cfg = self.config["actor_rollout_ref"]["rollout"]
        mbs = int(rollout_cfg["log_prob_micro_batch_size_per_gpu"])
        budget = token_budget(rollout_cfg, "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu")
        self.actor_mem.load_params()
        return self.actor.compute_log_prob(
            _to_device(batch), temperature=temperature, micro_batch_size=mbs, max_token_len=budget
        ).cpu()

    def ref_compute_log_prob(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        if self.ref is None or self.ref_mem is None:
            raise RuntimeError("ref_compute_log_prob: no reference role (enable actor.use_kl_loss)")
        self.ref_mem.load_params()
        out = self.ref.compute_log_prob(_to_device(batch), temperature=temperature).cpu()
        self.ref_mem.offload_params()
        return out

    # ------------------------------------------------------------------ training
    def actor_update(self, batch: RolloutBatch, temperature: float) -> dict[str, float]:
        assert self.actor is not None and self.actor_mem is not None
        self.actor_mem.load_all()
        metrics = self.actor.update(_to_device(batch), temperature=temperature)
        metrics.update(memory_metrics("update"))
        metrics.update(self.last_rollout_memory)
        metrics["memory/peak_rss_gb"] = peak_rss_gb()
        for mem in (self.actor_mem, self.ref_mem, self.critic_mem):
            if mem is not None:
                metrics.update(mem.host_metrics())
        # Gradients are not needed until the next backward; the optimizer state not until the next step.
        self.actor.model.zero_grad(set_to_none=True)
        self.actor_mem.offload_optimizer()
        return metrics

    def critic_compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        if self.critic is None or self.critic_mem is None:
            raise RuntimeError(
                "critic_compute_values: no critic role (algorithm.adv_estimator=gae builds one)"
            )
        self.critic_mem.load_params()
        return self.critic.compute_values(_to_device(batch)).cpu()

    def critic_update(self, batch: RolloutBatch) -> dict[str, float]:
        if self.critic is None or self.critic_mem is None:
            raise RuntimeError("critic_update: no critic role (algorithm.adv_estimator=gae builds one)")
        self.critic_mem.load_all()
        metrics = self.critic.update(_to_device(batch))
        self.critic.model.zero_grad(set_to_none=True)
        self.critic_mem.offload_all()
        return metrics

    def reward_model_compute_scores(self, batch: RolloutBatch) -> torch.Tensor:
        if self.reward_model is None:
            raise RuntimeError(
                "reward_model_compute_scores: no reward-model role (set reward_model.enable=true)"
            )
        return self.reward_model.compute_scores(_to_device(batch)).cpu()

    # ------------------------------------------------------------------ weight sync
    def sync_weights(self, *, reset_prefix_cache: bool = True) -> dict[str, float]:
        """Stream the actor's FSDP2 shards, one full tensor at a time, into the rollout engine in place.

        Collective across ranks (each ``full_tensor`` is an all-gather). No-op for the HF rollout, which
        runs on the actor's own module.
        """
        assert self.actor is not None and self.actor_mem is not None
        if isinstance(self.rollout, HFRollout):
            return {"timing_s/sync_weights_inner": 0.0, **memory_metrics("sync")}
        t0 = time.perf_counter()
        # The engine allocates from here on: give it the cached blocks.
        empty_cache()
        self.events.append("empty_cache")
        self.actor_mem.load_params()
        self._wake_rollout("weights")
        stats = StreamStats()
        self.rollout.update_weights(self.actor.stream_weights(stats), reset_prefix_cache=reset_prefix_cache)
        self.events.append("rollout.update_weights")
        # Gathered tensors are gone (the stream drops each one); the shards leave for the rollout.
        self.actor_mem.offload_params()
        empty_cache()
        return {
            "timing_s/sync_weights_inner": time.perf_counter() - t0,
            "sync/num_tensors": float(stats.num_tensors),
            "sync/total_mb": stats.total_bytes / 1e6,
            "sync/largest_tensor_mb": stats.largest_bytes / 1e6,
            "sync/peak_live_gathered_mb": stats.peak_live_bytes / 1e6,
            **memory_metrics("sync"),
        }

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, ckpt_dir: str) -> dict[str, float]:
        """This rank's shards of the actor (and critic) with optimizer and RNG state. No collectives."""
        assert self.actor is not None
        with self._resident(engine_sleeps=True):
            info = save_fsdp_state(
                self.actor.model,
                self.actor.optimizer,
                shard_prefix(ckpt_dir, self.rank, "actor"),
                extra={"num_skipped_steps": self.actor.stepper.num_skipped},
            )
            nbytes = info["bytes"]
            if self.critic is not None:
                nbytes += save_fsdp_state(
                    self.critic.model, self.critic.optimizer, shard_prefix(ckpt_dir, self.rank, "critic")
                )["bytes"]
        return {"checkpoint/shard_mb": nbytes / 1e6}

    def load_checkpoint(self, ckpt_dir: str) -> dict[str, float]:
        """Restore what `save_checkpoint` wrote. The rollout engine is refreshed by the next sync."""
        assert self.actor is not None
        with self._resident(engine_sleeps=True):
            extra = load_fsdp_state(
                self.actor.model, self.actor.optimizer, shard_prefix(ckpt_dir, self.rank, "actor")
            )
            self.actor.stepper.num_skipped = int(extra.get("num_skipped_steps", 0))
            if self.critic is not None:
                load_fsdp_state(
                    self.critic.model, self.critic.optimizer, shard_prefix(ckpt_dir, self.rank, "critic")
                )
        return {}

    def export_hf(self, out_dir: str) -> list[str]:
        """Write the current policy as a Hugging Face folder (rank 0 writes). Collective."""
        assert self.actor is not None
        with self._resident(engine_sleeps=True):
            return export_hf(
                self.actor.model,
                out_dir,
                src_model_dir=self.config["actor_rollout_ref"]["model"]["path"],
                rank=self.rank,
            )

    # ------------------------------------------------------------------ test / debug hooks
    def get_events(self) -> list[str]:
        return list(self.events)

    def actor_state(self) -> dict[str, torch.Tensor]:
        """This rank's local shards of the actor's parameters (copies), keyed by name."""
        assert self.actor is not None
        with self._resident():
            return {n: p.to_local().detach().cpu().clone() for n, p in self.actor.model.named_parameters()}

    def ref_state(self) -> dict[str, torch.Tensor]:
        assert self.ref is not None
        with self._resident():
            return {n: p.to_local().detach().cpu().clone() for n, p in self.ref.model.named_parameters()}

    def measure_weight_stream(self, hoard: bool) -> dict[str, float]:
        """Stream the actor's weights to a consumer that copies-and-drops (like the engine's loader) or,
        with ``hoard=True``, keeps every tensor (a second full copy). Returns the stream's bookkeeping, so a
        test can show the accounting tells the two apart. Collective."""
        assert self.actor is not None
        stats = StreamStats()
        kept = []
        with self._resident():
            for _name, tensor in self.actor.stream_weights(stats):
                if hoard:
                    kept.append(tensor)
                del tensor  # a copy-and-drop consumer lets go before asking for the next tensor
        del kept
        return {
            "peak_live_bytes": float(stats.peak_live_bytes),
            "largest_bytes": float(stats.largest_bytes),
            "total_bytes": float(stats.total_bytes),
        }

    def ping(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def echo_rows(self, batch: RolloutBatch) -> int:
        """Receives a batch and answers its size: the controller round trip without any model work."""
        return batch.num_samples
