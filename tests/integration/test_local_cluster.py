"""LocalCluster: every service its own process, pinned per pool, healthy, and gone after stop.

Also: a service dying at start-up fails start() with its log; SIGTERM or SIGKILL of
the process holding the cluster leaves no child behind; `rlfleet up/status/down`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfleet.common.config import config_from_dict
from rlfleet.common.http import http_get
from rlfleet.common.rpc import Server, check_health, create_channel, create_server
from rlfleet.launch import cli
from rlfleet.launch.cluster import LocalCluster, ServiceStartError
from rlfleet.scheduler.client import RemoteSchedulerClient
from rlfleet.scheduler.registry import ServiceState

pytestmark = pytest.mark.timeout(240)

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def gone(pid: int) -> bool:
    """True when neither the process nor anything in its process group is left."""
    for probe in (os.kill, os.killpg):
        try:
            probe(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def healthy(address: str) -> bool:
    channel = create_channel(address, retry_unavailable=False)
    try:
        return check_health(channel, timeout_s=5.0)
    finally:
        channel.close()


@pytest.fixture()
def dummy() -> Iterator[Server]:
    """A gRPC server with only health: stands in for services given by address."""
    server = create_server([])
    try:
        yield server
    finally:
        server.stop(0)


def base_config(model: Path, run_dir: Path, **extra: Any) -> dict[str, Any]:
    return {
        "actor": {"model_path": str(model)},
        "trainer": {"device": "cpu", "default_local_dir": str(run_dir)},
        "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
        **extra,
    }


@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 CPU cores for two pools")
def test_cluster_starts_every_service_pinned_and_stops_them_all(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = config_from_dict(base_config(tiny_model_dir, tmp_path / "run"))
    cluster = LocalCluster(config, tmp_path / "run", heartbeat_interval_s=0.5, grace_s=10)
    with cluster:
        h = cluster.start(timeout_s=180)
        pids = dict(h.pids)
        assert set(pids) == {"scheduler", "reward", "trainer", "rollout-0"}
        assert len(h.rollout) == 1 and h.mode == "disaggregated"
        for address in (h.scheduler, h.reward, h.trainer, *h.rollout):
            assert address is not None and address.startswith("127.0.0.1:")
            assert healthy(address), address

        # Disjoint pools: the trainer on the train pool's core, the replica on the other.
        assert h.cores["trainer"] == [CORES[0]] and h.cores["rollout-0"] == [CORES[1]]
        assert os.sched_getaffinity(pids["trainer"]) == {CORES[0]}
        assert os.sched_getaffinity(pids["rollout-0"]) == {CORES[1]}
        environ = Path(f"/proc/{pids['trainer']}/environ").read_bytes().split(b"\0")
        assert b"OMP_NUM_THREADS=1" in environ
        assert (tmp_path / "run" / "config.yaml").is_file()
        assert all((tmp_path / "run" / "logs" / f"{name}.log").is_file() for name in pids)

        with RemoteSchedulerClient(h.scheduler) as client:  # type: ignore[arg-type]
            entries = {e.spec.role: e for e in client.list_services()}
        assert set(entries) == {"rollout", "reward", "trainer"}
        assert all(e.state is ServiceState.ALIVE for e in entries.values())
        assert entries["rollout"].spec.address == h.rollout[0]
        # One name everywhere: the registry's ids are the launcher's names.
        assert {r: e.service_id for r, e in entries.items()} == {
            "rollout": "rollout-0", "reward": "reward", "trainer": "trainer"
        }  # fmt: skip
        assert entries["trainer"].spec.capabilities["roles"] == "actor,critic"
        # Secure by default: a per-cluster credential set; this process is the driver;
        # /sd needs a token, and no service has a token in its command line.
        assert cluster.security is not None and cluster.security.role == "driver"
        assert h.credentials_dir and (Path(h.credentials_dir) / "observer.token").is_file()
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(f"http://{h.metrics['scheduler']}/sd", timeout=5)
        targets = {g["labels"]["role"] for g in json.loads(http_get(h.metrics["scheduler"], "/sd"))}
        assert {"scheduler", "rollout", "reward"} <= targets
        for name, pid in pids.items():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert b"token" not in cmdline.lower(), name
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert f"RLFLEET_CREDENTIALS={h.credentials_dir}".encode() in environ, name
    for name, pid in pids.items():
        assert gone(pid), f"{name} (pid {pid}) survived stop()"


def test_service_dying_at_start_up_fails_with_its_log(tmp_path: Path, dummy: Server) -> None:
    raw = base_config(
        tmp_path / "no-such-model",
        tmp_path / "run",
        services={"reward": dummy.address, "trainer": dummy.address},
    )
    cluster = LocalCluster(config_from_dict(raw), tmp_path / "run", scheduler=False)
    with pytest.raises(ServiceStartError) as info:
        cluster.start(timeout_s=120)
    message = str(info.value)
    assert "rollout-0: exited with code 2" in message and "rollout-0.log" in message
    # The service's one-line reason, naming the key and the path, not its log's tail.
    assert "rollout.model_path (--model): cannot load" in message
    assert "no-such-model" in message and len(message.splitlines()) == 1
    assert cluster.pids and all(gone(pid) for pid in cluster.pids.values())


HOLDER = textwrap.dedent(
    """
    import json, sys, time
    from rlfleet.common.config import load_config
    from rlfleet.launch.cluster import LocalCluster
    cluster = LocalCluster(load_config(sys.argv[1]), sys.argv[2], scheduler=False)
    handle = cluster.start(timeout_s=60)
    print(json.dumps(handle.pids), flush=True)
    while True:
        time.sleep(1)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_orphans_when_the_holder_is_terminated_or_killed(
    tmp_path: Path, dummy: Server, sig: signal.Signals
) -> None:
    raw = base_config(
        tmp_path / "model",
        tmp_path / "run",
        services={"trainer": dummy.address, "rollout": [dummy.address]},
    )
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(config_file), str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert holder.stdout is not None
        pids: dict[str, int] = json.loads(holder.stdout.readline() or "{}")
        assert set(pids) == {"reward"}, pids
        os.kill(holder.pid, sig)
        holder.wait(timeout=30)
        deadline = time.monotonic() + 20
        while not all(gone(pid) for pid in pids.values()):
            assert time.monotonic() < deadline, f"children of the holder survived {sig.name}"
            time.sleep(0.1)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        if holder.stdout is not None:
            holder.stdout.close()


def parse(command: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"rlfleet {command}")
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_up_status_down(
    tmp_path: Path, dummy: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = base_config(
        tmp_path / "model",
        tmp_path / "run",
        services={"trainer": dummy.address, "rollout": [dummy.address]},
    )
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    state_dir = tmp_path / "state"
    assert cli.run(parse("up", ["--config", str(config_file), "--state-dir", str(state_dir)])) == 0
    state = cli.read_state(state_dir)
    assert state is not None
    pids = {p["name"]: p["pid"] for p in state["processes"]}
    try:
        assert set(pids) == {"scheduler", "reward"}
        capsys.readouterr()
        # A second `up` refuses while the first runs.
        assert (
            cli.run(parse("up", ["--config", str(config_file), "--state-dir", str(state_dir)])) == 1
        )
        assert "already up" in capsys.readouterr().err

        assert cli.run(parse("status", ["--state-dir", str(state_dir), "--json"])) == 0
        status = json.loads(capsys.readouterr().out)
        assert [s["role"] for s in status["services"]] == ["reward"]
        assert status["services"][0]["service_id"] == "reward"  # the launcher's name
        assert status["services"][0]["state"] == "alive"
        assert status["training"]["state"] == "idle"
        assert cli.run(parse("status", ["--state-dir", str(state_dir)])) == 0
        table = capsys.readouterr().out
        assert "reward" in table and "ALIVE" in table and state["handle"]["reward"] in table
        # `rlfleet up` runs with authentication on: a caller without a token is refused.
        import grpc

        from rlfleet.common.rpc import Security
        from rlfleet.v1 import scheduler_pb2, scheduler_pb2_grpc

        stranger = create_channel(
            state["handle"]["scheduler"], security=Security(insecure=True), retry_unavailable=False
        )
        with pytest.raises(grpc.RpcError) as refused:
            scheduler_pb2_grpc.SchedulerServiceStub(stranger).ListServices(
                scheduler_pb2.ListServicesRequest(), timeout=10
            )
        stranger.close()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        assert cli.run(parse("down", ["--state-dir", str(state_dir)])) == 0
    assert cli.read_state(state_dir) is None
    for name, pid in pids.items():
        assert gone(pid), f"{name} (pid {pid}) survived `rlfleet down`"


def test_dead_rollout_and_reward_are_restarted_on_their_ports(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = config_from_dict(
        base_config(
            tiny_model_dir,
            tmp_path / "run",
            services={"max_restarts": 1, "restart_backoff_s": 0.2},
        )
    )
    with LocalCluster(config, tmp_path / "run", heartbeat_interval_s=0.5, grace_s=10) as cluster:
        h = cluster.start(timeout_s=180)
        old = {name: h.pids[name] for name in ("reward", "rollout-0", "trainer")}
        for name in ("reward", "rollout-0"):
            os.kill(old[name], signal.SIGKILL)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            pids = cluster.pids
            if all(pids.get(n) not in (None, old[n]) for n in ("reward", "rollout-0")) and all(
                healthy(a) for a in (h.reward, h.rollout[0])
            ):
                break
            time.sleep(0.5)
        assert cluster.restarts == {"reward": 1, "rollout-0": 1}
        assert healthy(h.reward) and healthy(h.rollout[0])  # the same addresses
        with RemoteSchedulerClient(h.scheduler) as client:  # type: ignore[arg-type]
            while time.monotonic() < deadline:
                alive = [e.spec.address for e in client.list_services("rollout", alive_only=True)]
                if alive == h.rollout:
                    break
                time.sleep(0.5)
        assert alive == h.rollout
        with RemoteSchedulerClient(h.scheduler) as client:  # type: ignore[arg-type]
            [reward] = client.list_services("reward")
        assert reward.spec.pid == cluster.pids["reward"] != old["reward"]  # not the dead one
        assert cluster.pids["trainer"] == old["trainer"]
        # A second death is past max_restarts: the replica stays down.
        os.kill(cluster.pids["rollout-0"], signal.SIGKILL)
        while "rollout-0" not in cluster.given_up and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "rollout-0" in cluster.given_up and cluster.restarts["rollout-0"] == 1
        # The trainer too, by default (trainer.recovery), on its address.
        os.kill(old["trainer"], signal.SIGKILL)
        while time.monotonic() < deadline and not (
            cluster.pids.get("trainer") not in (None, old["trainer"]) and healthy(h.trainer)
        ):
            time.sleep(0.5)
        assert cluster.restarts.get("trainer") == 1 and healthy(h.trainer)
        # The launcher registers the new process once it answers: the registry names it
        # soon after, not the dead one.
        with RemoteSchedulerClient(h.scheduler) as client:  # type: ignore[arg-type]
            while time.monotonic() < deadline:
                [trainer] = client.list_services("trainer")
                if trainer.spec.pid != old["trainer"]:
                    break
                time.sleep(0.2)
        assert trainer.spec.pid == cluster.pids["trainer"] != old["trainer"]
    assert all(gone(pid) for pid in cluster.pids.values())


def test_the_tools_service_is_launched_for_a_service_tool_source(
    tiny_model_dir: Path, tmp_path: Path, dummy: Server
) -> None:
    from toolslib import check_tools_service, with_tools_service

    raw = with_tools_service(
        base_config(
            tiny_model_dir,
            tmp_path / "run",
            services={"reward": dummy.address, "trainer": dummy.address},
        )
    )
    with LocalCluster(config_from_dict(raw), tmp_path / "run", grace_s=10) as cluster:
        h = cluster.start(timeout_s=180)
        assert set(h.pids) == {"scheduler", "tools", "rollout-0"}
        check_tools_service(h, h.pids["rollout-0"])


def test_a_given_up_replica_is_replaced_to_keep_the_desired_count(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A desired count is set at the scheduler (the autoscaler, `rlfleet scale`) and a
    replica dies past services.max_restarts: the launcher gives up on it, takes it out
    of the registry (not listed dead for good) and starts a new replica in its place
    (at most max_restarts times), so the fleet is back at the count and the
    autoscaler, which waits for the fleet to match it, is not stuck."""
    config = config_from_dict(
        base_config(
            tiny_model_dir,
            tmp_path / "run",
            services={"max_restarts": 1, "restart_backoff_s": 0.2},
        )
    )
    with LocalCluster(config, tmp_path / "run", heartbeat_interval_s=0.5, grace_s=10) as cluster:
        h = cluster.start(timeout_s=180)
        deadline = time.monotonic() + 150
        with RemoteSchedulerClient(h.scheduler) as client:  # type: ignore[arg-type]
            client.set_scale("rollout", 1)
            while cluster._scale_generation != 1:  # the launcher follows it (no change)
                assert time.monotonic() < deadline
                time.sleep(0.2)
            first = cluster.pids["rollout-0"]
            os.kill(first, signal.SIGKILL)
            while not (  # restarted, up, and registered again as the new process
                cluster.restarts.get("rollout-0") == 1
                and cluster.pids.get("rollout-0") not in (None, first)
                and not cluster._restarting
                and any(
                    e.spec.pid == cluster.pids.get("rollout-0")
                    for e in client.list_services("rollout", alive_only=True)
                )
            ):
                assert time.monotonic() < deadline, "rollout-0 was not restarted"
                time.sleep(0.2)
            os.kill(cluster.pids["rollout-0"], signal.SIGKILL)  # past max_restarts
            while True:  # the given-up one out of the registry, its replacement in it
                alive = client.list_services("rollout", alive_only=True)
                listed = client.list_services("rollout")
                if [e.spec.service_id for e in listed] == ["rollout-1"] and len(alive) == 1:
                    break
                assert time.monotonic() < deadline, (cluster.rollout_replicas(), listed)
                time.sleep(0.2)
        assert "rollout-0" in cluster.given_up
        assert alive[0].spec.address != h.rollout[0]  # the new replica, not the given-up one
