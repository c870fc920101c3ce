"""Loss aggregation, masked statistics and the registered policy losses, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from fusedrl.algorithms.losses import LOSS_AGG_MODES, agg_denominator, agg_loss
from fusedrl.algorithms.registry import get_policy_loss, list_policy_losses, register_policy_loss
from fusedrl.algorithms.utils import masked_mean, masked_var, masked_whiten

NAN = float("nan")


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


# ------------------------------------------------------------------------------------ masked stats
def test_masked_mean_var_whiten_ignore_padding():
    x = torch.tensor([[1.0, 2.0], [3.0, NAN]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    close(masked_mean(x, mask), 2.0)
    close(masked_mean(x, mask, dim=-1), [1.5, 3.0])
    # deviations -1, 0, 1: biased 2/3, unbiased 1
    close(masked_var(x, mask), 1.0)
    close(masked_var(x, mask, unbiased=False), 2 / 3)
    w = masked_whiten(x, mask)
    close(w[mask.bool()], [-1.0, 0.0, 1.0], atol=1e-5)
    close(masked_whiten(x, mask, shift_mean=False)[mask.bool()], [1.0, 2.0, 3.0], atol=1e-5)


def test_masked_stats_degenerate_masks_do_not_produce_nan():
    x = torch.tensor([[5.0, 7.0]])
    close(masked_mean(x, torch.zeros(1, 2)), 0.0)
    close(masked_var(x, torch.tensor([[1.0, 0.0]])), 0.0)
    assert torch.isfinite(masked_whiten(x, torch.tensor([[1.0, 0.0]]))).all()


# --------------------------------------------------------------------------------------- agg_loss
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, NAN]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    "mode, expected, denom",
    [
        ("token-mean", 15 / 5, 5.0),  # (1+2+3+4+5) / 5 valid tokens
        ("seq-mean-token-sum", (6 + 9) / 2, 2.0),  # per-seq sums 6 and 9
        ("seq-mean-token-mean", (2 + 4.5) / 2, 2.0),  # per-seq means 2 and 4.5
        ("seq-mean-token-sum-norm", 15 / (2 * 3), 6.0),  # constant B * T_max
    ],
)
def test_agg_modes(mode, expected, denom):
    close(agg_loss(LOSS, MASK, mode), expected)
    assert agg_denominator(MASK, mode) == denom


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 3.0),
        ("seq-mean-token-sum", 7.5),
        ("seq-mean-token-mean", 3.25),
        # Dr. GRPO's denominator is the constant rows * T, so the extra row does count there: 15 / 9
        ("seq-mean-token-sum-norm", 15 / 9),
    ],
)
def test_fully_masked_row_is_not_a_sequence(mode, expected):
    loss = torch.cat([LOSS, torch.tensor([[7.0, 8.0, 9.0]])])
    mask = torch.cat([MASK, torch.zeros(1, 3)])
    close(agg_loss(loss, mask, mode), expected)


def test_agg_global_norm_replaces_denominator():
    close(agg_loss(LOSS, MASK, "token-mean", global_norm=10.0), 1.5)
    close(agg_loss(LOSS, MASK, "seq-mean-token-sum", global_norm=torch.tensor(5.0)), 3.0)
    close(agg_loss(LOSS, MASK, "seq-mean-token-mean", global_norm=4), 1.625)


def test_agg_all_masked_is_zero_and_bool_mask_works():
    close(agg_loss(LOSS, torch.zeros(2, 3), "token-mean"), 0.0)
    close(agg_loss(LOSS, MASK.bool(), "token-mean"), 3.0)


def test_agg_unknown_mode_names_config_key():
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.loss_agg_mode"):
        agg_loss(LOSS, MASK, "sum")
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.loss_agg_mode"):
        agg_denominator(MASK, "sum")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("splits", [[3, 3], [1, 5], [2, 2, 2]])
def test_split_with_global_norm_equals_full_batch(mode, splits):
    g = torch.Generator().manual_seed(1)
    loss = torch.randn(6, 5, generator=g, requires_grad=True)
    lengths = [5, 2, 4, 1, 3, 0]  # includes a fully padded row
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths])
    full = agg_loss(loss, mask, mode)
    (grad_full,) = torch.autograd.grad(full, loss)

    # as if each chunk were a different data-parallel rank / micro-batch
    chunks = list(zip(torch.split(loss, splits), torch.split(mask, splits)))
    global_norm = sum(agg_denominator(m, mode) for _, m in chunks)
    total = sum(agg_loss(l_, m, mode, global_norm=global_norm) for l_, m in chunks)
    (grad_split,) = torch.autograd.grad(total, loss)
    close(total, full.detach(), atol=1e-6)
    close(grad_split, grad_full)


# ----------------------------------------------------------------------------------------- vanilla
def _ppo_case():
    # row0 tokens: (A=+1, r=1.1) (A=+1, r=1.5) (A=-1, r=0.5) (A=-1, r=0.7)
    # row1 tokens: (A=-1, r=4.0) (A=+2, r=1.25) then two padded slots full of garbage
    ratios = torch.tensor([[1.1, 1.5, 0.5, 0.7], [4.0, 1.25, 1.0, 1.0]])
    old = torch.full((2, 4), -2.0)
    log_prob = (old + ratios.log()).clone()
    log_prob[1, 2:] = torch.tensor([100.0, NAN])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0], [-1.0, 2.0, 7.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    return log_prob.requires_grad_(True), old, adv, mask


def test_vanilla_ppo_hand_computed_token_mean():
    log_prob, old, adv, mask = _ppo_case()
    loss, metrics = get_policy_loss("vanilla")(
        log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0
    )
    # per token max(-A r, -A clip(r, 0.8, 1.28)), then the dual-clip cap 3 for A < 0:
    #   r=1.1  A=+1: max(-1.1, -1.1)  = -1.1
    #   r=1.5  A=+1: max(-1.5, -1.28) = -1.28  (upper clip)
    #   r=0.5  A=-1: max(0.5, 0.8)    =  0.8   (lower clip), cap 3 not hit
    #   r=0.7  A=-1: max(0.7, 0.8)    =  0.8   (lower clip)
    #   r=4.0  A=-1: max(4.0, 1.28)   =  4.0 -> min(4.0, 3) = 3.0 (dual clip)
    #   r=1.25 A=+2: max(-2.5, -2.5)  = -2.5   (inside the 1.28 upper bound)
    # sum = -0.28 over 6 valid tokens
    close(loss, -0.28 / 6)
    close(metrics["pg_clipfrac"], 3 / 6)
    close(metrics["pg_clipfrac_lower"], 1 / 6)
    close(metrics["ppo_kl"], -math.log(1.1 * 1.5 * 0.5 * 0.7 * 4.0 * 1.25) / 6)
    assert set(metrics) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())

    loss.backward()
    # unclipped tokens: d(-A r)/d logp = -A r, divided by 6; clipped / capped / padded tokens: 0
    expected_grad = torch.tensor([[-1.1, 0.0, 0.0, 0.0], [0.0, -2.5, 0.0, 0.0]]) / 6
    close(log_prob.grad, expected_grad)


def test_vanilla_ppo_seq_mean_token_mean():
    log_prob, old, adv, mask = _ppo_case()
    loss, _ = get_policy_loss("vanilla")(
        log_prob,
        old,
        adv,
        mask,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        loss_agg_mode="seq-mean-token-mean",
    )
    # row0 mean (-1.1 - 1.28 + 0.8 + 0.8) / 4 = -0.195; row1 mean (3 - 2.5) / 2 = 0.25
    close(loss, (-0.195 + 0.25) / 2)


def test_clip_higher_is_asymmetric():
    fn = get_policy_loss("vanilla")
    one = torch.ones(1, 1)
    up = torch.tensor([[math.log(1.25)]])  # ratio 1.25
    down = torch.tensor([[math.log(0.7)]])  # ratio 0.7
    zero = torch.zeros(1, 1)
    # A=+2, r=1.25: symmetric 0.2 clips to 1.2 -> -2.4; clip_high 0.28 leaves -2.5
    close(fn(up, zero, 2 * one, one)[0], -2.4, atol=1e-6)
    close(fn(up, zero, 2 * one, one, clip_ratio_high=0.28)[0], -2.5, atol=1e-6)
    # A=-1, r=0.7: low 0.2 clips to 0.8 -> 0.8; low 0.35 (bound 0.65) leaves 0.7; high has no say
    close(fn(down, zero, -one, one, clip_ratio_high=0.28)[0], 0.8, atol=1e-6)
    close(fn(down, zero, -one, one, clip_ratio_low=0.35)[0], 0.7, atol=1e-6)


def test_dual_clip_only_for_negative_advantages():
    fn = get_policy_loss("vanilla")
    one = torch.ones(1, 1)
    big = torch.tensor([[math.log(10.0)]])  # ratio 10
    zero = torch.zeros(1, 1)
    # A=-2: max(20, 2.4) = 20 -> capped at 2 * 3 = 6
    loss, m = fn(big, zero, -2 * one, one)
    close(loss, 6.0, atol=1e-5)
    close(m["pg_clipfrac_lower"], 1.0)
    # A=+2: the ordinary upper clip applies: max(-20, -2.4) = -2.4, no cap
    loss, m = fn(big, zero, 2 * one, one)
    close(loss, -2.4, atol=1e-5)
    close(m["pg_clipfrac_lower"], 0.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        fn(big, zero, one, one, clip_ratio_c=1.0)


def test_vanilla_extreme_log_ratio_is_finite():
    fn = get_policy_loss("vanilla")
    one = torch.ones(1, 2)
    log_prob = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1000.0, -1.0]])  # log ratio 1000 is clamped to 20
    loss, _ = fn(log_prob, old, torch.tensor([[-1.0, 1.0]]), one)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_prob.grad).all()
    # token0 hits the dual-clip cap 3; token1 has r=1 -> -1: mean (3 - 1) / 2
    close(loss, 1.0)


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
def test_bf16_inputs_are_computed_in_float32(name):
    log_prob = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    old = torch.tensor([[-1.1, -2.1]], dtype=torch.bfloat16)
    loss, metrics = get_policy_loss(name)(
        log_prob, old, torch.ones(1, 2, dtype=torch.bfloat16), torch.ones(1, 2)
    )
    assert loss.dtype == torch.float32 and metrics["ppo_kl"].dtype == torch.float32
    loss.backward()
    assert log_prob.grad.dtype == torch.bfloat16


# -------------------------------------------------------------------------------------------- gspo
def test_gspo_hand_computed():
    # row0: token log ratios 0.1 0.2 0.3 -> mean 0.2 -> s = e^0.2 = 1.2214028, A = +1
    # row1: token log ratios -0.1 -0.3 (+ a padded garbage slot) -> mean -0.2
    #       -> s = e^-0.2 = 0.8187308, A = -1
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    log_prob = (old + torch.tensor([[0.1, 0.2, 0.3], [-0.1, -0.3, 50.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, m = get_policy_loss("gspo")(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    s1 = math.exp(-0.2)
    # row0: max(-1.2214, -1.2) = -1.2 on every token (clipped); row1: max(s1, clip(s1)=s1) = s1
    # default agg seq-mean-token-mean: (-1.2 + s1) / 2
    close(loss, (-1.2 + s1) / 2)
    close(m["pg_clipfrac"], 3 / 5)
    close(m["ppo_kl"], -(0.1 + 0.2 + 0.3 - 0.1 - 0.3) / 5)
    close(m["pg_clipfrac_lower"], 0.0)
    assert set(m) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}

    loss.backward()
    # stop-gradient form: d s_{i,t} / d logp_t = s_i, so each unclipped row1 token gets
    # -A * s1 * (1/2 tokens) * (1/2 sequences) = s1 / 4; clipped row0 and the padded slot get 0
    close(log_prob.grad, [[0.0, 0.0, 0.0], [s1 / 4, s1 / 4, 0.0]])


def test_gspo_ratio_is_sequence_level():
    # every token's log ratio is different but they average to 0 -> ratio exactly 1 everywhere,
    # so nothing is clipped even though single tokens are far outside [0.8, 1.2]
    old = torch.zeros(1, 2)
    log_prob = torch.tensor([[1.0, -1.0]])
    loss, m = get_policy_loss("gspo")(log_prob, old, torch.ones(1, 2), torch.ones(1, 2))
    close(loss, -1.0)
    close(m["pg_clipfrac"], 0.0)


# ---------------------------------------------------------------------------------------- registry
def test_policy_loss_registry():
    assert {"vanilla", "gspo"} <= set(list_policy_losses())
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.policy_loss\.loss_mode") as err:
        get_policy_loss("ppo_but_misspelled")
    assert "vanilla" in str(err.value) and "gspo" in str(err.value)

    @register_policy_loss("test_only_const_loss")
    def const(log_prob, old_log_prob, advantages, response_mask, **kwargs):
        return log_prob.sum() * 0, {}

    assert get_policy_loss("test_only_const_loss") is const


# ------------------------------------------------------------- verl parity: seq-mean-token-sum-norm
def test_sum_norm_divides_by_rows_times_width_or_loss_scale_factor():
    # verl main's agg_loss: sum of the sequences' token sums / rows / H, H = the width (or loss_scale_factor)
    one = torch.ones(2, 1)
    close(agg_loss(one, one, "seq-mean-token-sum-norm"), (1 + 1) / 2 / 1)  # 1.0
    assert agg_denominator(one, "seq-mean-token-sum-norm", loss_scale_factor=4) == 2 * 4
    close(agg_loss(one, one, "seq-mean-token-sum-norm", loss_scale_factor=4), 2 / (2 * 4))  # 0.25
    # the factor only touches this mode
    assert agg_denominator(MASK, "token-mean", loss_scale_factor=4) == 5.0


def _grad_of_one_minibatch(mode: str, micro_rows: int, loss_scale_factor: float | None) -> float:
    """d loss / d w for one mini-batch through the shared update loop (one rank), with the per-token loss
    ``w * C`` (w = 1): the gradient is the aggregation's weight on C, micro-batching included."""
    from fusedrl.batch import RolloutBatch
    from fusedrl.workers.optim_step import GuardedStepper, minibatch_updates
    from tests.support import free_port, single_rank_group

    costs = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
    batch = RolloutBatch(
        prompts=torch.zeros(4, 1, dtype=torch.long),
        prompt_mask=torch.ones(4, 1, dtype=torch.long),
        response_mask=mask,
        advantages=costs,
        batch_size=[4],
    )
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.ones(()))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    stepper = GuardedStepper(model, optimizer, max_norm=1e9)

    def micro_loss(mb, norms, token_norm):
        loss = agg_loss(model.w * mb.advantages, mb.response_mask, mode, norms[mode])
        return loss, {"loss": loss.detach()}

    with single_rank_group(free_port()):
        minibatch_updates(
            batch,
            stepper=stepper,
            micro_loss=micro_loss,
            mini_rows=4,
            micro_rows=micro_rows,
            epochs=1,
            loss_agg_modes=[mode],
            world_size=1,
            loss_scale_factor=loss_scale_factor,
        )
    return 1.0 - float(model.w.detach())  # SGD with lr 1: w_new = 1 - grad


@pytest.mark.parametrize("micro_rows", [1, 2, 4])
def test_sum_norm_gradient_equals_verl_main_for_every_micro_batch_size(micro_rows):
    # verl main (model engine): each micro-batch adds sum(seq token sums) / global_batch_size * dp / H, and
    # FSDP averages over dp, so the mini-batch gradient on C is  sum(valid C) / (rows * H), rows = 4 =
    # ppo_mini_batch_size x rollout.n, whatever the micro-batch size (verl <= 0.6 divided by H only and scaled by
    # 1 / grad_accum: micro_rows times this). Valid C: 1 + 2 + 3 + 4 + 5 + 6 = 21.
    assert _grad_of_one_minibatch("seq-mean-token-sum-norm", micro_rows, None) == pytest.approx(21 / (4 * 3))
    # loss_scale_factor = 7 replaces H = 3
    assert _grad_of_one_minibatch("seq-mean-token-sum-norm", micro_rows, 7) == pytest.approx(21 / (4 * 7))
    # token-mean for comparison: 21 / 6 valid tokens
    assert _grad_of_one_minibatch("token-mean", micro_rows, None) == pytest.approx(21 / 6)


def test_gspo_policy_term_is_seq_mean_token_mean_whatever_loss_agg_mode():
    # verl hard-codes seq-mean-token-mean for GSPO's policy term. Ratio 1 everywhere (log_prob = old), so the
    # per-token loss is -A: row0 A = 0.2 on 3 tokens, row1 A = 1.0 on its 1 valid token.
    old = torch.zeros(2, 3)
    log_prob = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([[0.2, 0.2, 0.2], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    fn = get_policy_loss("gspo")
    assert fn.agg_mode == "seq-mean-token-mean"
    loss, _ = fn(log_prob, old, adv, mask, loss_agg_mode="token-mean")
    # seq-mean-token-mean: (-0.2 + -1.0) / 2 = -0.6   (token-mean would be -(0.6 + 1.0) / 4 = -0.4)
    close(loss, -0.6)
    loss.backward()
    # d/d logp = -A * s / (tokens of the row) / rows: row0 -0.2 / 3 / 2, row1 -1.0 / 1 / 2
    close(log_prob.grad, [[-0.2 / 6, -0.2 / 6, -0.2 / 6], [-0.5, 0.0, 0.0]])


def test_update_loop_passes_one_norm_per_mode():
    # GSPO's policy term and the entropy / KL terms under token-mean need different normalisers in one pass.
    from fusedrl.batch import RolloutBatch
    from fusedrl.workers.optim_step import GuardedStepper, minibatch_updates
    from tests.support import free_port, single_rank_group

    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    batch = RolloutBatch(
        prompts=torch.zeros(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.long),
        response_mask=mask,
        batch_size=[2],
    )
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.ones(()))
    stepper = GuardedStepper(model, torch.optim.SGD(model.parameters(), lr=0.0), max_norm=1.0)
    seen: list[dict] = []

    def micro_loss(mb, norms, token_norm):
        seen.append(dict(norms))
        return model.w * 0.0, {"zero": torch.zeros(())}

    with single_rank_group(free_port()):
        minibatch_updates(
            batch,
            stepper=stepper,
            micro_loss=micro_loss,
            mini_rows=2,
            micro_rows=1,
            epochs=1,
            loss_agg_modes=["seq-mean-token-mean", "token-mean", "token-mean"],
            world_size=1,
        )
    # 2 non-empty sequences; 3 + 1 = 4 valid tokens; the same normalisers for both micro-batches
    assert seen == [{"seq-mean-token-mean": 2.0, "token-mean": 4.0}] * 2
