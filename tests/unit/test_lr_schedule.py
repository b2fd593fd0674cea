"""The lr schedules (verl's): linear warm-up (a step count or a ratio of the run's
total), then constant or cosine decay to ``min_lr_ratio``; hand-computed values, and a
total that reaches the trainer only with the steps (the driver knows the run's length,
a trainer service started on its own does not)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlfleet.common.errors import InvalidArgument
from rlfleet.trainer.core import TrainerCore
from rlfleet.trainer.fsdp import WarmupSchedule, build_scheduler, set_schedule_total
from rlfleet.trainer.testing import make_batch, make_config


def test_warmup_then_cosine_hand_computed() -> None:
    f = WarmupSchedule(2, 10, "cosine", 0.1)
    # warm-up: (step + 1) / (warmup + 1); then 0.1 + 0.9 * (1 + cos(pi * p)) / 2 with
    # p = (step - 2) / 8, and 0.1 from the total on.
    expected = {0: 1 / 3, 1: 2 / 3, 2: 1.0, 6: 0.55, 10: 0.1, 12: 0.1}
    assert {s: f(s) for s in expected} == pytest.approx(expected)
    assert WarmupSchedule(2, 10, "constant", 0.1)(6) == 1.0
    # No total: no decay (nothing to decay towards).
    assert WarmupSchedule(0, None, "cosine", 0.1)(6) == 1.0


def test_a_warmup_ratio_follows_a_total_given_later() -> None:
    f = WarmupSchedule(0, None, "cosine", 0.0, warmup_ratio=0.5)
    assert f(0) == 1.0  # no total yet: no warm-up either
    f.set_total(4)
    assert (f.warmup, f.total) == (2, 4)
    assert [f(s) for s in range(4)] == pytest.approx([1 / 3, 2 / 3, 1.0, 0.5])
    fixed = WarmupSchedule(3, None, "cosine", 0.0)  # lr_warmup_steps given: kept
    fixed.set_total(100)
    assert fixed.warmup == 3


def test_set_schedule_total_puts_the_lr_into_effect_at_once(tiny_model_dir: Path) -> None:
    cfg = make_config(str(tiny_model_dir), actor={"lr": 1e-3, "lr_warmup_steps_ratio": 0.5})
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = build_scheduler(opt, cfg.actor, None)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    set_schedule_total(opt, sched, 8)  # warm-up of 4 steps: step 0 runs at lr / 5
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-4)
    assert sched.get_last_lr() == pytest.approx([2e-4])
    # The schedule travels in the scheduler's state dict (a checkpoint keeps it).
    again = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), cfg.actor, None)
    again.load_state_dict(sched.state_dict())
    assert (again.lr_lambdas[0].warmup, again.lr_lambdas[0].total) == (4, 8)


def test_train_steps_carry_the_total_to_the_schedule(tiny_model_dir: Path) -> None:
    cfg = make_config(
        str(tiny_model_dir),
        algorithm={"adv_estimator": "grpo"},
        actor={
            "lr": 1e-3,
            "ppo_mini_batch_size": 2,
            "lr_warmup_steps_ratio": 0.5,
            "lr_scheduler": "cosine",
            "min_lr_ratio": 0.1,
        },
    )
    assert cfg.trainer.total_training_steps is None
    core = TrainerCore(cfg)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    lrs = []
    for step in range(4):
        batch = {**make_batch(seed=step), "scores": scores.clone()}
        lrs.append(core.train_step(batch, total_steps=4)["actor/lr"])
    # warm-up int(0.5 x 4) = 2 steps, then cosine over the other 2: 1/3, 2/3, 1, 0.55.
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 0.55e-3], rel=1e-6)
    assert core.total_training_steps == 4
    for bad in (-1, 2**53, True):
        with pytest.raises(InvalidArgument, match="total_steps"):
            core.set_total_training_steps(bad)


def test_a_refused_step_leaves_the_schedule_and_a_load_takes_the_next_total(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from rlfleet.trainer import checkpoint

    cfg = make_config(
        str(tiny_model_dir),
        algorithm={"adv_estimator": "grpo"},
        actor={"lr": 1e-3, "ppo_mini_batch_size": 2, "lr_warmup_steps_ratio": 0.5},
        trainer={"default_local_dir": str(tmp_path / "run")},
    )
    core = TrainerCore(cfg)
    before = core.backend.lr("actor")
    bad = {**make_batch(bs=6, seed=0), "scores": torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])}
    with pytest.raises(InvalidArgument):  # 6 rows: not whole mini-batches of 4
        core.train_step(bad, total_steps=10)
    assert core.backend.lr("actor") == before and core.total_training_steps is None
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    core.train_step({**make_batch(seed=1), "scores": scores}, total_steps=10)
    checkpoint.save(core, step=1)
    core.train_step({**make_batch(seed=2), "scores": scores}, total_steps=1000)
    checkpoint.load(core)  # the schedule as saved, with its total of 10
    assert core.total_training_steps is None
    m = core.train_step({**make_batch(seed=2), "scores": scores}, total_steps=1000)
    # Step index 1 of 1000 with a warm-up of 500: lr x 2/501, not the saved schedule's.
    assert m["actor/lr"] == pytest.approx(1e-3 * 2 / 501, rel=1e-6)
