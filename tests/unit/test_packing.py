"""Remove-padding (packed forwards) and dynamic batch size give the padded path's numbers.

Real FSDP2 roles on gloo process groups, in spawned processes (pytest's own process never joins a group),
float32 throughout. One 1-rank run builds each role twice from the same checkpoint, once padded with
row micro-batches and once packed with token-budget micro-batches, and records log-probs, entropy,
values, and the metrics and parameters after one update; the tests compare the two. A 2-rank run
checks that ranks with very different lengths agree on the number of micro-batches (FSDP forwards are
collectives: disagreeing would hang) and still return every row in place.

Rows have very different lengths (1 to 16 prompt tokens, 1 to 12 response tokens), so a padded micro-batch
is mostly padding and a packed one holds 8 sequences of unequal length.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from support import free_port, padded_batch

ROLLOUT_N = 2
TP, TR = 16, 12
PROMPT_LENS = [16, 1, 9, 3, 12, 2, 5, 7]
RESPONSE_LENS = [12, 1, 3, 12, 6, 2, 9, 1]
BUDGET = 30  # tokens per micro-batch; the longest row has 28
ATOL = 1e-5
# Metrics are sums over ~100 tokens x hidden 32 of products, accumulated in a different order by the padded
# and the packed path (other micro-batch groupings, other matmul shapes, so other CPU kernels: AVX2-only
# and AVX-512 machines differ in the last bits). Float32's unit roundoff is u = 6e-8; a sum of n = 3.2e3
# terms is off by ~sqrt(n) u = 3.4e-6 typically (n u = 2e-4 at worst), and a gradient norm compounds
# that over the ~10 ops of a backward pass: ~3e-5. So losses and means get 2e-5, grad norms 1e-4 (seen:
# 1.8e-5 on an AVX2-only CPU, 0 to 5e-6 on AVX-512 ones). A real packing bug moves them by far more
# (the unmasked control below shifts log-probs by > 1e-2).
METRIC_RTOL = 2e-5
GRAD_NORM_RTOL = 1e-4


def _batch():
    gen = torch.Generator().manual_seed(3)
    batch = padded_batch(PROMPT_LENS, RESPONSE_LENS, tp=TP, tr=TR, gen=gen)
    b = len(PROMPT_LENS)
    batch.advantages = torch.randn(b, 1, generator=gen).expand(b, TR) * batch.response_mask  # [B, Tr]
    return batch


def _config(model_dir: str, loss_agg_mode: str, packed: bool):
    """The trainer YAML's defaults (typed, as the workers get them) with the test's sizes: padded + rows,
    or packed + token budget."""
    from fusedrl.config import role_configs_from_overrides

    return role_configs_from_overrides(
        [
            "data.train_files=unused",
            f"actor_rollout_ref.model.path={model_dir}",
            f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.dtype=float32",
            # float32 training, as the comparisons' tolerances assume (param_dtype=auto: bf16 on native-bf16 CPUs)
            "actor_rollout_ref.actor.fsdp_config.param_dtype=null",
            "actor_rollout_ref.ref.fsdp_config.param_dtype=null",
            "critic.model.fsdp_config.param_dtype=null",
            "trainer.val_before_train=false",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # 2 prompts x n=2: 4 rows, 2 optimizer steps
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",  # padded micro-batches of 3 + 1 rows
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.1",
            f"actor_rollout_ref.actor.loss_agg_mode={loss_agg_mode}",
            f"critic.loss_agg_mode={loss_agg_mode}",
            "critic.optim.lr=1e-2",
            "critic.forward_micro_batch_size_per_gpu=3",
            f"actor_rollout_ref.model.use_remove_padding={packed}",
            f"actor_rollout_ref.actor.use_dynamic_bsz={packed}",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={BUDGET}",
            f"critic.ppo_max_token_len_per_gpu={BUDGET}",
        ],
    )


def _full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _one_rank(model_dir: str, loss_agg_mode: str, out: str) -> None:
    from fusedrl.workers.actor import ActorRole
    from fusedrl.workers.critic import CriticRole
    from fusedrl.workers.logprob import response_log_probs, split_micro_batches

    results: dict = {}
    batch = _batch()
    for packed in (False, True):
        cfg = _config(model_dir, loss_agg_mode, packed)
        tag = "packed" if packed else "padded"
        # --- actor: log-probs + entropy of one forward, then the micro-batched no-grad pass
        actor = ActorRole(cfg.model, cfg.actor, rollout_n=ROLLOUT_N)
        assert actor.use_remove_padding is packed
        with torch.no_grad():
            log_probs, entropy = response_log_probs(
                actor.model, batch, temperature=0.7, with_entropy=True, remove_padding=packed
            )  # [B, Tr] each
        results[f"{tag}/log_probs"] = log_probs * batch.response_mask
        results[f"{tag}/entropy"] = entropy * batch.response_mask
        budget = BUDGET if packed else None
        results[f"{tag}/old_log_probs"] = actor.compute_log_prob(
            batch, temperature=0.7, micro_batch_size=3, max_token_len=budget
        )
        results[f"{tag}/num_micro_batches"] = len(split_micro_batches(batch, rows=3, max_token_len=budget)[0])
        if packed:  # negative control: one sequence of N tokens (no position restarts) must differ
            from fusedrl.workers.packing import pack_batch

            p = pack_batch(batch)
            with torch.no_grad():
                logits = actor.model(
                    input_ids=p.input_ids, position_ids=torch.arange(p.input_ids.shape[1])[None]
                )
            results["unmasked/log_probs"] = p.unpack(
                torch.log_softmax(p.response_rows(logits.logits) / 0.7, -1).gather(-1, p.targets[:, None])[
                    :, 0
                ]
            )
        # --- actor update from the padded path's old log-probs (ratio 1 at the start) and a KL target
        train = batch.clone()
        train.old_log_probs = results["padded/old_log_probs"]
        train.ref_log_probs = train.old_log_probs - 0.05 * batch.response_mask  # [B, Tr]
        results[f"{tag}/params_before"] = _full_params(actor.model)
        results[f"{tag}/actor_metrics"] = actor.update(train, temperature=0.7)
        results[f"{tag}/params_after"] = _full_params(actor.model)
        del actor
        # --- critic: values, one update towards returns of 1, values again
        torch.manual_seed(0)  # the value head is freshly initialised: the same draw for both paths
        critic = CriticRole(cfg.critic, rollout_n=ROLLOUT_N)
        assert critic.use_remove_padding is packed
        values = critic.compute_values(batch)  # [B, Tr]
        results[f"{tag}/values"] = values
        train = batch.clone()
        train.critic_values = results["padded/values"]
        train.returns = batch.response_mask.float()  # [B, Tr]
        results[f"{tag}/critic_metrics"] = critic.update(train)
        results[f"{tag}/values_after"] = critic.compute_values(batch)
        del critic
    torch.save(results, Path(out) / "one_rank.pt")


def _two_ranks(rank: int, model_dir: str, out: str) -> None:
    from fusedrl.workers.actor import ActorRole
    from fusedrl.workers.logprob import split_micro_batches

    cfg = _config(model_dir, "token-mean", packed=True)
    batch = _batch()
    # Rank 0: the four longest rows, 28+18+15+14 tokens: 3 micro-batches at a budget of 30;
    # rank 1: the four shortest, 12+8+4+2 tokens: 1 micro-batch on its own.
    lengths = (batch.prompt_mask.sum(1) + batch.response_mask.sum(1)).tolist()
    rows = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    mine = sorted(rows[:4] if rank == 0 else rows[4:])[::-1]  # reversed: order restoration is tested
    shard = batch[torch.tensor(mine)]
    actor = ActorRole(cfg.model, cfg.actor, rollout_n=ROLLOUT_N)
    local = len(split_micro_batches(shard, rows=3, max_token_len=10**6)[0])  # both ranks need 1
    agreed = len(split_micro_batches(shard, rows=3, max_token_len=BUDGET)[0])
    log_probs = actor.compute_log_prob(shard, temperature=0.7, micro_batch_size=3, max_token_len=BUDGET)
    torch.save(
        {"rows": mine, "log_probs": log_probs, "local": local, "agreed": agreed},
        Path(out) / f"two_ranks_{rank}.pt",
    )


def _entry(rank: int, world_size: int, port: int, job: str, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        if job == "one_rank":
            _one_rank(*args)
        else:
            _two_ranks(rank, *args)
    finally:
        dist.destroy_process_group()


def _spawn(world_size: int, job: str, *args) -> None:
    mp.spawn(_entry, args=(world_size, free_port(), job, args), nprocs=world_size, join=True)


@pytest.fixture(scope="module", params=["token-mean", "seq-mean-token-mean"])
def one_rank(request, tiny_model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("packing")
    _spawn(1, "one_rank", tiny_model_dir, request.param, str(out))
    return torch.load(out / "one_rank.pt", weights_only=False)


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)


def _one_token_share() -> float:
    """What one token changing sides moves a clip fraction by, at most: the fractions are token means per
    mini-batch (4 rows: 2 prompts x n=2), averaged over the mini-batches."""
    mask = _batch().response_mask
    per_mini = [int(mask[i : i + 4].sum()) for i in range(0, mask.shape[0], 4)]
    return 1.0 / (len(per_mini) * min(per_mini))


def _metric_close(key: str, packed: float, padded: float) -> None:
    if key.endswith(("clipfrac", "clipfrac_lower")):
        # A clip fraction counts tokens on either side of a threshold: a token whose ratio (or value, after
        # the first optimizer step) lands within float noise of the clip boundary may fall on different
        # sides in the two paths (seen on an AMX CPU: one value token of 18, vf_clipfrac 0.111 vs 0.139).
        # Up to one such token is noise; a packing bug moves many.
        assert abs(packed - padded) <= _one_token_share() + 1e-6, (key, packed, padded)
        return
    rtol = GRAD_NORM_RTOL if key.endswith("grad_norm") else METRIC_RTOL
    assert abs(packed - padded) <= rtol * max(1.0, abs(padded)), (key, packed, padded)


def test_packed_log_probs_and_entropy_equal_padded(one_rank):
    mask = _batch().response_mask.bool()
    for key in ("log_probs", "entropy"):
        padded, packed = one_rank[f"padded/{key}"], one_rank[f"packed/{key}"]
        assert padded.shape == packed.shape == (len(PROMPT_LENS), TR)
        assert padded[mask].abs().min() > 1e-3  # real numbers, not zeros on both sides
        _close(packed, padded)
        assert torch.all(packed[~mask] == 0)
    # The comparison can fail: without the position restarts the sequences attend to each other.
    broken = one_rank["unmasked/log_probs"]
    assert (broken - one_rank["padded/log_probs"])[mask].abs().max() > 1e-2


def test_dynamic_bsz_log_probs_equal_padded_in_row_order(one_rank):
    assert one_rank["padded/num_micro_batches"] == 3  # 8 rows by 3
    assert one_rank["packed/num_micro_batches"] == 4  # 101 real tokens in bins of <= 30
    _close(one_rank["packed/old_log_probs"], one_rank["padded/old_log_probs"])
    _close(one_rank["padded/old_log_probs"], one_rank["padded/log_probs"])


def test_packed_critic_values_equal_padded(one_rank):
    mask = _batch().response_mask.bool()
    assert one_rank["padded/values"][mask].abs().min() > 0
    _close(one_rank["packed/values"], one_rank["padded/values"])
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
        _metric_close(key, one_rank["packed/critic_metrics"][key], one_rank["padded/critic_metrics"][key])
    # After one AdamW step at lr 1e-2 each weight moves by up to lr whatever its gradient's size, so float32
    # noise in near-zero gradients (other matmul shapes on the two paths) becomes steps of up to lr: the
    # values (moved by 1.6 to 2.5 here) then differ by up to 4e-5 on an AVX2 kernel (`make test-avx2` on an
    # AMX Xeon; 5e-7 natively). 1e-4 is 1/16,000 of the smallest move a correct update makes.
    _close(one_rank["packed/values_after"], one_rank["padded/values_after"], atol=1e-4)
    assert (one_rank["padded/values_after"] - one_rank["padded/values"])[mask].abs().min() > 1.0


def test_dynamic_bsz_packed_update_equals_padded(one_rank):
    padded, packed = one_rank["padded/actor_metrics"], one_rank["packed/actor_metrics"]
    assert set(padded) == set(packed)
    assert {"actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"} <= set(padded)
    for key in padded:
        _metric_close(key, packed[key], padded[key])
    before_pad, before_pack = one_rank["padded/params_before"], one_rank["packed/params_before"]
    after_pad, after_pack = one_rank["padded/params_after"], one_rank["packed/params_after"]
    for name in before_pad:
        assert torch.equal(before_pad[name], before_pack[name]), f"{name}: the two roles started apart"
        step_pad = after_pad[name] - before_pad[name]
        step_pack = after_pack[name] - before_pack[name]
        assert step_pad.abs().max() > 1e-4, f"{name} did not change"  # so the equality is not trivial
        # AdamW's first steps move each element by about lr * g / |g|, which amplifies float32 noise in
        # gradients near 0; so: every element within 1% of lr = 1e-3, the whole step within 3e-4 (measured:
        # <= 2e-5 natively, 1.1e-4 for a query bias on AVX2 kernels: `make test-avx2` on an AMX Xeon), so
        # 3e-4. Not for the key bias: its true gradient is 0 (softmax ignores the shift q.b_k that is
        # the same for every key), so its Adam step is normalised rounding noise on both paths.
        _close(step_pack, step_pad, atol=1e-5)
        rel = float((step_pack - step_pad).norm() / step_pad.norm())
        assert rel < 3e-4 or name.endswith("k_proj.bias"), (name, rel)


@pytest.mark.timeout(300)  # ranks that disagree on the micro-batch count hang in a collective
def test_two_ranks_agree_on_micro_batch_count(tiny_model_dir, tmp_path):
    _spawn(2, "two_ranks", tiny_model_dir, str(tmp_path))
    ranks = [torch.load(tmp_path / f"two_ranks_{r}.pt", weights_only=False) for r in range(2)]
    assert [r["local"] for r in ranks] == [1, 1]
    assert [r["agreed"] for r in ranks] == [3, 3]  # rank 1 alone would need 1; it runs 3 with rank 0
    from fusedrl.workers.fsdp import load_causal_lm
    from fusedrl.workers.logprob import response_log_probs

    batch = _batch()
    model = load_causal_lm(tiny_model_dir, "float32").eval()  # plain, unsharded reference
    with torch.no_grad():
        expected = response_log_probs(model, batch, temperature=0.7)[0] * batch.response_mask  # [B, Tr]
    for r in ranks:
        _close(r["log_probs"], expected[torch.tensor(r["rows"])])
