"""Adaptive KL coefficients (in the reward and in the loss) and the actor's lr changed
at run time: wired through a real TrainerCore step by step, reported in the metrics,
and kept by checkpoints."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.common.config import ConfigError
from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.trainer import checkpoint
from rlfleet.trainer.core import TrainerCore
from rlfleet.trainer.ppo.core_algos import AdaptiveKLController
from rlfleet.trainer.testing import make_batch, make_config

SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0])


def _batch(seed: int) -> dict[str, Any]:
    return {**make_batch(seed=seed), "scores": SCORES}


def _next(beta: float, kl: float, target: float, samples: int, horizon: int) -> float:
    """Ziegler et al.'s update, by hand."""
    return beta * (1 + min(max(kl / target - 1, -0.2), 0.2) * samples / horizon)


def test_adaptive_controller_ignores_a_non_finite_kl() -> None:
    ctrl = AdaptiveKLController(0.1, target_kl=0.05, horizon=10)
    ctrl.update(math.nan, n_steps=5)
    ctrl.update(math.inf, n_steps=5)
    assert ctrl.value == 0.1
    ctrl.update(0.1, n_steps=5)  # twice the target: +20% x 5/10
    assert ctrl.value == pytest.approx(0.11)


def test_adaptive_kl_in_reward_moves_by_the_measured_kl(tiny_model_dir: Path) -> None:
    cfg = make_config(
        str(tiny_model_dir),
        algorithm={
            "adv_estimator": "reinforce_plus_plus",
            "use_kl_in_reward": True,
            "kl_ctrl": {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.01, "horizon": 100},
        },
    )
    core = TrainerCore(cfg)
    beta = 0.05
    for seed in range(3):
        m = core.train_step(_batch(seed))
        assert m["actor/reward_kl_penalty_coeff"] == pytest.approx(beta, rel=1e-12)
        beta = _next(beta, m["actor/reward_kl_penalty"], 0.01, 4, 100)
        assert core.kl_ctrl.value == pytest.approx(beta, rel=1e-12)
        assert core.state.kl_coef == core.kl_ctrl.value
    assert beta != 0.05


def _kl_loss_core(model: Path, run_dir: Path, ctrl: dict[str, Any]) -> TrainerCore:
    return TrainerCore(
        make_config(
            str(model),
            algorithm={"adv_estimator": "grpo"},
            actor={"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_ctrl": ctrl},
            trainer={"default_local_dir": str(run_dir)},
        )
    )


def test_adaptive_kl_loss_coefficient_moves_and_is_used(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    ctrl = {"type": "adaptive", "target_kl": 0.001, "horizon": 40}
    core = _kl_loss_core(tiny_model_dir, tmp_path, ctrl)
    beta = 0.1
    seen = []
    for seed in range(3):
        m = core.train_step(_batch(seed))
        # The coefficient this update used (the worker reports what it applied).
        assert m["actor/kl_coef"] == pytest.approx(beta, rel=1e-12)
        seen.append(m["actor/kl_loss"])
        beta = _next(beta, m["actor/kl_loss"], 0.001, 4, 40)
        assert core.kl_loss_ctrl.value == pytest.approx(beta, rel=1e-12)
    assert seen[0] == 0.0 and seen[-1] > 0.0  # actor == ref at first: the coefficient fell
    fixed = _kl_loss_core(tiny_model_dir, tmp_path / "fixed", {"type": "fixed"})
    for seed in range(2):
        assert fixed.train_step(_batch(seed))["actor/kl_coef"] == 0.1


def test_kl_coefficients_and_lr_survive_a_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    ctrl = {"type": "adaptive", "target_kl": 0.001, "horizon": 40}
    a = _kl_loss_core(tiny_model_dir, tmp_path, ctrl)
    for seed in range(2):
        a.train_step(_batch(seed))
    lr = a.set_lr_scale("actor", 0.25)
    assert lr == pytest.approx(0.25e-3)
    checkpoint.save(a, step=2)
    saved = a.kl_loss_ctrl.value
    expected = a.train_step(_batch(2))

    b = _kl_loss_core(tiny_model_dir, tmp_path, ctrl)
    assert b.kl_loss_ctrl.value == 0.1 != saved
    checkpoint.load(b)
    assert b.kl_loss_ctrl.value == saved
    got = b.train_step(_batch(2))
    assert got["actor/kl_coef"] == expected["actor/kl_coef"] != 0.1
    assert got["actor/lr"] == expected["actor/lr"] == pytest.approx(0.25e-3)
    assert got["actor/pg_loss"] == expected["actor/pg_loss"]


def test_set_lr_scale_keeps_the_schedule(tiny_model_dir: Path) -> None:
    cfg = make_config(str(tiny_model_dir), actor={"lr_warmup_steps": 3})
    core = TrainerCore(cfg)
    m = core.train_step(_batch(0))
    assert m["actor/lr"] == pytest.approx(1e-3 / 4)  # warm-up step 1 of 3
    assert core.set_lr_scale("actor", 0.5) == pytest.approx(0.5e-3 * 2 / 4)
    assert core.set_lr_scale("actor", 0.5) == pytest.approx(0.5e-3 * 2 / 4)  # absolute
    lrs = [core.train_step(_batch(s))["actor/lr"] for s in (1, 2, 3)]
    assert lrs == pytest.approx([0.5e-3 * 2 / 4, 0.5e-3 * 3 / 4, 0.5e-3])
    assert core.set_lr_scale("actor", 1.0) == pytest.approx(1e-3)


@pytest.mark.parametrize("scale", [0.0, -0.5, 1.5, math.nan, math.inf, 5e-324])
def test_set_lr_scale_refuses_bad_scales(tiny_model_dir: Path, scale: float) -> None:
    core = TrainerCore(make_config(str(tiny_model_dir)))
    with pytest.raises(InvalidArgument) as e:
        core.set_lr_scale("actor", scale)
    assert e.value.field == "scale"


def test_set_lr_scale_refuses_roles_it_cannot_change(tiny_model_dir: Path) -> None:
    core = TrainerCore(make_config(str(tiny_model_dir), algorithm={"adv_estimator": "grpo"}))
    with pytest.raises(InvalidArgument):
        core.set_lr_scale("ref", 0.5)
    with pytest.raises(FailedPrecondition):
        core.set_lr_scale("critic", 0.5)  # GRPO: no critic here


@pytest.mark.parametrize(
    ("sections", "path"),
    [
        (
            {"algorithm": {"kl_ctrl": {"type": "adaptive", "kl_coef": 0.0}}},
            "algorithm.kl_ctrl.kl_coef",
        ),
        ({"actor": {"kl_loss_ctrl": {"type": "adaptive"}}}, "actor.kl_loss_ctrl.type"),
        (
            {
                "actor": {
                    "use_kl_loss": True,
                    "kl_loss_coef": 0.0,
                    "kl_loss_ctrl": {"type": "adaptive"},
                }
            },
            "actor.kl_loss_coef",
        ),
        (
            {"trainer": {"health": {"enable": False, "guard": {"enable": True}}}},
            "trainer.health.guard.enable",
        ),
    ],
)
def test_config_refuses_controls_that_would_do_nothing(sections: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError) as e:
        make_config("m", **sections)
    assert [i.path for i in e.value.issues] == [path]
