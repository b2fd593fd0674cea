"""A service that stops answering without dying (SIGSTOP) is given up by its client's
liveness probe, with an error naming it and its address, instead of after the call's
deadline; a service that is merely busy is not."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from rlfleet.common.auth import credential_set, generate_tokens, write_credential_set
from rlfleet.common.errors import Unavailable
from rlfleet.common.rpc import Security, using_security
from rlfleet.rollout.client import RemoteRolloutClient
from rlfleet.rollout.engine import SamplingParams

pytestmark = pytest.mark.timeout(180)


@pytest.fixture()
def replica(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    tokens = generate_tokens()
    secrets = write_credential_set(tmp_path / "secrets", tokens)
    cmd = [sys.executable, "-m", "rlfleet.rollout.server", "--model", str(tiny_model_dir)]
    cmd += ["--port", "0", "--metrics-port", "-1", "--grace-s", "1", "--torch-threads", "1"]
    env = {**os.environ, "RLFLEET_CREDENTIALS": str(secrets / "rollout.json")}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
    try:
        ready = json.loads(lines.get(timeout=120))
        with using_security(Security(credentials=credential_set(tokens)["driver"])):
            yield ready["address"], proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_stopped_replica_is_given_up_with_its_address(
    replica: tuple[str, subprocess.Popen[str]],
) -> None:
    address, proc = replica
    # A deadline far beyond the test's time-out: only the liveness probe can end this.
    client = RemoteRolloutClient(address, generate_timeout_s=3600, liveness_s=1.0)
    params = SamplingParams(n=1, temperature=1.0, max_tokens=32, seed=0, ignore_eos=True)
    # Busy but alive: a long generation with the probe on finishes normally.
    busy = list(client.generate([[1, 2, 3]] * 64, params))
    assert len(busy) == 64
    stream = client.generate([[1, 2, 3]] * 512, params)
    os.kill(proc.pid, signal.SIGSTOP)
    with pytest.raises(Unavailable, match="stopped answering") as info:
        for _ in stream:
            pass
    assert address in str(info.value) and info.value.recoverable
    client.close()


def test_with_the_defaults_a_stopped_replica_is_given_up_within_15_s(
    replica: tuple[str, subprocess.Popen[str]],
) -> None:
    """The client's default liveness (``DEFAULT_LIVENESS_S``), not a test setting:
    a call to a frozen replica fails well within the issue's 15 s bound, naming the
    replica's role and address, although its own deadline is an hour away."""

    from rlfleet.rollout.client import DEFAULT_LIVENESS_S

    address, proc = replica
    client = RemoteRolloutClient(address, generate_timeout_s=3600)
    params = SamplingParams(n=1, temperature=1.0, max_tokens=32, seed=0, ignore_eos=True)
    stream = client.generate([[1, 2, 3]] * 512, params)
    os.kill(proc.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    with pytest.raises(Unavailable, match="stopped answering") as info:
        for _ in stream:
            pass
    waited = time.monotonic() - stopped
    assert DEFAULT_LIVENESS_S <= 5.0 and waited < 15.0, waited
    assert address in str(info.value) and "rollout" in str(info.value).lower()
    client.close()


def test_a_stopped_trainer_fails_the_call_naming_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    import yaml

    from rlfleet.trainer.client import RemoteTrainerClient

    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "actor": {"model_path": str(tiny_model_dir)},
                "trainer": {"device": "cpu", "default_local_dir": str(tmp_path / "run")},
            }
        )
    )
    address_file = tmp_path / "address"
    cmd = [sys.executable, "-m", "rlfleet.trainer.server", "--config", str(cfg)]
    cmd += ["--address-file", str(address_file), "--insecure"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        for _ in range(1200):
            if address_file.exists() or proc.poll() is not None:
                break
            threading.Event().wait(0.1)
        assert proc.poll() is None and address_file.exists()
        # The client's defaults: a frozen trainer is given up within the 15 s.
        client = RemoteTrainerClient(address_file.read_text(), timeout_s=3600)
        assert client.status()["global_step"] == 0  # alive: the probe leaves it alone
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(Unavailable, match="stopped answering") as info:
            client.status()
        waited = time.monotonic() - stopped
        assert waited < 15.0, waited
        assert "trainer" in str(info.value) and info.value.value == client.address
        client.close()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_stopped_reward_service_fails_the_call_naming_it(tmp_path: Path) -> None:
    from rlfleet.reward.client import RemoteRewardClient
    from rlfleet.reward.types import Sample

    cmd = [sys.executable, "-m", "rlfleet.reward.server", "--port", "0", "--insecure"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
    try:
        address = json.loads(lines.get(timeout=120))["address"]
        # The client's defaults: a frozen reward service is given up within 15 s.
        client = RemoteRewardClient(address, timeout_s=3600)
        sample = Sample(data_source="openai/gsm8k", response="#### 3", ground_truth="3")
        assert client.score([sample])[0].score == 1.0
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(Unavailable, match="stopped answering") as info:
            client.score([sample])
        waited = time.monotonic() - stopped
        assert waited < 15.0, waited
        assert address in str(info.value)
        client.close()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_the_default_scheduler_lists_a_silent_service_dead_within_15_s() -> None:
    """The scheduler's defaults (``rlfleet serve scheduler`` with no flags, and the
    launchers'): a service that stops beating is DEAD after interval x missed beats,
    under the 15 s the issue allows, and the driver stops sending it work then."""
    import argparse
    import inspect

    from rlfleet.launch.cluster import LocalCluster
    from rlfleet.scheduler.server import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([])
    assert args.heartbeat_interval_s * args.missed_heartbeats < 15.0
    local = inspect.signature(LocalCluster).parameters["heartbeat_interval_s"].default
    assert local * args.missed_heartbeats < 15.0
