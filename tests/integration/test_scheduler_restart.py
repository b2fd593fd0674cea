"""The scheduler dies mid-run: the local launcher restarts it on its address, the
rollout replicas register again when their heartbeat finds themselves forgotten, and
the launcher registers the reward service again; the registry is whole within a few
heartbeats, and the desired count can be set again."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rlfleet.common.config import config_from_dict
from rlfleet.common.rpc import Server, create_server
from rlfleet.launch.cluster import LocalCluster
from rlfleet.scheduler.client import RemoteSchedulerClient

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def dummy() -> Iterator[Server]:
    """Health only: stands in for the trainer."""
    server = create_server([])
    try:
        yield server
    finally:
        server.stop(0)


def _wait(what: str, ok: Callable[[], bool], timeout_s: float = 120.0) -> float:
    t0 = time.monotonic()
    while not ok():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return time.monotonic() - t0


def test_a_killed_scheduler_is_restarted_and_its_registry_rebuilt(
    tiny_model_dir: Path, tmp_path: Path, dummy: Server
) -> None:
    config = config_from_dict(
        {
            "actor": {"model_path": str(tiny_model_dir)},
            "trainer": {"device": "cpu", "default_local_dir": str(tmp_path / "run")},
            "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
            "services": {"trainer": dummy.address, "restart_backoff_s": 0.2},
        }
    )
    with LocalCluster(config, tmp_path / "run", heartbeat_interval_s=0.5, grace_s=10) as cluster:
        h = cluster.start(timeout_s=180)
        assert h.scheduler is not None
        client = RemoteSchedulerClient(h.scheduler, timeout_s=5.0)

        def registered() -> dict[str, set[str]]:
            try:
                entries = client.list_services(alive_only=True)
            except Exception:
                return {}
            out: dict[str, set[str]] = {}
            for e in entries:
                out.setdefault(e.spec.role, set()).add(e.spec.address)
            return out

        whole = {"rollout": set(h.rollout), "reward": {h.reward}}
        _wait("the registry", lambda: registered() == whole)
        client.set_scale("rollout", 1)
        old = cluster.pids["scheduler"]
        os.kill(old, signal.SIGKILL)
        _wait("a new scheduler process", lambda: cluster.pids.get("scheduler", old) != old)
        # Same address; the replica re-registers on its own, the reward service is
        # registered again by the launcher.
        _wait("the registry rebuilt", lambda: registered() == whole)
        assert cluster.restarts == {"scheduler": 1}
        assert client.scale("rollout")[0] == 0  # the desired count lived in its memory
        # Its requests are numbered afresh, and the launcher follows them.
        assert client.set_scale("rollout", 2) == (2, 1)
        _wait("a second replica", lambda: len(registered().get("rollout", ())) == 2)
        client.close()
    log = (tmp_path / "run" / "logs" / "rollout-0.log").read_text()
    assert "registering again" in log
