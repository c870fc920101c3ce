"""Process-group start-up shared by every worker kind (fused RL workers, SFT workers).

Start-up is two-phase because torch.distributed needs rank 0's address before any rank can join: the
driver asks rank 0 for `rendezvous_address`, then every rank calls `join_process_group` with it.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fusedrl.workers.carried_moves import MoveCarrier
from fusedrl.workers.device import local_device_index
from fusedrl.workers.fsdp import device_type


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rendezvous_address(nnodes: int) -> tuple[str, int]:
    """This host's address (loopback on a single node) and a free port, for rank 0 to serve."""
    host = "127.0.0.1" if nnodes == 1 else socket.gethostbyname(socket.gethostname())
    return host, _free_port()


def join_process_group(
    *, rank: int, world_size: int, master_addr: str, master_port: int, slots_per_node: int, **extra_env: str
) -> None:
    """Set the torch.distributed environment (plus ``extra_env``), pick this rank's device and join the
    default process group: NCCL on CUDA, gloo on CPU. Collective.

    The device is the worker's slot on its node among the devices it can see (`local_device_index`: under
    Ray, one visible device, index 0); ``LOCAL_RANK`` is set to it, as vLLM's external launcher expects."""
    local_rank = local_device_index(rank, slots_per_node, device_count=torch.cuda.device_count())
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        TOKENIZERS_PARALLELISM="false",
        **extra_env,
    )
    if device_type() == "cuda":
        torch.cuda.set_device(local_rank)
    backend = "nccl" if device_type() == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=30),
        # NCCL binds the group to this worker's device up front instead of guessing it from the rank.
        device_id=torch.device("cuda", local_rank) if backend == "nccl" else None,
    )


def agreed_by_ranks(value: Any, what: str) -> Any:
    """``value``, which every rank of the default process group must hold alike (collective); a clear error
    on every rank where they differ (``what``: what the value says, for the message)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    if any(v != value for v in every):
        raise RuntimeError(f"the ranks disagree {what}: {every} (rank order)")
    return value


class DistributedWorker(MoveCarrier):
    """What every worker kind shares: who it is, and the two-phase join of its group's process group.

    ``config`` is the run's typed role configs (`fusedrl.role_config.RoleConfigs` / ``SFTRoleConfigs``):
    its ``trainer.nnodes`` / ``n_gpus_per_node`` decide the rendezvous host and the local device index."""

    def __init__(self, config: Any, *, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.auto_report: dict[str, Any] = {"settings": {}, "line": ""}

    def _resolve_auto_defaults(self, roles: Any = None) -> None:
        """Resolve the config's ``auto`` keys for this group's device, after `_join` (collective: the ranks
        agree on one set of device facts, `fusedrl.auto_defaults.group_facts`), before any role is built.
        ``roles``: the roles this worker holds, whose keys its report names."""
        from fusedrl.auto_defaults import group_facts, report, resolve_configs

        facts = group_facts()
        self.config, chosen = resolve_configs(self.config, facts, roles)
        self.auto_report = report(chosen, facts)
        if self.auto_report["line"] and self.rank == 0:
            logging.getLogger("fusedrl").info("%s", self.auto_report["line"])

    def resolved_defaults(self) -> dict[str, Any]:
        """What this worker's ``auto`` keys became: ``{"settings": {dotted key: value}, "line": str}`` (the
        trainer prints the line once and keeps the settings, `fusedrl.auto_defaults.announce_resolved`)."""
        return self.auto_report

    def master_address(self) -> tuple[str, int]:
        """Rank 0 is asked for the rendezvous address of torch.distributed."""
        return rendezvous_address(int(self.config.trainer.nnodes))

    def _join(self, master_addr: str, master_port: int, **extra_env: str) -> None:
        join_process_group(
            rank=self.rank,
            world_size=self.world_size,
            master_addr=master_addr,
            master_port=master_port,
            slots_per_node=int(self.config.trainer.n_gpus_per_node),
            **extra_env,
        )
