"""A real rollout replica process registers, heartbeats and deregisters on SIGTERM."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("torch")

from rlfleet.common.rpc import create_server
from rlfleet.rollout.client import RemoteRolloutClient
from rlfleet.rollout.engine import SamplingParams
from rlfleet.v1 import scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.timeout(180)


class FakeScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Records Register / Heartbeat / Deregister calls."""

    def __init__(self) -> None:
        self.calls: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.log: list[tuple[str, Any]] = []

    def _record(self, name: str, request: Any) -> None:
        self.log.append((name, request))
        self.calls.put((name, request))

    def Register(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("Register", request)
        return scheduler_pb2.RegisterResponse(
            service_id="rollout-7", heartbeat_interval_s=0.2, weight_version=0
        )

    def Heartbeat(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("Heartbeat", request)
        return scheduler_pb2.HeartbeatResponse(known=True)

    def Deregister(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("Deregister", request)
        return scheduler_pb2.DeregisterResponse()

    def wait_for(self, name: str, timeout_s: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                got, request = self.calls.get(timeout=left)
            except queue.Empty:
                break
            if got == name:
                return request
        raise AssertionError(f"no {name} within {timeout_s}s; calls: {[n for n, _ in self.log]}")


@pytest.fixture()
def scheduler() -> Iterator[tuple[FakeScheduler, str]]:
    fake = FakeScheduler()
    server = create_server([(scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, fake)])
    try:
        yield fake, server.address
    finally:
        server.stop(0)


def read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"replica printed nothing within {timeout_s}s") from None


def test_replica_registers_heartbeats_and_deregisters(
    tiny_model_dir: Path, scheduler: tuple[FakeScheduler, str]
) -> None:
    fake, sched_addr = scheduler
    cmd = [
        sys.executable,
        "-m",
        "rlfleet.rollout.server",
        "--model",
        str(tiny_model_dir),
        "--engine",
        "hf",
        "--port",
        "0",
        "--scheduler",
        sched_addr,
        "--metrics-port",
        "0",
        "--grace-s",
        "2",
        "--torch-threads",
        "1",
        "--insecure",  # the fake scheduler has no auth; test_scheduler_rollout.py has it on
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(read_line(proc, 90))
        assert ready["event"] == "serving" and ready["service_id"] == "rollout-7"
        address = ready["address"]
        assert address.startswith("127.0.0.1:") and ready["port"] > 0

        reg = fake.wait_for("Register").info
        assert reg.role == scheduler_pb2.ROLE_ROLLOUT
        assert reg.address == address
        assert reg.capabilities["engine"] == "hf"
        assert reg.capabilities["model"] == str(tiny_model_dir)
        assert reg.capacity > 0 and reg.pid == proc.pid
        assert reg.devices and reg.devices[0].kind == "cpu"
        assert reg.metrics_address == ready["metrics"]
        beat = fake.wait_for("Heartbeat")
        assert beat.service_id == "rollout-7"

        with RemoteRolloutClient(address) as client:
            samples = list(client.generate([[5, 6, 7]], SamplingParams(n=2, max_tokens=4)))
        assert len(samples) == 2
        with urllib.request.urlopen(f"http://{ready['metrics']}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert "rlfleet_rollout_generated_tokens_total" in text
        assert "rlfleet_rollout_time_to_first_sample_seconds_count 1.0" in text

        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        dereg = fake.wait_for("Deregister", timeout_s=5)
        assert dereg.service_id == "rollout-7"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
