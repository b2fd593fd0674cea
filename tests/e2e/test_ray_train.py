"""`rlfleet train --config examples/arithmetic_ray.yaml` on a machine with no Ray
running: the Ray launcher starts a local Ray, trains two steps on a tiny model, exits 0
and leaves no process behind; every socket the run listened on was on loopback.

The run gets its own Ray temp directory (``RAY_TMPDIR``), so every Ray process it
starts (gcs_server, raylet, workers) names that directory in its command line, and
every service process names the run directory: both mark what the run started.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")

from rlfleet.driver.data.preprocess import preprocess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arithmetic_ray.yaml"
RUN_LIMIT_S = 420.0
GONE_LIMIT_S = 60.0
LOOPBACK = "127.0.0.1"


def _procs() -> dict[int, tuple[int, str]]:
    """pid -> (process group, command line) of every process readable in /proc."""
    out: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after ")".
        fields = stat.rsplit(")", 1)[1].split()
        out[int(entry.name)] = (int(fields[2]), cmdline)
    return out


def _left_behind(pgid: int, markers: tuple[str, ...]) -> dict[int, str]:
    """Processes of the run's process group, or naming one of ``markers``."""
    me = os.getpid()
    return {
        pid: cmd
        for pid, (group, cmd) in _procs().items()
        if pid != me and (group == pgid or any(m in cmd for m in markers))
    }


def _listening(pids: set[int]) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) of the TCP sockets that
    ``pids`` listen on."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    out: set[str] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                    out.add(f[1].rsplit(":", 1)[0])
    return out


def _loopback(hex_addr: str) -> bool:
    """127.0.0.0/8, as IPv4 or IPv4-mapped IPv6 (little-endian words), or ::1."""
    if len(hex_addr) == 8:
        return hex_addr.endswith("7F")
    if hex_addr == "00000000000000000000000001000000":  # ::1
        return True
    return hex_addr.startswith("0000000000000000FFFF0000") and hex_addr.endswith("7F")


def _ray_running(wait_s: float = 120.0) -> bool:
    """Whether a Ray cluster still runs on this machine after up to ``wait_s``
    (another test's may be finishing)."""
    from ray._private.services import find_gcs_addresses

    deadline = time.monotonic() + wait_s
    while find_gcs_addresses():
        find_gcs_addresses.cache_clear()  # Ray caches what it found
        if time.monotonic() > deadline:
            return True
        time.sleep(2.0)
    return False


@pytest.fixture()
def ray_tmp() -> Iterator[Path]:
    # Short: Ray's Unix sockets live under it (a socket path is at most 107 bytes).
    path = Path(tempfile.mkdtemp(prefix="rlray-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class _Run:
    returncode: int
    log: str
    summary: dict[str, Any]
    listening: set[str]  # what the run's processes listened on, while it ran
    left: dict[int, str]  # what was still running after the run ended


def _train(
    model: Path, tmp_path: Path, overrides: list[str], env: dict[str, str], ray_tmp: Path
) -> _Run:
    """``rlfleet train --config examples/arithmetic_ray.yaml`` for two steps of four
    prompts, watched: every socket its processes listen on, what is left after it."""
    data = tmp_path / "data"
    preprocess("arithmetic", None, data, n=32, n_test=4, digits=1, ops="+-", seed=0)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlfleet.launch.train", "--config", str(EXAMPLE)]
    cmd += ["--log-level", "INFO"]
    cmd += [
        f"actor.model_path={model}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        "data.train_batch_size=4",
        "data.max_response_length=8",
        "actor.ppo_mini_batch_size=2",
        "critic.ppo_mini_batch_size=2",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run_dir}",
        *overrides,
    ]
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # a local Ray on 127.0.0.1 only
        "RAY_TMPDIR": str(ray_tmp),
        "RAY_ADDRESS": "",  # `auto` must not be redirected elsewhere
        "OMP_NUM_THREADS": "1",
        **env,
    }
    log, out_file = tmp_path / "train.log", tmp_path / "train.out"
    with open(log, "wb") as err, open(out_file, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=err, env=env, cwd=tmp_path, start_new_session=True
        )
    markers = (str(ray_tmp), str(run_dir))
    listening: set[str] = set()
    left: dict[int, str] = {}
    try:
        deadline = time.monotonic() + RUN_LIMIT_S
        while proc.poll() is None and time.monotonic() < deadline:
            listening |= _listening(set(_left_behind(proc.pid, markers)))
            time.sleep(0.5)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            pytest.fail(
                f"rlfleet train still running after {RUN_LIMIT_S}s:\n{log.read_text()[-4000:]}"
            )
    finally:
        deadline = time.monotonic() + GONE_LIMIT_S
        while time.monotonic() < deadline:
            left = _left_behind(proc.pid, markers)
            if not left:
                break
            time.sleep(0.5)
        for pid in left:  # clean up what the run left, then fail below
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    summary = json.loads(out_file.read_text().strip().splitlines()[-1])
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["global_steps"] == 2 and steps == [1, 2], (summary, steps)
    # Every service ran in an actor of this Ray, on loopback.
    for name in ("scheduler", "reward", "trainer", "rollout-0"):
        assert (run_dir / "logs" / f"{name}.log").is_file(), name
    (up,) = [line for line in text.splitlines() if line.startswith("services up")]
    assert "trainer 127.0.0.1:" in up and "rollout 127.0.0.1:" in up, up
    return _Run(proc.returncode, text, summary, listening, left)


def test_rlfleet_train_starts_a_local_ray_trains_and_leaves_nothing(
    tiny_model_dir: Path, tmp_path: Path, ray_tmp: Path
) -> None:
    if _ray_running():
        # `ray.address: auto` would join it: this test is about starting one.
        pytest.skip("a Ray cluster is running on this machine")
    run = _train(tiny_model_dir, tmp_path, [], {}, ray_tmp)
    assert "starting a local one" in run.log, run.log[-4000:]
    # Ray (GCS, raylet, workers) and every service listened on loopback only.
    assert run.listening, "saw no listening socket of the run"
    assert all(_loopback(a) for a in run.listening), sorted(run.listening)
    assert run.left == {}, f"left behind: {run.left}"


def test_rlfleet_train_joins_a_running_cluster_by_host_and_port(
    tiny_model_dir: Path, tmp_path: Path, ray_tmp: Path
) -> None:
    """`ray.address=HOST:PORT`: the run joins a cluster someone else started (a head
    with no CPU and a two-core worker node, as `ray start` would make them), places
    every service on the worker node, and leaves the cluster running when it ends."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "node_ip_address": LOOPBACK,
            "include_dashboard": False,
        },
    )
    try:
        worker = cluster.add_node(num_cpus=2, node_ip_address=LOOPBACK)
        run = _train(tiny_model_dir, tmp_path, [f"ray.address={cluster.address}"], {}, ray_tmp)
        assert "starting a local one" not in run.log, run.log[-4000:]
        # The cluster outlived the run; the pools' services ran on the worker node
        # (the head has no CPU for a bundle).
        assert cluster.remaining_processes_alive()
        (up,) = [line for line in run.log.splitlines() if "ray cluster up:" in line]
        on = dict(item.split("=", 1) for item in up.split("ray cluster up: ", 1)[1].split(", "))
        for name in ("trainer", "rollout-0"):
            assert f"({worker.node_id[:12]})" in on[name], up
        assert run.listening and all(_loopback(a) for a in run.listening), run.listening
        assert run.left == {}, f"left behind: {run.left}"
    finally:
        cluster.shutdown()
