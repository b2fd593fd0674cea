"""Which transport the weight pushes of a real training run take.

A short GRPO run (two steps, the tiny model, arithmetic data) drives a real trainer
service and a real rollout replica, each a gRPC server on 127.0.0.1 (port 0), as
``rlfleet train`` against deployed services does. With ``rollout.weight_transport``
auto every push of the run goes over the bulk plane (shared memory: the replica
shares this host's ``/dev/shm``), never the gRPC stream; forced to ``tcp`` or
``grpc`` every push takes that one. The transport is read from three places: the
driver's step metrics (``weight_sync/transport/<name>``), its Prometheus counter
(``rlfleet_scheduler_weight_pushes_total{transport}``) and its log line per
replica and push; and the replica's own count of bytes applied per transport
(``rlfleet_rollout_weight_update_bytes_total{transport}``) confirms it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from rlfleet.common.config import Config, load_config
from rlfleet.common.rpc import create_server
from rlfleet.driver.clients import Role, remote_workers
from rlfleet.driver.data.preprocess import preprocess
from rlfleet.driver.loop import PPOTrainer
from rlfleet.reward.client import InProcessRewardClient
from rlfleet.reward.core import RewardManager
from rlfleet.rollout.core import RolloutCore
from rlfleet.rollout.hf_engine import HFEngine
from rlfleet.rollout.server import start_rollout_server
from rlfleet.trainer.core import TrainerCore
from rlfleet.trainer.servicer import TrainerServicer
from rlfleet.trainer.servicer import add_to_server as trainer_add_to_server

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppo_tiny.yaml"
STEPS = 2


@pytest.fixture(scope="module")
def arithmetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("arith")
    preprocess("arithmetic", None, out, n=32, n_test=4, digits=1, ops="+-", seed=0)
    return out


def _config(model: Path, data: Path, run_dir: Path, transport: str) -> Config:
    return load_config(
        EXAMPLE,
        [
            f"actor.model_path={model}",
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}",
            f"trainer.default_local_dir={run_dir}",
            "data.train_batch_size=4",
            "data.max_response_length=6",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size=null",
            "actor.use_kl_loss=false",
            "ref.log_prob_micro_batch_size=null",
            "rollout.log_prob_micro_batch_size=null",
            "rollout.n=2",
            f"rollout.weight_transport={transport}",
            f"trainer.total_training_steps={STEPS}",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.val_before_train=false",
            "trainer.resume_mode=disable",
            "trainer.logger=[jsonl]",
        ],
    )


@pytest.fixture()
def services(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, str, RolloutCore]]:
    """A trainer service and a rollout replica (real gRPC servers on loopback); the
    trainer's config is the run's (its own ``weight_transport`` stays ``auto``: the
    driver's request says which transport to take)."""
    trainer = TrainerCore(_config(tiny_model_dir, tmp_path, tmp_path / "trainer", "auto"))
    trainer_server = create_server([(trainer_add_to_server, TrainerServicer(trainer))])
    rollout = RolloutCore(HFEngine(tiny_model_dir), replica_id="r0")
    rollout_server = start_rollout_server(rollout)
    try:
        yield trainer_server.address, rollout_server.address, rollout
    finally:
        rollout_server.stop(0)
        rollout.close()
        trainer_server.stop(0)


def _replica_bytes(core: RolloutCore, transport: str) -> float:
    value = core.metrics.registry.get_sample_value(
        "rlfleet_rollout_weight_update_bytes_total", {"transport": transport}
    )
    return float(value or 0.0)


@pytest.mark.parametrize(("mode", "expected"), [("auto", "shm"), ("tcp", "tcp"), ("grpc", "grpc")])
def test_every_push_of_a_run_takes_the_configured_transport(
    services: tuple[str, str, RolloutCore],
    tiny_model_dir: Path,
    arithmetic_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    expected: str,
) -> None:
    trainer_address, rollout_address, replica = services
    cfg = _config(tiny_model_dir, arithmetic_dir, tmp_path / "run", mode)
    caplog.set_level(logging.INFO, logger="rlfleet.driver.loop")
    mapping = remote_workers(trainer_address, [rollout_address])
    mapping[Role.RewardModel] = InProcessRewardClient(RewardManager(cfg.reward, num_workers=0))
    with PPOTrainer(config=cfg, role_worker_mapping=mapping) as run:
        records = run.fit()
        pushes = {
            t: run.metrics.registry.get_sample_value(
                "rlfleet_scheduler_weight_pushes_total", {"transport": t}
            )
            for t in ("shm", "tcp", "grpc")
        }
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    for r in records:  # one push per step, to the one replica, over `expected`
        used = {
            k.removeprefix("weight_sync/transport/"): v
            for k, v in r.metrics.items()
            if k.startswith("weight_sync/transport/")
        }
        assert used == {expected: 1.0}, (r.step, used)
        assert r.metrics["weight_sync/bytes"] > 0 and r.metrics["weight_sync/GBps"] > 0
    assert pushes == {t: float(STEPS if t == expected else 0) for t in pushes}
    if mode == "auto":
        assert pushes["grpc"] == 0.0  # every push of the run over the bulk plane
    lines = [
        m
        for m in caplog.messages
        if re.match(r"weight push v\d+ -> rollout replica \S+ \(127\.0\.0\.1:\d+\): ", m)
    ]
    assert len(lines) == STEPS
    assert all(f"): {expected}, " in m and " bytes, " in m and " GB/s" in m for m in lines)
    # The replica applied the weights over that transport, and over no other.
    assert _replica_bytes(replica, expected) > 0
    for other in {"shm", "tcp", "grpc"} - {expected}:
        assert _replica_bytes(replica, other) == 0.0, other
    assert replica.status().weight_version == STEPS
