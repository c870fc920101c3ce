"""The reference under bf16 mixed precision keeps its shards in bf16 (`fusedrl.workers.actor._sharded_model`,
``frozen``): its log-probs must equal, bit for bit, those of the same model kept in float32 and cast by
FSDP2's mixed precision at every gather, which is what a frozen model's float32 master weights amount to.
Real gloo process group, one rank."""

from __future__ import annotations

import torch
from support import padded_batch, single_rank_group, spawned_result

TP, TR = 6, 5


def _body(port: int, model_dir: str, out: str) -> None:
    with single_rank_group(port):
        from fusedrl.config import role_configs_from_overrides
        from fusedrl.workers.actor import RefRole
        from fusedrl.workers.fsdp import load_causal_lm, shard_for_training
        from fusedrl.workers.logprob import batched_log_probs

        cfg = role_configs_from_overrides(
            [
                "data.train_files=unused",
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.ref.fsdp_config.model_dtype=float32",
                "actor_rollout_ref.ref.fsdp_config.param_dtype=bfloat16",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3",
            ]
        )
        ref = RefRole(cfg.model, cfg.ref)
        # The route the frozen path replaces: float32 shards, cast to bf16 by FSDP2 at every gather.
        cast_each_pass = shard_for_training(
            load_causal_lm(model_dir, "float32", ref.model.config._attn_implementation),
            gradient_checkpointing=False,
            param_dtype="bfloat16",
        )
        gen = torch.Generator().manual_seed(5)
        batch = padded_batch([6, 4, 3, 5, 2, 6], [5, 2, 4, 1, 5, 3], tp=TP, tr=TR, gen=gen)
        torch.save(
            {
                "dtypes": sorted({str(p.dtype) for p in ref.model.parameters()}),
                "baseline_dtypes": sorted({str(p.dtype) for p in cast_each_pass.parameters()}),
                "frozen": ref.compute_log_prob(batch, temperature=0.7),
                "cast_each_pass": batched_log_probs(
                    cast_each_pass, batch, temperature=0.7, micro_batch_size=3, max_token_len=None
                ),
                "mask": batch.response_mask.bool(),
            },
            out,
        )


def test_bf16_reference_is_stored_in_bf16_with_the_same_log_probs(tiny_model_dir, tmp_path):
    r = spawned_result(_body, tiny_model_dir, tmp_path, timeout=300)
    assert r["dtypes"] == ["torch.bfloat16"]  # stored cast: half the memory, no cast per pass
    assert r["baseline_dtypes"] == ["torch.float32"]
    frozen, baseline = r["frozen"][r["mask"]], r["cast_each_pass"][r["mask"]]
    assert torch.isfinite(frozen).all() and frozen.abs().sum() > 0
    assert torch.equal(frozen, baseline), float((frozen - baseline).abs().max())
