"""The FSDP2 actor with Ulysses sequence parallelism (``actor.ulysses_sequence_parallel_size=2``) on 2 gloo
ranks computes the same old log-probs, loss metrics and reduced gradients as the same actor with sp=1;
the reference (which follows the actor's sp) the same log-probs; the critic with
``critic.ulysses_sequence_parallel_size=2`` the same values, value loss and reduced gradients.

sp=1: data parallel over 2 ranks, each rank gets half the rows (as the driver's ``run_split`` shards
them), padded forwards. sp=2: one sequence-parallel group of both ranks, data-parallel size 1, both ranks
get every row (``run_split(..., replicas=2)``), each rank runs half of the packed tokens. One optimizer
step over the whole 8-row batch in both cases (token-mean loss, entropy bonus, grad clip); the gradients
FSDP2 reduced are compared before the step is taken into account (AdamW's first step divides by |g|, so
parameters would amplify float noise on near-zero gradients). Tolerances as in test_ulysses.py.
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
ATOL = 2e-5
GRAD_RTOL = 1e-4


def _configs(model_dir: str, sp: int):
    """The typed model, actor, ref and critic configs the workers would get, with this test's sizes."""
    from fusedrl.config import role_configs_from_overrides

    actor = "actor_rollout_ref.actor"
    cfg = role_configs_from_overrides(
        [
            "data.train_files=unused",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.n=2",
            f"{actor}.ulysses_sequence_parallel_size={sp}",
            f"{actor}.ppo_mini_batch_size=4",  # 4 prompts x n=2 = the whole 8-row batch: one optimizer step
            f"{actor}.ppo_micro_batch_size_per_gpu=2",
            f"{actor}.ppo_epochs=1",
            f"{actor}.loss_agg_mode=token-mean",
            f"{actor}.entropy_coeff=0.01",
            f"{actor}.use_kl_loss=false",
            f"{actor}.grad_clip=1.0",
            f"{actor}.policy_loss.loss_mode=vanilla",
            f"{actor}.optim.lr=1e-3",
            f"{actor}.optim.weight_decay=0.0",
            f"{actor}.fsdp_config.model_dtype=float32",
            f"{actor}.fsdp_config.param_dtype=null",
            f"critic.ulysses_sequence_parallel_size={sp}",
            "critic.optim.lr=1e-3",
            "critic.optim.weight_decay=0.0",
            "critic.grad_clip=1.0",
            # float32 compute on every CPU: `auto` is bf16 where bf16 is native (AMX, AVX-512 BF16)
            "critic.model.fsdp_config.param_dtype=null",
        ],
    )
    return cfg.model, cfg.actor, cfg.ref, cfg.critic


def _batch():
    gen = torch.Generator().manual_seed(3)
    batch = padded_batch(PROMPT_LENS, RESPONSE_LENS, tp=TP, tr=TR, gen=gen)
    batch.advantages = torch.randn(len(PROMPT_LENS), TR, generator=gen) * batch.response_mask  # [B, Tr]
    return batch


def _run(rank: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from fusedrl.workers.actor import ActorRole, RefRole
    from fusedrl.workers.critic import CriticRole

    results: dict = {}
    full = _batch()
    for sp in (1, 2):
        batch = full if sp == 2 else full[rank * 4 : rank * 4 + 4]  # sp=1: this rank's half of the rows
        model_cfg, actor_cfg, ref_cfg, critic_cfg = _configs(model_dir, sp)
        torch.manual_seed(0)  # the value head is not in the checkpoint: the same random head for both runs
        critic = CriticRole(critic_cfg, rollout_n=2)
        values = critic.compute_values(batch)
        train = batch.clone()
        train.critic_values, train.returns = values, batch.response_mask * 0.5  # [B, Tr]
        critic_metrics = critic.update(train)
        critic_grads = {n: p.grad.full_tensor().clone() for n, p in critic.model.named_parameters()}
        del critic
        ref = RefRole(model_cfg, ref_cfg, sp=sp)  # the reference follows the actor's sp
        ref_log_probs = ref.compute_log_prob(batch, temperature=0.7)
        del ref
        actor = ActorRole(model_cfg, actor_cfg, rollout_n=2)
        assert actor.world_size == 2 // sp  # the data-parallel size
        old = actor.compute_log_prob(batch, temperature=0.7, micro_batch_size=2)
        batch.old_log_probs = old - 0.3 * batch.response_mask  # ratio e^0.3 > 1 + 0.2: A > 0 tokens clip
        metrics = actor.update(batch, temperature=0.7)
        grads = {n: p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()}
        results[sp] = {
            "old_log_probs": old,
            "ref": ref_log_probs,
            "metrics": metrics,
            "grads": grads,
            "values": values,
            "critic_metrics": critic_metrics,
            "critic_grads": critic_grads,
        }
        del actor
        dist.barrier()
    torch.save(results, Path(out) / f"rank{rank}.pt")


def _entry(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _run(rank, model_dir, out)
    finally:
        dist.destroy_process_group()


def test_ulysses_actor_matches_data_parallel(tiny_model_dir, tmp_path):
    mp.spawn(_entry, args=(2, free_port(), tiny_model_dir, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    mask = _batch().response_mask.bool()
    dp_old = torch.cat([ranks[0][1]["old_log_probs"], ranks[1][1]["old_log_probs"]])  # [8, Tr]
    assert dp_old[mask].abs().min() > 1e-3
    dp_ref = torch.cat([ranks[0][1]["ref"], ranks[1][1]["ref"]])  # [8, Tr]
    for r in ranks:
        torch.testing.assert_close(r[2]["old_log_probs"], dp_old, atol=ATOL, rtol=0)
        torch.testing.assert_close(r[2]["ref"], dp_ref, atol=ATOL, rtol=0)
    dp_metrics, sp_metrics = ranks[0][1]["metrics"], ranks[0][2]["metrics"]
    assert dp_metrics["actor/pg_clipfrac"] > 0  # the clip is exercised
    for key in ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert abs(sp_metrics[key] - dp_metrics[key]) <= 1e-5 * max(1.0, abs(dp_metrics[key])), key
    assert (
        abs(sp_metrics["actor/grad_norm"] - dp_metrics["actor/grad_norm"])
        <= GRAD_RTOL * dp_metrics["actor/grad_norm"]
    )
    for r in ranks:
        for part in ("grads", "critic_grads"):
            for name, g in ranks[0][1][part].items():
                scale = float(g.abs().max())
                assert scale > 0, (part, name)
                err = float((r[2][part][name] - g).abs().max())
                assert err <= GRAD_RTOL * scale, (part, name, err, scale)
    # The critic (critic.ulysses_sequence_parallel_size=2): values and the value loss as data parallel.
    dp_values = torch.cat([ranks[0][1]["values"], ranks[1][1]["values"]])  # [8, Tr]
    assert dp_values[mask].abs().min() > 0
    for r in ranks:
        torch.testing.assert_close(r[2]["values"], dp_values, atol=ATOL, rtol=0)
    for key in ("critic/vf_loss", "critic/grad_norm"):
        dp, sp = ranks[0][1]["critic_metrics"][key], ranks[0][2]["critic_metrics"][key]
        assert abs(sp - dp) <= GRAD_RTOL * max(1e-3, abs(dp)), (key, sp, dp)
