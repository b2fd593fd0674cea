"""The autoscaler end to end on the local launcher: the scheduler process reads the
training status the driver publishes, moves the desired rollout count, and the
LocalCluster starts and drains real rollout processes to match."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rlfleet.common.config import config_from_dict
from rlfleet.common.http import http_get
from rlfleet.common.rpc import Server, create_server
from rlfleet.launch.cluster import LocalCluster
from rlfleet.scheduler.client import RemoteSchedulerClient
from rlfleet.scheduler.registry import TrainingStatus

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def dummy() -> Iterator[Server]:
    """Health only: stands in for the trainer and the reward service, which this test
    does not need (only the scheduler and the rollout replicas run)."""
    server = create_server([])
    try:
        yield server
    finally:
        server.stop(0)


def _wait(what: str, ok: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_autoscaler_adds_and_drains_replicas_on_the_local_launcher(
    tiny_model_dir: Path, tmp_path: Path, dummy: Server
) -> None:
    config = config_from_dict(
        {
            "actor": {"model_path": str(tiny_model_dir)},
            "trainer": {"device": "cpu", "default_local_dir": str(tmp_path / "run")},
            "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
            "services": {"trainer": dummy.address, "reward": dummy.address},
            "scheduler": {
                "autoscale": {
                    "enable": True,
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "target_gen_share": 0.5,
                    "cooldown_s": 0,
                    "interval_s": 0.3,
                }
            },
        }
    )
    with LocalCluster(config, tmp_path / "run", heartbeat_interval_s=0.5, grace_s=10) as cluster:
        h = cluster.start(timeout_s=180)
        assert h.scheduler is not None
        assert cluster.rollout_replicas() == ["rollout-0"]
        with RemoteSchedulerClient(h.scheduler) as client:

            def alive() -> list[str]:
                return sorted(
                    e.spec.address for e in client.list_services("rollout", alive_only=True)
                )

            def publish(step: int, gen_s: float) -> None:
                metrics = {"timing_s/gen": gen_s, "timing_s/step": 1.0}
                client.set_training_status(
                    TrainingStatus(global_step=step, state="running", metrics=metrics)
                )

            _wait("rollout-0 registered", lambda: len(alive()) == 1)
            # Generation is 90% of the step: the autoscaler asks for one more replica,
            # the launcher starts it, it registers.
            publish(1, 0.9)
            _wait("a second replica", lambda: len(alive()) == 2)
            assert cluster.rollout_replicas() == ["rollout-0", "rollout-1"]
            assert client.scale("rollout")[0] == 2
            added = cluster.pids["rollout-1"]
            # At max_replicas: a busy step changes nothing.
            publish(2, 0.95)
            time.sleep(1.5)
            assert client.scale("rollout")[0] == 2
            # Generation a small share: one fewer; the newest is deregistered, drained
            # and stopped, the first keeps serving.
            publish(3, 0.1)
            _wait("the second replica drained", lambda: len(alive()) == 1 and _gone(added))
            assert cluster.rollout_replicas() == ["rollout-0"]
            assert alive() == h.rollout
        assert cluster.fleet_metrics() == {
            "fleet/restarted": 0.0,
            "fleet/rollout_replicas": 1.0,
            "fleet/scaled_down": 1.0,
            "fleet/scaled_up": 1.0,
        }
        text = http_get(h.metrics["scheduler"], "/metrics").decode()
        assert 'rlfleet_autoscale_decisions_total{direction="up"} 1.0' in text
        assert 'rlfleet_autoscale_decisions_total{direction="down"} 1.0' in text
        assert "rlfleet_autoscale_desired_replicas 1.0" in text
        log = (tmp_path / "run" / "logs" / "scheduler.log").read_text()
        assert "autoscale: rollout replicas 1 -> 2 at step 1: generation share 0.90" in log
        assert "autoscale: rollout replicas 2 -> 1 at step 3" in log


def test_a_replica_scaled_away_finishes_the_generation_it_holds(
    tiny_model_dir: Path, tmp_path: Path, dummy: Server
) -> None:
    """Scaling down drains: the replica leaving is deregistered (no new work), then
    SIGTERM lets it finish the generation in flight, which its caller receives in
    full; then its process is gone."""
    import threading

    from rlfleet.rollout.client import RemoteRolloutClient
    from rlfleet.rollout.engine import SamplingParams

    config = config_from_dict(
        {
            "actor": {"model_path": str(tiny_model_dir)},
            "trainer": {"device": "cpu", "default_local_dir": str(tmp_path / "run")},
            "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
            "rollout": {"replicas": 2},
            "services": {"trainer": dummy.address, "reward": dummy.address},
        }
    )
    with LocalCluster(config, tmp_path / "run", heartbeat_interval_s=0.5, grace_s=60) as cluster:
        h = cluster.start(timeout_s=180)
        leaving = h.rollout[1]  # the newest leaves first
        pid = cluster.pids["rollout-1"]
        params = SamplingParams(n=1, temperature=1.0, max_tokens=48, seed=0, ignore_eos=True)
        got: list[object] = []
        client = RemoteRolloutClient(leaving, generate_timeout_s=120)

        def generate() -> None:
            try:
                got.extend(client.generate([[1, 2, 3]] * 2048, params))
            except Exception as e:  # reported below
                got.append(e)

        caller = threading.Thread(target=generate)
        caller.start()
        # In flight: 2,048 samples run as 8 engine batches of 256, seconds even on a
        # quiet machine, and the queue depth is watched closely.
        deadline = time.monotonic() + 120
        while not got and client.status().queue_depth == 0:
            assert time.monotonic() < deadline, "the generation never started"
            time.sleep(0.005)
        assert not got, f"the generation ended before the scale-down: {got[:1]}"
        cluster.scale_rollout(1)
        caller.join(120)
        client.close()
        assert not caller.is_alive()
        errors = [g for g in got if isinstance(g, Exception)]
        assert not errors, errors
        assert len(got) == 2048 and all(len(s.token_ids) == 48 for s in got)  # type: ignore[attr-defined]
        _wait("the drained replica to exit", lambda: _gone(pid), 60)
        with RemoteSchedulerClient(h.scheduler) as sched:  # type: ignore[arg-type]
            alive = [e.spec.address for e in sched.list_services("rollout", alive_only=True)]
        assert alive == [h.rollout[0]]
        assert cluster.events["scaled_down"] == 1
