"""A replica that stops answering without dying (SIGSTOP) is given up by its client's
liveness probe, with an error naming the replica, instead of after the stream's
deadline; a replica that is merely busy is not."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
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
