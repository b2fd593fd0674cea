"""A real rollout replica process registers with a real scheduler server, heartbeats,
goes DEAD when frozen, comes back, and is gone after SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch")

from rlfleet.common.auth import credential_set, generate_tokens, write_credential_set
from rlfleet.common.rpc import Security, using_security
from rlfleet.scheduler.client import RemoteSchedulerClient
from rlfleet.scheduler.registry import Registry, SchedulerCore, ServiceEntry, ServiceState
from rlfleet.scheduler.server import start_scheduler_server

pytestmark = pytest.mark.timeout(180)


def wait_until(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s}s"
        time.sleep(0.1)


def test_rollout_replica_registers_goes_dead_and_leaves(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Auth on, as in a cluster: the replica registers with its rollout credential
    # (heartbeats and deregistration carry its lease); this process is the driver.
    tokens = generate_tokens()
    secrets = write_credential_set(tmp_path / "secrets", tokens)
    driver = Security(credentials=credential_set(tokens)["driver"])
    core = SchedulerCore(Registry(heartbeat_interval_s=0.3, missed_heartbeats=3))
    core.set_training_status(weight_version=0)
    with using_security(driver), start_scheduler_server(core, metrics_port=0) as server:
        cmd = [
            sys.executable, "-m", "rlfleet.rollout.server",
            "--model", str(tiny_model_dir), "--engine", "hf", "--port", "0",
            "--scheduler", server.address, "--grace-s", "1",
        ]  # fmt: skip
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            CUDA_VISIBLE_DEVICES="",
            RLFLEET_CREDENTIALS=str(secrets / "rollout.json"),
        )
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        client = RemoteSchedulerClient(server.address)
        try:

            def rollouts() -> list[ServiceEntry]:
                return client.list_services("rollout")

            wait_until("registered", lambda: len(rollouts()) == 1, 120)
            [entry] = rollouts()
            assert entry.service_id == "rollout-1" and entry.state is ServiceState.ALIVE
            assert entry.spec.pid == proc.pid and entry.spec.address.startswith("127.0.0.1:")
            assert entry.spec.capabilities["engine"] == "hf"
            assert entry.spec.devices and entry.spec.devices[0].kind == "cpu"
            assert entry.spec.metrics_address  # listed for Prometheus discovery
            first = entry.last_heartbeat_unix
            wait_until("heartbeating", lambda: rollouts()[0].last_heartbeat_unix > first, 10)

            os.kill(proc.pid, signal.SIGSTOP)  # silent: 3 missed beats -> DEAD
            wait_until("DEAD", lambda: rollouts()[0].state is ServiceState.DEAD, 10)
            os.kill(proc.pid, signal.SIGCONT)
            wait_until("ALIVE again", lambda: rollouts()[0].state is ServiceState.ALIVE, 10)

            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            assert rollouts() == []  # deregistered on the way out
        finally:
            client.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_a_replica_registers_under_its_launchers_name_unless_another_holds_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The name a launcher gives a replica (``--replica-id rollout-3``) is its registry
    id; a second replica asking for a name a live one holds is not given that entry
    (nor refused): it registers under an assigned id, with a warning."""
    import types

    from rlfleet.rollout.server import SchedulerRegistration
    from rlfleet.v1 import scheduler_pb2

    creds = credential_set(generate_tokens())
    core = SchedulerCore(Registry(heartbeat_interval_s=0.3, missed_heartbeats=3))
    load = types.SimpleNamespace(queue_depth=0, tokens_per_second=0.0, weight_version=0)

    def registration(port: int) -> SchedulerRegistration:
        info = scheduler_pb2.ServiceInfo(
            service_id="rollout-3",
            role=scheduler_pb2.ROLE_ROLLOUT,
            address=f"127.0.0.1:{port}",
            node="n",
        )
        with using_security(Security(credentials=creds["rollout"])):
            return SchedulerRegistration(server.address, info, lambda: load)  # type: ignore[arg-type,return-value]

    with (
        using_security(Security(credentials=creds["driver"])),
        start_scheduler_server(core) as server,
    ):
        first, second = registration(40001), registration(40002)
        try:
            first.start()
            assert first.service_id == "rollout-3"
            with caplog.at_level("WARNING"):
                second.start()
            assert second.service_id not in ("", "rollout-3")
            assert any("keeps rollout-3" in r.getMessage() for r in caplog.records)
            with RemoteSchedulerClient(server.address) as client:
                ids = {e.service_id: e.spec.address for e in client.list_services()}
            assert ids == {"rollout-3": "127.0.0.1:40001", second.service_id: "127.0.0.1:40002"}
        finally:
            first.stop()
            second.stop()
