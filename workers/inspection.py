"""Read-only hooks of a fused worker for tests, benchmarks and debugging: copies of a role's shards, the
recorded memory moves, the weight stream's bookkeeping, and bare round trips. None changes state that
training uses. `InspectionHooks` is an object the worker holds (`WorkerDict.inspection`); the worker's
remote methods of the same names delegate to it, so grep finds every remote call on the one worker class."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from fusedrl.batch import RolloutBatch
from fusedrl.workers.fsdp import StreamStats, device_type


class InspectionHooks:
    """What the hooks read: the worker's ``rank``, its ``events`` list and ``resident`` (a context manager
    that brings every offloaded model and optimizer onto the device, `WorkerDict._resident`); the roles
    once they are built (`attach`)."""

    def __init__(
        self, *, rank: int, events: Any, resident: Callable[[], AbstractContextManager[None]]
    ) -> None:
        self.rank = rank
        self.events = events
        self._resident = resident
        self.actor: Any = None
        self.ref: Any = None
        self.rollout: Any = None
        self.shares_actor_module = False

    def attach(self, actor: Any, ref: Any, rollout: Any, *, shares_actor_module: bool) -> None:
        """The worker's roles (None where it holds none); ``shares_actor_module``: the engine runs on the
        actor's own module (`EngineTraits.shares_actor_module`), so it has no parameters of its own."""
        self.actor, self.ref, self.rollout = actor, ref, rollout
        self.shares_actor_module = shares_actor_module

    def get_events(self) -> list[str]:
        """The memory moves recorded so far (the last `MAX_EVENTS`), oldest first."""
        return list(self.events)

    def actor_state(self) -> dict[str, torch.Tensor]:
        """This rank's local shards of the actor's parameters (copies), keyed by name."""
        assert self.actor is not None
        with self._resident():
            return {n: p.to_local().detach().cpu().clone() for n, p in self.actor.model.named_parameters()}

    def cpu_affinity(self) -> list[int]:
        """The CPUs this worker's main thread may run on."""
        return sorted(os.sched_getaffinity(0))

    def ref_state(self) -> dict[str, torch.Tensor]:
        """This rank's local shards of the reference's parameters (copies), keyed by name."""
        assert self.ref is not None
        with self._resident():
            return {n: p.to_local().detach().cpu().clone() for n, p in self.ref.model.named_parameters()}

    def expert_parallel_modules(self) -> dict[str, list[str]]:
        """Per role (actor, ref): the names of its modules whose experts are spread over the ranks
        (`fusedrl.workers.expert_parallel.ExpertParallelExperts`)."""
        from fusedrl.workers.expert_parallel import ExpertParallelExperts

        roles = {"actor": self.actor, "ref": self.ref}
        return {
            role: [n for n, m in r.model.named_modules() if isinstance(m, ExpertParallelExperts)]
            for role, r in roles.items()
            if r is not None
        }

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
            "largest_buffer_bytes": float(stats.largest_buffer_bytes),
            "total_bytes": float(stats.total_bytes),
        }

    def actor_training_bytes(self) -> dict[str, float]:
        """This rank's bytes of the actor's trainable parameters and of its optimizer state (local
        shards): what LoRA shrinks."""
        assert self.actor is not None

        def local_bytes(t: torch.Tensor) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size()

        trainable = [p for p in self.actor.model.parameters() if p.requires_grad]
        state = [v for s in self.actor.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return {
            "trainable_params": float(sum(p.numel() for p in trainable)),
            "trainable_bytes": float(sum(local_bytes(p) for p in trainable)),
            "optimizer_state_bytes": float(sum(local_bytes(v) for v in state)),
        }

    def compute_dtypes(self) -> dict[str, str]:
        """The dtypes the models really compute in: the actor's weights inside a forward (after FSDP2's
        mixed-precision cast) and the rollout engine's parameters. Collective (the forward all-gathers)."""
        assert self.actor is not None
        seen: list[torch.dtype] = []
        layer = self.actor.model.model.layers[0]
        hook = layer.register_forward_pre_hook(lambda m, args: seen.append(next(m.parameters()).dtype))
        try:
            with self._resident(), torch.no_grad():
                ids = torch.ones(1, 2, dtype=torch.long, device=device_type())
                self.actor.model(input_ids=ids)
        finally:
            hook.remove()
        out = {"actor": str(seen[0]).removeprefix("torch.")}
        if self.rollout is not None and not self.shares_actor_module:
            out["rollout"] = str(self.rollout.param_dtype()).removeprefix("torch.")
        return out

    def torch_threads(self) -> int:
        """Torch's intra-op threads in this worker (the CPUs of its slot on a CPU machine)."""
        return torch.get_num_threads()

    def ping(self) -> int:
        """This worker's rank: a round trip with no work."""
        return self.rank

    def pid(self) -> int:
        """The worker's process id."""
        return os.getpid()

    def echo_rows(self, batch: RolloutBatch) -> int:
        """Receives a batch and answers its size: the controller round trip without any model work."""
        return batch.num_samples

    def actor_tied_embeddings(self) -> dict[str, Any]:
        """Whether the actor's output head is still its input embedding (one parameter object, as
        ``tie_word_embeddings`` asks), with this rank's local shards of both."""
        assert self.actor is not None
        model = self.actor.model
        head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        with self._resident():
            return {
                "same": head is embed,
                "lm_head": head.to_local().detach().cpu().clone(),
                "embed": embed.to_local().detach().cpu().clone(),
            }

    def rollout_tied_embeddings(self) -> dict[str, Any]:
        """The engine's input embedding (a copy) and whether its output head is that tensor or equal to it.
        The engine's weights must be awake and hold streamed values."""
        engine = self.rollout.engine
        engine.model_state()  # refuses while the weights are asleep or discarded
        model = engine._model()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        return {
            "same": head is embed or head.data_ptr() == embed.data_ptr(),
            "equal": bool(torch.equal(head.detach(), embed.detach())),
            "embed": embed.detach().cpu().clone(),
        }


class InspectionMethods:
    """The fused worker's remote methods for tests and benchmarks, each answered by its `InspectionHooks`
    (``self.inspection``)."""

    inspection: InspectionHooks

    def get_events(self) -> list[str]:
        return self.inspection.get_events()

    def actor_state(self) -> dict[str, torch.Tensor]:
        return self.inspection.actor_state()

    def ref_state(self) -> dict[str, torch.Tensor]:
        return self.inspection.ref_state()

    def cpu_affinity(self) -> list[int]:
        return self.inspection.cpu_affinity()

    def expert_parallel_modules(self) -> dict[str, list[str]]:
        return self.inspection.expert_parallel_modules()

    def measure_weight_stream(self, hoard: bool) -> dict[str, float]:
        return self.inspection.measure_weight_stream(hoard)

    def actor_training_bytes(self) -> dict[str, float]:
        return self.inspection.actor_training_bytes()

    def compute_dtypes(self) -> dict[str, str]:
        return self.inspection.compute_dtypes()

    def torch_threads(self) -> int:
        return self.inspection.torch_threads()

    def ping(self) -> int:
        return self.inspection.ping()

    def pid(self) -> int:
        return self.inspection.pid()

    def echo_rows(self, batch: RolloutBatch) -> int:
        return self.inspection.echo_rows(batch)

    def actor_tied_embeddings(self) -> dict[str, Any]:
        return self.inspection.actor_tied_embeddings()

    def rollout_tied_embeddings(self) -> dict[str, Any]:
        return self.inspection.rollout_tied_embeddings()
