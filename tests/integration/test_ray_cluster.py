"""The Ray launcher on a real multi-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``: each node its own raylet, all on 127.0.0.1): every
role on its own node, the trainer's two ranks on two nodes, a few PPO steps with the
full batch, nothing left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from rlfleet.common.config import config_from_dict  # noqa: E402
from rlfleet.driver.data.preprocess import preprocess  # noqa: E402

pytestmark = pytest.mark.timeout(600)

LOOPBACK = "127.0.0.1"


@pytest.fixture(scope="module")
def ray_nodes() -> Iterator[Cluster]:
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"  # see conftest
    # A head with no CPU (the driver, the scheduler and reward actors need none) and
    # three one-core nodes: two for the train pool, one for the rollout pool.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "node_ip_address": LOOPBACK, "include_dashboard": False},
    )
    for _ in range(3):
        cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK)
    ray.init(address=cluster.address, _node_ip_address=LOOPBACK, namespace="rlfleet")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _raw(model: Path, data: Path, run_dir: Path) -> dict[str, Any]:
    return {
        "launcher": "ray",
        "data": {
            "train_files": str(data / "train.parquet"),
            "val_files": str(data / "test.parquet"),
            "train_batch_size": 4,
            "max_prompt_length": 64,
            "max_response_length": 8,
        },
        "actor": {"model_path": str(model), "lr": 1e-4, "ppo_mini_batch_size": 2},
        "rollout": {"n": 2},
        "algorithm": {"adv_estimator": "grpo"},
        "reward": {"num_workers": 1},
        "trainer": {
            "total_training_steps": 2,
            "test_freq": -1,
            "save_freq": -1,
            "default_local_dir": str(run_dir),
            "resume_mode": "disable",
            "logger": ["jsonl"],
            "val_before_train": False,
        },
        "resource_pools": {"train_pool": [1, 1], "rollout_pool": [1]},
        "mapping": {"actor": "train_pool", "rollout": "rollout_pool"},
    }


def test_ppo_steps_with_every_role_on_its_own_node(
    ray_nodes: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from rlfleet.driver.loop import StepRecord
    from rlfleet.launch.ray_cluster import RayCluster
    from rlfleet.scheduler.client import RemoteSchedulerClient

    data = tmp_path / "data"
    preprocess("arithmetic", None, data, n=32, n_test=4, digits=1, ops="+-", seed=0)
    config = config_from_dict(_raw(tiny_model_dir, data, tmp_path / "run"))
    assert config.world_size("actor") == 2
    records: list[StepRecord] = []
    with RayCluster(config, tmp_path / "run", heartbeat_interval_s=0.5) as cluster:
        handle = cluster.start(timeout_s=300)
        nodes = cluster.nodes()
        # Every service on a node address (here loopback), in its own actor.
        assert {"scheduler", "reward", "trainer", "trainer-1", "rollout-0"} <= set(nodes)
        placed = {name: nodes[name]["node_id"] for name in ("trainer", "trainer-1", "rollout-0")}
        assert len(set(placed.values())) == 3, placed  # two train nodes, one rollout node
        assert all(a.startswith(f"{LOOPBACK}:") for a in (handle.trainer, *handle.rollout))
        named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        assert {"rlfleet/trainer", "rlfleet/trainer-1", "rlfleet/rollout-0"} <= named
        with RemoteSchedulerClient(handle.scheduler or "") as client:
            entries = client.list_services(alive_only=True)
        assert {e.spec.role for e in entries} == {"rollout", "reward", "trainer"}
        # What `rlfleet status` shows: each service's node (its Ray node's address),
        # devices and Ray actor id, the one the named actor really has.
        actor_ids = {
            name: ray.get(ray.get_actor(f"rlfleet/{name}").node.remote())["actor_id"]
            for name in ("trainer", "reward", "rollout-0")
        }
        by_role = {e.spec.role: e for e in entries}
        for role, name in (("trainer", "trainer"), ("reward", "reward"), ("rollout", "rollout-0")):
            e = by_role[role]
            assert e.service_id == name, role  # the registry's id is the actor's name
            assert e.spec.capabilities["ray_actor_id"] == actor_ids[name], role
            assert e.spec.node == nodes[name]["ip"] == LOOPBACK, role
            assert e.spec.devices and all(d.kind == "cpu" for d in e.spec.devices), role
        assert by_role["trainer"].spec.capabilities["nodes"] == LOOPBACK
        # Credentials reach the services in their environment (inline: other nodes need
        # not see this machine's files), never on a command line.
        from rlfleet.common.auth import read_credential_set

        assert cluster.credentials_dir is not None
        tokens = read_credential_set(cluster.credentials_dir).values()
        for name, pid in cluster.pids.items():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert not any(t.encode() in cmdline for t in tokens), name
            assert b"RLFLEET_CREDENTIALS" in Path(f"/proc/{pid}/environ").read_bytes(), name
        from rlfleet.launch.cli import format_services

        table = format_services(entries)
        assert "RAY ACTOR" in table.splitlines()[0]
        assert all(actor_ids[n] in table for n in actor_ids)

        _fit(config, cluster, handle, records.append)
    assert [r.step for r in records] == [1, 2]
    # The full batch each step (the driver refuses a step with samples missing).
    assert all(len(r.indices) == config.data.train_batch_size for r in records)
    left = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("rlfleet/")
    ]
    assert left == []
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )


def _fit(config: Any, cluster: Any, handle: Any, on_step: Callable[[Any], None]) -> list[Any]:
    """A PPO run on ``cluster``'s services, as `rlfleet train` drives it (membership from
    its scheduler, its fleet metrics, its way to kill a frozen trainer)."""
    from rlfleet.driver.clients import remote_workers
    from rlfleet.driver.loop import PPOTrainer

    with PPOTrainer(
        config,
        role_worker_mapping=remote_workers(handle.trainer, handle.rollout, handle.reward),
        scheduler=handle.scheduler,
        on_step=on_step,
        fleet_metrics=cluster.fleet_metrics,
        kill_trainer=cluster.kill_trainer,
    ) as trainer:
        return trainer.fit()


def _wait(what: str, ok: Any, timeout_s: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.3)


def _alive_rollouts(scheduler: str) -> list[str]:
    from rlfleet.scheduler.client import RemoteSchedulerClient

    with RemoteSchedulerClient(scheduler) as client:
        return sorted(e.spec.address for e in client.list_services("rollout", alive_only=True))


@pytest.mark.slow
def test_scale_rollout_one_two_one_mid_run(
    ray_nodes: Cluster, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rlfleet scale rollout N` (the command, then the scheduler's SetScale) is followed
    by the Ray launcher during a run: 1 -> 2 -> 1 replicas, every step with the full
    batch, the new replica serving the current weights once it takes work."""
    from rlfleet.cli import main
    from rlfleet.driver.loop import StepRecord
    from rlfleet.launch.ray_cluster import RayCluster
    from rlfleet.scheduler.client import RemoteSchedulerClient

    data = tmp_path / "data"
    preprocess("arithmetic", None, data, n=32, n_test=4, digits=1, ops="+-", seed=0)
    raw = _raw(tiny_model_dir, data, tmp_path / "run")
    raw["resource_pools"] = {"train_pool": [1], "rollout_pool": [1]}
    raw["trainer"]["total_training_steps"] = 4
    config = config_from_dict(raw)
    records: list[StepRecord] = []
    seen: dict[int, list[str]] = {}
    with RayCluster(config, tmp_path / "run", heartbeat_interval_s=0.5) as cluster:
        cluster.supervise_interval_s = 0.3
        handle = cluster.start(timeout_s=300)
        scheduler = handle.scheduler or ""
        client = RemoteSchedulerClient(scheduler)

        assert cluster.credentials_dir is not None
        monkeypatch.setenv("RLFLEET_CREDENTIALS", str(cluster.credentials_dir / "driver.json"))
        versions: dict[int, set[int]] = {}

        def on_step(record: StepRecord) -> None:
            records.append(record)
            seen[record.step] = _alive_rollouts(scheduler)
            if record.step == 2:  # both replicas serve the same weights (asked directly)
                from rlfleet.rollout.client import RemoteRolloutClient

                versions[2] = set()
                for address in seen[2]:
                    with RemoteRolloutClient(address) as replica:
                        versions[2].add(replica.status().weight_version)
            if record.step == 1:
                assert main(["scale", "rollout", "2", "--scheduler", scheduler]) == 0
                _wait("2 replicas", lambda: len(_alive_rollouts(scheduler)) == 2)
            elif record.step == 3:
                client.set_scale("rollout", 1)
                _wait("1 replica", lambda: len(_alive_rollouts(scheduler)) == 1)

        _fit(config, cluster, handle, on_step)
        client.close()
    # (stop() waits for the supervisor to finish stopping the replica it removed)
    assert cluster.events["scaled_up"] == 1 and cluster.events["scaled_down"] == 1
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert all(len(r.indices) == config.data.train_batch_size for r in records)
    assert [len(seen[s]) for s in (1, 2, 3, 4)] == [1, 2, 2, 1]
    assert records[1].metrics["fleet/rollout_replicas"] == 2.0
    assert records[3].metrics["fleet/rollout_replicas"] == 1.0
    # The replica added after step 1 was given the current weights before its work.
    assert len(versions[2]) == 1 and min(versions[2]) >= 1


@pytest.mark.slow
def test_the_autoscaler_adds_a_replica_actor_during_a_run(
    ray_nodes: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The scheduler's autoscaler, fed by the driver's published step timings, asks
    for a second replica (generation is most of every step here); the Ray launcher
    starts it as an actor in the rollout pool and the run trains on both."""
    from rlfleet.common.http import http_get
    from rlfleet.driver.loop import StepRecord
    from rlfleet.launch.ray_cluster import RayCluster

    data = tmp_path / "data"
    preprocess("arithmetic", None, data, n=32, n_test=4, digits=1, ops="+-", seed=0)
    raw = _raw(tiny_model_dir, data, tmp_path / "run")
    raw["resource_pools"] = {"train_pool": [1], "rollout_pool": [1]}
    raw["trainer"]["total_training_steps"] = 4
    raw["scheduler"] = {
        "autoscale": {
            "enable": True,
            "min_replicas": 1,
            "max_replicas": 2,
            "target_gen_share": 0.01,
            "target_queue_depth": 1000,
            "cooldown_s": 0,
            "interval_s": 0.3,
        }
    }
    config = config_from_dict(raw)
    seen: dict[int, list[str]] = {}
    with RayCluster(config, tmp_path / "run", heartbeat_interval_s=0.5) as cluster:
        cluster.supervise_interval_s = 0.3
        handle = cluster.start(timeout_s=300)
        scheduler = handle.scheduler or ""

        def on_step(record: StepRecord) -> None:
            if record.step == 1:
                _wait(
                    "the autoscaler's second replica", lambda: len(_alive_rollouts(scheduler)) == 2
                )
            seen[record.step] = _alive_rollouts(scheduler)

        records = _fit(config, cluster, handle, on_step)
        assert cluster.events["scaled_up"] == 1 and cluster.rollout_replicas() == [
            "rollout-0",
            "rollout-1",
        ]
        named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        assert "rlfleet/rollout-1" in named
        text = http_get(handle.metrics["scheduler"], "/metrics").decode()
        assert 'rlfleet_autoscale_decisions_total{direction="up"} 1.0' in text
        assert "rlfleet_autoscale_desired_replicas 2.0" in text
    assert [len(seen[s]) for s in (1, 2, 3, 4)] == [2, 2, 2, 2]
    assert all(len(r.indices) == config.data.train_batch_size for r in records)
    assert records[-1].metrics["fleet/rollout_replicas"] == 2.0
    log = (tmp_path / "run" / "logs" / "scheduler.log").read_text()
    assert "autoscale: rollout replicas 1 -> 2 at step 1" in log


@pytest.mark.slow
def test_the_scheduler_and_a_trainer_rank_die_and_the_run_goes_on(
    ray_nodes: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Under Ray too: the scheduler is SIGKILLed after step 1 (restarted in its actor
    on its address; the replica registers again), then the trainer's second rank after
    step 3 (rank 0 leaves its broken group, every rank is restarted, the driver restores
    the step-2 checkpoint and redoes steps 3 and 4)."""
    import signal
    import time

    from rlfleet.driver.loop import StepRecord
    from rlfleet.launch.ray_cluster import RayCluster
    from rlfleet.scheduler.client import RemoteSchedulerClient

    data = tmp_path / "data"
    preprocess("arithmetic", None, data, n=32, n_test=4, digits=1, ops="+-", seed=0)
    raw = _raw(tiny_model_dir, data, tmp_path / "run")
    raw["trainer"].update(
        total_training_steps=4, save_freq=2, recovery={"enable": True, "wait_s": 240}
    )
    raw["services"] = {"max_restarts": 2, "restart_backoff_s": 0.2}
    config = config_from_dict(raw)
    assert config.world_size("actor") == 2
    with RayCluster(config, tmp_path / "run", heartbeat_interval_s=0.5) as cluster:
        cluster.supervise_interval_s = 0.3
        handle = cluster.start(timeout_s=300)
        scheduler = handle.scheduler or ""
        first = dict(cluster.pids)

        def on_step(record: StepRecord) -> None:
            if record.step == 1 and cluster.pids["scheduler"] == first["scheduler"]:
                os.kill(first["scheduler"], signal.SIGKILL)
                _wait("the scheduler back", lambda: cluster.restarts.get("scheduler") == 1)
                _wait("the replica registered again", lambda: len(_alive_rollouts(scheduler)) == 1)
            if record.step == 3 and cluster.pids["trainer-1"] == first["trainer-1"]:
                os.kill(first["trainer-1"], signal.SIGKILL)

        t0 = time.monotonic()
        records = _fit(config, cluster, handle, on_step)
        assert time.monotonic() - t0 < 500
        assert cluster.restarts == {"scheduler": 1, "trainer": 1}
        now = cluster.pids
        assert all(now[n] != first[n] for n in ("scheduler", "trainer", "trainer-1"))
        assert now["rollout-0"] == first["rollout-0"] and now["reward"] == first["reward"]
        # The restarted scheduler knows the fleet again (the launcher registered the
        # trainer and the reward service; the replica registered itself).
        with RemoteSchedulerClient(scheduler) as client:
            roles = {e.spec.role for e in client.list_services(alive_only=True)}
        assert roles == {"rollout", "reward", "trainer"}
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert all(len(r.indices) == config.data.train_batch_size for r in records)
    last = records[-1].metrics
    assert last["fault/trainer_recoveries"] == 1.0 and last["fault/redone_steps"] == 1.0
    assert last["fleet/restarted"] == 2.0


@pytest.mark.slow
def test_a_replicas_node_removed_mid_run_is_replaced_and_no_sample_is_lost(
    ray_nodes: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import threading

    from rlfleet.driver.loop import StepRecord
    from rlfleet.launch.ray_cluster import RayCluster

    spare = ray_nodes.add_node(num_cpus=1, node_ip_address=LOOPBACK)  # room for the replacement
    data = tmp_path / "data"
    preprocess("arithmetic", None, data, n=32, n_test=4, digits=1, ops="+-", seed=0)
    raw = _raw(tiny_model_dir, data, tmp_path / "run")
    raw["resource_pools"] = {"train_pool": [1], "rollout_pool": [1, 1]}
    raw["data"]["max_response_length"] = 32
    raw["trainer"]["total_training_steps"] = 4
    config = config_from_dict(raw)
    records: list[StepRecord] = []
    removed: dict[str, str] = {}
    with RayCluster(config, tmp_path / "run", heartbeat_interval_s=0.5) as cluster:
        cluster.supervise_interval_s = 0.3
        handle = cluster.start(timeout_s=300)
        # A replica on a node other than the driver's: the pool-less services (scheduler,
        # reward) live on the driver's node, which on one machine (every node at
        # 127.0.0.1) may be any of them.
        driver_node = ray.get_runtime_context().get_node_id()
        nodes = cluster.nodes()
        victim = next(n for n in ("rollout-1", "rollout-0") if nodes[n]["node_id"] != driver_node)
        victim_node = nodes[victim]["node_id"]
        node = next(n for n in ray_nodes.list_all_nodes() if n.node_id == victim_node)
        assert node is not ray_nodes.head_node

        victim_pid = cluster.pids[victim]

        def remove() -> None:
            ray_nodes.remove_node(node)
            # A node that dies takes its processes with it at once: no graceful drain
            # (the service process here only got SIGTERM from its dying actor).
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim_pid, signal.SIGKILL)

        def on_step(record: StepRecord) -> None:
            records.append(record)
            if record.step == 1:
                # (on_step runs after step 1's weight push.) The victim is stopped before
                # step 2 asks it, so step 2's share surely waits in it, and its node is
                # removed 1 s into step 2, within the liveness probe's 4 s and the
                # registry's 1.5 s: the driver still counts on it when it dies.
                removed["node"] = victim_node
                os.kill(victim_pid, signal.SIGSTOP)
                threading.Timer(1.0, remove).start()
            if record.step == 2:
                _wait("a replacement", lambda: cluster.events["replaced"] >= 1, 180)

        _fit(config, cluster, handle, on_step)
        replacement = cluster.nodes()[victim]
        assert replacement["node_id"] != removed["node"]
        assert cluster.events["lost"] >= 1
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert all(len(r.indices) == config.data.train_batch_size for r in records)
    assert records[-1].metrics["fleet/replaced"] >= 1.0
    # The lost replica's share of step 2 was generated again by the other one.
    assert records[1].metrics["rollout/requeued_samples"] > 0
    assert sum(r.metrics["rollout/requeued_samples"] for r in records[2:]) == 0
    del spare


@pytest.mark.slow
def test_a_given_up_replica_actor_is_retired_and_replaced_to_the_desired_count(
    ray_nodes: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A desired count is set at the scheduler and a replica dies past
    services.max_restarts: the launcher gave up on it but kept it (its actor holding
    its bundle's room, listed as running, in the registry until listed dead); now its
    actor ends, it leaves the registry, and a new replica actor takes its place."""
    from rlfleet.launch.ray_cluster import RayCluster
    from rlfleet.scheduler.client import RemoteSchedulerClient

    data = tmp_path / "data"
    preprocess("arithmetic", None, data, n=32, n_test=4, digits=1, ops="+-", seed=0)
    raw = _raw(tiny_model_dir, data, tmp_path / "run")
    raw["resource_pools"] = {"train_pool": [1], "rollout_pool": [1]}
    raw["services"] = {"max_restarts": 1, "restart_backoff_s": 0.2}
    config = config_from_dict(raw)
    with RayCluster(config, tmp_path / "run", heartbeat_interval_s=0.5) as cluster:
        cluster.supervise_interval_s = 0.3
        handle = cluster.start(timeout_s=300)
        first_address = handle.rollout[0]
        with RemoteSchedulerClient(handle.scheduler or "") as client:
            client.set_scale("rollout", 1)
            _wait("the count followed", lambda: cluster._scale_generation == 1)
            first = cluster.pids["rollout-0"]
            os.kill(first, signal.SIGKILL)
            _wait(
                "rollout-0 restarted",
                lambda: (
                    cluster.restarts.get("rollout-0") == 1
                    and cluster.pids.get("rollout-0") not in (None, first)
                ),
            )
            os.kill(cluster.pids["rollout-0"], signal.SIGKILL)  # past max_restarts

            def replaced() -> bool:
                listed = client.list_services("rollout")
                alive = client.list_services("rollout", alive_only=True)
                return [e.spec.service_id for e in listed] == ["rollout-1"] and len(alive) == 1

            _wait("the given-up replica replaced", replaced, 180)
            alive = client.list_services("rollout", alive_only=True)
        assert "rollout-0" in cluster.given_up
        assert cluster.rollout_replicas() == ["rollout-1"]
        assert alive[0].spec.address != first_address
        named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        assert "rlfleet/rollout-0" not in named and "rlfleet/rollout-1" in named


@pytest.mark.slow
def test_a_frozen_trainer_is_killed_through_its_actor_and_restarted(
    ray_nodes: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SIGSTOP on the trainer: the driver gives up on its call, and after
    trainer.recovery.kill_after_s has the Ray launcher end the process through its
    actor; the supervisor restarts it there and the run finishes."""
    import signal

    from rlfleet.driver.loop import StepRecord
    from rlfleet.launch.ray_cluster import RayCluster

    data = tmp_path / "data"
    preprocess("arithmetic", None, data, n=32, n_test=4, digits=1, ops="+-", seed=0)
    raw = _raw(tiny_model_dir, data, tmp_path / "run")
    raw["resource_pools"] = {"train_pool": [1], "rollout_pool": [1]}
    raw["trainer"].update(
        total_training_steps=3,
        save_freq=1,
        recovery={"enable": True, "wait_s": 240, "kill_after_s": 2},
    )
    raw["services"] = {"restart_backoff_s": 0.2}
    config = config_from_dict(raw)
    with RayCluster(config, tmp_path / "run", heartbeat_interval_s=0.5) as cluster:
        cluster.supervise_interval_s = 0.3
        handle = cluster.start(timeout_s=300)
        first = cluster.pids["trainer"]

        def on_step(record: StepRecord) -> None:
            if record.step == 1 and cluster.pids["trainer"] == first:
                os.kill(first, signal.SIGSTOP)

        records = _fit(config, cluster, handle, on_step)
        assert cluster.events["killed"] == 1 and cluster.restarts == {"trainer": 1}
        assert cluster.pids["trainer"] != first
    assert [r.step for r in records] == [1, 2, 3]
    assert records[-1].metrics["fault/trainer_recoveries"] == 1.0


@pytest.mark.slow
def test_the_trainers_node_removed_mid_run_moves_the_trainer(
    ray_nodes: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With trainer.recovery, a trainer whose node dies is placed again in the train
    pool (Ray moves the bundle to a spare node) on a new address; the launcher
    registers it, the driver finds it in the registry, restores the step-2 checkpoint
    into it and finishes the run."""
    from rlfleet.driver.loop import StepRecord
    from rlfleet.launch.ray_cluster import RayCluster
    from rlfleet.scheduler.client import RemoteSchedulerClient

    spare = ray_nodes.add_node(num_cpus=1, node_ip_address=LOOPBACK)  # room for the move
    data = tmp_path / "data"
    preprocess("arithmetic", None, data, n=32, n_test=4, digits=1, ops="+-", seed=0)
    raw = _raw(tiny_model_dir, data, tmp_path / "run")
    raw["resource_pools"] = {"train_pool": [1], "rollout_pool": [1]}
    raw["trainer"].update(
        total_training_steps=4, save_freq=2, recovery={"enable": True, "wait_s": 240}
    )
    config = config_from_dict(raw)
    with RayCluster(config, tmp_path / "run", heartbeat_interval_s=0.5) as cluster:
        cluster.supervise_interval_s = 0.3
        handle = cluster.start(timeout_s=300)
        driver_node = ray.get_runtime_context().get_node_id()
        trainer_node = cluster.nodes()["trainer"]["node_id"]
        assert trainer_node != driver_node  # the head (no CPU) holds no bundle
        node = next(n for n in ray_nodes.list_all_nodes() if n.node_id == trainer_node)

        def on_step(record: StepRecord) -> None:
            if record.step == 2 and cluster.events["replaced"] == 0:  # step 3 finds it gone
                ray_nodes.remove_node(node)

        records = _fit(config, cluster, handle, on_step)
        moved = cluster.nodes()["trainer"]
        assert moved["node_id"] != trainer_node
        assert cluster.handle is not None  # its trainer: the new address (the port may repeat)
        with RemoteSchedulerClient(handle.scheduler or "") as client:
            trainers = [e.spec.address for e in client.list_services("trainer")]
        assert trainers == [cluster.handle.trainer]
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert all(len(r.indices) == config.data.train_batch_size for r in records)
    last = records[-1].metrics
    assert last["fault/trainer_recoveries"] == 1.0 and last["fault/redone_steps"] == 0.0
    assert last["fleet/lost"] >= 1.0 and last["fleet/replaced"] >= 1.0
    del spare


@pytest.mark.slow
def test_verl_nnodes_layout_is_colocated_on_ray(
    ray_nodes: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``trainer.nnodes=2`` x ``n_gpus_per_node=1`` (verl's keys, no resource_pools):
    one global_pool of two nodes; each node's bundle holds a trainer rank and a rollout
    replica (colocated, time-shared), and PPO steps run."""
    from rlfleet.driver.loop import StepRecord
    from rlfleet.launch.train import train

    data = tmp_path / "data"
    preprocess("arithmetic", None, data, n=32, n_test=4, digits=1, ops="+-", seed=0)
    raw = _raw(tiny_model_dir, data, tmp_path / "run")
    del raw["resource_pools"], raw["mapping"]
    raw["trainer"].update({"nnodes": 2, "n_gpus_per_node": 1})
    config = config_from_dict(raw)
    assert config.resource_pools == {"global_pool": [1, 1]}
    assert config.placement().mode == "colocated" and config.world_size("actor") == 2
    records: list[StepRecord] = []
    summary = train(config, on_step=records.append, start_timeout_s=300)
    assert summary["global_steps"] == 2
    assert all(len(r.indices) == config.data.train_batch_size for r in records)
    assert records[-1].metrics["fleet/rollout_replicas"] == 2.0
    left = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("rlfleet/")
    ]
    assert left == []


def test_gpu_pools_place_every_actor_and_colocated_replicas_share_the_trainers_gpus(
    ray_nodes: Cluster, tmp_path: Path
) -> None:
    """On two nodes with 8 (fake) GPUs each, verl's colocated layout (``nnodes=2``,
    ``n_gpus_per_node=8``): 16 trainer-rank actors and 16 rollout-replica actors all
    place in the pool's two bundles (before, each replica asked for 4 GPUs and most
    waited forever), each replica on one GPU its node's trainer ranks hold, no two on
    the same. Then a disaggregated pool of 8 GPUs with ``tensor_parallel_size`` 2:
    4 replicas on 2 GPUs each, and a 5th is refused. Only placement runs here: the
    services' processes need CUDA (the GPU machine's tests start them)."""
    from rlfleet.launch.cluster import ServiceStartError
    from rlfleet.launch.ray_cluster import RayCluster, _Service

    gpu_nodes = [
        ray_nodes.add_node(num_cpus=0, num_gpus=8, node_ip_address=LOOPBACK) for _ in range(2)
    ]
    ray_nodes.wait_for_nodes()
    base = {
        "actor": {"model_path": "m", "ppo_mini_batch_size": 16},
        "algorithm": {"adv_estimator": "grpo"},
        "rollout": {"n": 4},
        "data": {"train_batch_size": 64},
        "launcher": "ray",
    }
    launched: list[RayCluster] = []

    def place(raw: dict[str, Any]) -> tuple[RayCluster, list[Any], list[Any]]:
        cluster = RayCluster(config_from_dict(raw), tmp_path / f"run{len(launched)}")
        launched.append(cluster)
        cfg = cluster.config
        cluster._place(ray, deadline=time.monotonic() + 60)
        pool = cfg.mapping.actor
        ranks = []
        for rank, bundle in enumerate(cluster.gpus.rank_bundles(pool, cfg.world_size("actor"))):
            name = f"trainer-{rank}"
            actor = cluster._actor(ray, name, pool, bundle, cluster.gpus.request("trainer", pool))
            ranks.append(_Service(name, "trainer", actor, pool, bundle,
                                  launch={"env": {"RANK": str(rank)}}))  # fmt: skip
            cluster._services.append(ranks[-1])
        rpool = cfg.mapping.rollout
        replicas = []
        for i, (bundle, slot) in enumerate(cluster._rollout_places(rpool, cfg.rollout_replicas())):
            name = f"rollout-{i}"
            actor = cluster._actor(ray, name, rpool, bundle, cluster.gpus.request("rollout", rpool))
            svc = _Service(name, "rollout", actor, rpool, bundle, slot=slot)
            replicas.append(svc)
            cluster._services.append(svc)
        for svc in ranks + replicas:  # a pending actor would time out here
            svc.info = ray.get(svc.actor.node.remote(), timeout=60)
        return cluster, ranks, replicas

    try:
        raw = {**base, "trainer": {"device": "cuda", "nnodes": 2, "n_gpus_per_node": 8}}
        cluster, ranks, replicas = place(raw)
        assert len(ranks) == 16 and len(replicas) == 16
        by_node: dict[str, set[str]] = {}
        for r in ranks:
            [gpu] = r.info["gpu_ids"]
            by_node.setdefault(r.info["node_id"], set()).add(gpu)
        assert len(by_node) == 2 and all(len(g) == 8 for g in by_node.values())
        used: dict[str, list[str]] = {}
        for r in replicas:
            assert r.info["gpu_ids"] == []  # asks Ray for none: it shares
            [gpu] = cluster._devices(r)
            assert gpu in by_node[r.info["node_id"]]
            used.setdefault(r.info["node_id"], []).append(gpu)
        assert {n: sorted(g) for n, g in used.items()} == {n: sorted(g) for n, g in by_node.items()}
        cluster.stop()

        raw = {
            **base,
            "trainer": {"device": "cuda"},
            "rollout": {"n": 4, "tensor_parallel_size": 2, "engine": "vllm"},
            "resource_pools": {"train_pool": [8], "rollout_pool": [8]},
            "mapping": {"actor": "train_pool", "rollout": "rollout_pool"},
        }
        cluster, ranks, replicas = place(raw)
        assert len(replicas) == 4
        gpus = [g for r in replicas for g in cluster._devices(r)]
        assert all(len(r.info["gpu_ids"]) == 2 for r in replicas) and len(set(gpus)) == 8
        with pytest.raises(ServiceStartError, match="no room"):
            cluster._rollout_places("rollout_pool", 1)
        cluster.stop()

        # ray.pool_strategy: PACK puts a [4, 4] pool's two bundles on one 8-GPU node,
        # the default STRICT_SPREAD on two.
        for strategy, nodes_used in (("PACK", 1), ("STRICT_SPREAD", 2)):
            raw = {
                **base,
                "trainer": {"device": "cuda"},
                "resource_pools": {"train_pool": [4, 4], "rollout_pool": [4]},
                "mapping": {"actor": "train_pool", "rollout": "rollout_pool"},
                "ray": {"pool_strategy": strategy},
            }
            packed = RayCluster(config_from_dict(raw), tmp_path / f"pack-{strategy}")
            launched.append(packed)
            packed._place(ray, deadline=time.monotonic() + 60)
            table = ray.util.placement_group_table(packed.placement_groups["train_pool"])
            assert table["strategy"] == strategy
            assert len(set(table["bundles_to_node_id"].values())) == nodes_used, strategy
            packed.stop()
    finally:
        for c in launched:
            c.stop()
        for node in gpu_nodes:
            ray_nodes.remove_node(node)


def test_a_lost_replica_is_replaced_on_a_live_node_of_its_pool_without_a_spare(
    ray_nodes: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """No node has room for the dead node's bundle: the replacement goes to the pool's
    bundle on a live node (next to the other replica) instead of waiting for one, and
    the supervisor is not held up while it starts."""
    from rlfleet.driver.loop import StepRecord
    from rlfleet.launch.ray_cluster import RayCluster

    data = tmp_path / "data"
    preprocess("arithmetic", None, data, n=32, n_test=4, digits=1, ops="+-", seed=0)
    raw = _raw(tiny_model_dir, data, tmp_path / "run")
    raw["resource_pools"] = {"train_pool": [1], "rollout_pool": [1, 1]}
    raw["trainer"]["total_training_steps"] = 3
    config = config_from_dict(raw)
    records: list[StepRecord] = []
    with RayCluster(config, tmp_path / "run", heartbeat_interval_s=0.5) as cluster:
        cluster.supervise_interval_s = 0.3
        handle = cluster.start(timeout_s=300)
        driver_node = ray.get_runtime_context().get_node_id()
        nodes = cluster.nodes()
        victim = next(n for n in ("rollout-1", "rollout-0") if nodes[n]["node_id"] != driver_node)
        other = "rollout-0" if victim == "rollout-1" else "rollout-1"
        node = next(n for n in ray_nodes.list_all_nodes() if n.node_id == nodes[victim]["node_id"])
        # Fill every node with room for a one-CPU bundle, so Ray cannot move the
        # victim's: only the launcher's choice of a live bundle can place the replacement.
        free = int(ray.available_resources().get("CPU", 0))
        filler = ray.util.placement_group([{"CPU": 1}] * free, strategy="SPREAD") if free else None
        if filler is not None:
            ray.get(filler.ready(), timeout=60)

        def on_step(record: StepRecord) -> None:
            records.append(record)
            if record.step == 1:
                ray_nodes.remove_node(node)
            if record.step == 2:
                _wait("a replacement", lambda: cluster.events["replaced"] >= 1, 180)

        try:
            _fit(config, cluster, handle, on_step)
            after = cluster.nodes()
        finally:
            if filler is not None:
                ray.util.remove_placement_group(filler)
        assert after[victim]["node_id"] == after[other]["node_id"] == nodes[other]["node_id"]
        assert cluster.events["lost"] >= 1
    assert [r.step for r in records] == [1, 2, 3]
    assert all(len(r.indices) == config.data.train_batch_size for r in records)


def test_the_tools_service_is_launched_as_an_actor_for_a_service_tool_source(
    ray_nodes: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A multi-turn tool source of kind ``service``: the Ray launcher starts the tools
    service as an actor (pool-less, on the driver's node, like the scheduler) and hands
    its address to every rollout replica."""
    from toolslib import check_tools_service, with_tools_service

    from rlfleet.launch.ray_cluster import RayCluster

    data = tmp_path / "data"
    preprocess("arithmetic", None, data, n=32, n_test=4, digits=1, ops="+-", seed=0)
    raw = _raw(tiny_model_dir, data, tmp_path / "run")
    raw["resource_pools"] = {"train_pool": [1], "rollout_pool": [1]}
    config = config_from_dict(with_tools_service(raw))
    with RayCluster(config, tmp_path / "run", heartbeat_interval_s=0.5) as cluster:
        handle = cluster.start(timeout_s=300)
        assert "tools" in cluster.nodes()
        assert cluster.nodes()["tools"]["node_id"] == ray.get_runtime_context().get_node_id()
        named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        assert "rlfleet/tools" in named
        check_tools_service(handle, cluster.pids["rollout-0"])
