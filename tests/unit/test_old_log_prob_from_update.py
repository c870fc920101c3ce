"""Old log-probs from the update's own forward (a batch used once, in one optimizer step).

Two actors start from the same weights. One gets ``old_log_probs`` from a separate no-grad pass (the
recomputed route) and updates; the other updates a batch without them, so its loss takes the forward's
own log-probs, detached. The two updates must be the same (parameters within 1e-6 after a large step) and
the forward's log-probs must equal the separate pass's. Run for row micro-batches and for dynamic batch
size (which reorders rows into micro-batches, so the order must be restored). Real gloo process group.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.multiprocessing as mp
from support import free_port, local_params, padded_batch, single_rank_group

TP, TR = 6, 5
LR = 1e-2


def _configs(model_dir: str, dynamic: bool):
    """The YAML's model and actor sections (typed, as the workers get them) with this test's sizes."""
    from fusedrl.config import role_configs_from_overrides

    actor = "actor_rollout_ref.actor"
    cfg = role_configs_from_overrides(
        [
            "data.train_files=unused",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.n=2",
            f"{actor}.ppo_mini_batch_size=3",  # prompts: 3 x n=2 = the whole 6-row batch, one optimizer step
            f"{actor}.ppo_micro_batch_size_per_gpu=2",
            f"{actor}.use_dynamic_bsz={dynamic}",
            f"{actor}.ppo_max_token_len_per_gpu=16",  # 2-3 rows of up to 11 tokens: rows regrouped by length
            f"{actor}.ppo_epochs=1",
            f"{actor}.clip_ratio=0.2",
            f"{actor}.loss_agg_mode=token-mean",
            f"{actor}.entropy_coeff=0.01",
            f"{actor}.use_kl_loss=true",
            f"{actor}.kl_loss_coef=0.1",
            f"{actor}.kl_loss_type=low_var_kl",
            f"{actor}.grad_clip=1.0",
            f"{actor}.policy_loss.loss_mode=vanilla",
            f"{actor}.optim.lr={LR}",
            f"{actor}.optim.weight_decay=0.0",
            f"{actor}.fsdp_config.model_dtype=float32",
            f"{actor}.fsdp_config.param_dtype=null",
            # Padded rows, as before `auto`: packed micro-batches of other compositions differ by float32
            # rounding (~5e-7 in log-probs), which Adam's first step lifts above the 1e-6 parameter bound.
            "actor_rollout_ref.model.use_remove_padding=false",
        ],
    )
    return cfg.model, cfg.actor


def _batch():
    gen = torch.Generator().manual_seed(3)
    batch = padded_batch([6, 4, 3, 5, 2, 6], [5, 2, 4, 1, 5, 3], tp=TP, tr=TR, gen=gen)
    batch.advantages = torch.randn(6, TR, generator=gen) * batch.response_mask  # [B, Tr]
    batch.ref_log_probs = -6.0 + 0.1 * torch.randn(6, TR, generator=gen)  # [B, Tr]
    return batch


def _worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    with single_rank_group(port):
        from fusedrl.workers.actor import ActorRole

        result = {}
        for dynamic in (False, True):
            model_cfg, actor_cfg = _configs(model_dir, dynamic)
            torch.manual_seed(0)
            recomputed = ActorRole(model_cfg, actor_cfg, rollout_n=2)
            torch.manual_seed(0)
            reused = ActorRole(model_cfg, actor_cfg, rollout_n=2)
            before = local_params(recomputed.model)

            batch = _batch()
            old = recomputed.compute_log_prob(
                batch, temperature=0.7, micro_batch_size=4, max_token_len=16 if dynamic else None
            )  # [B, Tr], the separate pass
            batch.old_log_probs = old
            m_recomputed = recomputed.update(batch, temperature=0.7)

            batch = _batch()  # no old_log_probs
            m_reused = reused.update(batch, temperature=0.7)
            forward = reused.forward_log_probs

            p_rec, p_reu = local_params(recomputed.model), local_params(reused.model)
            result[str(dynamic)] = {
                "max_param_diff": max(float((p_rec[n] - p_reu[n]).abs().max()) for n in p_rec),
                "max_param_change": max(float((p_rec[n] - before[n]).abs().max()) for n in p_rec),
                "changed": sum(bool((p_rec[n] != before[n]).any()) for n in p_rec) / len(p_rec),
                "log_prob_diff": float((forward - old).abs().max()),
                "padding_zero": bool((forward[batch.response_mask == 0] == 0).all()),
                "pg_loss": [m_recomputed["actor/pg_loss"], m_reused["actor/pg_loss"]],
                "grad_norm": [m_recomputed["actor/grad_norm"], m_reused["actor/grad_norm"]],
                "ppo_kl": m_reused["actor/ppo_kl"],
            }
        Path(out_dir, "result.json").write_text(json.dumps(result))


def test_update_with_forward_old_log_probs_equals_recomputed(tiny_model_dir, tmp_path):
    mp.spawn(_worker, args=(free_port(), tiny_model_dir, str(tmp_path)), nprocs=1, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    for dynamic, r in result.items():
        # A real step: Adam moves parameters by ~lr; both routes move them the same way.
        assert r["max_param_change"] > 0.5 * LR, (dynamic, r)
        assert r["changed"] > 0.9, (dynamic, r)
        assert r["max_param_diff"] <= 1e-6, (dynamic, r)
        # The forward's log-probs are the old policy's: float32 agreement of two forwards of other shapes.
        assert r["log_prob_diff"] <= 1e-5, (dynamic, r)
        assert r["padding_zero"], dynamic
        assert abs(r["pg_loss"][0] - r["pg_loss"][1]) <= 1e-5 * max(1.0, abs(r["pg_loss"][0])), (dynamic, r)
        assert abs(r["grad_norm"][0] - r["grad_norm"][1]) <= 1e-4 * r["grad_norm"][0], (dynamic, r)
        assert abs(r["ppo_kl"]) <= 1e-7, (dynamic, r)  # ratio exactly 1 on the reused route


def test_update_without_old_log_probs_refuses_several_steps(tiny_model_dir):
    """Several mini-batches (or epochs) need the old policy's log-probs from before the first step."""
    import dataclasses

    import pytest

    cfg = dataclasses.replace(
        _configs(tiny_model_dir, False)[1], ppo_mini_batch_size=1
    )  # three optimizer steps
    with pytest.raises(ValueError, match="one mini-batch"):
        _refusal(tiny_model_dir, cfg)


def _refusal(model_dir: str, cfg) -> None:
    """ActorRole.update's check runs before any collective; build the role's state without a group."""
    from fusedrl.workers.actor import ActorRole

    actor = ActorRole.__new__(ActorRole)
    actor.cfg, actor.world_size, actor.rollout_n = cfg, 1, 2
    actor.model = torch.nn.Linear(1, 1)
    actor.update(_batch(), temperature=1.0)
