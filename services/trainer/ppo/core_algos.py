"""PPO math for LM post-training: advantages, KL estimators, losses, masked statistics.

This module is pure: tensors in, tensors out. It does no I/O, reads no config objects and
keeps no global state (the KL controllers hold one float each). Names and signatures follow
verl's ``core_algos`` so that verl users find what they expect.

Shape conventions: ``bs`` is the batch size, ``response_length`` the padded length of the
response part of each sequence. ``response_mask`` is 1 on valid response tokens and 0 on
padding; any nonzero entry counts as valid. Masked positions never influence a result, even
if they hold NaN or inf, and outputs of the advantage estimators are 0 there.

Degenerate inputs have defined, finite results instead of NaN:

* a masked mean over no valid element is 0;
* a masked variance over fewer than 2 valid elements (unbiased) or none (biased) is 0, so
  whitening maps such values to 0 (or to the mean when ``shift_mean=False``);
* in the sequence-level modes of :func:`agg_loss`, rows with no valid token are left out
  of the mean over sequences.

References:
    PPO, Schulman et al. 2017: https://arxiv.org/abs/1707.06347
    GAE, Schulman et al. 2015: https://arxiv.org/abs/1506.02438
    GRPO (DeepSeekMath), Shao et al. 2024: https://arxiv.org/abs/2402.03300
    RLOO, Ahmadian et al. 2024: https://arxiv.org/abs/2402.14740
    REINFORCE++, Hu 2025: https://arxiv.org/abs/2501.03262
    ReMax, Li et al. 2023: https://arxiv.org/abs/2310.10505
    Dual-clip PPO, Ye et al. 2020: https://arxiv.org/abs/1912.09729
    DAPO, Yu et al. 2025: https://arxiv.org/abs/2503.14476
    GSPO, Zheng et al. 2025: https://arxiv.org/abs/2507.18071
    CISPO (MiniMax-M1), MiniMax 2025: https://arxiv.org/abs/2506.13585
    Truncated importance sampling, Yao et al. 2025: https://fengyao.notion.site/off-policy-rl
    Adaptive KL controller, Ziegler et al. 2019: https://arxiv.org/abs/1909.08593
    KL estimators k1/k2/k3, Schulman 2020: http://joschu.net/blog/kl-approx.html
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "AGG_LOSS_MODES",
    "KL_PENALTY_TYPES",
    "POLICY_LOSS_MODES",
    "ROLLOUT_IS_LEVELS",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_group_filter_mask",
    "compute_grpo_outcome_advantage",
    "compute_overlong_penalty",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_gspo",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rollout_is_weights",
    "compute_value_loss",
    "entropy_from_logits",
    "get_kl_controller",
    "get_response_mask",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]

AGG_LOSS_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_PENALTY_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")
POLICY_LOSS_MODES = ("vanilla", "gspo", "cispo")
ROLLOUT_IS_LEVELS = ("token", "sequence")

# exp() of a log-ratio beyond this bound overflows or dominates everything else; both the
# PPO ratio and the k3 estimator clamp the log-ratio to [-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP].
_LOG_RATIO_CLAMP = 20.0
# verl clamps the k3 estimate to this bound to keep single tokens from dominating the loss.
_K3_CLAMP = 10.0
# GSPO's sequence-level log-ratio is clamped from above to this before exp (as verl does).
_GSPO_LOG_RATIO_MAX = 10.0
# Default chunk of logits processed at once by logprobs_from_logits, in elements
# (2**25 fp32 elements = 128 MiB of temporaries per chunk).
_CHUNK_ELEMENTS = 1 << 25


# --------------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------------


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(
    values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Sum of ``values`` over the positions where ``mask`` is nonzero.

    Args:
        values: any shape, e.g. ``(bs, response_length)``.
        mask: same shape as ``values`` (or broadcastable); nonzero marks a valid element.
        axis: dimension(s) to reduce; ``None`` reduces everything.

    Returns:
        The sum, a 0-dim tensor if ``axis`` is None, else ``values`` reduced over ``axis``.
        Masked positions are excluded with ``torch.where``, so NaN/inf there do not leak.
    """
    picked = torch.where(_valid(mask), values, 0)
    if axis is None:
        return picked.sum()
    return picked.sum(dim=axis)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is nonzero.

    Args:
        values: any shape, e.g. ``(bs, response_length)``.
        mask: same shape as ``values``; nonzero marks a valid element.
        axis: dimension(s) to reduce; ``None`` reduces everything.

    Returns:
        The mean (0-dim if ``axis`` is None). Where no element is valid the mean is 0
        (the count is clamped to 1), never NaN.
    """
    valid = _valid(mask).expand_as(values)
    total = masked_sum(values, valid, axis)
    count = valid.sum() if axis is None else valid.sum(dim=axis)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid elements of ``values`` (over all dimensions).

    Args:
        values: any shape, e.g. ``(bs, response_length)``.
        mask: same shape as ``values``; nonzero marks a valid element.
        unbiased: apply Bessel's correction ``n / (n - 1)``.

    Returns:
        0-dim variance. Defined as 0 when there are fewer than 2 valid elements with
        ``unbiased=True`` (Bessel's factor is undefined there) or none with ``unbiased=False``.
    """
    valid = _valid(mask).expand_as(values)
    mean = masked_mean(values, valid)
    variance = masked_mean((values - mean) ** 2, valid)
    if unbiased:
        n = valid.sum().to(variance.dtype)
        variance = torch.where(n > 1, variance * n / (n - 1).clamp(min=1), 0.0)
    return variance


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True
) -> torch.Tensor:
    """Normalize ``values`` to zero mean and unit variance using valid-element statistics.

    ``(values - mean) / sqrt(var + 1e-8)`` with the masked mean and unbiased masked variance.

    Args:
        values: any shape, e.g. ``(bs, response_length)``.
        mask: same shape as ``values``; nonzero marks a valid element.
        shift_mean: if False, add the mean back (only rescale).

    Returns:
        Same shape as ``values``. Masked positions receive the same affine map (their content
        is whatever it was, transformed); callers zero them if they need to.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def get_response_mask(
    response_id: torch.Tensor,
    eos_token: int | Sequence[int],
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """Mask of the tokens up to and including the first EOS of each response.

    Args:
        response_id: ``(bs, response_length)`` generated token ids.
        eos_token: one EOS id or several (any of them ends the response).
        dtype: dtype of the returned mask.

    Returns:
        ``(bs, response_length)`` mask, 1 up to and including the first EOS token, 0 after it;
        all ones for a row without EOS.
    """
    eos_ids = torch.as_tensor(
        [eos_token] if isinstance(eos_token, int) else list(eos_token), device=response_id.device
    )
    is_eos = torch.isin(response_id, eos_ids).to(torch.int64)
    # Number of EOS tokens strictly before each position; valid while that is zero.
    eos_before = torch.cumsum(is_eos, dim=-1) - is_eos
    return (eos_before == 0).to(dtype)


# --------------------------------------------------------------------------------------------
# Advantage estimators
# --------------------------------------------------------------------------------------------


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (https://arxiv.org/abs/1506.02438).

    Over the valid tokens ``t`` of a row, in order, with ``t'`` the next valid token::

        delta_t = r_t + gamma * V_{t'} - V_t          (V after the last valid token is 0)
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t

    Masked positions are skipped: they neither contribute a reward or value nor break the
    recursion, so a row with holes gives the same result as the row with the holes removed.
    Advantages are then whitened over all valid tokens of the batch (as verl does); returns
    are not.

    Args:
        token_level_rewards: ``(bs, response_length)`` reward per token.
        values: ``(bs, response_length)`` critic values ``V_t`` (detached).
        response_mask: ``(bs, response_length)``, nonzero on valid tokens.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        ``advantages``: ``(bs, response_length)``, whitened, 0 at masked positions.
        ``returns``: ``(bs, response_length)``, unwhitened ``A_t + V_t``, 0 at masked positions.
    """
    with torch.no_grad():
        valid = _valid(response_mask)
        bs, length = token_level_rewards.shape
        zeros = torch.zeros(bs, dtype=values.dtype, device=values.device)
        next_value = zeros
        last_gae = zeros
        advantages = torch.zeros_like(values)
        # The loop runs over positions only; every step is vectorized over the batch.
        for t in reversed(range(length)):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            gae = delta + gamma * lam * last_gae
            last_gae = torch.where(valid[:, t], gae, last_gae)
            next_value = torch.where(valid[:, t], values[:, t], next_value)
            advantages[:, t] = last_gae
        returns = torch.where(valid, advantages + values, 0.0)
        advantages = torch.where(valid, masked_whiten(advantages, valid), 0.0)
    return advantages, returns


def _group_ids(index: Any, bs: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map per-sample group ids (tensor, array or list of hashables) to ``0..n_groups-1``."""
    if isinstance(index, torch.Tensor):
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
        _, inverse = torch.unique(index, return_inverse=True)
        inverse = inverse.to(device)
    else:
        arr = np.asarray(index)
        if arr.ndim != 1:
            raise ValueError(f"index must be 1-D, got shape {arr.shape}")
        _, inv = np.unique(arr, return_inverse=True)
        inverse = torch.as_tensor(inv.reshape(-1), dtype=torch.int64, device=device)
    if inverse.numel() != bs:
        raise ValueError(f"index has {inverse.numel()} entries but the batch has {bs} rows")
    n_groups = int(inverse.max().item()) + 1 if bs > 0 else 0
    return inverse, n_groups


def _group_stats(
    scores: torch.Tensor, inverse: torch.Tensor, n_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group mean and unbiased group std (0 for groups of one)."""
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count.index_add_(0, inverse, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, inverse, scores)
    mean = total / count
    sq_dev = torch.zeros_like(count).index_add_(0, inverse, (scores - mean[inverse]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    return count[inverse], mean[inverse], std[inverse]


IndexLike = torch.Tensor | np.ndarray | Sequence[Hashable]


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: IndexLike,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (https://arxiv.org/abs/2402.03300, Sec. 4.1.2).

    Each response's score is the sum of its token rewards. Within each group of responses to
    the same prompt: ``A_i = (s_i - mean_g) / (std_g + epsilon)`` with the unbiased std (or
    ``A_i = s_i - mean_g`` when ``norm_adv_by_std_in_grpo`` is False, as in Dr. GRPO,
    https://arxiv.org/abs/2503.20783). A group of one uses mean 0 and std 1, as verl does,
    so its advantage is ``s_i / (1 + epsilon)``. The advantage is broadcast to every valid
    token.

    Args:
        token_level_rewards: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        index: ``(bs,)`` group id per sample: tensor, numpy array or list of hashables
            (e.g. prompt uids).
        epsilon: added to the std.
        norm_adv_by_std_in_grpo: divide by the group std.

    Returns:
        ``advantages`` and ``returns`` (identical), ``(bs, response_length)``, 0 at masked
        positions.
    """
    with torch.no_grad():
        valid = _valid(response_mask)
        scores = masked_sum(token_level_rewards, valid, axis=-1)
        inverse, n_groups = _group_ids(index, scores.shape[0], scores.device)
        count, mean, std = _group_stats(scores, inverse, n_groups)
        single = count == 1
        mean = torch.where(single, 0.0, mean)
        std = torch.where(single, 1.0, std)
        adv = scores - mean
        if norm_adv_by_std_in_grpo:
            adv = adv / (std + epsilon)
        advantages = torch.where(valid, adv.unsqueeze(-1), 0.0)
    return advantages, advantages


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: IndexLike,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO outcome advantage (https://arxiv.org/abs/2402.14740, Eq. 7).

    ``A_i = s_i - (1 / (n - 1)) * sum_{j != i} s_j`` within each group of ``n`` responses to
    the same prompt; for a group of one the baseline is 0 (``A_i = s_i``).

    Args:
        token_level_rewards: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        index: ``(bs,)`` group id per sample (tensor, array or list of hashables).
        epsilon: unused; kept for signature compatibility with verl.

    Returns:
        ``advantages`` and ``returns`` (identical), ``(bs, response_length)``, 0 at masked
        positions.
    """
    del epsilon
    with torch.no_grad():
        valid = _valid(response_mask)
        scores = masked_sum(token_level_rewards, valid, axis=-1)
        inverse, n_groups = _group_ids(index, scores.shape[0], scores.device)
        count, mean, _ = _group_stats(scores, inverse, n_groups)
        others = (mean * count - scores) / (count - 1).clamp(min=1)
        baseline = torch.where(count > 1, others, 0.0)
        advantages = torch.where(valid, (scores - baseline).unsqueeze(-1), 0.0)
    return advantages, advantages


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantage (https://arxiv.org/abs/2501.03262).

    Discounted return over the valid tokens, ``G_t = r_t + gamma * G_{t'}`` (``t'`` the next
    valid token; masked positions are skipped and their rewards ignored), then whitened over
    all valid tokens of the batch.

    Args:
        token_level_rewards: ``(bs, response_length)``; include any KL penalty beforehand.
        response_mask: ``(bs, response_length)``.
        gamma: discount factor.

    Returns:
        ``advantages``: ``(bs, response_length)`` whitened returns, 0 at masked positions.
        ``returns``: ``(bs, response_length)`` unwhitened returns, 0 at masked positions.
    """
    with torch.no_grad():
        valid = _valid(response_mask)
        running = torch.zeros_like(token_level_rewards[:, 0])
        returns = torch.zeros_like(token_level_rewards)
        for t in reversed(range(token_level_rewards.shape[1])):
            running = torch.where(valid[:, t], token_level_rewards[:, t] + gamma * running, running)
            returns[:, t] = running
        returns = torch.where(valid, returns, 0.0)
        advantages = torch.where(valid, masked_whiten(returns, valid), 0.0)
    return advantages, returns


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: IndexLike,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline (https://arxiv.org/abs/2501.03262).

    ``s_i - mean_g`` within each prompt group (mean 0 for a group of one), broadcast to every
    valid token, then whitened over all valid tokens of the batch (so long responses weigh
    more in the batch statistics, as in verl).

    Args:
        token_level_rewards: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        index: ``(bs,)`` group id per sample (tensor, array or list of hashables).
        epsilon: unused (whitening uses its own 1e-8); kept for compatibility with verl.

    Returns:
        ``advantages`` and ``returns`` (identical), ``(bs, response_length)``, 0 at masked
        positions.
    """
    del epsilon
    with torch.no_grad():
        valid = _valid(response_mask)
        scores = masked_sum(token_level_rewards, valid, axis=-1)
        inverse, n_groups = _group_ids(index, scores.shape[0], scores.device)
        count, mean, _ = _group_stats(scores, inverse, n_groups)
        centered = scores - torch.where(count > 1, mean, 0.0)
        per_token = torch.where(valid, centered.unsqueeze(-1), 0.0)
        advantages = torch.where(valid, masked_whiten(per_token, valid), 0.0)
    return advantages, advantages


def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax advantage (https://arxiv.org/abs/2310.10505, Alg. 1).

    Returns are the undiscounted reward-to-go ``R_t = sum_{k >= t} r_k`` over valid tokens;
    the advantage subtracts the per-sequence baseline, the reward of the greedy response:
    ``A_t = R_t - b``.

    Args:
        token_level_rewards: ``(bs, response_length)``.
        reward_baselines: ``(bs,)`` reward of the greedy decode of each prompt.
        response_mask: ``(bs, response_length)``.

    Returns:
        ``advantages``: ``(bs, response_length)``, 0 at masked positions.
        ``returns``: ``(bs, response_length)``, 0 at masked positions.
    """
    with torch.no_grad():
        valid = _valid(response_mask)
        rewards = torch.where(valid, token_level_rewards, 0.0)
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
        returns = torch.where(valid, returns, 0.0)
        advantages = torch.where(valid, returns - reward_baselines.unsqueeze(-1), 0.0)
    return advantages, returns


# --------------------------------------------------------------------------------------------
# DAPO: dynamic sampling and overlong reward shaping
# --------------------------------------------------------------------------------------------


def compute_group_filter_mask(values: torch.Tensor, index: IndexLike) -> torch.Tensor:
    """DAPO's dynamic-sampling filter (https://arxiv.org/abs/2503.14476, Eq. 11): keep the
    groups whose values are not all equal.

    A group whose responses all score the same gives every response a zero group-relative
    advantage, so it adds nothing to the gradient but dilutes it. A group of one sample is
    kept (its values cannot differ), as verl does. "All equal" is exact equality (the
    group's maximum equals its minimum), not a variance below a tolerance.

    Args:
        values: ``(bs,)`` the filter's metric per sample (e.g. the sequence reward).
        index: ``(bs,)`` group id per sample (tensor, array or list of hashables).

    Returns:
        ``(bs,)`` bool, True for the samples of the groups to keep.
    """
    values = values.reshape(-1)
    inverse, n_groups = _group_ids(index, values.shape[0], values.device)
    hi = torch.full((n_groups,), -torch.inf, dtype=values.dtype, device=values.device)
    lo = torch.full((n_groups,), torch.inf, dtype=values.dtype, device=values.device)
    hi = hi.scatter_reduce(0, inverse, values, "amax")
    lo = lo.scatter_reduce(0, inverse, values, "amin")
    count = torch.zeros(n_groups, dtype=torch.int64, device=values.device)
    count.index_add_(0, inverse, torch.ones_like(inverse))
    keep = (hi > lo) | (count == 1)
    return keep[inverse]


def compute_overlong_penalty(
    response_length: torch.Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float,
) -> torch.Tensor:
    """DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476, Eq. 13), the
    penalty added to a response's score.

    With ``L_max = max_response_length`` and ``L_cache = overlong_buffer_len``, a response of
    ``|y|`` tokens gets ``min(-(|y| - (L_max - L_cache)) / L_cache * penalty_factor, 0)``:
    0 up to ``L_max - L_cache`` tokens, then falling linearly to ``-penalty_factor`` at
    ``L_max`` (verl's DAPO reward manager; the paper's ``-1`` beyond ``L_max`` cannot occur
    since generation stops there).

    Args:
        response_length: ``(bs,)`` response lengths in tokens (the end token included).
        max_response_length: ``L_max``.
        overlong_buffer_len: ``L_cache``, ``0 < L_cache <= L_max``.
        penalty_factor: the penalty at ``L_max`` (>= 0).

    Returns:
        ``(bs,)`` float penalty, <= 0.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len must be in (0, max_response_length={max_response_length}], "
            f"got {overlong_buffer_len}"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    expected = max_response_length - overlong_buffer_len
    exceed = response_length.to(torch.float64) - expected
    penalty = (-exceed / overlong_buffer_len * penalty_factor).clamp(max=0.0)
    return penalty.to(torch.float32)


# --------------------------------------------------------------------------------------------
# KL penalty and controllers
# --------------------------------------------------------------------------------------------


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probabilities.

    With ``log r = ref_logprob - logprob`` (http://joschu.net/blog/kl-approx.html):

    * ``"kl"`` / ``"k1"``: ``logprob - ref_logprob`` (unbiased, high variance, can be < 0);
    * ``"abs"``: ``|logprob - ref_logprob|``;
    * ``"mse"`` / ``"k2"``: ``0.5 * (logprob - ref_logprob) ** 2``;
    * ``"low_var_kl"`` / ``"k3"``: ``exp(log r) - log r - 1`` (unbiased, >= 0), with
      ``log r`` clamped to [-20, 20] before ``exp`` and the result clamped to [-10, 10] as
      verl does.

    ``"full"`` needs the full distributions (logits), not per-token log-probs, and raises
    NotImplementedError.

    Args:
        logprob: ``(bs, response_length)`` log-probs of the sampled tokens under the policy.
        ref_logprob: ``(bs, response_length)`` same tokens under the reference policy.
        kl_penalty: estimator name, one of ``KL_PENALTY_TYPES``.

    Returns:
        ``(bs, response_length)`` per-token KL estimate.
    """
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        log_ratio = (ref_logprob - logprob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        kld = torch.exp(log_ratio) - log_ratio - 1
        return kld.clamp(-_K3_CLAMP, _K3_CLAMP)
    if kl_penalty == "full":
        raise NotImplementedError(
            "kl_penalty='full' needs the full policy and reference logits; per-token "
            "log-probs are not enough. Use 'k1', 'k2' or 'k3'."
        )
    raise ValueError(f"unknown kl_penalty {kl_penalty!r}; expected one of {KL_PENALTY_TYPES}")


class FixedKLController:
    """Constant KL coefficient.

    Args:
        kl_coef: the coefficient ``beta`` returned by ``.value``.
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing; present so both controllers share one interface."""
        del current_kl, n_steps


class AdaptiveKLController:
    """Proportional KL controller (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).

    On each update: ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)`` and
    ``beta <- beta * (1 + e * n_steps / horizon)``. A non-finite ``current_kl`` leaves
    ``beta`` as it is (one bad batch must not poison the coefficient for good).

    Args:
        init_kl_coef: initial ``beta``.
        target_kl: KL the controller steers towards (> 0).
        horizon: number of steps (samples) over which an error is corrected (> 0).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards the target given the KL measured over ``n_steps`` samples."""
        if not math.isfinite(current_kl):
            return
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def get_kl_controller(
    type: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build a KL controller.

    Args:
        type: ``"fixed"`` or ``"adaptive"``.
        kl_coef: the (initial) coefficient.
        target_kl: target KL, required for ``"adaptive"``.
        horizon: controller horizon, required for ``"adaptive"``.

    Returns:
        A controller with ``.value`` and ``.update(current_kl, n_steps)``.
    """
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(
                f"adaptive KL controller needs target_kl and horizon, got "
                f"target_kl={target_kl}, horizon={horizon}"
            )
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller type {type!r}; expected 'fixed' or 'adaptive'")


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    * ``"token-mean"``: mean over all valid tokens of the batch (each token weighs the same);
    * ``"seq-mean-token-sum"``: sum over each sequence's valid tokens, mean over sequences;
    * ``"seq-mean-token-mean"``: mean over each sequence's valid tokens, mean over sequences.

    Rows without any valid token are left out of the mean over sequences; with no valid token
    at all the result is 0 (never NaN). Values at masked positions are ignored, even NaN.

    Args:
        loss_mat: ``(bs, response_length)`` per-token loss.
        loss_mask: ``(bs, response_length)``, nonzero on tokens that count.
        loss_agg_mode: one of ``AGG_LOSS_MODES``.

    Returns:
        0-dim loss.
    """
    valid = _valid(loss_mask)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, valid)
    if loss_agg_mode == "seq-mean-token-sum":
        per_seq = masked_sum(loss_mat, valid, axis=-1)
    elif loss_agg_mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, valid, axis=-1)
    else:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {AGG_LOSS_MODES}"
        )
    return masked_mean(per_seq, valid.any(dim=-1))


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped PPO policy loss with dual clip (verl's ``loss_mode: vanilla``).

    ``ratio = exp(log_prob - old_log_prob)`` (log-ratio clamped to [-20, 20]). Per token
    (PPO, https://arxiv.org/abs/1707.06347, Eq. 7; asymmetric clip range as in DAPO)::

        L = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))

    and for ``A < 0`` the dual clip (https://arxiv.org/abs/1912.09729, Eq. 5) caps it:
    ``L = min(L, -A * clip_ratio_c)``, which bounds the update when the ratio explodes on a
    token with negative advantage.

    Args:
        old_log_prob: ``(bs, response_length)`` log-probs under the behaviour policy.
        log_prob: ``(bs, response_length)`` log-probs under the current policy (with grad).
        advantages: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        clip_ratio_low: lower clip epsilon (ratio >= 1 - clip_ratio_low).
        clip_ratio_high: upper clip epsilon (ratio <= 1 + clip_ratio_high).
        clip_ratio_c: dual-clip constant, must be > 1.
        loss_agg_mode: see :func:`agg_loss`.
        rollout_is_weights: ``(bs, response_length)`` per-token weights (no gradient) that
            multiply the per-token loss before aggregation, e.g. the truncated importance
            weights of :func:`compute_rollout_is_weights`; None: 1.

    Returns:
        ``pg_loss``: 0-dim loss to minimize.
        ``pg_clipfrac``: fraction of valid tokens where the clipped term is the active one
        (``-A * clip(ratio) > -A * ratio``).
        ``ppo_kl``: masked mean of ``old_log_prob - log_prob`` (k1 estimate of
        KL(pi_old || pi), unclamped).
        ``pg_clipfrac_lower``: fraction of valid tokens where the dual clip is active
        (``A < 0`` and the clipped loss exceeds ``-A * clip_ratio_c``).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"clip ratios must be >= 0, got clip_ratio_low={clip_ratio_low}, "
            f"clip_ratio_high={clip_ratio_high}"
        )
    valid = _valid(response_mask)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    ppo_kl = masked_mean(-log_ratio.detach(), valid)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).to(log_prob.dtype), valid)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    negative = advantages < 0
    dual_active = negative & (clip_pg_losses1 > pg_losses3)
    pg_clipfrac_lower = masked_mean(dual_active.to(log_prob.dtype), valid)

    pg_losses = torch.where(negative, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, valid, loss_agg_mode)
    return pg_loss, pg_clipfrac.detach(), ppo_kl, pg_clipfrac_lower.detach()


def _check_clip_ratios(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"clip ratios must be >= 0, got clip_ratio_low={clip_ratio_low}, "
            f"clip_ratio_high={clip_ratio_high}"
        )


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO: a sequence-level importance ratio, clipped at the sequence level
    (https://arxiv.org/abs/2507.18071, Eq. 5-7 and the GSPO-token form, Eq. 13-14).

    Per sequence ``i`` the ratio is the geometric mean of its token ratios over its
    ``|y_i|`` valid tokens::

        s_i = exp( (1 / |y_i|) * sum_t (log_prob_t - old_log_prob_t) )

    and each token carries ``s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]``: its value is
    ``s_i`` (so every token of a sequence is clipped together), its gradient is
    ``s_i * grad log_prob_t``. Per token, as in PPO but without the dual clip::

        L_t = max(-A_t * s_it, -A_t * clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high))

    aggregated by ``loss_agg_mode``; ``"seq-mean-token-mean"`` (the default, and what
    verl always uses for GSPO) gives the paper's ``(1/G) sum_i (1/|y_i|) sum_t``. The
    log of ``s_i`` is clamped to at most 10 before ``exp``, as verl does. GSPO's clip
    ranges are far smaller than PPO's (the paper: 3e-4 and 4e-4) since they bound a
    per-token average.

    Args:
        old_log_prob: ``(bs, response_length)`` log-probs under the behaviour policy.
        log_prob: ``(bs, response_length)`` log-probs under the current policy (with grad).
        advantages: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``; each row is one sequence.
        clip_ratio_low, clip_ratio_high: the sequence-level clip range.
        loss_agg_mode: see :func:`agg_loss`.
        rollout_is_weights: per-token weights multiplying the loss (see
            :func:`compute_policy_loss`); None: 1.

    Returns:
        ``pg_loss``: 0-dim loss to minimize.
        ``pg_clipfrac``: fraction of valid tokens where the clipped term is active.
        ``ppo_kl``: masked mean of ``old_log_prob - log_prob`` (token-level k1).
        ``pg_clipfrac_lower``: fraction of valid tokens where the clipped term is active
        at the lower bound (``s_i < 1 - clip_ratio_low``, negative advantage).
    """
    _check_clip_ratios(clip_ratio_low, clip_ratio_high)
    valid = _valid(response_mask)
    log_ratio = log_prob - old_log_prob
    ppo_kl = masked_mean(-log_ratio.detach(), valid)
    seq_log_ratio = masked_mean(log_ratio, valid, axis=-1)  # 0 for a row with no token
    # Value s_i at every token; gradient s_i * d log_prob_t. The detached sum is added
    # last, so that log_prob - log_prob.detach() is exactly 0 before it (verl#2775).
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(log_seq_ratio.clamp(max=_GSPO_LOG_RATIO_MAX))
    pg_losses1 = -advantages * seq_ratio
    clipped_ratio = seq_ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses2 = -advantages * clipped_ratio
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    active = pg_losses2 > pg_losses1
    pg_clipfrac = masked_mean(active.to(log_prob.dtype), valid)
    lower = active & (seq_ratio < 1.0 - clip_ratio_low)
    pg_clipfrac_lower = masked_mean(lower.to(log_prob.dtype), valid)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, valid, loss_agg_mode)
    return pg_loss, pg_clipfrac.detach(), ppo_kl, pg_clipfrac_lower.detach()


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO: clipped importance-sampling weights under a stop-gradient
    (MiniMax-M1, https://arxiv.org/abs/2506.13585, Eq. 4-5).

    ``ratio = exp(log_prob - old_log_prob)`` (log-ratio clamped to [-20, 20]); per token::

        L_t = -sg(clip(ratio_t, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A_t * log_prob_t

    Unlike PPO's clipped surrogate, no token's gradient is zeroed: a clipped token still
    contributes ``-clip(ratio) * A * grad log_prob``; only its weight is bounded. The loss
    value is not a surrogate of the reward (it is ``-A * log_prob`` at ratio 1); its
    gradient is what matters.

    Args:
        old_log_prob: ``(bs, response_length)`` log-probs under the behaviour policy.
        log_prob: ``(bs, response_length)`` log-probs under the current policy (with grad).
        advantages: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        clip_ratio_low, clip_ratio_high: the clip range of the weights.
        loss_agg_mode: see :func:`agg_loss`.
        rollout_is_weights: per-token weights multiplying the loss (see
            :func:`compute_policy_loss`); None: 1.

    Returns:
        ``pg_loss``: 0-dim loss to minimize.
        ``pg_clipfrac``: fraction of valid tokens whose ratio lies outside the clip range.
        ``ppo_kl``: masked mean of ``old_log_prob - log_prob``.
        ``pg_clipfrac_lower``: fraction of valid tokens with ``ratio < 1 - clip_ratio_low``.
    """
    _check_clip_ratios(clip_ratio_low, clip_ratio_high)
    valid = _valid(response_mask)
    log_ratio = log_prob - old_log_prob
    ppo_kl = masked_mean(-log_ratio.detach(), valid)
    with torch.no_grad():
        ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
        weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
        low = ratio < 1.0 - clip_ratio_low
        pg_clipfrac = masked_mean((low | (ratio > 1.0 + clip_ratio_high)).to(ratio.dtype), valid)
        pg_clipfrac_lower = masked_mean(low.to(ratio.dtype), valid)
    # Masked positions out of the product itself (not only out of the mean): a NaN
    # there would reach the gradient through ``log_prob`` (PPO's clamp blocks it).
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    weighted = torch.where(valid, weight * advantages, zero)
    pg_losses = -weighted * torch.where(valid, log_prob, zero)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, valid, loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance-sampling weights for the mismatch between the rollout engine
    and the trainer (Yao et al. 2025, https://fengyao.notion.site/off-policy-rl; verl's
    ``algorithm.rollout_correction``).

    The samples were drawn from the rollout engine's distribution ``pi_rollout`` (its
    kernels, precision, KV cache), the loss assumes the trainer's ``pi_old``. Each token's
    loss is weighted by::

        token:     w_t = min(exp(old_log_prob_t - rollout_log_prob_t), threshold)
        sequence:  w_t = min(exp(sum_t' (old_log_prob_t' - rollout_log_prob_t')), threshold)

    (the sequence level gives all tokens of a row their sequence's weight). Log-ratios are
    clamped to [-20, 20] before ``exp``. No gradient flows through the weights.

    Args:
        old_log_prob: ``(bs, response_length)`` the trainer's log-probs of the samples.
        rollout_log_prob: ``(bs, response_length)`` the rollout engine's.
        response_mask: ``(bs, response_length)``; masked positions get weight 0 and do not
            enter the metrics.
        level: ``"token"`` or ``"sequence"``.
        threshold: the truncation ``C`` (> 0).

    Returns:
        ``weights``: ``(bs, response_length)``, detached, 0 at masked positions.
        ``metrics`` (verl's names, 0-dim tensors): ``rollout_is_mean`` (mean weight after
        truncation over valid tokens), ``rollout_is_max`` (largest ratio before
        truncation), ``rollout_is_ratio_fraction_high`` (fraction of valid tokens whose
        ratio exceeded ``threshold``, i.e. was truncated).
    """
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout IS level {level!r}; expected one of {ROLLOUT_IS_LEVELS}")
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    with torch.no_grad():
        valid = _valid(response_mask)
        log_ratio = torch.where(valid, old_log_prob - rollout_log_prob, 0.0)
        if level == "sequence":
            log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
        ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
        weights = torch.where(valid, ratio.clamp(max=threshold), 0.0)
        picked = torch.where(valid, ratio, 0.0)
        metrics = {
            "rollout_is_mean": masked_mean(weights, valid),
            "rollout_is_max": picked.amax() if picked.numel() else picked.new_zeros(()),
            "rollout_is_ratio_fraction_high": masked_mean(
                (ratio > threshold).to(ratio.dtype), valid
            ),
        }
    return weights, metrics


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO, https://arxiv.org/abs/1707.06347; as in OpenAI baselines).

    ``v_clip = clip(vpreds, values - cliprange_value, values + cliprange_value)`` and per
    token ``0.5 * max((vpreds - R)^2, (v_clip - R)^2)``, aggregated by ``loss_agg_mode``.

    Args:
        vpreds: ``(bs, response_length)`` current critic predictions (with grad).
        returns: ``(bs, response_length)`` targets ``R``.
        values: ``(bs, response_length)`` critic predictions at rollout time.
        response_mask: ``(bs, response_length)``.
        cliprange_value: maximum move of the prediction away from ``values``.
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        ``vf_loss``: 0-dim loss.
        ``vf_clipfrac``: fraction of valid tokens where the clipped term is the larger one.
    """
    valid = _valid(response_mask)
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpredclipped - returns).square()
    clipped_vf_losses = torch.maximum(vf_losses1, vf_losses2)
    vf_loss = 0.5 * agg_loss(clipped_vf_losses, valid, loss_agg_mode)
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).to(vpreds.dtype), valid)
    return vf_loss, vf_clipfrac.detach()


# --------------------------------------------------------------------------------------------
# Log-probabilities and entropy from logits
# --------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 are upcast to fp32 for logsumexp; fp64 stays fp64.
    return torch.promote_types(dtype, torch.float32)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits`` over the last dimension.

    ``H = logsumexp(l) - sum(softmax(l) * l)`` with ``l = logits / temperature``, computed
    in at least fp32 (the division happens after the upcast).

    Args:
        logits: ``(..., vocab_size)``, e.g. ``(bs, response_length, vocab_size)``.
        temperature: > 0; the distribution of ``logits / temperature``.

    Returns:
        ``(...)`` entropy in nats, fp32 (fp64 for fp64 input).
    """
    x = logits.to(_compute_dtype(logits.dtype))
    if temperature != 1.0:
        x = x / temperature
    probs = torch.softmax(x, dim=-1)
    return torch.logsumexp(x, dim=-1) - (probs * x).sum(dim=-1)


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Aggregated token entropy (subtract ``coef * result`` from the loss to add a bonus).

    Args:
        logits: ``(bs, response_length, vocab_size)``.
        response_mask: ``(bs, response_length)``.
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        0-dim aggregated entropy.
    """
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)


class _LabelLogprob(torch.autograd.Function):
    """``logits[label] - logsumexp(logits)`` row chunk by row chunk, with a matching backward.

    Only the input logits (in their own dtype), the labels and one logsumexp per row are
    saved for backward; the fp32 upcast of a chunk lives only while that chunk is processed.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int, inv_temp: float
    ) -> torch.Tensor:
        cdt = _compute_dtype(logits.dtype)
        n = logits.shape[0]
        out = torch.empty(n, dtype=cdt, device=logits.device)
        lse = torch.empty(n, dtype=cdt, device=logits.device)
        for start in range(0, n, chunk_rows):
            end = min(start + chunk_rows, n)
            chunk = _scaled_chunk(logits[start:end], cdt, inv_temp)
            lse[start:end] = torch.logsumexp(chunk, dim=-1)
            picked = chunk.gather(-1, labels[start:end].unsqueeze(-1)).squeeze(-1)
            out[start:end] = picked - lse[start:end]
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_rows = chunk_rows
        ctx.inv_temp = inv_temp
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, labels, lse = ctx.saved_tensors
        cdt = lse.dtype
        inv_temp = ctx.inv_temp
        n = logits.shape[0]
        whole = 0 < n <= ctx.chunk_rows and logits.dtype == cdt  # the chunk is the gradient
        grad_logits = None if whole else torch.empty_like(logits)
        for start in range(0, n, ctx.chunk_rows):
            end = min(start + ctx.chunk_rows, n)
            g = grad_out[start:end].to(cdt).unsqueeze(-1)
            if inv_temp != 1.0:
                g = g * inv_temp  # d(l / T) / dl = 1 / T
            # d/dl (l_y - logsumexp(l)) = onehot(y) - softmax(l), in place in one
            # fresh chunk-sized tensor (the subtraction's result).
            chunk = _scaled_chunk(logits[start:end], cdt, inv_temp)
            grad = torch.sub(chunk, lse[start:end].unsqueeze(-1)).exp_().mul_(-g)
            grad.scatter_add_(-1, labels[start:end].unsqueeze(-1), g)
            if grad_logits is None:
                return grad, None, None, None
            grad_logits[start:end] = grad
        assert grad_logits is not None  # None only when one chunk returned above
        return grad_logits, None, None, None


def _scaled_chunk(chunk: torch.Tensor, cdt: torch.dtype, inv_temp: float) -> torch.Tensor:
    """``chunk`` in the compute dtype, divided by the temperature after the upcast."""
    x = chunk.to(cdt)
    return x * inv_temp if inv_temp != 1.0 else x


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probability of ``labels`` under ``softmax(logits / temperature)``, without a
    full log_softmax (nor a tempered copy of the logits).

    Computes ``logits[label] - logsumexp(logits)`` per row. This is lean compared with
    ``log_softmax(logits.float()).gather(...)``: that materializes a second
    ``(rows, vocab_size)`` fp32 tensor (plus an fp32 copy of bf16 logits), and autograd keeps
    it alive until backward. Here rows are processed in chunks of ``chunk_size`` (default:
    about 2**25 elements per chunk), so fp32 temporaries are bounded by one chunk, and the
    custom backward saves only the original logits and one fp32 logsumexp per row,
    recomputing ``softmax`` chunk by chunk.

    Args:
        logits: ``(..., vocab_size)``, e.g. ``(bs, response_length, vocab_size)``; any float
            dtype (bf16/fp16 are upcast to fp32 one chunk at a time).
        labels: ``(...)`` integer token ids in ``[0, vocab_size)``.
        chunk_size: rows per chunk; ``None`` picks one from the vocabulary size.
        temperature: > 0; applied to each chunk after its upcast (and in backward).

    Returns:
        ``(...)`` log-probabilities, fp32 (fp64 for fp64 input).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab "
            f"dimension {tuple(logits.shape[:-1])}"
        )
    vocab = logits.shape[-1]
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    flat_logits = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1).to(torch.int64)
    out = _LabelLogprob.apply(flat_logits, flat_labels, chunk_size, 1.0 / temperature)
    assert isinstance(out, torch.Tensor)
    return out.reshape(labels.shape)
