"""CriticRole in real gloo process groups (spawned, so pytest's own process never joins a group).

One 2-rank run regresses a fixed target for 20 updates; one 1-rank run does the first two updates on the
whole batch. The first update must give the same loss and the same new values in both: the mini-batch
normaliser is global, so how rows are split over ranks and micro-batches must not change the step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from support import free_port, padded_batch

ROLLOUT_N = 2
TP, TR = 6, 5
STEPS_2RANK = 20
STEPS_1RANK = 2


def _full_batch():
    """4 samples (2 prompts x n=2), left-padded prompts and right-padded responses of varied lengths."""
    return padded_batch([6, 4, 3, 5], [5, 2, 4, 1], tp=TP, tr=TR, gen=torch.Generator().manual_seed(1))


def _critic_cfg(model_dir: str):
    """The YAML's critic section (typed, as the workers get it) with this test's values."""
    from fusedrl.config import role_configs_from_overrides

    return role_configs_from_overrides(
        [
            "data.train_files=unused",
            f"actor_rollout_ref.model.path={model_dir}",
            "critic.model.fsdp_config.model_dtype=float32",
            "critic.model.fsdp_config.param_dtype=null",
            "critic.model.use_remove_padding=false",
            "critic.model.enable_gradient_checkpointing=false",
            "critic.model.attn_implementation=sdpa",
            "critic.optim.lr=1e-2",
            "critic.optim.betas=[0.9,0.999]",
            "critic.optim.weight_decay=0.0",
            "critic.ppo_mini_batch_size=2",  # prompts across ranks: the whole batch, one optimizer step
            "critic.ppo_micro_batch_size_per_gpu=1",  # gradient accumulation over micro-batches
            "critic.forward_micro_batch_size_per_gpu=2",
            "critic.use_dynamic_bsz=false",
            "critic.ppo_epochs=1",
            "critic.cliprange_value=0.5",
            "critic.grad_clip=1.0",
            "critic.loss_agg_mode=token-mean",
            "critic.ulysses_sequence_parallel_size=1",
        ]
    ).critic


def _worker(rank: int, world_size: int, port: int, model_dir: str, steps: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        from fusedrl.workers.critic import CriticRole

        torch.manual_seed(rank)  # a rank-dependent seed: the value head must still agree across ranks
        critic = CriticRole(_critic_cfg(model_dir), rollout_n=ROLLOUT_N)
        full = _full_batch()
        rows = full.num_samples // world_size
        batch = full[rank * rows : (rank + 1) * rows]
        batch.returns = batch.response_mask.float()  # [b, Tr], target 1.0 on valid tokens

        history = []
        values_log = []
        for _ in range(steps):
            values = critic.compute_values(batch)  # [b, Tr]
            values_log.append(values.tolist())
            batch.critic_values = values
            history.append(critic.update(batch))
        final = critic.compute_values(batch)
        values_log.append(final.tolist())
        result = {"history": history, "values": values_log, "mask": batch.response_mask.tolist()}
        Path(out_dir, f"ws{world_size}_rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _run(world_size: int, model_dir: str, steps: int, out_dir: Path) -> list[dict]:
    mp.spawn(
        _worker,
        args=(world_size, free_port(), model_dir, steps, str(out_dir)),
        nprocs=world_size,
        join=True,
    )
    return [json.loads((out_dir / f"ws{world_size}_rank{r}.json").read_text()) for r in range(world_size)]


def _masked_mse_to_one(values: list, mask: list) -> float:
    v, m = torch.tensor(values), torch.tensor(mask).float()
    return float((((v - 1.0) ** 2) * m).sum() / m.sum())


@pytest.mark.slow  # ~27 s (CI budget); the PPO runs of tests/e2e train the critic on 2 ranks
def test_critic_update_two_ranks_matches_one_rank(tiny_model_dir, tmp_path):
    two = _run(2, tiny_model_dir, STEPS_2RANK, tmp_path)
    one = _run(1, tiny_model_dir, STEPS_1RANK, tmp_path)

    # --- metrics are all-reduced: every rank reports the same numbers
    keys = {
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/lr",
        "critic/skipped_steps",
    }
    for step in range(STEPS_2RANK):
        m0, m1 = two[0]["history"][step], two[1]["history"][step]
        assert set(m0) == keys
        assert m0 == m1, f"step {step}: ranks disagree"
    assert two[0]["history"][0]["critic/lr"] == 1e-2

    # --- compute_values: [b, Tr] per rank, zero on padding
    for r in range(2):
        for values in two[r]["values"]:
            v, mask = torch.tensor(values), torch.tensor(two[r]["mask"])
            assert v.shape == (2, TR)
            assert torch.all(v[mask == 0] == 0)

    # --- the regression converges towards the target
    losses = [m["critic/vf_loss"] for m in two[0]["history"]]
    assert losses[0] > 0.2  # random head: values near 0, target 1 -> about 0.5
    assert losses[-1] < 0.1 * losses[0], losses
    final_mse = [_masked_mse_to_one(two[r]["values"][-1], two[r]["mask"]) for r in range(2)]
    assert max(final_mse) < 0.05, final_mse

    # --- the same first step on 1 rank x 4 rows as on 2 ranks x 2 rows
    first_two = two[0]["history"][0]
    first_one = one[0]["history"][0]
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
        assert abs(first_two[key] - first_one[key]) < 1e-5, (key, first_two[key], first_one[key])
    values_two = torch.tensor(two[0]["values"][1] + two[1]["values"][1])  # after one update, [4, Tr]
    values_one = torch.tensor(one[0]["values"][1])
    torch.testing.assert_close(values_two, values_one, atol=1e-5, rtol=1e-4)
