"""The rollout autoscaler: the policy on hand-made signals, and the loop against a real
scheduler core (registry, heartbeats with queue depth, training status)."""

from __future__ import annotations

import pytest

from rlfleet.common.config import AutoscaleConfig, ConfigError, config_from_dict
from rlfleet.scheduler.autoscale import Autoscaler, Signals, autoscale_collector, decide
from rlfleet.scheduler.registry import (
    Registry,
    SchedulerCore,
    ServiceLoad,
    ServiceSpec,
)

S = AutoscaleConfig(
    enable=True,
    min_replicas=1,
    max_replicas=3,
    target_queue_depth=8,
    target_gen_share=0.6,
    max_staleness=2,
    cooldown_s=10,
)


@pytest.mark.parametrize(
    ("signals", "current", "expected"),
    [
        # a long queue: one more replica (16 waiting over 1 replica > 8)
        (Signals(replicas=1, queue_depth=16, gen_share=0.1, step=3), 1, ("up", 2)),
        # generation dominates the step
        (Signals(replicas=2, queue_depth=0, gen_share=0.7, step=3), 2, ("up", 3)),
        # at max: stay, however busy
        (Signals(replicas=3, queue_depth=100, gen_share=0.9, step=3), 3, None),
        # generation busy but its samples stale (pipelined: ahead of training), nothing
        # queued: one fewer, not one more
        (Signals(replicas=2, queue_depth=0, gen_share=0.7, staleness=3.0, step=3), 2, ("down", 1)),
        # stale with a long queue: neither
        (Signals(replicas=2, queue_depth=40, gen_share=0.7, staleness=3.0, step=3), 2, None),
        # idle: short queue and generation a small share
        (Signals(replicas=2, queue_depth=4, gen_share=0.2, step=3), 2, ("down", 1)),
        # a short queue but generation at 0.4 (not < 0.3): stay
        (Signals(replicas=2, queue_depth=0, gen_share=0.4, step=3), 2, None),
        # stale and idle: one fewer
        (Signals(replicas=2, queue_depth=0, gen_share=0.5, staleness=3.0, step=3), 2, ("down", 1)),
        # at min: stay, however idle
        (Signals(replicas=1, queue_depth=0, gen_share=0.05, step=3), 1, None),
        # no step yet: no generation share, a short queue: stay
        (Signals(replicas=2, queue_depth=0), 2, None),
        # outside the bounds (set by hand): back inside
        (Signals(replicas=5, gen_share=0.9, step=3), 5, ("down", 3)),
    ],
)
def test_policy(signals: Signals, current: int, expected: tuple[str, int] | None) -> None:
    d = decide(signals, S, current=current)
    assert (None if d is None else (d.direction, d.replicas)) == expected
    if d is not None:
        assert d.reason  # every decision says why


def test_bounds_are_checked_in_the_config() -> None:
    with pytest.raises(ConfigError, match="min_replicas"):
        config_from_dict({"scheduler": {"autoscale": {"min_replicas": 3, "max_replicas": 2}}})
    with pytest.raises(ConfigError, match="target_gen_share"):
        config_from_dict({"scheduler": {"autoscale": {"target_gen_share": 1.5}}})


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _replica(core: SchedulerCore, i: int, queue: int = 0) -> str:
    entry = core.register(
        ServiceSpec(role="rollout", address=f"127.0.0.1:{6000 + i}", node="n", capabilities={})
    )
    core.heartbeat(entry.service_id, ServiceLoad(queue_depth=queue), lease=entry.lease)
    return entry.service_id


def _step(core: SchedulerCore, step: int, gen: float, total: float = 1.0) -> None:
    core.set_training_status(
        global_step=step,
        state="running",
        metrics={"timing_s/gen": gen, "timing_s/step": total},
    )


def test_loop_acts_once_per_measured_step_and_respects_the_cooldown() -> None:
    clock = Clock()
    core = SchedulerCore(Registry(heartbeat_interval_s=1000.0))
    auto = Autoscaler(core, S, clock=clock)
    assert auto.check() is None  # no replica yet: the launcher is starting them
    _replica(core, 0)
    assert auto.check() is None  # no step yet, empty queue
    _step(core, 1, gen=0.9)
    event = auto.check()
    assert event is not None and (event.replicas_from, event.replicas_to) == (1, 2)
    assert "generation share 0.90" in event.reason and event.step == 1
    assert core.scale("rollout")[0] == 2
    # The launcher has not added the replica yet: nothing more.
    _step(core, 2, gen=0.9)
    clock.t = 100.0
    assert auto.check() is None
    _replica(core, 1)
    # Reached 2, a new step measured with 2, past the cooldown: one more.
    event = auto.check()
    assert event is not None and event.replicas_to == 3
    _replica(core, 2)
    # Idle now, but within the cooldown and on the same step: stay.
    clock.t = 105.0
    _step(core, 2, gen=0.1)
    assert auto.check() is None
    clock.t = 111.0
    assert auto.check() is None  # past the cooldown, but no new step
    _step(core, 3, gen=0.1)
    event = auto.check()
    assert event is not None and event.direction == "down" and event.replicas_to == 2
    assert auto.decisions == {"up": 2, "down": 1}
    assert [e.replicas_to for e in auto.events] == [2, 3, 2]


def test_queue_depth_from_heartbeats_scales_up_before_any_step() -> None:
    core = SchedulerCore(Registry(heartbeat_interval_s=1000.0))
    auto = Autoscaler(core, S, clock=Clock())
    _replica(core, 0, queue=20)
    event = auto.check()
    assert event is not None and event.replicas_to == 2 and "queue depth 20.0" in event.reason


def test_metrics_count_decisions_and_show_the_desired_count() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    core = SchedulerCore(Registry(heartbeat_interval_s=1000.0))
    auto = Autoscaler(core, S, clock=Clock())
    registry = CollectorRegistry()
    registry.register(autoscale_collector(auto))
    _replica(core, 0)
    _step(core, 1, gen=0.9)
    auto.check()
    text = generate_latest(registry).decode()
    assert 'rlfleet_autoscale_decisions_total{direction="up"} 1.0' in text
    assert 'rlfleet_autoscale_decisions_total{direction="down"} 0.0' in text
    assert "rlfleet_autoscale_desired_replicas 2.0" in text


def test_a_scale_set_from_outside_is_measured_before_the_next_decision() -> None:
    """`rlfleet scale rollout 1` while the autoscaler runs: the policy moves on from 1,
    but only after a step measured with one replica, not on the evidence of the fleet
    the operator replaced."""
    core = SchedulerCore(Registry(heartbeat_interval_s=1000.0))
    clock = Clock()
    auto = Autoscaler(core, S, clock=clock)
    ids = [_replica(core, i) for i in range(3)]
    core.set_scale("rollout", 3)
    _step(core, 4, gen=0.9)
    assert auto.check() is None  # at max_replicas: nothing to do
    core.set_scale("rollout", 1)  # the operator
    for service_id in ids[1:]:  # the launcher drains two
        core.deregister(service_id)
    clock.t = 100.0  # past the cooldown
    assert auto.check() is None  # step 4 was measured with three replicas
    _step(core, 5, gen=0.9)
    assert auto.check() is None  # the operator's change starts a cooldown too
    clock.t = 111.0
    event = auto.check()
    assert event is not None and (event.replicas_from, event.replicas_to) == (1, 2)
    assert event.step == 5


def test_a_scale_set_from_outside_counts_from_the_step_published_when_it_was_set() -> None:
    """The operator's change, noticed by a round that comes only after the next step
    (measured with the new count) is published: that step counts. Before, the round
    took the step it saw as the change's, and waited for one more: a run held in that
    step's callback waiting for replicas never got them."""
    core = SchedulerCore(Registry(heartbeat_interval_s=1000.0))
    auto = Autoscaler(core, S.model_copy(update={"cooldown_s": 0}), clock=Clock())
    ids = [_replica(core, i) for i in range(2)]
    core.set_scale("rollout", 2)
    _step(core, 3, gen=0.4)
    assert auto.check() is None  # neither busy nor idle: stays at 2
    core.set_scale("rollout", 1)  # the operator, with step 3 published
    core.deregister(ids[1])
    _step(core, 4, gen=0.9)  # measured with one replica, before the next round
    assert core.scale_set_at_step("rollout") == 3
    event = auto.check()
    assert event is not None and (event.replicas_from, event.replicas_to) == (1, 2)
    assert event.step == 4


def test_a_step_that_waited_for_a_replica_counts_that_wait_as_generation() -> None:
    """Step time spent waiting for a rollout replica (none left while one restarts,
    or a newcomer brought to the current weights) is the rollout side's."""
    core = SchedulerCore(Registry(heartbeat_interval_s=1000.0))
    auto = Autoscaler(core, S, clock=Clock())
    _replica(core, 0)
    metrics = {"timing_s/gen": 0.05, "timing_s/wait_replicas": 3.0, "timing_s/step": 4.0}
    core.set_training_status(global_step=4, state="running", metrics=metrics)
    assert auto.signals().gen_share == pytest.approx(3.05 / 4.0)
    event = auto.check()
    assert event is not None and event.replicas_to == 2 and "0.76" in event.reason


def test_with_no_count_set_a_replica_lost_waits_for_a_step_without_it() -> None:
    """No `rlfleet scale` yet: the target follows the replicas alive, so a replica's
    loss moves it. The next decision waits for a step after the one published when
    the loss was seen, not on the evidence of a step that ran with the lost replica."""
    core = SchedulerCore(Registry(heartbeat_interval_s=1000.0))
    auto = Autoscaler(core, S.model_copy(update={"cooldown_s": 0}), clock=Clock())
    ids = [_replica(core, i) for i in range(3)]
    _step(core, 10, gen=0.9)
    assert auto.check() is None  # at max_replicas, however busy
    core.deregister(ids[2])
    assert core.scale_set_at_step("rollout") == -1  # never set
    assert auto.check() is None  # step 10 ran with three
    _step(core, 11, gen=0.9)
    event = auto.check()
    assert event is not None and (event.replicas_from, event.replicas_to) == (2, 3)
    assert event.step == 11
