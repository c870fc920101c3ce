"""Which CUDA device a worker process drives.

Ray starts each fused worker with ``num_gpus=1`` and sets ``CUDA_VISIBLE_DEVICES`` to that one device, so
inside the process it is always device 0, whatever the worker's rank. A launcher that shows every device
of the node to every process (torchrun, or Ray without GPU isolation) instead needs the rank on the node.
The rule below covers both: the worker's slot on its node, taken modulo the devices the process can see.
vLLM's ``external_launcher`` reads ``LOCAL_RANK`` and requires it to be below the visible device count.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def visible_device_count(environ: Mapping[str, str], device_count: int) -> int:
    """Devices this process can address: ``device_count`` (what CUDA reports), cut to the entries of
    ``CUDA_VISIBLE_DEVICES`` when that is set (an empty value hides every device)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return device_count
    entries = [v for v in visible.split(",") if v.strip()]
    return min(len(entries), device_count)


def local_device_index(
    rank: int, slots_per_node: int, *, device_count: int, environ: Mapping[str, str] | None = None
) -> int:
    """The index, among the visible devices, of the device that the worker of global ``rank`` drives.

    ``slots_per_node``: ``trainer.n_gpus_per_node``. ``device_count``: ``torch.cuda.device_count()``
    (0 on a CPU machine: the slot on the node is returned, which is what ``LOCAL_RANK`` means there).
    """
    env = os.environ if environ is None else environ
    slot = rank % max(1, slots_per_node)
    if device_count == 0:
        return slot
    visible = visible_device_count(env, device_count)
    if visible == 0:
        raise RuntimeError(
            f"rank {rank}: CUDA reports {device_count} device(s) but CUDA_VISIBLE_DEVICES="
            f"{env.get('CUDA_VISIBLE_DEVICES')!r} hides them all; give each worker one GPU (num_gpus=1)."
        )
    return slot % visible
