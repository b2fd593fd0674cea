"""What each data-parallel rank does with its share of a batch.

A :class:`Worker` runs the model-side operations on one rank's rows: forward passes in
micro-batches, and PPO updates as ``ppo_epochs`` x mini-batches x micro-batches with
gradient accumulation. The batch-wide logic (validation, advantages, counters) is in
:class:`rlfleet.trainer.core.TrainerCore`, which hands each rank its rows.

Micro-batches hold ``*_micro_batch_size`` samples, or, with ``use_dynamic_bsz`` (verl's
name), as many samples as fit a token budget (``*_max_token_len_per_gpu``): rows are
dealt longest first into the fewest balanced groups that fit
(:func:`~rlfleet.trainer.batch.token_budget_groups`), every rank cutting as many as the
rank that needs the most (FSDP's collectives need the same number of forwards
everywhere). A row costs its real tokens when the backend packs the role's sequences
(``use_remove_padding``), its padded length otherwise. Forward outputs come back in the
rows' order.

Loss scaling. Each micro-batch loss is the PPO loss of that micro-batch (from
``core_algos``), multiplied by its share of the mini-batch: its valid tokens (or
sequences, for the ``seq-mean-*`` modes) over the mini-batch's total across all ranks,
times the world size (FSDP averages gradients over ranks). The accumulated gradient is
then exactly the gradient of the loss over the whole mini-batch, however it is cut into
micro-batches and ranks; this is what makes a 1-rank and an N-rank update agree.

A loss whose terms aggregate differently scales each term by its own share: GSPO's policy
term is always a mean over sequences (``seq-mean-token-mean``, as in verl), its entropy
and KL terms follow ``loss_agg_mode``.

Policy losses (``actor.policy_loss.loss_mode``, verl's key): ``vanilla`` (dual-clip PPO),
``gspo`` (sequence-level ratio; a sequence is a row of the micro-batch, whole whether the
backend packs it or not, so the per-sequence mean needs no regrouping) and ``cispo``;
all from :mod:`~rlfleet.trainer.ppo.core_algos`. With
``algorithm.rollout_correction.rollout_is`` set, each token's policy loss is weighted by
the truncated importance weight ``min(exp(old_log_prob - rollout_log_prob), C)``
(``rollout_corr/rollout_is_mean``, ``rollout_corr/rollout_is_max``,
``rollout_corr/rollout_is_ratio_fraction_high``); when the old log-probs come from the
update's own forward (see :meth:`Worker.update_actor`), the weights use those.

Metrics are weighted the same way: each micro-batch reports its values times its share,
so a step's metrics (``actor/pg_loss``, ``actor/pg_clipfrac``, ``critic/vf_loss``, ...)
are the values over the whole mini-batch, whatever the micro-batches and ranks: a loss
as it aggregates, per-token diagnostics (``actor/pg_clipfrac``, ``actor/ppo_kl``,
``rollout_corr/rollout_is_mean``, ...) as token means; an update reports their mean
over its optimizer steps.
Maxima (``rollout_corr/rollout_is_max``) are the maximum over micro-batches, optimizer
steps and ranks instead.
They stay tensors on the device until the end of the update and are read back in
one transfer, so a micro-batch costs no host-device synchronisation beyond the
forward and backward themselves. The actor's entropy (a pass over the full vocabulary)
is computed only when ``entropy_coeff`` is not 0 (``actor/entropy`` then appears in the
update's metrics; ``compute_log_prob`` always returns it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlfleet.common.config import Config
from rlfleet.trainer.backend import Backend, Metrics, ModelRole, Outputs
from rlfleet.trainer.batch import Batch, batch_size, index_select, split, token_budget_groups
from rlfleet.trainer.ppo import core_algos

__all__ = ["MAX_METRICS", "MicroBatching", "Worker"]

_TOKEN_MODES = ("token-mean",)
#: GSPO's policy term is a mean over sequences whatever loss_agg_mode says (as in verl).
_GSPO_AGG = "seq-mean-token-mean"
#: Metrics reduced by their maximum (over micro-batches, steps and ranks), not a mean.
MAX_METRICS = frozenset({"rollout_corr/rollout_is_max"})


def _mean_metrics(items: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The mean of each metric over ``items`` (the maximum for :data:`MAX_METRICS`)."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    most: dict[str, float] = {}
    for m in items:
        for k, v in m.items():
            if k in MAX_METRICS:
                most[k] = max(most.get(k, v), v)
                continue
            sums[k] += v
            counts[k] += 1
    return {k: sums[k] / counts[k] for k in sums} | most


def _sum_metrics(items: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The sum of each metric over ``items`` (the maximum for :data:`MAX_METRICS`)."""
    sums: dict[str, float] = defaultdict(float)
    most: dict[str, float] = {}
    for m in items:
        for k, v in m.items():
            if k in MAX_METRICS:
                most[k] = max(most.get(k, v), v)
            else:
                sums[k] += v
    return dict(sums) | most


def _read_metrics(items: Sequence[Metrics]) -> list[dict[str, float]]:
    """Every value of ``items`` as a float, tensors read back in one transfer."""
    tensors = [v for m in items for v in m.values() if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.detach().float() for t in tensors]).tolist() if tensors else [])
    return [
        {k: next(read) if isinstance(v, torch.Tensor) else float(v) for k, v in m.items()}
        for m in items
    ]


def _units(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What a loss averages over: valid tokens, or sequences with a valid token."""
    valid = mask != 0
    if mode in _TOKEN_MODES:
        return valid.sum().to(torch.float64)
    return valid.any(dim=-1).sum().to(torch.float64)


def _share(mask: torch.Tensor, mode: str, scale: float) -> torch.Tensor:
    """A micro-batch's share of the mini-batch: its loss units times ``scale`` (world
    size over the mini-batch's units on all ranks); a tensor, so no host sync."""
    return (_units(mask, mode) * scale).to(torch.float32)


def _weighted(metrics: Metrics, share: torch.Tensor) -> Metrics:
    """Each metric times the micro-batch's share: summed over a step's micro-batches
    (and averaged over ranks) they give the mini-batch's value, however it was cut.
    :data:`MAX_METRICS` stay as they are (their maximum is taken instead)."""
    return {
        k: v.detach() if k in MAX_METRICS else v.detach() * share
        for k, v in metrics.items()
        if isinstance(v, torch.Tensor)
    }


@dataclass(frozen=True)
class MicroBatching:
    """How an operation cuts rows: ``size`` samples (None: all), or with ``budget`` set,
    by tokens (``packed``: real tokens count, else the padded length)."""

    size: int | None
    budget: int | None = None
    packed: bool = False


class Worker:
    """One rank's model operations (see the module docstring)."""

    def __init__(self, config: Config, backend: Backend) -> None:
        self.config = config
        self.backend = backend

    @property
    def temperature(self) -> float:
        t = self.config.rollout.temperature
        return t if t > 0 else 1.0

    # ---------------------------------------------------------------- micro-batches

    def _packs(self, role: ModelRole) -> bool:
        section = self.config.critic if role == "critic" else self.config.actor
        return bool(section.use_remove_padding)

    def batching(self, op: str) -> MicroBatching:
        """The micro-batching of ``op`` from the config (verl's keys)."""
        c = self.config
        a, cr, ref, ro = c.actor, c.critic, c.ref, c.rollout

        def pick(flag: bool | None, budget: int | None) -> int | None:
            on = a.use_dynamic_bsz if flag is None else flag
            return (budget or a.ppo_max_token_len_per_gpu) if on else None

        if op == "compute_log_prob":
            size = ro.log_prob_micro_batch_size or a.ppo_micro_batch_size
            budget = pick(ro.log_prob_use_dynamic_bsz, ro.log_prob_max_token_len_per_gpu)
            return MicroBatching(size, budget, self._packs("actor"))
        if op == "compute_ref_log_prob":
            budget = pick(ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu)
            return MicroBatching(ref.log_prob_micro_batch_size, budget, self._packs("ref"))
        if op == "compute_values":
            budget = pick(
                cr.use_dynamic_bsz,
                cr.forward_max_token_len_per_gpu or cr.ppo_max_token_len_per_gpu,
            )
            return MicroBatching(cr.ppo_micro_batch_size, budget, self._packs("critic"))
        if op == "update_critic":
            budget = pick(cr.use_dynamic_bsz, cr.ppo_max_token_len_per_gpu)
            return MicroBatching(cr.ppo_micro_batch_size, budget, self._packs("critic"))
        if op in ("update_actor", "sft_step"):
            budget = pick(a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu)
            return MicroBatching(a.ppo_micro_batch_size, budget, self._packs("actor"))
        raise ValueError(f"no micro-batching for {op!r}")

    def _groups(self, batch: Batch, how: MicroBatching) -> list[torch.Tensor] | None:
        """Row indices of each micro-batch by the token budget (None: by size)."""
        if how.budget is None:
            return None
        mask = batch["attention_mask"]
        if how.packed:
            lengths = (mask != 0).sum(dim=-1)
        else:
            lengths = torch.full((mask.shape[0],), mask.shape[1], dtype=torch.int64)
        groups = token_budget_groups(lengths, how.budget)
        if self.backend.world_size > 1:
            # Every rank runs as many micro-batches as the one that needs the most: each
            # rank marks 1 for every micro-batch it needs (rows per rank are equal).
            need = (torch.arange(lengths.numel()) < len(groups)).to(torch.float32)
            most = int((self.backend.all_reduce_sum(need) > 0).sum())
            if most > len(groups):
                groups = token_budget_groups(lengths, how.budget, at_least=most)
        return groups

    def _micro(
        self, batch: Batch, how: MicroBatching
    ) -> tuple[list[Batch], list[torch.Tensor] | None]:
        """The micro-batches, and their rows when cut by tokens (None: consecutive)."""
        groups = self._groups(batch, how)
        if groups is None:
            bs = batch_size(batch)
            return (list(split(batch, how.size or bs)) if bs else []), None
        return [index_select(batch, g) for g in groups], groups

    # ---------------------------------------------------------------- forward

    def _forward_cat(
        self, role: ModelRole, op: str, batch: Batch, with_entropy: bool = False
    ) -> Outputs:
        micro, groups = self._micro(batch, self.batching(op))
        outs = self.backend.forward(
            role, micro, temperature=self.temperature, with_entropy=with_entropy
        )
        if not outs:
            return {}
        cat = {k: torch.cat([o[k] for o in outs], dim=0) for k in outs[0]}
        if groups is None:
            return cat
        order = torch.cat(groups)  # row order of ``cat``: put each row back in place
        return {k: torch.empty_like(v).index_copy_(0, order, v) for k, v in cat.items()}

    def compute_log_prob(self, batch: Batch) -> Batch:
        out = self._forward_cat("actor", "compute_log_prob", batch, with_entropy=True)
        return {"old_log_probs": out["log_prob"], "entropys": out["entropy"]}

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        out = self._forward_cat("ref", "compute_ref_log_prob", batch)
        return {"ref_log_prob": out["log_prob"]}

    def compute_values(self, batch: Batch) -> Batch:
        out = self._forward_cat("critic", "compute_values", batch)
        return {"values": out["values"]}

    # ---------------------------------------------------------------- updates

    def _minibatches(
        self, batch: Batch, mini_per_rank: int, shuffle: bool, seed: int
    ) -> list[Batch]:
        bs = batch_size(batch)
        if shuffle:
            # Shuffle within each mini-batch position only, reproducibly (seed + step),
            # so ranks keep their interleaved share and a resumed run shuffles alike.
            g = torch.Generator().manual_seed(seed)
            order = torch.cat(
                [
                    start + torch.randperm(min(mini_per_rank, bs - start), generator=g)
                    for start in range(0, bs, mini_per_rank)
                ]
            )
            batch = index_select(batch, order)
        return list(split(batch, mini_per_rank))

    def _update(
        self,
        role: ModelRole,
        op: str,
        batch: Batch,
        *,
        mini_per_rank: int,
        epochs: int,
        shuffle: bool,
        seed: int,
        loss_modes: Sequence[str],
        loss_fn_for: Any,
        with_entropy: bool,
        extra: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        """``loss_fn_for(scales)`` builds a micro-batch loss from ``scales``: for each of
        ``loss_modes``, the world size over the mini-batch's loss units on all ranks."""
        prefix = "critic" if role == "critic" else "actor"
        how = self.batching(op)
        modes = list(dict.fromkeys(loss_modes))
        per_mb: list[Metrics] = []
        counts: list[int] = []  # micro-batches of each optimizer step
        steps: list[tuple[float, bool]] = []
        for epoch in range(epochs):
            for mb in self._minibatches(batch, mini_per_rank, shuffle, seed + epoch):
                local = torch.stack([_units(mb["response_mask"], m) for m in modes])
                totals = self.backend.all_reduce_sum(local).tolist()
                world = self.backend.world_size
                scales = {m: world / max(t, 1.0) for m, t in zip(modes, totals, strict=True)}
                micro, _ = self._micro(mb, how)
                got = self.backend.forward_backward(
                    role,
                    micro,
                    loss_fn_for(scales),
                    temperature=self.temperature,
                    with_entropy=with_entropy,
                )
                per_mb.extend(got)
                counts.append(len(got))
                steps.append(self.backend.optimizer_step(role))
        # Each step's value is the sum of its micro-batches' shares (this rank's part of
        # the mini-batch's value; TrainerCore averages the ranks); then the mean of steps.
        read = iter(_read_metrics(per_mb))
        metrics = []
        for n, (grad_norm, stepped) in zip(counts, steps, strict=True):
            merged = _sum_metrics([next(read) for _ in range(n)])
            merged[f"{prefix}/grad_norm"] = grad_norm
            merged[f"{prefix}/skipped_steps"] = 0.0 if stepped else 1.0
            metrics.append(merged)
        out = _mean_metrics(metrics)
        out[f"{prefix}/skipped_steps"] = sum(m[f"{prefix}/skipped_steps"] for m in metrics)
        out[f"{prefix}/lr"] = self.backend.lr(role)
        out.update(extra or {})
        self.backend.scheduler_step(role)
        return out

    def update_actor(
        self,
        batch: Batch,
        *,
        mini_per_rank: int,
        seed: int,
        old_log_probs_from_current: bool = False,
        kl_loss_coef: float | None = None,
    ) -> dict[str, float]:
        """PPO policy updates on this rank's rows.

        ``kl_loss_coef``: the KL loss's coefficient for this update (the trainer core's
        controller, ``actor.kl_loss_ctrl``); None: ``actor.kl_loss_coef``.

        ``old_log_probs_from_current``: the batch has no ``old_log_probs``; the loss
        takes the actor's own log-probs of this forward, detached (ratio exactly 1).
        Equal to the old-log-prob pass only before the first optimizer step, so it
        requires one epoch over one mini-batch (the trainer core decides; see
        :meth:`rlfleet.trainer.core.TrainerCore.skips_old_log_prob`).
        """
        a = self.config.actor
        assert a.clip_ratio_low is not None and a.clip_ratio_high is not None
        if old_log_probs_from_current and (a.ppo_epochs != 1 or batch_size(batch) > mini_per_rank):
            raise ValueError(
                "old log-probs from the update's own forward need one epoch over one "
                f"mini-batch (ppo_epochs {a.ppo_epochs}, {batch_size(batch)} rows, "
                f"mini-batch {mini_per_rank})"
            )
        low, high = a.clip_ratio_low, a.clip_ratio_high
        use_kl = a.use_kl_loss
        kl_coef = a.kl_loss_coef if kl_loss_coef is None else kl_loss_coef
        mode = a.loss_agg_mode
        loss_mode = a.policy_loss.loss_mode
        pg_mode = _GSPO_AGG if loss_mode == "gspo" else mode
        correction = self.config.algorithm.rollout_correction
        with_entropy = a.entropy_coeff != 0

        def policy_loss(
            old: torch.Tensor,
            log_prob: torch.Tensor,
            advantages: torch.Tensor,
            mask: torch.Tensor,
            weights: torch.Tensor | None,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            if loss_mode == "gspo":
                return core_algos.compute_policy_loss_gspo(
                    old, log_prob, advantages, mask, low, high, pg_mode, weights
                )
            if loss_mode == "cispo":
                return core_algos.compute_policy_loss_cispo(
                    old, log_prob, advantages, mask, low, high, pg_mode, weights
                )
            return core_algos.compute_policy_loss(
                old, log_prob, advantages, mask, low, high, a.clip_ratio_c, pg_mode, weights
            )

        def loss_fn_for(scales: Mapping[str, float]) -> Any:
            def loss_fn(out: Outputs, mb: dict[str, Any]) -> tuple[torch.Tensor, Metrics]:
                mask = mb["response_mask"]
                log_prob = out["log_prob"]
                old = log_prob.detach() if old_log_probs_from_current else mb["old_log_probs"]
                weights = None
                is_metrics: Metrics = {}
                if correction.rollout_is is not None:
                    weights, found = core_algos.compute_rollout_is_weights(
                        old,
                        mb["rollout_log_probs"],
                        mask,
                        correction.rollout_is,
                        correction.rollout_is_threshold,
                    )
                    is_metrics = {f"rollout_corr/{k}": v for k, v in found.items()}
                pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = policy_loss(
                    old, log_prob, mb["advantages"], mask, weights
                )
                pg_share = _share(mask, pg_mode, scales[pg_mode])
                share = _share(mask, mode, scales[mode])
                token_share = _share(mask, _TOKEN_MODES[0], scales[_TOKEN_MODES[0]])
                loss = pg_loss * pg_share
                # Means over tokens weigh by tokens, whatever the loss aggregates over.
                token_metrics: Metrics = {
                    "actor/pg_clipfrac": pg_clipfrac,
                    "actor/ppo_kl": ppo_kl,
                    "actor/pg_clipfrac_lower": pg_clipfrac_lower,
                    **is_metrics,
                }
                m: Metrics = {}
                if with_entropy:
                    entropy = core_algos.agg_loss(out["entropy"], mask, mode)
                    loss = loss - a.entropy_coeff * entropy * share
                    m["actor/entropy"] = entropy
                if use_kl:
                    kld = core_algos.kl_penalty(log_prob, mb["ref_log_prob"], a.kl_loss_type)
                    kl_loss = core_algos.agg_loss(kld, mask, mode)
                    loss = loss + kl_coef * kl_loss * share
                    m["actor/kl_loss"] = kl_loss
                return loss, (
                    _weighted({"actor/pg_loss": pg_loss}, pg_share)
                    | _weighted(token_metrics, token_share)
                    | _weighted(m, share)
                )

            return loss_fn

        return self._update(
            "actor",
            "update_actor",
            batch,
            mini_per_rank=mini_per_rank,
            epochs=a.ppo_epochs,
            shuffle=a.shuffle,
            seed=seed,
            loss_modes=(pg_mode, mode, _TOKEN_MODES[0]),
            loss_fn_for=loss_fn_for,
            with_entropy=with_entropy,
            extra={"actor/kl_coef": kl_coef} if use_kl else None,
        )

    def update_critic(self, batch: Batch, *, mini_per_rank: int, seed: int) -> dict[str, float]:
        c = self.config.critic
        mode = c.loss_agg_mode

        def loss_fn_for(scales: Mapping[str, float]) -> Any:
            def loss_fn(out: Outputs, mb: dict[str, Any]) -> tuple[torch.Tensor, Metrics]:
                mask = mb["response_mask"]
                vpreds = out["values"]
                vf_loss, vf_clipfrac = core_algos.compute_value_loss(
                    vpreds, mb["returns"], mb["values"], mask, c.cliprange_value, mode
                )
                m: Metrics = {
                    "critic/vf_loss": vf_loss,
                    "critic/vf_clipfrac": vf_clipfrac,
                    "critic/vpred_mean": core_algos.masked_mean(vpreds.detach(), mask),
                }
                share = _share(mask, mode, scales[mode])
                return vf_loss * share, _weighted(m, share)

            return loss_fn

        return self._update(
            "critic",
            "update_critic",
            batch,
            mini_per_rank=mini_per_rank,
            epochs=c.ppo_epochs or 1,
            shuffle=c.shuffle,
            seed=seed,
            loss_modes=(mode,),
            loss_fn_for=loss_fn_for,
            with_entropy=False,
        )

    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of token-mean cross-entropy on the response tokens."""
        local = _units(batch["response_mask"], "token-mean")
        total = float(self.backend.all_reduce_sum(local.reshape(1)).item())
        scale = self.backend.world_size / max(total, 1.0)

        def loss_fn(out: Outputs, mb: dict[str, Any]) -> tuple[torch.Tensor, Metrics]:
            mask = mb["response_mask"]
            nll = core_algos.masked_mean(-out["log_prob"], mask)
            share = _share(mask, "token-mean", scale)
            return nll * share, _weighted({"sft/loss": nll}, share)

        micro, _ = self._micro(batch, self.batching("sft_step"))
        per_mb = _read_metrics(self.backend.forward_backward("actor", micro, loss_fn))
        grad_norm, stepped = self.backend.optimizer_step("actor")
        # The per-micro-batch shares add up to this rank's part of the global mean.
        out = {"sft/loss": sum(m["sft/loss"] for m in per_mb)}
        out["actor/grad_norm"] = grad_norm
        out["actor/skipped_steps"] = 0.0 if stepped else 1.0
        out["actor/lr"] = self.backend.lr("actor")
        self.backend.scheduler_step("actor")
        return out
