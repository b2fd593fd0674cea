"""Early warnings when a PPO run goes wrong, and the optional guard that acts on them.

:class:`HealthMonitor` reads each step's metrics (``trainer.health``) and flags:

* ``entropy_collapse`` -- the policy's token entropy fell below ``entropy_min``
  (nats), or below ``entropy_min_ratio`` of its mean over the first ``window`` steps.
  The entropy is the actor update's (``actor/entropy``, with an entropy bonus), else
  the old-log-prob pass's (``actor/entropy_old``), else the sampled tokens' mean
  negative log-prob (``rollout/neg_log_prob_mean``, an estimate of the entropy at the
  sampling temperature); the first one seen is used for the whole run.
* ``reward_drop`` -- the moving average of the mean score (``critic/score/mean`` over
  ``window`` steps) fell more than ``reward_drop_ratio`` of its best value below that
  best, or fell ``reward_drop_steps`` steps in a row.
* ``val_drop`` -- the validation score (``val/test_score/mean``, every
  ``trainer.test_freq`` steps; the one before training counts) is more than
  ``val_drop_ratio`` of its best below that best; it holds until the next validation.
* ``ppo_kl_high`` -- ``|actor/ppo_kl|``, the KL of an update's policy to the one
  that sampled the batch, exceeds ``max_ppo_kl``.
* ``grad_norm_high`` -- ``actor/grad_norm`` (before clipping) exceeds
  ``max_grad_norm``, or a gradient norm is not finite (the trainer then skipped the
  optimizer step: ``actor/skipped_steps``, ``critic/skipped_steps``).

A check that starts firing is one :class:`HealthWarning`: one line saying what was
seen, against which key, and what to try. While it keeps firing it is not repeated;
once it clears and fires again, it is a new warning. Every step's metrics get
``health/<check>`` (1 while firing, else 0), ``health/warnings`` (checks firing now)
and ``health/warnings_total`` (warnings so far).

:class:`Guard` (``trainer.health.guard``, off by default) is what the driver does on a
new warning: roll the trainer back to the last checkpoint saved before the warnings
started (``rollback``; needs ``trainer.save_freq``) and multiply the actor's lr by
``lr_factor``, at most ``max_interventions`` times, then ``cooldown_steps`` steps of
quiet while the moving windows refill. Its state (``health/interventions``,
``health/rollbacks``, ``health/lr_scale``) and the monitor's go into the driver's
checkpoints, so a resumed run keeps both.

Pure bookkeeping: no I/O, no clients (the driver acts on what :class:`Guard` decides).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlfleet.common.config import HealthConfig

__all__ = ["CHECKS", "Guard", "GuardAction", "HealthMonitor", "HealthWarning", "sampled_entropy"]

#: The checks, in the order their warnings are reported.
CHECKS: tuple[str, ...] = (
    "entropy_collapse",
    "reward_drop",
    "val_drop",
    "ppo_kl_high",
    "grad_norm_high",
)

#: Where the entropy is read from, first found first (see the module docstring).
ENTROPY_KEYS: tuple[str, ...] = (
    "actor/entropy",
    "actor/entropy_old",
    "rollout/neg_log_prob_mean",
)
REWARD_KEY = "critic/score/mean"
VAL_KEY = "val/test_score/mean"
_KEY = "trainer.health"


@dataclass(frozen=True)
class HealthWarning:
    """One check that started firing at ``step``; ``message`` is the console line."""

    check: str
    step: int
    message: str


def sampled_entropy(logprobs: Sequence[Sequence[float]]) -> float | None:
    """The mean negative log-prob of the sampled tokens (an estimate of the policy's
    entropy at the sampling temperature); None when no sample carries log-probs."""
    rows = [np.asarray(lp, dtype=np.float64) for lp in logprobs if len(lp)]
    if not rows:
        return None
    return float(-np.concatenate(rows).mean())


def _fmt(x: float) -> str:
    return f"{x:.3g}"


class HealthMonitor:
    """The checks of ``trainer.health`` over a run's steps (see the module docstring)."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self.active: dict[str, bool] = dict.fromkeys(CHECKS, False)
        self.seen: dict[str, bool] = dict.fromkeys(CHECKS, False)  # also while quiet
        self.warnings_total = 0
        self.quiet_until = 0  # no new warning at steps <= this (after an intervention)
        self._rewards: deque[float] = deque(maxlen=config.window)
        self._ma_prev: float | None = None
        self._ma_best: float | None = None
        self._ma_best_step = 0
        self._falls = 0
        self._entropy_key: str | None = None
        self._entropy_first: list[float] = []
        self._entropy_ref: float | None = None
        self._val_best: float | None = None
        self._val_best_step = 0
        self._val_message: str | None = None  # the last validation's verdict

    # ------------------------------------------------------------------ checks

    def observe(self, step: int, metrics: Mapping[str, float]) -> list[HealthWarning]:
        """Run every check on one step's metrics; returns the checks that started firing
        at this step (none while quiet after an intervention)."""
        if not self.config.enable:
            return []
        found = {
            "entropy_collapse": self._entropy(metrics),
            "reward_drop": self._reward(step, metrics),
            "val_drop": self._val(step, metrics),
            "ppo_kl_high": self._ppo_kl(metrics),
            "grad_norm_high": self._grad_norm(metrics),
        }
        new = []
        quiet = step <= self.quiet_until
        for check in CHECKS:
            self.seen[check] = found[check] is not None
            message = None if quiet else found[check]
            if message is not None and not self.active[check]:
                new.append(HealthWarning(check, step, f"health: step {step}: {message}"))
            self.active[check] = message is not None
        self.warnings_total += len(new)
        return new

    @property
    def firing(self) -> bool:
        """A check fires (a warning was raised and its condition still holds)."""
        return any(self.active.values())

    @property
    def healthy(self) -> bool:
        """No check's condition held at the last step, quiet period or not."""
        return not any(self.seen.values())

    def metrics(self) -> dict[str, float]:
        """``health/<check>`` flags, ``health/warnings`` and ``health/warnings_total``."""
        out = {f"health/{c}": 1.0 if on else 0.0 for c, on in self.active.items()}
        out["health/warnings"] = float(sum(self.active.values()))
        out["health/warnings_total"] = float(self.warnings_total)
        return out

    def _entropy(self, metrics: Mapping[str, float]) -> str | None:
        c = self.config
        if self._entropy_key is None:
            self._entropy_key = next((k for k in ENTROPY_KEYS if k in metrics), None)
        key = self._entropy_key
        if key is None or key not in metrics or not math.isfinite(metrics[key]):
            return None
        value = float(metrics[key])
        if self._entropy_ref is None:
            self._entropy_first.append(value)
            if len(self._entropy_first) >= c.window:
                self._entropy_ref = float(np.mean(self._entropy_first))
        try_ = (
            "try a lower actor.lr, actor.entropy_coeff > 0, or a KL term to the reference "
            "(actor.use_kl_loss)"
        )
        if c.entropy_min > 0 and value < c.entropy_min:
            return (
                f"entropy collapse: {key} {_fmt(value)} is below {_KEY}.entropy_min "
                f"{_fmt(c.entropy_min)}: the policy is settling on a few outputs; {try_}"
            )
        ref = self._entropy_ref
        if c.entropy_min_ratio > 0 and ref is not None and value < c.entropy_min_ratio * ref:
            return (
                f"entropy collapse: {key} {_fmt(value)} is {value / ref:.0%} of its initial "
                f"{_fmt(ref)} (below {_KEY}.entropy_min_ratio {c.entropy_min_ratio:g}): the "
                f"policy is settling on a few outputs; {try_}"
            )
        return None

    def _reward(self, step: int, metrics: Mapping[str, float]) -> str | None:
        c = self.config
        value = metrics.get(REWARD_KEY)
        if value is None or not math.isfinite(value):
            return None
        self._rewards.append(float(value))
        # The average of what there is until the window fills: a collapse in the first
        # steps is seen then, not measured against an already collapsed best.
        ma = float(np.mean(self._rewards))
        n = len(self._rewards)
        self._falls = self._falls + 1 if self._ma_prev is not None and ma < self._ma_prev else 0
        self._ma_prev = ma
        if self._ma_best is None or ma > self._ma_best:
            self._ma_best, self._ma_best_step = ma, step
        best = self._ma_best
        try_ = "try a lower actor.lr or a smaller actor.clip_ratio, or turn on trainer.health.guard"
        if c.reward_drop_ratio > 0 and best - ma > c.reward_drop_ratio * abs(best) > 0:
            return (
                f"reward drop: the mean score over the last {n} steps, {_fmt(ma)}, is "
                f"{(best - ma) / abs(best):.0%} below its best {_fmt(best)} (step "
                f"{self._ma_best_step}; {_KEY}.reward_drop_ratio {c.reward_drop_ratio:g}): "
                f"the policy is getting worse; {try_}"
            )
        if c.reward_drop_steps > 0 and self._falls >= c.reward_drop_steps:
            return (
                f"reward drop: the mean score over the last {n} steps fell "
                f"{self._falls} steps in a row, to {_fmt(ma)} ({_KEY}.reward_drop_steps "
                f"{c.reward_drop_steps}); {try_}"
            )
        return None

    def note_validation(self, step: int, score: float) -> None:
        """A validation outside a training step (before training): it sets the best."""
        self._val(step, {VAL_KEY: score})

    def _val(self, step: int, metrics: Mapping[str, float]) -> str | None:
        c = self.config
        score = metrics.get(VAL_KEY)
        if score is None or not math.isfinite(score):
            return self._val_message  # no validation this step: the last verdict holds
        self._val_message = None
        if self._val_best is None or score > self._val_best:
            self._val_best, self._val_best_step = float(score), step
            return None
        best = self._val_best
        if c.val_drop_ratio > 0 and best - score > c.val_drop_ratio * abs(best) > 0:
            self._val_message = (
                f"validation drop: {VAL_KEY} {_fmt(score)} is {(best - score) / abs(best):.0%} "
                f"below its best {_fmt(best)} (step {self._val_best_step}; "
                f"{_KEY}.val_drop_ratio {c.val_drop_ratio:g}): the policy got worse on held-out "
                "prompts; try a lower actor.lr, or turn on trainer.health.guard"
            )
        return self._val_message

    def _ppo_kl(self, metrics: Mapping[str, float]) -> str | None:
        bound = self.config.max_ppo_kl
        value = metrics.get("actor/ppo_kl")
        if bound <= 0 or value is None or abs(value) <= bound:  # NaN fires
            return None
        return (
            f"ppo_kl high: actor/ppo_kl {_fmt(value)} exceeds {_KEY}.max_ppo_kl {_fmt(bound)}: "
            "an update moves the policy too far from the one that sampled its batch; try a "
            "lower actor.lr, fewer actor.ppo_epochs, or a smaller actor.clip_ratio"
        )

    def _grad_norm(self, metrics: Mapping[str, float]) -> str | None:
        for role in ("actor", "critic"):
            norm = metrics.get(f"{role}/grad_norm")
            skipped = metrics.get(f"{role}/skipped_steps", 0.0)
            if (norm is not None and not math.isfinite(norm)) or skipped > 0:
                return (
                    f"grad norm not finite: {role}/grad_norm {norm}, {skipped:g} optimizer "
                    f"step(s) skipped: the {role}'s update diverged; try a lower {role}.lr, "
                    f"a smaller {role}.grad_clip, or {role}.dtype float32"
                )
        bound = self.config.max_grad_norm
        norm = metrics.get("actor/grad_norm")
        if bound > 0 and norm is not None and norm > bound:
            return (
                f"grad norm high: actor/grad_norm {_fmt(norm)} exceeds {_KEY}.max_grad_norm "
                f"{_fmt(bound)} (clipped to actor.grad_clip before the step): the loss "
                "surface got steep; try a lower actor.lr"
            )
        return None

    # ------------------------------------------------------------------ after an intervention

    def restart(self, step: int, cooldown: int) -> None:
        """After the guard acted at ``step``: the moving windows start again and no
        warning is raised through ``step + cooldown``. The entropy reference and the
        best reward are kept (the run should get back to them)."""
        self._rewards.clear()
        self._ma_prev = None
        self._falls = 0
        self._val_message = None  # it judged the weights rolled back from
        self.quiet_until = step + cooldown

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "active": dict(self.active),
            "seen": dict(self.seen),
            "warnings_total": self.warnings_total,
            "quiet_until": self.quiet_until,
            "rewards": list(self._rewards),
            "ma_prev": self._ma_prev,
            "ma_best": self._ma_best,
            "ma_best_step": self._ma_best_step,
            "falls": self._falls,
            "entropy_key": self._entropy_key,
            "entropy_first": list(self._entropy_first),
            "entropy_ref": self._entropy_ref,
            "val_best": self._val_best,
            "val_best_step": self._val_best_step,
            "val_message": self._val_message,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.active = {c: bool(state.get("active", {}).get(c, False)) for c in CHECKS}
        self.seen = {c: bool(state.get("seen", {}).get(c, False)) for c in CHECKS}
        self.warnings_total = int(state.get("warnings_total", 0))
        self.quiet_until = int(state.get("quiet_until", 0))
        self._rewards = deque(
            (float(x) for x in state.get("rewards", [])), maxlen=self.config.window
        )
        self._ma_prev = state.get("ma_prev")
        self._ma_best = state.get("ma_best")
        self._ma_best_step = int(state.get("ma_best_step", 0))
        self._falls = int(state.get("falls", 0))
        self._entropy_key = state.get("entropy_key")
        self._entropy_first = [float(x) for x in state.get("entropy_first", [])]
        self._entropy_ref = state.get("entropy_ref")
        self._val_best = state.get("val_best")
        self._val_best_step = int(state.get("val_best_step", 0))
        self._val_message = state.get("val_message")


@dataclass(frozen=True)
class GuardAction:
    """What the driver does for an intervention: load checkpoint ``rollback_step``
    first (None: no rollback), then set the actor's lr scale to ``lr_scale``."""

    number: int  # 1 for the first intervention of the run
    rollback_step: int | None
    lr_scale: float
    reason: str  # the warnings that triggered it, by check name


class Guard:
    """Decides the interventions of ``trainer.health.guard`` (module docstring)."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config.guard
        self.interventions = 0
        self.rollbacks = 0
        self.lr_scale = 1.0
        self.good_checkpoint: int | None = None  # last step saved while healthy
        self.spent_noted = False

    @property
    def enabled(self) -> bool:
        return self.config.enable

    def checkpoint_saved(self, step: int, healthy: bool) -> None:
        """A checkpoint of ``step`` was saved; it is a rollback target if the run was
        healthy then (no check's condition held, :attr:`HealthMonitor.healthy`)."""
        if healthy:
            self.good_checkpoint = step

    def decide(self, warnings: Sequence[HealthWarning]) -> GuardAction | None:
        """The intervention for this step's new warnings; None when the guard is off,
        nothing new fired, or ``max_interventions`` are spent."""
        if not self.enabled or not warnings or self.interventions >= self.config.max_interventions:
            return None
        self.interventions += 1
        self.lr_scale *= self.config.lr_factor
        target = self.good_checkpoint if self.config.rollback else None
        return GuardAction(
            self.interventions, target, self.lr_scale, ", ".join(w.check for w in warnings)
        )

    def rolled_back(self) -> None:
        self.rollbacks += 1

    def metrics(self) -> dict[str, float]:
        return {
            "health/interventions": float(self.interventions),
            "health/rollbacks": float(self.rollbacks),
            "health/lr_scale": self.lr_scale,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "interventions": self.interventions,
            "rollbacks": self.rollbacks,
            "lr_scale": self.lr_scale,
            "good_checkpoint": self.good_checkpoint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.interventions = int(state.get("interventions", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.lr_scale = float(state.get("lr_scale", 1.0))
        good = state.get("good_checkpoint")
        self.good_checkpoint = None if good is None else int(good)
