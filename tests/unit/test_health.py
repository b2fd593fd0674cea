"""The health checks and the guard's decisions, step by step on hand-made metrics."""

from __future__ import annotations

import math
from typing import Any

import pytest

from rlfleet.common.config import HealthConfig
from rlfleet.driver.health import CHECKS, Guard, HealthMonitor, sampled_entropy


def _cfg(**kw: Any) -> HealthConfig:
    guard = kw.pop("guard", {})
    return HealthConfig.model_validate({**kw, "guard": guard})


def _run(monitor: HealthMonitor, steps: list[dict[str, float]], start: int = 1) -> list[list[str]]:
    """The checks that started firing at each step."""
    return [[w.check for w in monitor.observe(start + i, m)] for i, m in enumerate(steps)]


def test_entropy_below_a_fraction_of_its_initial_mean() -> None:
    mon = HealthMonitor(_cfg(window=3, entropy_min_ratio=0.25))
    ent = [1.0, 0.8, 0.6, 0.5, 0.2, 0.1, 0.1, 0.9, 0.05]  # initial mean 0.8: bound 0.2
    fired = _run(mon, [{"actor/entropy_old": e} for e in ent])
    # Fires at 0.1 (< 0.2, not at 0.2 itself), once while it lasts, and again after clearing.
    assert fired == [[], [], [], [], [], ["entropy_collapse"], [], [], ["entropy_collapse"]]
    first = HealthMonitor(_cfg(window=1, entropy_min_ratio=0.5))
    assert first.observe(1, {"actor/entropy": 1.0}) == []  # it sets the reference


def test_entropy_message_says_what_and_what_to_try() -> None:
    mon = HealthMonitor(_cfg(window=2, entropy_min_ratio=0.5))
    _run(mon, [{"actor/entropy": 2.0}, {"actor/entropy": 2.0}])
    (w,) = mon.observe(3, {"actor/entropy": 0.5})
    assert w.check == "entropy_collapse" and w.step == 3
    assert "0.5" in w.message and "25%" in w.message and "entropy_min_ratio" in w.message
    assert "actor.lr" in w.message and "\n" not in w.message


def test_entropy_absolute_floor_and_source_kept() -> None:
    mon = HealthMonitor(_cfg(window=5, entropy_min=0.3, entropy_min_ratio=0.0))
    # The first key seen is the run's source: a later actor/entropy does not replace it.
    fired = _run(
        mon,
        [
            {"rollout/neg_log_prob_mean": 1.0},
            {"rollout/neg_log_prob_mean": 0.2, "actor/entropy": 5.0},
            {"actor/entropy": 0.1},  # not the source: ignored
        ],
    )
    assert fired == [[], ["entropy_collapse"], []]
    assert mon.metrics()["health/entropy_collapse"] == 0.0


def test_reward_drop_from_its_best_moving_average() -> None:
    mon = HealthMonitor(_cfg(window=2, reward_drop_ratio=0.5))
    r = [0.2, 0.2, 0.3, 0.3, 0.2, 0.12, 0.0, 0.0, 0.35, 0.3]
    # Moving averages: -, .2, .25, .3, .25, .16, .06, 0, .175, .325. Best .3 at step 4
    # (a drop of more than .15 fires), then .325.
    fired = _run(mon, [{"critic/score/mean": x} for x in r])
    assert fired == [[], [], [], [], [], [], ["reward_drop"], [], [], []]
    assert mon.active["reward_drop"] is False  # back at the best
    assert mon.warnings_total == 1


def test_reward_drop_message_and_no_warning_without_a_best() -> None:
    mon = HealthMonitor(_cfg(window=1, reward_drop_ratio=0.5))
    assert _run(mon, [{"critic/score/mean": 0.0}] * 3) == [[], [], []]  # nothing to lose
    mon.observe(4, {"critic/score/mean": 0.4})
    (w,) = mon.observe(5, {"critic/score/mean": 0.1})
    assert "0.1" in w.message and "75%" in w.message and "best 0.4 (step 4" in w.message


def test_reward_falling_n_steps_in_a_row() -> None:
    mon = HealthMonitor(_cfg(window=1, reward_drop_ratio=0.0, reward_drop_steps=3))
    r = [1.0, 0.9, 0.8]
    assert _run(mon, [{"critic/score/mean": x} for x in r]) == [[], [], []]
    (w,) = mon.observe(4, {"critic/score/mean": 0.7})
    assert "fell 3 steps in a row, to 0.7" in w.message
    assert _run(mon, [{"critic/score/mean": x} for x in (0.6, 0.65)], start=5) == [[], []]
    assert not mon.active["reward_drop"]


def test_ppo_kl_bound_is_on_the_absolute_value_and_nan_fires() -> None:
    mon = HealthMonitor(_cfg(max_ppo_kl=0.05))
    kl = [0.01, -0.06, 0.04, math.nan, 0.2]
    fired = _run(mon, [{"actor/ppo_kl": x} for x in kl])
    assert fired == [[], ["ppo_kl_high"], [], ["ppo_kl_high"], []]
    off = HealthMonitor(_cfg(max_ppo_kl=0.0))
    assert _run(off, [{"actor/ppo_kl": 9.0}]) == [[]]


def test_grad_norm_high_non_finite_or_skipped() -> None:
    mon = HealthMonitor(_cfg(max_grad_norm=10.0))
    steps: list[dict[str, float]] = [
        {"actor/grad_norm": 3.0},
        {"actor/grad_norm": 30.0},
        {"actor/grad_norm": 1.0},
        {"actor/grad_norm": 1.0, "critic/grad_norm": math.inf},
        {"actor/grad_norm": 1.0},
        {"actor/grad_norm": 1.0, "actor/skipped_steps": 1.0},
    ]
    assert _run(mon, steps) == [
        [],
        ["grad_norm_high"],
        [],
        ["grad_norm_high"],
        [],
        ["grad_norm_high"],
    ]
    only_nonfinite = HealthMonitor(_cfg(max_grad_norm=0.0))
    assert _run(only_nonfinite, [{"actor/grad_norm": 1e9}, {"actor/grad_norm": math.nan}]) == [
        [],
        ["grad_norm_high"],
    ]


def test_metrics_flags_counters_and_disabled_monitor() -> None:
    mon = HealthMonitor(_cfg(max_ppo_kl=0.05, max_grad_norm=10.0))
    mon.observe(1, {"actor/ppo_kl": 0.1, "actor/grad_norm": 50.0})
    m = mon.metrics()
    assert set(m) == {f"health/{c}" for c in CHECKS} | {"health/warnings", "health/warnings_total"}
    assert m["health/ppo_kl_high"] == m["health/grad_norm_high"] == 1.0
    assert m["health/warnings"] == 2.0 and m["health/warnings_total"] == 2.0
    mon.observe(2, {"actor/ppo_kl": 0.1, "actor/grad_norm": 1.0})
    m = mon.metrics()
    assert m["health/warnings"] == 1.0 and m["health/warnings_total"] == 2.0
    off = HealthMonitor(_cfg(enable=False))
    assert off.observe(1, {"actor/ppo_kl": 9.0, "actor/grad_norm": math.nan}) == []


def test_restart_is_quiet_then_checks_again() -> None:
    mon = HealthMonitor(_cfg(window=1, max_ppo_kl=0.05, reward_drop_ratio=0.5))
    mon.observe(1, {"critic/score/mean": 1.0})
    assert [w.check for w in mon.observe(2, {"actor/ppo_kl": 0.5})] == ["ppo_kl_high"]
    mon.restart(2, cooldown=2)
    assert mon.observe(3, {"actor/ppo_kl": 0.5, "critic/score/mean": 0.1}) == []
    assert not mon.firing and not mon.healthy  # quiet, but not a healthy step
    assert mon.observe(4, {"actor/ppo_kl": 0.5}) == []
    fired = [w.check for w in mon.observe(5, {"actor/ppo_kl": 0.5, "critic/score/mean": 0.2})]
    assert fired == ["reward_drop", "ppo_kl_high"]  # the best (1.0) was kept


def test_monitor_state_round_trip() -> None:
    cfg = _cfg(window=2, entropy_min_ratio=0.5, reward_drop_ratio=0.5)
    a = HealthMonitor(cfg)
    steps = [{"actor/entropy_old": 1.0, "critic/score/mean": 0.5}] * 3
    _run(a, steps)
    b = HealthMonitor(cfg)
    b.load_state_dict(a.state_dict())
    later = [{"actor/entropy_old": 0.4, "critic/score/mean": 0.1}] * 2
    assert _run(a, later, start=4) == _run(b, later, start=4)
    assert a.state_dict() == b.state_dict()


def test_sampled_entropy() -> None:
    assert sampled_entropy([[-1.0, -3.0], [], [-2.0]]) == pytest.approx(2.0)
    assert sampled_entropy([[], []]) is None


def test_guard_halves_the_lr_rolls_back_to_the_last_healthy_checkpoint() -> None:
    cfg = _cfg(max_ppo_kl=0.05, guard={"enable": True, "max_interventions": 2})
    mon, guard = HealthMonitor(cfg), Guard(cfg)
    assert guard.decide(mon.observe(1, {"actor/ppo_kl": 0.0})) is None  # nothing new
    guard.checkpoint_saved(1, healthy=mon.healthy)
    warnings = mon.observe(2, {"actor/ppo_kl": 0.3})
    guard.checkpoint_saved(2, healthy=mon.healthy)  # saved while firing: not a target
    first = guard.decide(warnings)
    assert first is not None
    assert (first.number, first.rollback_step, first.lr_scale, first.reason) == (
        1,
        1,
        0.5,
        "ppo_kl_high",
    )
    second = guard.decide(warnings)
    assert second is not None and second.lr_scale == 0.25
    assert guard.decide(warnings) is None  # max_interventions spent
    guard.rolled_back()
    assert guard.metrics() == {
        "health/interventions": 2.0,
        "health/rollbacks": 1.0,
        "health/lr_scale": 0.25,
    }
    again = Guard(cfg)
    again.load_state_dict(guard.state_dict())
    assert again.state_dict() == guard.state_dict()


def test_guard_off_or_without_rollback() -> None:
    cfg = _cfg(max_ppo_kl=0.05)
    mon = HealthMonitor(cfg)
    warnings = mon.observe(1, {"actor/ppo_kl": 0.3})
    assert warnings and Guard(cfg).decide(warnings) is None  # off by default
    no_rollback = _cfg(guard={"enable": True, "rollback": False, "lr_factor": 0.1})
    guard = Guard(no_rollback)
    guard.checkpoint_saved(5, healthy=True)
    action = guard.decide(warnings)
    assert action is not None and action.rollback_step is None and action.lr_scale == 0.1


def test_validation_drop_from_its_best_holds_until_the_next_validation() -> None:
    mon = HealthMonitor(_cfg(val_drop_ratio=0.25))
    mon.note_validation(0, 0.4)  # before training: it sets the best
    steps: list[dict[str, float]] = [
        {},
        {"val/test_score/mean": 0.32},  # 20% below: not yet
        {},
        {"val/test_score/mean": 0.28},  # 30% below
        {},  # no validation: the verdict holds, no second warning
        {"val/test_score/mean": 0.5},  # a new best clears it
        {"val/test_score/mean": 0.3},
    ]
    fired = _run(mon, steps)
    assert fired == [[], [], [], ["val_drop"], [], [], ["val_drop"]]
    first = HealthMonitor(_cfg(val_drop_ratio=0.25))
    assert first.observe(1, {"val/test_score/mean": 0.0}) == []  # the first sets the best
    msg = mon.state_dict()["val_message"]
    assert "val/test_score/mean 0.3 is 40% below its best 0.5 (step 6" in msg
    mon.restart(7, cooldown=0)  # after a rollback the old verdict no longer applies
    assert mon.observe(8, {}) == [] and not mon.active["val_drop"]


def test_a_reward_that_collapses_before_the_window_fills_is_seen() -> None:
    """0.47 then nothing: the average of what there is counts from the first step."""
    mon = HealthMonitor(_cfg(window=5, reward_drop_ratio=0.5))
    fired = _run(mon, [{"critic/score/mean": x} for x in (0.469, 0.0, 0.0, 0.0, 0.0)])
    assert ["reward_drop"] in fired[:3]
