"""The reward model with Ulysses sequence parallelism (``reward_model.ulysses_sequence_parallel_size=2``) on
2 gloo ranks gives the same sequence scores as with sp=1.

sp=1: data parallel over 2 ranks, each rank scores half the rows in padded forwards (as the driver's
``run_split`` shards them). sp=2: one sequence-parallel group of both ranks, both get every row
(``run_split(..., replicas=2)``), each runs half of the packed tokens and the head's per-token outputs are
gathered before each row's last real token is read. Rows of different prompt / response lengths (left-
and right-padding, micro-batches of 3 rows) check that the last token is found in the packed layout.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.multiprocessing as mp
from support import free_port, padded_batch

TP, TR = 16, 12
PROMPT_LENS = [16, 1, 9, 3, 12, 2, 5, 7]
RESPONSE_LENS = [12, 1, 3, 12, 6, 2, 9, 1]
# float32 forwards summed in another order (packed vs padded rows, heads split over ranks): a few ulps of
# activations of size O(1) through a 2-layer model, as in test_ulysses_actor.py.
ATOL = 2e-5


def _batch():
    return padded_batch(PROMPT_LENS, RESPONSE_LENS, tp=TP, tr=TR, gen=torch.Generator().manual_seed(5))


def _run(rank: int, rm_dir: str, out: str) -> None:
    import torch.distributed as dist

    from fusedrl.config import role_configs_from_overrides
    from fusedrl.workers.reward_model import RewardModelRole

    full = _batch()
    scores = {}
    for sp in (1, 2):
        cfg = role_configs_from_overrides(
            [
                "data.train_files=unused",
                f"actor_rollout_ref.model.path={rm_dir}",
                "reward_model.enable=true",
                f"reward_model.model.path={rm_dir}",
                "reward_model.fsdp_config.model_dtype=float32",
                "reward_model.micro_batch_size_per_gpu=3",
                f"reward_model.ulysses_sequence_parallel_size={sp}",
            ]
        ).reward_model
        role = RewardModelRole(cfg)
        assert (role.sp_group is None) == (sp == 1)
        batch = full if sp == 2 else full[rank * 4 : rank * 4 + 4]  # sp=1: this rank's half of the rows
        seen: list[torch.Size] = []  # the token ids each forward of this rank embeds
        hook = role.model.model.embed_tokens.register_forward_hook(
            lambda _m, i, _o, sink=seen: sink.append(i[0].shape)
        )
        scores[sp] = role.compute_scores(batch)  # [B] or [B/2]
        hook.remove()
        scores[f"seen{sp}"] = seen
        del role
        dist.barrier()
    torch.save(scores, Path(out) / f"rank{rank}.pt")


def _entry(rank: int, world_size: int, port: int, rm_dir: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _run(rank, rm_dir, out)
    finally:
        dist.destroy_process_group()


def test_ulysses_reward_model_matches_data_parallel(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)  # the score head is new: saved once, so both runs load the same head
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32)
    rm_dir = str(tmp_path / "rm")
    rm.save_pretrained(rm_dir)
    mp.spawn(_entry, args=(2, free_port(), rm_dir, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    dp = torch.cat([ranks[0][1], ranks[1][1]])  # [8]
    assert dp.shape == (8,) and dp.abs().min() > 1e-4 and len(set(dp.tolist())) == 8  # real, distinct
    # The padded path itself reads the head at each row's last real token: check one row by hand.
    batch = _batch()
    ids, mask, pos = batch[torch.tensor([3])].sequences()  # [1, T]
    with torch.no_grad():
        hidden = rm.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state  # [1, T, H]
        expected = rm.score(hidden[0, TP + RESPONSE_LENS[3] - 1]).float()  # [1]
    torch.testing.assert_close(dp[3:4], expected, atol=ATOL, rtol=0)
    for r in ranks:
        torch.testing.assert_close(r[2], dp, atol=ATOL, rtol=0)
        # sp=2 really splits: one packed row per micro-batch (3 of them), this rank's half of its tokens
        # (each row padded to a multiple of 2), not the padded [3, Tp+Tr] forwards of sp=1.
        assert len(r["seen2"]) == 3 and all(shape[0] == 1 for shape in r["seen2"])
        real = sum(PROMPT_LENS) + sum(RESPONSE_LENS)
        assert sum(shape[1] for shape in r["seen2"]) <= real // 2 + 3
        assert all(shape[1] == TP + TR for shape in r["seen1"])
