"""On CPU, FSDP2 units stay gathered for a whole pass (`fusedrl.workers.fsdp.gathered_for_pass`).

Two gloo ranks run the same actor twice from one checkpoint: once with the per-micro-batch regather
(``GATHER_ONCE_PER_PASS = False``, FSDP2's default) and once gathering each unit once per pass. Each run
records the log-probs of a no-grad pass over 4 micro-batches, the parameters after one update of
2 mini-batches x 2 micro-batches, and how many all-gathers each pass issued (counted at FSDP2's own
all-gather). The tests check that the numbers are the same, that the gathers drop to one per unit per pass,
and that after a pass every parameter is back to its shard (the optimizer and the weight stream see shards,
and a later forward gathers again).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from support import free_port, gloo_rank, padded_batch

ROLLOUT_N = 2
TP, TR = 8, 6
PROMPT_LENS = [8, 3, 5, 2, 7, 4, 6, 1]
RESPONSE_LENS = [6, 2, 4, 6, 3, 5, 1, 2]


def _config(model_dir: str):
    from fusedrl.config import role_configs_from_overrides

    return role_configs_from_overrides(
        [
            "data.train_files=unused",
            f"actor_rollout_ref.model.path={model_dir}",
            f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.dtype=float32",
            "actor_rollout_ref.actor.fsdp_config.param_dtype=null",  # float32, as the tolerances assume
            "trainer.val_before_train=false",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # 2 prompts x n=2 over 2 ranks: 2 rows per rank
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",  # 2 micro-batches per mini-batch
            "actor_rollout_ref.actor.optim.lr=1e-3",
        ],
    )


class _GatherCounter:
    """Counts FSDP2's all-gathers (one per unit unshard) by wrapping the function its param group calls."""

    def __init__(self) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

        self.module, self.original, self.count = pg, pg.foreach_all_gather, 0

        def counted(*args, **kwargs):
            self.count += 1
            return self.original(*args, **kwargs)

        pg.foreach_all_gather = counted

    def take(self) -> int:
        n, self.count = self.count, 0
        return n


def _all_sharded(model) -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in model.parameters())


def _rank(rank: int, model_dir: str, out: str) -> None:
    import fusedrl.workers.fsdp as fsdp
    from fusedrl.workers.actor import ActorRole
    from fusedrl.workers.logprob import response_log_probs

    gen = torch.Generator().manual_seed(5)
    full = padded_batch(PROMPT_LENS, RESPONSE_LENS, tp=TP, tr=TR, gen=gen)
    full.advantages = torch.randn(len(PROMPT_LENS), 1, generator=gen).expand(-1, TR) * full.response_mask
    shard = full[torch.arange(rank * 4, rank * 4 + 4)]  # [4, ...] rows per rank
    counter = _GatherCounter()
    results: dict = {}
    for once in (False, True):
        fsdp.GATHER_ONCE_PER_PASS = once
        tag = "once" if once else "regather"
        cfg = _config(model_dir)
        actor = ActorRole(cfg.model, cfg.actor, rollout_n=ROLLOUT_N)
        results["units"] = len(fsdp.fsdp_units(actor.model))
        counter.take()
        lp = actor.compute_log_prob(shard, temperature=0.7, micro_batch_size=1)  # 4 micro-batches
        results[f"{tag}/lp_gathers"] = counter.take()
        results[f"{tag}/log_probs"] = lp
        results[f"{tag}/sharded_after_lp"] = _all_sharded(actor.model)
        train = shard.clone()
        train.old_log_probs = lp
        results[f"{tag}/metrics"] = actor.update(train, temperature=0.7)
        results[f"{tag}/update_gathers"] = counter.take()
        results[f"{tag}/sharded_after_update"] = _all_sharded(actor.model)
        with torch.no_grad():  # a plain forward after the pass: units reshard after it again
            response_log_probs(actor.model, shard[torch.arange(2)], temperature=0.7)
        results[f"{tag}/plain_forward_gathers"] = counter.take()
        results[f"{tag}/sharded_after_plain"] = _all_sharded(actor.model)
        results[f"{tag}/params"] = {n: p.full_tensor().clone() for n, p in actor.model.named_parameters()}
        del actor
    torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("gather_once")
    mp.spawn(gloo_rank, args=(2, free_port(), _rank, (tiny_model_dir, str(out))), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.timeout(300)
def test_same_numbers_with_one_gather_per_pass(ranks):
    for r in ranks:
        torch.testing.assert_close(r["once/log_probs"], r["regather/log_probs"], atol=1e-6, rtol=0)
        for name, value in r["regather/params"].items():
            torch.testing.assert_close(r["once/params"][name], value, atol=1e-6, rtol=1e-5, msg=name)
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert abs(r["once/metrics"][key] - r["regather/metrics"][key]) <= 1e-5 * max(
                1.0, abs(r["regather/metrics"][key])
            )


@pytest.mark.timeout(300)
def test_each_unit_gathered_once_per_pass(ranks):
    for r in ranks:
        units = r["units"]
        assert units >= 3  # 2 decoder layers + the root
        # no-grad pass over 4 micro-batches: every unit per micro-batch vs every unit once
        assert r["regather/lp_gathers"] == 4 * units
        assert r["once/lp_gathers"] == units
        # update, 2 mini-batches x 2 micro-batches: every unit for each forward and again for its backward
        # vs every unit once per mini-batch (resharded for the optimizer step in between)
        assert r["regather/update_gathers"] == 2 * 2 * 2 * units
        assert r["once/update_gathers"] == 2 * units


@pytest.mark.timeout(300)
def test_shards_are_restored_after_every_pass(ranks):
    for r in ranks:
        for tag in ("once", "regather"):
            assert r[f"{tag}/sharded_after_lp"] and r[f"{tag}/sharded_after_update"], tag
            assert r[f"{tag}/sharded_after_plain"], tag
        # outside a pass the default is back: a plain forward gathers each layer and the root again
        assert r["once/plain_forward_gathers"] == r["regather/plain_forward_gathers"] == r["units"]
