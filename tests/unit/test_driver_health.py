"""A deliberately too-high actor lr in a real run (every role in this process): the
health check warns on the console and in the metrics; with the guard on, the trainer
is rolled back to the last healthy checkpoint and its lr halved, and a resumed run
keeps both."""

from __future__ import annotations

import logging
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.common.config import Config, load_config
from rlfleet.driver.clients import Role, in_process_workers
from rlfleet.driver.data.preprocess import preprocess
from rlfleet.driver.loop import PPOTrainer
from rlfleet.trainer.checkpoint import read_state

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arithmetic_ppo.yaml"
TOO_HIGH = 0.2  # AdamW moves every weight by about this in its first step: 10x their scale


@pytest.fixture(scope="module")
def arithmetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("arith")
    preprocess("arithmetic", None, out, n=32, n_test=4, digits=1, ops="+-*", seed=0)
    return out


def _config(model: Path, data: Path, run_dir: Path, *overrides: str) -> Config:
    base = [
        f"actor.model_path={model}",
        f"data.train_files={data / 'train.parquet'}",
        "data.val_files=[]",
        f"trainer.default_local_dir={run_dir}",
        "data.train_batch_size=4",
        "data.max_response_length=8",
        "actor.ppo_mini_batch_size=2",  # two optimizer steps per PPO step
        "critic.ppo_mini_batch_size=2",
        "rollout.n=2",
        "trainer.critic_warmup=0",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
    ]
    return load_config(EXAMPLE, [*base, *overrides])


def reward_fn(samples: list[Any]) -> list[float]:
    """A deterministic 0/1 score per response text: a random model gets none of the
    arithmetic right, and all-equal scores would give no advantages to learn from."""
    return [float(zlib.crc32(s.response.encode()) % 2) for s in samples]


class CountingTrainer:
    """The real in-process trainer client; records the driver's calls and arguments."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.calls: Counter[str] = Counter()
        self.args: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            self.args.append((name, args))
            return attr(*args, **kwargs)

        return call


@pytest.mark.parametrize("lr", [1e-5, TOO_HIGH])
def test_too_high_lr_warns(
    tiny_model_dir: Path,
    arithmetic_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    lr: float,
) -> None:
    cfg = _config(
        tiny_model_dir, arithmetic_dir, tmp_path, f"actor.lr={lr}",
        "trainer.total_training_steps=2", "trainer.save_freq=-1",
    )  # fmt: skip
    with (
        caplog.at_level(logging.WARNING, logger="rlfleet.driver.tracking"),
        PPOTrainer(config=cfg, reward_fn=reward_fn) as trainer,
    ):
        records = trainer.fit()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("health")]
    first = records[0].metrics
    if lr != TOO_HIGH:  # the same run at a sane lr: quiet
        assert lines == [] and first["health/warnings_total"] == 0.0
        return
    # The second mini-batch of step 1 already sees a policy far from the sampling one.
    assert first["health/ppo_kl_high"] == 1.0, first["actor/ppo_kl"]
    assert first["health/warnings_total"] >= 1.0
    (ppo_kl,) = [line for line in lines if "ppo_kl high" in line]
    assert ppo_kl.startswith("health: step 1: ppo_kl high: actor/ppo_kl ")
    assert "trainer.health.max_ppo_kl 0.05" in ppo_kl and "lower actor.lr" in ppo_kl
    # Warned once, not again while it keeps firing; the guard is off: nothing changed.
    assert sum("ppo_kl high" in line for line in lines) == 1
    assert all(r.metrics["health/interventions"] == 0.0 for r in records)
    assert records[-1].metrics["actor/lr"] == TOO_HIGH


def test_guard_rolls_back_and_halves_the_lr_and_a_resume_keeps_it(
    tiny_model_dir: Path,
    arithmetic_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Steps 1-2 train only the critic (healthy; checkpoints 1 and 2); step 3 is the
    # actor's first update at the too-high lr.
    common = [
        f"actor.lr={TOO_HIGH}", "trainer.critic_warmup=2", "trainer.save_freq=1",
        "trainer.resume_mode=auto", "trainer.health.guard.enable=true",
    ]  # fmt: skip
    run = tmp_path / "run"
    cfg = _config(tiny_model_dir, arithmetic_dir, run, *common, "trainer.total_training_steps=3")
    mapping: dict[Any, Any] = dict(in_process_workers(cfg))
    made: list[CountingTrainer] = []

    def trainer_factory(c: Config) -> CountingTrainer:
        made.append(CountingTrainer(in_process_workers(c)[Role.ActorRolloutRef](c)))
        return made[-1]

    mapping[Role.ActorRolloutRef] = mapping[Role.Critic] = trainer_factory
    with (
        caplog.at_level(logging.WARNING, logger="rlfleet.driver.tracking"),
        PPOTrainer(config=cfg, role_worker_mapping=mapping, reward_fn=reward_fn) as trainer,
    ):
        records = trainer.fit()
    (counting,) = made
    m = records[2].metrics
    assert [r.metrics["health/warnings"] for r in records[:2]] == [0.0, 0.0]
    assert m["health/ppo_kl_high"] == 1.0
    assert (m["health/interventions"], m["health/rollbacks"], m["health/lr_scale"]) == (1, 1, 0.5)
    loads = [a for name, a in counting.args if name == "load_checkpoint"]
    # The first is fit()'s look for a checkpoint to resume from (resume_mode auto).
    assert loads == [("checkpoints",), ("checkpoints/global_step_2",)]
    assert [a for name, a in counting.args if name == "set_lr_scale"] == [("actor", 0.5)]
    (guard_line,) = [r.getMessage() for r in caplog.records if "health guard" in r.getMessage()]
    assert "intervention 1 of 3 on ppo_kl_high" in guard_line
    assert "rolled back to the checkpoint of step 2" in guard_line
    assert f"actor lr now {TOO_HIGH / 2:.3g}" in guard_line
    # Step 3's checkpoint (saved after the intervention) holds step 2's actor and the
    # halved lr; the bad update is gone.
    ckpt = run / "checkpoints"
    before, after = (read_state(ckpt / f"global_step_{s}" / "actor") for s in (2, 3))
    for name, t in before["model"].items():
        assert torch.equal(t, after["model"][name]), name
    groups = after["optimizer"]["param_groups"]
    assert all(g["lr"] == pytest.approx(TOO_HIGH / 2) for g in groups)

    # A resumed run trains at the halved lr and keeps the guard's count and quiet time.
    cfg4 = _config(tiny_model_dir, arithmetic_dir, run, *common, "trainer.total_training_steps=4")
    with PPOTrainer(config=cfg4, reward_fn=reward_fn) as trainer:
        (step4,) = trainer.fit()
        assert trainer.guard.interventions == 1
        assert trainer.health.quiet_until == 3 + 5  # trainer.health.guard.cooldown_steps
    assert step4.step == 4
    assert step4.metrics["actor/lr"] == pytest.approx(TOO_HIGH / 2)
    assert step4.metrics["health/interventions"] == 1.0
    assert step4.metrics["health/lr_scale"] == 0.5
