"""`workers.distributed.agreed_by_ranks`: the value every rank holds alike, else a clear error on every rank
(two gloo processes; the in-place sync agrees on whether to stream with it)."""

from __future__ import annotations

import os

import torch.distributed as dist
import torch.multiprocessing as mp
from support import free_port


def _entry(rank: int, port: int, out: str) -> None:
    from fusedrl.workers.distributed import agreed_by_ranks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        same = agreed_by_ranks(True, "whether their engines need a stream")
        try:
            agreed_by_ranks(rank == 0, "whether their engines need a stream")
            differ = "no error"
        except RuntimeError as err:
            differ = str(err)
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
            f.write(f"{same}\n{differ}")
    finally:
        dist.destroy_process_group()


def test_agreed_by_ranks(tmp_path):
    from fusedrl.workers.distributed import agreed_by_ranks

    assert agreed_by_ranks(3, "anything") == 3  # no process group: this process's value
    mp.spawn(_entry, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        same, differ = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        assert same == "True"
        assert differ == "the ranks disagree whether their engines need a stream: [True, False] (rank order)"
