"""One PPO step is one hop to the trainer: a real trainer gRPC server on 127.0.0.1 (its
calls counted by a server interceptor this test installs), two real rollout replicas
and a reward service, and a short ``PPOTrainer.fit`` run (what ``rlfleet train`` runs)
against them. Each step makes exactly one ``TrainStep`` call and one ``PushWeights``
call covering both replicas, and no per-phase call; the trainer's metrics reach the
step record unchanged (the driver's own names do not collide with them)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

torch = pytest.importorskip("torch")

from rlfleet.common.config import Config, config_from_dict  # noqa: E402
from rlfleet.common.rpc import create_server  # noqa: E402
from rlfleet.driver.clients import remote_workers  # noqa: E402
from rlfleet.driver.data.preprocess import preprocess  # noqa: E402
from rlfleet.driver.loop import PPOTrainer  # noqa: E402
from rlfleet.reward.server import start_reward_service  # noqa: E402
from rlfleet.rollout.client import RemoteRolloutClient  # noqa: E402
from rlfleet.rollout.core import RolloutCore  # noqa: E402
from rlfleet.rollout.hf_engine import HFEngine  # noqa: E402
from rlfleet.rollout.server import start_rollout_server  # noqa: E402
from rlfleet.trainer.core import TrainerCore  # noqa: E402
from rlfleet.trainer.servicer import TrainerServicer  # noqa: E402
from rlfleet.trainer.servicer import add_to_server as trainer_add_to_server  # noqa: E402
from rlfleet.v1 import trainer_pb2  # noqa: E402

pytestmark = pytest.mark.timeout(300)

STEPS = 3
SERVICE = "/rlfleet.v1.TrainerService/"
PER_PHASE = (
    "ComputeLogProb",
    "ComputeRefLogProb",
    "ComputeValues",
    "ComputeAdvantage",
    "UpdateCritic",
    "UpdateActor",
)


class CallCounter(grpc.ServerInterceptor):
    """Counts every call the server receives by method, and keeps what ``TrainStep``
    answered and how many targets each ``PushWeights`` named."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.train_steps: list[trainer_pb2.TrainStepResponse] = []
        self.push_targets: list[int] = []
        self._lock = threading.Lock()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = details.method
        with self._lock:
            self.calls[method.removeprefix(SERVICE)] += 1
        handler = continuation(details)
        if handler is None:
            return None
        if method == SERVICE + "TrainStep":
            behavior = handler.stream_unary

            def train_step(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                response = behavior(requests, context)
                with self._lock:
                    self.train_steps.append(response)
                return response

            return grpc.stream_unary_rpc_method_handler(
                train_step,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if method == SERVICE + "PushWeights":
            unary = handler.unary_unary

            def push(request: Any, context: grpc.ServicerContext) -> Any:
                with self._lock:
                    self.push_targets.append(len(request.targets))
                return unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                push,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _config(model: Path, data: Path, run_dir: Path) -> Config:
    return config_from_dict(
        {
            "data": {
                "train_files": str(data / "train.parquet"),
                "val_files": [],
                "train_batch_size": 4,
                "max_prompt_length": 64,
                "max_response_length": 8,
            },
            # One mini-batch of the whole batch, one epoch: the old-log-prob pass is
            # skipped once the driver knows the batch is on-policy (from step 2).
            # A warm-up ratio and a cosine decay: the trainer below is not told the
            # run's length, so they follow the total the driver sends with each step.
            "actor": {
                "model_path": str(model),
                "lr": 1e-4,
                "ppo_mini_batch_size": 4,
                "lr_warmup_steps_ratio": 0.5,
                "lr_scheduler": "cosine",
                "min_lr_ratio": 0.1,
            },
            "rollout": {"n": 2},
            "algorithm": {"adv_estimator": "grpo"},
            "reward": {"num_workers": 1},
            "trainer": {
                "total_training_steps": STEPS,
                "test_freq": -1,
                "save_freq": -1,
                "default_local_dir": str(run_dir),
                "resume_mode": "disable",
                "logger": [],
                "val_before_train": False,
            },
            "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
            "mapping": {"actor": "train_pool", "rollout": "rollout_pool"},
        }
    )


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("arith")
    preprocess("arithmetic", None, out, n=32, n_test=4, digits=1, ops="+-*", seed=0)
    return out


def test_each_step_is_one_train_step_and_one_push(
    tiny_model_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    cfg = _config(tiny_model_dir, data_dir, tmp_path / "run")
    # The trainer service as `rlfleet serve trainer --config` starts it from a config
    # that does not give the run's length (the driver works it out).
    unsized = cfg.model_copy(
        update={"trainer": cfg.trainer.model_copy(update={"total_training_steps": None})}
    )
    counter = CallCounter()
    trainer_server = create_server(
        [
            (
                trainer_add_to_server,
                TrainerServicer(TrainerCore(unsized)),
            )
        ],
        interceptors=[counter],
    )
    cores = [RolloutCore(HFEngine(tiny_model_dir), replica_id=f"r{i}") for i in range(2)]
    rollouts = [start_rollout_server(core) for core in cores]
    reward = start_reward_service(cfg.reward)
    try:
        mapping = remote_workers(
            trainer_server.address, [r.address for r in rollouts], reward.address
        )
        with PPOTrainer(config=cfg, role_worker_mapping=mapping) as driver:
            records = driver.fit()
            policy_version = driver._policy_version
        versions = []
        for server in rollouts:
            with RemoteRolloutClient(server.address) as client:
                versions.append(client.status().weight_version)
    finally:
        reward.stop(grace_s=0.0)
        for server in rollouts:
            server.stop(0)
        for core in cores:
            core.close()
        trainer_server.stop(0)

    assert [r.step for r in records] == [1, 2, 3]
    # One training call per step, and none of the per-phase calls.
    assert counter.calls["TrainStep"] == STEPS
    assert {m: counter.calls[m] for m in PER_PHASE} == dict.fromkeys(PER_PHASE, 0)
    # One push per step, each to both replicas, which all serve the last version.
    assert counter.calls["PushWeights"] == STEPS
    assert counter.push_targets == [2] * STEPS
    assert versions == [policy_version] * 2 == [STEPS] * 2

    # The trainer's metrics (phases timed there, data metrics) reach the records as it
    # sent them: nothing the driver adds overwrites them.
    assert len(counter.train_steps) == STEPS
    for record, response in zip(records, counter.train_steps, strict=True):
        assert response.actor_updated
        for key, value in response.metrics.items():
            assert record.metrics[key] == pytest.approx(value, rel=0, abs=0), key
        for phase in ("adv", "update_actor"):
            assert f"timing_s/{phase}" in response.metrics
        assert "critic/score/mean" in response.metrics
        assert "staleness/mean" not in response.metrics  # the driver's, added by it
        assert record.metrics["staleness/max"] == 0.0
    # Step 1: the driver has not pushed yet, so it cannot vouch for the replicas'
    # weights; then every batch is on-policy and the redundant pass is skipped.
    assert [r.metrics["rollout/on_policy"] for r in records] == [0.0, 1.0, 1.0]
    assert [r.metrics["actor/old_log_prob_skipped"] for r in records] == [0.0, 1.0, 1.0]
    assert ["timing_s/old_log_prob" in r.metrics for r in records] == [True, False, False]
    # The lr schedule knew the run's 3 steps: warm-up int(0.5 x 3) = 1 step (lr x 1/2),
    # then cosine from 1.0 down towards 0.1 at step 3 (halfway: 0.55).
    lrs = [r.metrics["actor/lr"] for r in records]
    assert lrs == pytest.approx([0.5e-4, 1e-4, 0.55e-4], rel=1e-6)
