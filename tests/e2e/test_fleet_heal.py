"""Every rollout replica dies at once (the local launcher, a scheduler; synchronous
and pipelined): the driver's generation finds none left, waits for the launcher's
restarts to register (``rollout.replica_wait_s``), gives them the current weights (in
a pipelined run the main thread adopts them while the producer waits) and the
unfinished prompts, and the run goes on: every step with its full batch, in the data
order."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from runlib import arithmetic, grpo_config, loader_order

from rlfleet.common.config import Config, config_from_dict
from rlfleet.common.errors import RlfleetError
from rlfleet.driver.clients import Role, remote_workers
from rlfleet.driver.loop import PPOTrainer, StepRecord
from rlfleet.launch.cluster import LocalCluster
from rlfleet.scheduler.client import RemoteSchedulerClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 4


def _config(model: Path, tmp_path: Path, **sections: dict[str, Any]) -> Config:
    data = arithmetic(tmp_path / "data", n=64)
    return config_from_dict(grpo_config(model, data, tmp_path / "run", **sections))


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_the_run_waits_for_its_replicas_when_every_one_dies(
    tiny_model_dir: Path, tmp_path: Path, pipelined: bool
) -> None:
    config = _config(
        tiny_model_dir,
        tmp_path,
        rollout={"replicas": 2, "replica_wait_s": 120},
        trainer={"total_training_steps": STEPS, "pipeline": {"enable": pipelined}},
        services={"max_restarts": 2, "restart_backoff_s": 0.2},
    )
    with LocalCluster(config, tmp_path / "run", heartbeat_interval_s=0.5, grace_s=10) as cluster:
        h = cluster.start(timeout_s=180)
        first = {n: cluster.pids[n] for n in ("rollout-0", "rollout-1")}

        def on_step(record: StepRecord) -> None:
            if record.step == 1:  # both at once, before step 2 generates
                for pid in first.values():
                    os.kill(pid, signal.SIGKILL)

        with PPOTrainer(
            config=config,
            role_worker_mapping=remote_workers(h.trainer, h.rollout, h.reward),
            scheduler=h.scheduler,
            on_step=on_step,
            fleet_metrics=cluster.fleet_metrics,
        ) as trainer:
            records = trainer.fit()
            expected = loader_order(trainer, STEPS)
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert [r.indices for r in records] == expected
    assert all(r.metrics["rollout/samples"] == 8 for r in records)
    # The run goes on as soon as one is back (the supervisor restarts them one by one).
    assert records[-1].metrics["fleet/restarted"] >= 1.0


def test_without_a_wait_the_step_fails_naming_the_replicas(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = _config(
        tiny_model_dir,
        tmp_path,
        rollout={"replicas": 1, "replica_wait_s": 0},
        trainer={"total_training_steps": STEPS},
        services={"max_restarts": 0},
    )
    with LocalCluster(config, tmp_path / "run", heartbeat_interval_s=0.5, grace_s=10) as cluster:
        h = cluster.start(timeout_s=180)

        def on_step(record: StepRecord) -> None:
            if record.step == 1:
                os.kill(cluster.pids["rollout-0"], signal.SIGKILL)

        with (
            PPOTrainer(
                config=config,
                role_worker_mapping=remote_workers(h.trainer, h.rollout, h.reward),
                scheduler=h.scheduler,
                on_step=on_step,
            ) as trainer,
            pytest.raises(RlfleetError) as failed,
        ):
            trainer.fit()
    assert trainer.global_steps == 1
    assert h.rollout[0] in str(failed.value)  # names the replica it lost


def _two_replicas(model: Path, tmp_path: Path) -> Config:
    return _config(
        model,
        tmp_path,
        rollout={"replicas": 2, "replica_wait_s": 120},
        trainer={"total_training_steps": STEPS},
        services={"max_restarts": 2, "restart_backoff_s": 0.2},
    )


def _fit_with(config: Config, cluster: LocalCluster, h: Any, trainer_client: Any) -> Any:
    """A run on the cluster with the trainer reached through ``trainer_client`` (a
    test wraps one of its calls); its records and the data order's."""
    mapping = remote_workers(h.trainer, h.rollout, h.reward)
    mapping[Role.ActorRolloutRef] = trainer_client
    with PPOTrainer(
        config=config,
        role_worker_mapping=mapping,
        scheduler=h.scheduler,
        fleet_metrics=cluster.fleet_metrics,
    ) as trainer:
        return trainer.fit(), loader_order(trainer, STEPS)


def test_a_push_just_after_the_scheduler_restarted_waits_for_the_replicas(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The scheduler is killed and restarted by the launcher between a step's start and
    its weight push: the trainer, which sends weights only to replicas registered
    there, finds none yet (they register again at their next heartbeat) and refuses
    the push. The driver treats that as a push that reached no replica: it waits for
    them, gives them the weights when they are back, and the run goes on."""
    from rlfleet.trainer.client import RemoteTrainerClient

    config = _two_replicas(tiny_model_dir, tmp_path)
    # Heartbeats every 10 s: the restarted registry (its restart takes a few seconds)
    # stays without the replicas long enough for the push.
    with LocalCluster(config, tmp_path / "run", heartbeat_interval_s=10.0, grace_s=10) as cluster:
        h = cluster.start(timeout_s=180)
        trainer_client = RemoteTrainerClient(h.trainer)
        real_push = trainer_client.push_weights
        pushes: list[int] = []

        def push_after_a_scheduler_restart(*args: Any, **kwargs: Any) -> Any:
            pushes.append(kwargs.get("version", 0))
            if len(pushes) == 2:  # step 2's push (the first is step 1's)
                old = cluster.pids["scheduler"]
                os.kill(old, signal.SIGKILL)
                deadline = time.monotonic() + 60
                while cluster.pids.get("scheduler") in (None, old):
                    assert time.monotonic() < deadline, "the scheduler was not restarted"
                    time.sleep(0.05)
                with RemoteSchedulerClient(h.scheduler) as client:  # serving again
                    while True:
                        try:
                            client.list_services("rollout")
                            break
                        except RlfleetError:
                            assert time.monotonic() < deadline
                            time.sleep(0.05)
            return real_push(*args, **kwargs)

        trainer_client.push_weights = push_after_a_scheduler_restart  # type: ignore[method-assign]
        records, expected = _fit_with(config, cluster, h, trainer_client)
        trainer_client.close()
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert [r.indices for r in records] == expected
    assert all(r.metrics["rollout/samples"] == 8 for r in records)
    assert "scheduler" in dict(cluster.restarts)
    refused = [r.getMessage() for r in caplog.records if "reached no replica" in r.getMessage()]
    assert refused and "registered with the scheduler" in refused[0]


def test_a_replica_frozen_before_a_push_fails_it_alone_and_fast(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A replica that froze while the trainer trained (SIGSTOP; a stuck device) does
    not hold the weight push up (it took 23 s, every replica's buckets waiting on it):
    it does not answer the liveness probe before the push, so it fails the push alone,
    is dropped, and the run goes on with the other one (and takes it back, thawed)."""
    from rlfleet.trainer.client import RemoteTrainerClient

    config = _two_replicas(tiny_model_dir, tmp_path)
    with LocalCluster(config, tmp_path / "run", heartbeat_interval_s=0.5, grace_s=10) as cluster:
        h = cluster.start(timeout_s=180)
        trainer_client = RemoteTrainerClient(h.trainer)
        real_train = trainer_client.train_step
        frozen: list[int] = []

        def train_then_freeze(*args: Any, **kwargs: Any) -> Any:
            result = real_train(*args, **kwargs)
            if not frozen and result.global_step == 2:  # before step 2's push
                frozen.append(cluster.pids["rollout-1"])
                os.kill(frozen[0], signal.SIGSTOP)
            return result

        trainer_client.train_step = train_then_freeze  # type: ignore[method-assign]
        try:
            records, expected = _fit_with(config, cluster, h, trainer_client)
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
            trainer_client.close()
    assert frozen, "the replica was never frozen"
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert [r.indices for r in records] == expected
    assert all(r.metrics["rollout/samples"] == 8 for r in records)
    # The probe's second, not the 20 s a push to a frozen replica waited.
    assert records[1].metrics["timing_s/weight_sync"] < 5.0, records[1].metrics
