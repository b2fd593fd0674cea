"""The rollout autoscaler: the scheduler moves the desired rollout count from the
fleet's own signals; the launcher follows (docs/fault-tolerance.md).

:func:`decide` is the policy, a pure function of :class:`Signals`; :class:`Autoscaler`
is the loop around it in the scheduler process: every ``interval_s`` it gathers the
signals from the registry (replicas alive, their heartbeats' queue depth) and the
driver's training status (generation share, staleness, the step), and when the
policy says so, sets the desired scale (:meth:`SchedulerCore.set_scale`, what
``rlfleet scale rollout N`` calls). Each decision is logged with its reason, counted
(``rlfleet_autoscale_decisions_total{direction}``), and kept in a short history
(:attr:`Autoscaler.events`, the ``rlfleet_autoscale_desired_replicas`` gauge).

The policy moves one replica at a time, never outside ``[min_replicas,
max_replicas]``, never within ``cooldown_s`` of the last change, never while the
launcher has not yet reached the last desired count, and only after a training step
measured with the current fleet (the step counter moved since the change), so it
does not act twice on the same evidence. A count set from outside (``rlfleet scale``)
is such a change too: the policy moves from it after a step measured with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["AutoscaleEvent", "Autoscaler", "Decision", "Signals", "decide"]

logger = logging.getLogger(__name__)

_HISTORY = 256


@dataclass(frozen=True)
class Signals:
    """What the policy looks at.

    Attributes:
        replicas: rollout replicas alive in the registry.
        queue_depth: samples waiting, summed over the alive replicas' last heartbeats.
        gen_share: generation's share of the last step's time, the wait for a rollout
            replica before it included (None: no step yet).
        staleness: the last step's mean sample staleness in weight versions (None:
            not reported, e.g. synchronous runs report 0).
        step: the driver's global step (-1: no training status yet).
    """

    replicas: int
    queue_depth: float = 0.0
    gen_share: float | None = None
    staleness: float | None = None
    step: int = -1


@dataclass(frozen=True)
class Decision:
    direction: Literal["up", "down"]
    replicas: int
    reason: str


def decide(signals: Signals, settings: Any, *, current: int) -> Decision | None:
    """The desired change, or None (stay).

    Args:
        signals: the fleet now.
        settings: ``scheduler.autoscale`` (an :class:`AutoscaleConfig`).
        current: the count to move from (the launcher's target, which the alive count
            has reached when this is called).
    """
    s = settings
    per_replica = signals.queue_depth / max(1, signals.replicas)
    gen = signals.gen_share
    if current < s.min_replicas:
        return Decision("up", s.min_replicas, f"below min_replicas {s.min_replicas}")
    if current > s.max_replicas:
        return Decision("down", s.max_replicas, f"above max_replicas {s.max_replicas}")
    stale = signals.staleness is not None and signals.staleness > s.max_staleness
    if current < s.max_replicas and not stale:
        if per_replica > s.target_queue_depth:
            return Decision(
                "up",
                current + 1,
                f"queue depth {per_replica:.1f} per replica > target {s.target_queue_depth:g}",
            )
        if gen is not None and gen > s.target_gen_share:
            return Decision(
                "up",
                current + 1,
                f"generation share {gen:.2f} of the step > target {s.target_gen_share:g}",
            )
    if current > s.min_replicas:
        idle_queue = per_replica <= s.target_queue_depth / 2
        low_gen = gen is not None and gen < s.target_gen_share / 2
        if idle_queue and low_gen:
            return Decision(
                "down",
                current - 1,
                f"generation share {gen:.2f} < {s.target_gen_share / 2:g} and queue depth "
                f"{per_replica:.1f} per replica <= {s.target_queue_depth / 2:g}",
            )
        if stale and idle_queue:
            return Decision(
                "down",
                current - 1,
                f"staleness {signals.staleness:.2f} > max_staleness {s.max_staleness:g}",
            )
    return None


@dataclass(frozen=True)
class AutoscaleEvent:
    """One decision, as logged and exported."""

    time: float  # wall clock (Unix seconds)
    direction: str
    replicas_from: int
    replicas_to: int
    reason: str
    step: int


class Autoscaler:
    """Runs :func:`decide` against a :class:`~rlfleet.scheduler.registry.SchedulerCore`.

    Args:
        core: the scheduler's core (registry, training status, desired scale).
        settings: ``scheduler.autoscale``.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self, core: Any, settings: Any, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.core = core
        self.settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._last_change: float | None = None
        self._step_at_change = -1
        self._target: int | None = None  # the desired count as of the last round
        self.events: deque[AutoscaleEvent] = deque(maxlen=_HISTORY)
        self.decisions = {"up": 0, "down": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def signals(self) -> Signals:
        replicas = self.core.list_services("rollout", alive_only=True)
        queue = float(sum(max(0, e.load.queue_depth) for e in replicas))
        status = self.core.training_status()
        m = status.metrics
        gen_share = None
        step_s = m.get("timing_s/step", 0.0)
        if "timing_s/gen" in m and step_s > 0:
            # A step that waited for a rollout replica (none left, or newcomers being
            # brought to the current weights) waited on the rollout side too.
            gen = m["timing_s/gen"] + m.get("timing_s/wait_replicas", 0.0)
            gen_share = min(1.0, max(0.0, gen / step_s))
        started = status.state != "idle" or status.global_step > 0
        return Signals(
            replicas=len(replicas),
            queue_depth=queue,
            gen_share=gen_share,
            staleness=m.get("staleness/mean"),
            step=status.global_step if started else -1,
        )

    def desired(self, alive: int | None = None) -> int:
        """The count the launcher is asked for (until one is set: the replicas alive,
        ``alive`` when the caller has just counted them)."""
        desired, _ = self.core.scale("rollout")
        if desired:
            return int(desired)
        return len(self.core.list_services("rollout", alive_only=True)) if alive is None else alive

    def check(self) -> AutoscaleEvent | None:
        """One round: gather, decide, act. Returns the decision taken, if any."""
        with self._lock:
            sig = self.signals()
            if sig.replicas == 0 and not self.core.scale("rollout")[0]:
                return None  # the launcher is still starting the fleet
            target = self.desired(sig.replicas)
            now = self._clock()
            if self._target is not None and target != self._target:
                # Someone else moved the count (`rlfleet scale`): a change like one of
                # ours, so the next decision waits for a step measured with it.
                # The step published when it was set, not the one now: this round may
                # come after a step already measured with the new count. With no count
                # ever set the target follows the replicas alive: a replica came or
                # went, and the step now is the first one that may not have seen it.
                set_at = self.core.scale_set_at_step("rollout")
                if set_at < 0:
                    set_at = sig.step
                logger.warning(
                    "autoscale: rollout replicas set to %d from outside at step %d; next "
                    "decision after a step with them", target, set_at,
                )  # fmt: skip
                lo, hi = self.settings.min_replicas, self.settings.max_replicas
                if not lo <= target <= hi:
                    logger.warning(
                        "autoscale: %d is outside scheduler.autoscale's [%d, %d]: the "
                        "autoscaler brings the count back within them (turn it off to "
                        "keep it)", target, lo, hi,
                    )  # fmt: skip
                self._last_change, self._step_at_change = now, set_at
            self._target = target
            if sig.replicas != target:
                return None  # the launcher is still adding or draining replicas
            if self._last_change is not None:
                if now - self._last_change < self.settings.cooldown_s:
                    return None
                if sig.step <= self._step_at_change:
                    return None  # no step measured with the current fleet yet
            decision = decide(sig, self.settings, current=target)
            if decision is None:
                return None
            self.core.set_scale("rollout", decision.replicas)
            self._target = decision.replicas
            self._last_change = now
            self._step_at_change = sig.step
            self.decisions[decision.direction] += 1
            event = AutoscaleEvent(
                time=time.time(),
                direction=decision.direction,
                replicas_from=target,
                replicas_to=decision.replicas,
                reason=decision.reason,
                step=sig.step,
            )
            self.events.append(event)
        logger.warning(
            "autoscale: rollout replicas %d -> %d at step %d: %s",
            event.replicas_from, event.replicas_to, event.step, event.reason,
        )  # fmt: skip
        return event

    def _run(self) -> None:
        while not self._stop.wait(self.settings.interval_s):
            try:
                self.check()
            except Exception:  # one bad round must not end the loop
                logger.exception("autoscale round failed")

    def start(self) -> Autoscaler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rlfleet-autoscale", daemon=True)
            self._thread.start()
            s = self.settings
            logger.info(
                "autoscale on: rollout replicas in [%d, %d], queue depth target %g, generation "
                "share target %g, cooldown %gs",
                s.min_replicas, s.max_replicas, s.target_queue_depth, s.target_gen_share,
                s.cooldown_s,
            )  # fmt: skip
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None


def autoscale_collector(autoscaler: Autoscaler) -> Any:
    """A Prometheus collector: ``rlfleet_autoscale_decisions_total{direction}`` and
    ``rlfleet_autoscale_desired_replicas``."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _Collector:
        def collect(self) -> Any:
            c = CounterMetricFamily(
                "rlfleet_autoscale_decisions",
                "Rollout scale changes the autoscaler made, by direction",
                labels=["direction"],
            )
            for direction, n in sorted(autoscaler.decisions.items()):
                c.add_metric([direction], float(n))
            yield c
            g = GaugeMetricFamily(
                "rlfleet_autoscale_desired_replicas",
                "Rollout replicas the scheduler asks the launcher for",
            )
            g.add_metric([], float(autoscaler.desired()))
            yield g

    return _Collector()
