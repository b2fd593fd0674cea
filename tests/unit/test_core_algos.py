"""Hand-computed checks of the PPO math in rlfleet.trainer.ppo.core_algos.

Expected values are written out as numbers, with the arithmetic in comments. Tensors are
float64 unless the test is about dtypes, so tolerances can be tight.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from rlfleet.trainer.ppo import core_algos as ca

F64 = torch.float64


def t(data: object, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor(data, dtype=dtype)


# --------------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------------


def test_masked_sum_and_mean_ignore_masked_values_even_nan() -> None:
    values = t([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = t([[1, 1, 0], [1, 0, 1]], torch.int64)
    # valid: 1 + 2 + 4 + 6 = 13 over 4 elements
    assert_close(ca.masked_sum(values, mask), t(13.0))
    assert_close(ca.masked_mean(values, mask), t(3.25))
    # per row: [1+2, 4+6] / [2, 2]
    assert_close(ca.masked_sum(values, mask, axis=-1), t([3.0, 10.0]))
    assert_close(ca.masked_mean(values, mask, axis=-1), t([1.5, 5.0]))
    # per column: [(1+4)/2, 2/1, 6/1]
    assert_close(ca.masked_mean(values, mask, axis=0), t([2.5, 2.0, 6.0]))


def test_masked_mean_with_no_valid_element_is_zero() -> None:
    values = t([[1.0, 2.0], [3.0, 4.0]])
    mask = t([[0, 0], [1, 0]])
    assert_close(ca.masked_mean(values, mask, axis=-1), t([0.0, 3.0]))
    assert_close(ca.masked_mean(values, torch.zeros_like(mask)), t(0.0))


def test_masked_var_biased_and_unbiased() -> None:
    values = t([[1.0, 2.0, 100.0], [3.0, 6.0, -5.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # valid 1, 2, 3: mean 2, squared deviations 1 + 0 + 1 = 2
    assert_close(ca.masked_var(values, mask, unbiased=False), t(2.0 / 3.0))
    assert_close(ca.masked_var(values, mask, unbiased=True), t(1.0))


def test_masked_var_degenerate_counts_are_zero() -> None:
    values = t([[5.0, 7.0]])
    assert_close(ca.masked_var(values, t([[1, 0]]), unbiased=True), t(0.0))
    assert_close(ca.masked_var(values, t([[1, 0]]), unbiased=False), t(0.0))
    assert_close(ca.masked_var(values, t([[0, 0]]), unbiased=True), t(0.0))


def test_masked_whiten() -> None:
    values = t([[1.0, 2.0, 100.0], [3.0, 6.0, -5.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # valid 1, 2, 3: mean 2, unbiased var 1 -> (x - 2) / sqrt(1 + 1e-8)
    s = 1.0 / math.sqrt(1.0 + 1e-8)
    out = ca.masked_whiten(values, mask)
    assert_close(out[mask.bool()], t([-s, 0.0, s]))
    out_noshift = ca.masked_whiten(values, mask, shift_mean=False)
    assert_close(out_noshift[mask.bool()], t([2.0 - s, 2.0, 2.0 + s]))


def test_masked_whiten_single_valid_element_is_finite() -> None:
    out = ca.masked_whiten(t([[4.0, 9.0]]), t([[1, 0]]))
    assert torch.isfinite(out).all()
    assert out[0, 0].item() == 0.0


def test_get_response_mask() -> None:
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 1, 1, 1]])
    assert_close(
        ca.get_response_mask(ids, eos_token=2),
        torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]),
    )
    # several EOS ids: 7 ends row 1 at position 2
    assert_close(
        ca.get_response_mask(ids, eos_token=[2, 7], dtype=torch.float32),
        torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float32),
    )


# --------------------------------------------------------------------------------------------
# GAE
# --------------------------------------------------------------------------------------------

# 1x3 example, gamma = 0.9, lam = 0.8 (gamma * lam = 0.72); rewards [0, 0, 1],
# values [0.5, 0.6, 0.7]:
#   t=2: delta = 1 + 0.9*0   - 0.7 = 0.3     A2 = 0.3
#   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03    A1 = 0.03 + 0.72*0.3   = 0.246
#   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04    A0 = 0.04 + 0.72*0.246 = 0.21712
#   returns = A + V = [0.71712, 0.846, 1.0]
# whitening: mean = 0.76312 / 3 = 0.254373333; deviations [-0.037253333, -0.008373333,
#   0.045626667]; unbiased var = 0.003539716 / 2 = 0.001769858; std = 0.042069681
#   advantages = deviations / sqrt(var + 1e-8) = [-0.885512474, -0.199034300, 1.084546774]
GAE_RAW = [0.21712, 0.246, 0.3]
GAE_RETURNS = [0.71712, 0.846, 1.0]
GAE_WHITE = [-0.8855124742276503, -0.19903429986219223, 1.084546774089842]


def test_gae_hand_computed_1x3() -> None:
    rewards = t([[0.0, 0.0, 1.0]])
    values = t([[0.5, 0.6, 0.7]])
    mask = t([[1, 1, 1]])
    adv, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(ret, t([GAE_RETURNS]))
    assert_close(adv, t([GAE_WHITE]))


def test_gae_trailing_padding_does_not_leak() -> None:
    # Same row, padded with 2 positions holding junk reward and value.
    rewards = t([[0.0, 0.0, 1.0, 50.0, -7.0]])
    values = t([[0.5, 0.6, 0.7, 9.0, 3.0]])
    mask = t([[1, 1, 1, 0, 0]])
    adv, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(ret, t([[*GAE_RETURNS, 0.0, 0.0]]))
    assert_close(adv, t([[*GAE_WHITE, 0.0, 0.0]]))


def test_gae_hole_in_the_middle_is_skipped() -> None:
    # The masked position 1 is skipped: the row equals [0, 0, 1] / [0.5, 0.6, 0.7] above.
    rewards = t([[0.0, 123.0, 0.0, 1.0]])
    values = t([[0.5, -4.0, 0.6, 0.7]])
    mask = t([[1, 0, 1, 1]])
    adv, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(ret, t([[0.71712, 0.0, 0.846, 1.0]]))
    assert_close(adv, t([[GAE_WHITE[0], 0.0, GAE_WHITE[1], GAE_WHITE[2]]]))


def test_gae_batch_whitening_and_all_masked_row() -> None:
    # Row 0 as above; row 1 has one token: delta = 2 - 1 = 1, A = 1, R = 2; row 2 all masked.
    rewards = t([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    values = t([[0.5, 0.6, 0.7], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    adv, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(ret, t([GAE_RETURNS, [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    # whitening over the 4 valid raw advantages [0.21712, 0.246, 0.3, 1.0] (row 2 ignored):
    #   mean 1.76312 / 4 = 0.44078; deviations [-0.22366, -0.19478, -0.14078, 0.55922];
    #   squares sum 0.4205090608; unbiased var 0.1401696869; std 0.3743924237
    w = [-0.5973945460860972, -0.5202562357446572, -0.3760225529732665, 1.493673334804021]
    assert_close(adv, t([w[:3], [w[3], 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert torch.isfinite(adv).all()


def test_gae_gamma_one_lam_one_is_reward_to_go_minus_value() -> None:
    # With gamma = lam = 1, A_t = sum_{k>=t} r_k - V_t, so returns = reward-to-go [3, 2, 1].
    rewards = t([[1.0, 1.0, 1.0]])
    values = t([[0.3, -0.2, 0.9]])
    _, ret = ca.compute_gae_advantage_return(rewards, values, t([[1, 1, 1]]), 1.0, 1.0)
    assert_close(ret, t([[3.0, 2.0, 1.0]]))


# --------------------------------------------------------------------------------------------
# Outcome advantages: GRPO, RLOO, REINFORCE++, ReMax
# --------------------------------------------------------------------------------------------


def _outcome_batch() -> tuple[torch.Tensor, torch.Tensor]:
    # Scores (row sums) [1, 0, 2, 5]; the reward sits on the last valid token.
    rewards = t([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    return rewards, mask


def test_grpo_groups_and_group_of_one() -> None:
    rewards, mask = _outcome_batch()
    eps = 1e-6
    # group "a" = samples 0..2, scores [1, 0, 2]: mean 1, unbiased std sqrt((0+1+1)/2) = 1
    # group "b" = sample 3 alone: mean 0, std 1 -> 5 / (1 + eps)
    expected = [0.0, -1.0 / (1 + eps), 1.0 / (1 + eps), 5.0 / (1 + eps)]
    adv, ret = ca.compute_grpo_outcome_advantage(rewards, mask, ["a", "a", "a", "b"], eps)
    assert_close(adv, t(expected).unsqueeze(-1) * mask)
    assert_close(ret, adv)


def test_grpo_index_types_agree() -> None:
    rewards, mask = _outcome_batch()
    ref, _ = ca.compute_grpo_outcome_advantage(rewards, mask, ["a", "a", "a", "b"])
    for index in (
        np.array(["u1", "u1", "u1", "u0"], dtype=object),
        torch.tensor([7, 7, 7, 3]),
        [10, 10, 10, 11],
    ):
        adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, index)
        assert_close(adv, ref)


def test_grpo_without_std_normalization() -> None:
    rewards = t([[3.0, 0.0], [1.0, 0.0]])
    mask = t([[1, 1], [1, 0]])
    # scores [3, 1], mean 2 -> [1, -1]
    adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, [0, 0], norm_adv_by_std_in_grpo=False)
    assert_close(adv, t([[1.0, 1.0], [-1.0, 0.0]]))
    # with std: std = sqrt((1 + 1) / 1) = sqrt(2)
    adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, [0, 0], epsilon=0.0)
    r = 1.0 / math.sqrt(2.0)
    assert_close(adv, t([[r, r], [-r, 0.0]]))


def test_grpo_identical_scores_give_zero_and_bad_index_raises() -> None:
    rewards = t([[1.0], [1.0], [1.0]])
    mask = t([[1], [1], [1]])
    adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, [0, 0, 0])
    assert_close(adv, torch.zeros(3, 1, dtype=F64))
    with pytest.raises(ValueError, match="index has 2 entries but the batch has 3"):
        ca.compute_grpo_outcome_advantage(rewards, mask, [0, 0])


def test_rloo_leave_one_out_and_group_of_one() -> None:
    rewards, mask = _outcome_batch()
    # group a scores [1, 0, 2], sum 3: baselines (3-1)/2 = 1, (3-0)/2 = 1.5, (3-2)/2 = 0.5
    #   -> advantages [0, -1.5, 1.5]; group b alone: baseline 0 -> 5
    adv, ret = ca.compute_rloo_outcome_advantage(rewards, mask, ["a", "a", "a", "b"])
    assert_close(adv, t([0.0, -1.5, 1.5, 5.0]).unsqueeze(-1) * mask)
    assert_close(ret, adv)


def test_reinforce_plus_plus_discounted_whitened() -> None:
    # gamma 0.5, reward 1 at the last valid token (position 2); position 3 is padding with a
    # junk reward that must be ignored.
    #   returns = [0.25, 0.5, 1.0, 0]
    #   whitening over [0.25, 0.5, 1.0]: mean 0.583333, unbiased var (0.111111 + 0.006944
    #   + 0.173611) / 2 = 0.1458333 -> [-0.872871531, -0.218217883, 1.091089414]
    rewards = t([[0.0, 0.0, 1.0, 9.0]])
    mask = t([[1, 1, 1, 0]])
    adv, ret = ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    assert_close(ret, t([[0.25, 0.5, 1.0, 0.0]]))
    assert_close(adv, t([[-0.8728715310169463, -0.21821788275423665, 1.0910894137711826, 0.0]]))


def test_reinforce_plus_plus_baseline() -> None:
    # scores [1, 3, 5], groups [a, a, b]: a mean 2 -> [-1, 1]; b alone (mean 0) -> 5
    # per token over the mask: [-1, -1], [1], [5, 5]; whitening over these 5 values:
    #   mean 9/5 = 1.8, deviations [-2.8, -2.8, -0.8, 3.2, 3.2], squares sum 36.8,
    #   unbiased var 9.2, std 3.0331502
    rewards = t([[0.0, 1.0], [3.0, 0.0], [0.0, 5.0]])
    mask = t([[1, 1], [1, 0], [1, 1]])
    adv, ret = ca.compute_reinforce_plus_plus_baseline_outcome_advantage(
        rewards, mask, ["a", "a", "b"]
    )
    s = math.sqrt(9.2 + 1e-8)
    expected = t([[-2.8 / s, -2.8 / s], [-0.8 / s, 0.0], [3.2 / s, 3.2 / s]])
    assert_close(adv, expected)
    assert_close(ret, adv)


def test_remax() -> None:
    # rewards [0, 0.5, 1.0 | pad 4.0]: reward-to-go [1.5, 1.5, 1.0, 0]; baseline 0.7
    #   -> advantages [0.8, 0.8, 0.3, 0]
    rewards = t([[0.0, 0.5, 1.0, 4.0], [1.0, 0.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0], [0, 0, 0, 0]])
    adv, ret = ca.compute_remax_outcome_advantage(rewards, t([0.7, 2.0]), mask)
    assert_close(ret, t([[1.5, 1.5, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert_close(adv, t([[0.8, 0.8, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0]]))


def test_outcome_estimators_all_masked_row_is_zero_and_finite() -> None:
    rewards = t([[1.0, 2.0], [3.0, 4.0]])
    mask = t([[1, 1], [0, 0]])
    for adv, _ in (
        ca.compute_grpo_outcome_advantage(rewards, mask, [0, 0]),
        ca.compute_rloo_outcome_advantage(rewards, mask, [0, 0]),
        ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, 1.0),
        ca.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, [0, 1]),
    ):
        assert torch.isfinite(adv).all()
        assert_close(adv[1], t([0.0, 0.0]))


# --------------------------------------------------------------------------------------------
# KL penalty and controllers
# --------------------------------------------------------------------------------------------

LOGP = [-1.0, -2.0]
REF = [-1.5, -1.0]  # logprob - ref = [0.5, -1.0]; ref - logprob = [-0.5, 1.0]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("kl", [0.5, -1.0]),
        ("k1", [0.5, -1.0]),
        ("abs", [0.5, 1.0]),
        ("mse", [0.125, 0.5]),  # 0.5 * 0.25, 0.5 * 1
        ("k2", [0.125, 0.5]),
        # exp(-0.5) + 0.5 - 1 = 0.1065306597; exp(1) - 1 - 1 = 0.7182818285
        ("low_var_kl", [0.10653065971263342, 0.7182818284590451]),
        ("k3", [0.10653065971263342, 0.7182818284590451]),
    ],
)
def test_kl_penalty_types(name: str, expected: list[float]) -> None:
    assert_close(ca.kl_penalty(t(LOGP), t(REF), name), t(expected))


def test_kl_k3_is_clamped_and_finite() -> None:
    # ref - logp = 15: exp(15) - 16 ~ 3.3e6 -> clamped to 10; 1000 would overflow without the
    # log-ratio clamp; -1000: exp(-20) + 20 - 1 ~ 19 -> clamped to 10.
    logp = torch.zeros(3, dtype=F64, requires_grad=True)
    out = ca.kl_penalty(logp, t([15.0, 1000.0, -1000.0]), "k3")
    assert_close(out, t([10.0, 10.0, 10.0]))
    out.sum().backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()


def test_kl_penalty_unknown_and_full() -> None:
    with pytest.raises(ValueError, match="unknown kl_penalty 'k4'"):
        ca.kl_penalty(t(LOGP), t(REF), "k4")
    with pytest.raises(NotImplementedError, match="full"):
        ca.kl_penalty(t(LOGP), t(REF), "full")


def test_fixed_kl_controller() -> None:
    ctl = ca.get_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(ctl, ca.FixedKLController)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.05


def test_adaptive_kl_controller_arithmetic() -> None:
    ctl = ca.get_kl_controller("adaptive", kl_coef=0.2, target_kl=6.0, horizon=10000)
    assert isinstance(ctl, ca.AdaptiveKLController)
    # KL 9: error 9/6 - 1 = 0.5 -> clipped to 0.2; factor 1 + 0.2 * 256 / 10000 = 1.00512
    ctl.update(current_kl=9.0, n_steps=256)
    assert ctl.value == pytest.approx(0.2 * 1.00512, rel=1e-12)
    # KL 3: error -0.5 -> -0.2; factor 1 - 0.00512 = 0.99488
    ctl.update(current_kl=3.0, n_steps=256)
    assert ctl.value == pytest.approx(0.2 * 1.00512 * 0.99488, rel=1e-12)
    # KL 6.6: error 0.1 (within the clip); factor 1 + 0.1 * 1000 / 10000 = 1.01
    ctl.update(current_kl=6.6, n_steps=1000)
    assert ctl.value == pytest.approx(0.2 * 1.00512 * 0.99488 * 1.01, rel=1e-12)


def test_kl_controller_errors() -> None:
    with pytest.raises(ValueError, match="target_kl=None"):
        ca.get_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(ValueError, match="target_kl must be > 0, got 0"):
        ca.AdaptiveKLController(0.1, 0.0, 100)
    with pytest.raises(ValueError, match="unknown KL controller type 'pid'"):
        ca.get_kl_controller("pid", kl_coef=0.1)


# --------------------------------------------------------------------------------------------
# Loss aggregation
# --------------------------------------------------------------------------------------------

LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, float("nan")]]
LOSS_MASK = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]  # ragged; row 2 fully masked


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7.0 / 3.0),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 non-empty rows
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2 non-empty rows
    ],
)
def test_agg_loss_modes_ragged_with_empty_row(mode: str, expected: float) -> None:
    loss = t(LOSS).requires_grad_()
    out = ca.agg_loss(loss, t(LOSS_MASK), mode)
    assert_close(out, t(expected))
    out.backward()
    assert loss.grad is not None
    assert torch.isfinite(loss.grad).all()
    assert (loss.grad[t(LOSS_MASK) == 0] == 0).all()


@pytest.mark.parametrize("mode", ca.AGG_LOSS_MODES)
def test_agg_loss_all_masked_is_zero(mode: str) -> None:
    assert_close(ca.agg_loss(t(LOSS), torch.zeros(3, 3), mode), t(0.0))


def test_agg_loss_unknown_mode() -> None:
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'seq-sum'"):
        ca.agg_loss(t(LOSS), t(LOSS_MASK), "seq-sum")


# --------------------------------------------------------------------------------------------
# Policy loss (dual-clip PPO)
# --------------------------------------------------------------------------------------------

# clip_ratio_low 0.2, clip_ratio_high 0.28, clip_ratio_c 3; one row of five tokens:
#   tok  A    ratio  -A*r   -A*clip(r)        max        dual (A<0)        loss  clip  lower
#   0   +1    1.5   -1.5   -1.28 (clip 1.28)  -1.28       -                -1.28   yes   no
#   1   +1    1.0   -1.0   -1.0               -1.0        -                -1.0    no    no
#   2   -1    0.5    0.5    0.8  (clip 0.8)    0.8        min(3, 0.8)=0.8   0.8    yes   no
#   3   -1    5.0    5.0    1.28 (clip 1.28)   5.0        min(3, 5)=3       3.0    no    yes
#   4   masked (ratio e^30, A = 100): ignored
# token-mean loss = (-1.28 - 1 + 0.8 + 3) / 4 = 0.38; clipfrac 2/4; lower 1/4
# ppo_kl = mean(old - new) = -(ln 1.5 + 0 + ln 0.5 + ln 5) / 4 = -ln(3.75) / 4
PG_RATIO = [1.5, 1.0, 0.5, 5.0, math.exp(30.0)]
PG_ADV = [[1.0, 1.0, -1.0, -1.0, 100.0]]
PG_MASK = [[1, 1, 1, 1, 0]]


def _pg_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    old = t([[-1.0, -2.0, -0.5, -3.0, -40.0]])
    new = (old + torch.log(t([PG_RATIO]))).requires_grad_()
    return old, new


def test_policy_loss_hand_computed() -> None:
    old, new = _pg_inputs()
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = ca.compute_policy_loss(
        old, new, t(PG_ADV), t(PG_MASK), 0.2, 0.28, clip_ratio_c=3.0
    )
    assert_close(pg_loss, t(0.38))
    assert_close(clipfrac, t(0.5))
    assert_close(clipfrac_lower, t(0.25))
    assert_close(ppo_kl, t(-math.log(3.75) / 4))
    pg_loss.backward()
    # Only token 1 (unclipped, A=+1) has a gradient: d(-A*r)/dlogp / 4 = -1 * 1.0 / 4.
    # Clipped tokens 0 and 2, dual-clipped token 3 and masked token 4 have zero gradient.
    assert new.grad is not None
    assert_close(new.grad, t([[0.0, -0.25, 0.0, 0.0, 0.0]]))


def test_policy_loss_dual_clip_inactive_with_large_c() -> None:
    old, new = _pg_inputs()
    # With c = 10 the dual clip (cap 10) does not bind at ratio 5: token 3 loss = 5.
    pg_loss, clipfrac, _, clipfrac_lower = ca.compute_policy_loss(
        old, new, t(PG_ADV), t(PG_MASK), 0.2, 0.28, clip_ratio_c=10.0
    )
    assert_close(pg_loss, t((-1.28 - 1.0 + 0.8 + 5.0) / 4))
    assert_close(clipfrac, t(0.5))
    assert_close(clipfrac_lower, t(0.0))


def test_policy_loss_seq_mean_token_sum() -> None:
    old, new = _pg_inputs()
    pg_loss, *_ = ca.compute_policy_loss(
        old, new, t(PG_ADV), t(PG_MASK), 0.2, 0.28, loss_agg_mode="seq-mean-token-sum"
    )
    assert_close(pg_loss, t(-1.28 - 1.0 + 0.8 + 3.0))


def test_policy_loss_on_policy_equals_negative_mean_advantage() -> None:
    logp = t([[-1.0, -2.0, -3.0]])
    adv = t([[0.5, -2.0, 7.0]])
    pg_loss, clipfrac, ppo_kl, lower = ca.compute_policy_loss(
        logp, logp.clone(), adv, t([[1, 1, 0]]), 0.2, 0.2
    )
    # ratio 1 everywhere: loss = -(0.5 - 2.0) / 2 = 0.75, nothing clipped
    assert_close(pg_loss, t(0.75))
    assert_close((clipfrac, ppo_kl, lower), (t(0.0), t(0.0), t(0.0)))


def test_policy_loss_rejects_bad_clip_ratio_c() -> None:
    old, new = _pg_inputs()
    with pytest.raises(ValueError, match=r"clip_ratio_c must be > 1.0 .* got 1.0"):
        ca.compute_policy_loss(old, new, t(PG_ADV), t(PG_MASK), 0.2, 0.2, clip_ratio_c=1.0)


def test_policy_loss_rollout_is_weights_multiply_each_token() -> None:
    logp = t([[-1.0, -2.0, -3.0]])
    adv = t([[0.5, -2.0, 7.0]])
    weights = t([[2.0, 0.5, 9.0]])
    pg_loss, *_ = ca.compute_policy_loss(
        logp, logp.clone(), adv, t([[1, 1, 0]]), 0.2, 0.2, rollout_is_weights=weights
    )
    # ratio 1: per token -A * w = [-1.0, 1.0, (masked)] -> mean 0.0
    assert_close(pg_loss, t(0.0))


# --------------------------------------------------------------------------------------------
# GSPO
# --------------------------------------------------------------------------------------------

# Two sequences, clip_ratio_low 0.2, clip_ratio_high 0.05:
#   row 0: A = +1, token ratios [1.21, 1.0] (third token masked, ratio e^30):
#          s_0 = sqrt(1.21 * 1.0) = 1.1 > 1.05, clipped: loss per token -1.05, no gradient
#   row 1: A = -2, token ratios [0.729, 1.0, 1.0]:
#          s_1 = 0.729^(1/3) = 0.9 >= 0.8, unclipped: loss per token -A * 0.9 = 1.8
# seq-mean-token-mean: (mean(-1.05, -1.05) + mean(1.8, 1.8, 1.8)) / 2 = 0.375
# gradient of row 1's tokens: (1/2 rows) * (1/3 tokens) * (-A) * s_1 = 2 * 0.9 / 6 = 0.3
# pg_clipfrac = 2 clipped tokens / 5 valid; ppo_kl = -(ln 1.21 + ln 0.729) / 5
GSPO_RATIO = [[1.21, 1.0, math.exp(30.0)], [0.729, 1.0, 1.0]]
GSPO_ADV = [[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]
GSPO_MASK = [[1, 1, 0], [1, 1, 1]]


def _gspo_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    old = t([[-1.0, -2.0, -40.0], [-0.5, -3.0, -1.5]])
    new = (old + torch.log(t(GSPO_RATIO))).requires_grad_()
    return old, new


def test_gspo_hand_computed() -> None:
    old, new = _gspo_inputs()
    pg_loss, clipfrac, ppo_kl, lower = ca.compute_policy_loss_gspo(
        old, new, t(GSPO_ADV), t(GSPO_MASK), 0.2, 0.05
    )
    assert_close(pg_loss, t(0.375))
    assert_close(clipfrac, t(0.4))
    assert_close(lower, t(0.0))
    assert_close(ppo_kl, t(-(math.log(1.21) + math.log(0.729)) / 5))
    pg_loss.backward()
    assert new.grad is not None
    # Row 0 is clipped as a whole: its ratio-1 token has no gradient either (token-level
    # PPO would clip only the 1.21 token); row 1 tokens each get 0.3.
    assert_close(new.grad, t([[0.0, 0.0, 0.0], [0.3, 0.3, 0.3]]))


def test_gspo_lower_clip_and_token_mean() -> None:
    old, new = _gspo_inputs()
    # clip_ratio_low 0.05: s_1 = 0.9 < 0.95, so row 1 is clipped at the lower bound:
    # per token max(-A * 0.9, -A * 0.95) = max(1.8, 1.9) = 1.9; every valid token clipped.
    # token-mean over the 5 valid tokens: (2 * -1.05 + 3 * 1.9) / 5 = 0.72
    pg_loss, clipfrac, _, lower = ca.compute_policy_loss_gspo(
        old, new, t(GSPO_ADV), t(GSPO_MASK), 0.05, 0.05, loss_agg_mode="token-mean"
    )
    assert_close(pg_loss, t(0.72))
    assert_close(clipfrac, t(1.0))
    assert_close(lower, t(0.6))
    pg_loss.backward()
    assert new.grad is not None
    assert_close(new.grad, torch.zeros_like(new))


def test_gspo_on_policy_gradient_is_sequence_mean_of_advantage() -> None:
    # ratio 1 everywhere: s_i = 1, loss = -(1/G) sum_i A_i; the gradient of token t of
    # row i is -A_i / (G * |y_i|): row 0 (2 tokens) -1/4, row 1 (3 tokens) 2/6.
    logp = t([[-1.0, -2.0, -3.0], [-0.5, -0.25, -2.0]])
    new = logp.clone().requires_grad_()
    weights = t([[3.0, 3.0, 3.0], [1.0, 1.0, 1.0]])
    pg_loss, clipfrac, ppo_kl, _ = ca.compute_policy_loss_gspo(
        logp, new, t(GSPO_ADV), t(GSPO_MASK), 3e-4, 4e-4
    )
    assert_close(pg_loss, t((-1.0 + 2.0) / 2))
    assert_close((clipfrac, ppo_kl), (t(0.0), t(0.0)))
    pg_loss.backward()
    assert new.grad is not None
    assert_close(new.grad, t([[-0.25, -0.25, 0.0], [1 / 3, 1 / 3, 1 / 3]]))
    # rollout IS weights multiply each token's loss: row 0 weighs 3
    weighted, *_ = ca.compute_policy_loss_gspo(
        logp, logp, t(GSPO_ADV), t(GSPO_MASK), 3e-4, 4e-4, rollout_is_weights=weights
    )
    assert_close(weighted, t((-3.0 + 2.0) / 2))


# --------------------------------------------------------------------------------------------
# CISPO
# --------------------------------------------------------------------------------------------

# clip_ratio_low 0.2, clip_ratio_high 0.28; one row, old log-probs [-1, -2, -0.5, (masked)]:
#   tok  A    ratio  weight sg(clip)  log_prob       loss = -w * A * log_prob
#   0   +1    1.5    1.28            -1 + ln 1.5    -1.28 * (-1 + ln 1.5)
#   1   -1    0.5    0.8             -2 + ln 0.5     0.8 * (-2 + ln 0.5)
#   2   +2    1.0    1.0             -0.5            1.0
# token-mean = the sum / 3; gradient -w * A / 3 at every valid token, clipped ones too.
CISPO_RATIO = [[1.5, 0.5, 1.0, math.exp(30.0)]]
CISPO_ADV = [[1.0, -1.0, 2.0, 5.0]]
CISPO_MASK = [[1, 1, 1, 0]]


def test_cispo_hand_computed() -> None:
    old = t([[-1.0, -2.0, -0.5, -40.0]])
    new = (old + torch.log(t(CISPO_RATIO))).requires_grad_()
    pg_loss, clipfrac, ppo_kl, lower = ca.compute_policy_loss_cispo(
        old, new, t(CISPO_ADV), t(CISPO_MASK), 0.2, 0.28
    )
    expected = (
        -1.28 * (-1 + math.log(1.5)) + 0.8 * (-2 + math.log(0.5)) + 1.0
    ) / 3  # = -0.131171...
    assert_close(pg_loss, t(expected))
    assert_close(clipfrac, t(2 / 3))
    assert_close(lower, t(1 / 3))
    assert_close(ppo_kl, t(-math.log(0.75) / 3))
    pg_loss.backward()
    assert new.grad is not None
    # Clipped tokens keep a gradient (bounded by the clipped weight); PPO's would be 0.
    assert_close(new.grad, t([[-1.28 / 3, 0.8 / 3, -2.0 / 3, 0.0]]))


def test_cispo_weights_and_seq_mean() -> None:
    old = t([[-1.0, -2.0, -0.5, -40.0]])
    new = old + torch.log(t(CISPO_RATIO))
    weights = t([[0.5, 2.0, 1.0, 7.0]])
    pg_loss, *_ = ca.compute_policy_loss_cispo(
        old, new, t(CISPO_ADV), t(CISPO_MASK), 0.2, 0.28,
        loss_agg_mode="seq-mean-token-sum", rollout_is_weights=weights,
    )  # fmt: skip
    expected = -1.28 * 0.5 * (-1 + math.log(1.5)) + 0.8 * 2.0 * (-2 + math.log(0.5)) + 1.0
    assert_close(pg_loss, t(expected))


def test_cispo_masked_nan_reaches_neither_the_loss_nor_the_gradient() -> None:
    """What the mask leaves out cannot matter, NaN included, for CISPO as for PPO:
    the product -w * A * log_prob would carry a NaN at a masked position into the
    gradient of log_prob."""
    old = t([[-1.0, -2.0, -0.5, float("nan")]])
    new = t([[-0.9, -2.1, -0.5, float("nan")]]).requires_grad_()
    adv = t([[1.0, -1.0, 0.5, float("nan")]])
    pg_loss, *_ = ca.compute_policy_loss_cispo(old, new, adv, t(CISPO_MASK), 0.2, 0.28)
    pg_loss.backward()
    assert torch.isfinite(pg_loss) and new.grad is not None
    assert torch.isfinite(new.grad).all() and new.grad[0, 3] == 0


def test_policy_losses_reject_negative_clip_ratios() -> None:
    old, new = _gspo_inputs()
    for fn in (ca.compute_policy_loss_gspo, ca.compute_policy_loss_cispo):
        with pytest.raises(ValueError, match="clip ratios must be >= 0"):
            fn(old, new, t(GSPO_ADV), t(GSPO_MASK), -0.1, 0.2)


# --------------------------------------------------------------------------------------------
# Truncated importance sampling (rollout correction)
# --------------------------------------------------------------------------------------------

# old - rollout log-ratios, threshold C = 2:
#   row 0: ratios [3, 0.5, (masked: rollout log-prob NaN)]  -> token weights [2, 0.5, 0]
#   row 1: ratios [1.2, 1.0, 4.0]                           -> token weights [1.2, 1, 2]
# token level: mean weight (2 + 0.5 + 1.2 + 1 + 2) / 5 = 1.34; max ratio 4; truncated 2/5
# sequence level: row 0 ratio 3 * 0.5 = 1.5 -> 1.5 on both valid tokens; row 1
#   1.2 * 1 * 4 = 4.8 -> 2 on all three: mean (2 * 1.5 + 3 * 2) / 5 = 1.8; max 4.8; 3/5
IS_RATIO = [[3.0, 0.5, 1.0], [1.2, 1.0, 4.0]]
IS_MASK = [[1, 1, 0], [1, 1, 1]]


def _is_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    rollout = t([[-1.0, -2.0, float("nan")], [-0.5, -1.0, -3.0]])
    old = torch.nan_to_num(rollout, nan=-1.0) + torch.log(t(IS_RATIO))
    return old, rollout


def test_rollout_is_token_level() -> None:
    old, rollout = _is_inputs()
    weights, m = ca.compute_rollout_is_weights(old, rollout, t(IS_MASK), "token", 2.0)
    assert_close(weights, t([[2.0, 0.5, 0.0], [1.2, 1.0, 2.0]]))
    assert_close(m["rollout_is_mean"], t(1.34))
    assert_close(m["rollout_is_max"], t(4.0))
    assert_close(m["rollout_is_ratio_fraction_high"], t(0.4))
    assert not weights.requires_grad


def test_rollout_is_sequence_level() -> None:
    old, rollout = _is_inputs()
    weights, m = ca.compute_rollout_is_weights(old, rollout, t(IS_MASK), "sequence", 2.0)
    assert_close(weights, t([[1.5, 1.5, 0.0], [2.0, 2.0, 2.0]]))
    assert_close(m["rollout_is_mean"], t(1.8))
    assert_close(m["rollout_is_max"], t(4.8))
    assert_close(m["rollout_is_ratio_fraction_high"], t(0.6))


def test_rollout_is_rejects_bad_arguments() -> None:
    old, rollout = _is_inputs()
    with pytest.raises(ValueError, match="unknown rollout IS level 'geometric'"):
        ca.compute_rollout_is_weights(old, rollout, t(IS_MASK), "geometric", 2.0)
    with pytest.raises(ValueError, match="threshold must be > 0"):
        ca.compute_rollout_is_weights(old, rollout, t(IS_MASK), "token", 0.0)


# --------------------------------------------------------------------------------------------
# DAPO: dynamic sampling filter, overlong penalty
# --------------------------------------------------------------------------------------------


def test_group_filter_drops_groups_with_equal_values() -> None:
    values = t([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 5.0])
    index = ["a", "a", "a", "b", "b", "b", "c", "c", "d"]
    # a: all 1 (dropped); b: mixed (kept); c: all 0 (dropped); d: a group of one (kept)
    keep = ca.compute_group_filter_mask(values, index)
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 2 + [True]
    # the same with integer ids, interleaved
    ids = torch.tensor([7, 3, 7, 3])
    assert ca.compute_group_filter_mask(t([0.5, 1.0, 0.5, 1.0]), ids).tolist() == [False] * 4
    assert ca.compute_group_filter_mask(t([0.5, 1.0, 0.25, 1.0]), ids).tolist() == [
        True, False, True, False,
    ]  # fmt: skip


def test_overlong_penalty_is_linear_in_the_buffer() -> None:
    lengths = torch.tensor([10, 16, 17, 18, 20])
    # L_max 20, buffer 4: no penalty up to 16 tokens, then -(len - 16) / 4 * factor
    assert_close(
        ca.compute_overlong_penalty(lengths, 20, 4, 1.0),
        torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]),
    )
    assert_close(
        ca.compute_overlong_penalty(lengths, 20, 4, 0.5),
        torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]),
    )
    for bad in (0, 21):
        with pytest.raises(ValueError, match="overlong_buffer_len must be in"):
            ca.compute_overlong_penalty(lengths, 20, bad, 1.0)
    with pytest.raises(ValueError, match="penalty_factor must be >= 0"):
        ca.compute_overlong_penalty(lengths, 20, 4, -1.0)


# --------------------------------------------------------------------------------------------
# Value loss
# --------------------------------------------------------------------------------------------


def test_value_loss_clipping() -> None:
    # cliprange 0.2 around old values 1.0, i.e. [0.8, 1.2]:
    #   tok 0: v 1.5 -> clip 1.2, R 2: (1.5-2)^2 = 0.25, (1.2-2)^2 = 0.64 -> 0.64, clipped
    #   tok 1: v 0.9 (inside),  R 0: 0.81, 0.81                          -> 0.81
    #   tok 2: v 0.5 -> clip 0.8, R 1: 0.25, 0.04                         -> 0.25
    #   tok 3: masked
    # vf_loss = 0.5 * (0.64 + 0.81 + 0.25) / 3 = 0.283333; clipfrac 1/3
    vpreds = t([[1.5, 0.9, 0.5, 50.0]]).requires_grad_()
    returns = t([[2.0, 0.0, 1.0, 0.0]])
    values = t([[1.0, 1.0, 1.0, 1.0]])
    vf_loss, vf_clipfrac = ca.compute_value_loss(vpreds, returns, values, t([[1, 1, 1, 0]]), 0.2)
    assert_close(vf_loss, t(0.5 * 1.7 / 3))
    assert_close(vf_clipfrac, t(1.0 / 3.0))
    vf_loss.backward()
    # grad of 0.5 * mean: (v - R) / 3 where unclipped term active; 0 for the clipped token 0
    assert vpreds.grad is not None
    assert_close(vpreds.grad, t([[0.0, 0.9 / 3, -0.5 / 3, 0.0]]))


# --------------------------------------------------------------------------------------------
# Entropy and log-probs from logits
# --------------------------------------------------------------------------------------------


def test_entropy_uniform_is_log_vocab() -> None:
    logits = torch.full((2, 3, 7), 3.7)
    assert_close(ca.entropy_from_logits(logits), torch.full((2, 3), math.log(7.0)))


def test_entropy_two_outcomes() -> None:
    # logits [0, ln 3] -> p = [0.25, 0.75]; H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351446
    logits = t([[0.0, math.log(3.0)]])
    assert_close(ca.entropy_from_logits(logits), t([0.5623351446188083]))


def test_entropy_bf16_is_computed_in_fp32() -> None:
    out = ca.entropy_from_logits(torch.zeros(4, 1000, dtype=torch.bfloat16))
    assert out.dtype == torch.float32
    assert_close(out, torch.full((4,), math.log(1000.0)))


def test_compute_entropy_loss_ragged() -> None:
    # row entropies ln 2 (V=2 uniform) everywhere; token-mean over 3 valid tokens = ln 2
    logits = torch.zeros(2, 2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    assert_close(ca.compute_entropy_loss(logits, mask, "token-mean"), torch.tensor(math.log(2.0)))


def test_logprobs_hand_computed() -> None:
    # logits [0, ln 3]: log p = [ln 0.25, ln 0.75]
    logits = t([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    out = ca.logprobs_from_logits(logits, torch.tensor([0, 1]))
    assert_close(out, t([math.log(0.25), math.log(0.75)]))


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 100])
def test_logprobs_match_log_softmax_fp32(chunk_size: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 11, generator=gen) * 4).requires_grad_()
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    out = ca.logprobs_from_logits(logits, labels, chunk_size=chunk_size)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = torch.log_softmax(ref_logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert out.dtype == torch.float32
    assert_close(out, ref, atol=1e-6, rtol=0)
    weights = torch.randn(2, 5, generator=gen)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    assert logits.grad is not None and ref_logits.grad is not None
    assert_close(logits.grad, ref_logits.grad, atol=1e-6, rtol=0)


def test_logprobs_bf16_and_gradcheck() -> None:
    gen = torch.Generator().manual_seed(1)
    logits32 = torch.randn(3, 4, 50, generator=gen) * 3
    labels = torch.randint(0, 50, (3, 4), generator=gen)
    logits_bf16 = logits32.to(torch.bfloat16).requires_grad_()
    out = ca.logprobs_from_logits(logits_bf16, labels, chunk_size=5)
    assert out.dtype == torch.float32
    # Reference: the same bf16 values upcast to fp32 (logsumexp is done in fp32 per chunk).
    up = logits_bf16.detach().float()
    ref = torch.log_softmax(up, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert_close(out, ref, atol=1e-6, rtol=0)
    out.sum().backward()
    assert logits_bf16.grad is not None and logits_bf16.grad.dtype == torch.bfloat16

    logits64 = torch.randn(4, 6, dtype=F64, generator=gen).requires_grad_()
    labels64 = torch.tensor([0, 5, 2, 2])
    assert torch.autograd.gradcheck(
        lambda x: ca.logprobs_from_logits(x, labels64, chunk_size=3), (logits64,)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_entropy_with_temperature(dtype: torch.dtype) -> None:
    """The temperature is applied after the fp32 upcast, inside the chunks: the same as
    log_softmax of the upcast logits divided by T, values and gradients."""
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 4, 30, generator=gen) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 30, (3, 4), generator=gen)
    out = ca.logprobs_from_logits(logits, labels, chunk_size=5, temperature=0.7)
    ref_logits = logits.detach().clone().requires_grad_()
    tempered = ref_logits.float() / 0.7
    ref = torch.log_softmax(tempered, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert_close(out, ref, atol=1e-5, rtol=0)
    weights = torch.randn(3, 4, generator=gen)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    assert logits.grad is not None and ref_logits.grad is not None
    assert_close(logits.grad.float(), ref_logits.grad.float(), atol=1e-5, rtol=0)
    want = torch.distributions.Categorical(logits=tempered.detach()).entropy()
    assert_close(ca.entropy_from_logits(logits.detach(), 0.7), want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="temperature"):
        ca.logprobs_from_logits(logits, labels, temperature=0.0)


def test_logprobs_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="labels shape"):
        ca.logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.int64))
