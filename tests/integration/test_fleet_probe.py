"""The driver's load probe before it splits a batch over the replicas: a dead replica
(connection refused) and a silent one (a socket that accepts and never answers) cost
at most a probe deadline each, not gRPC's retries, and go last in line; the live
replicas, least loaded first, get the prompts."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from rlfleet.driver.clients import RolloutReplica, Workers
from rlfleet.driver.fleet import RolloutFleet
from rlfleet.rollout.client import PROBE_TIMEOUT_S, RemoteRolloutClient
from rlfleet.rollout.core import RolloutStatusInfo

pytestmark = pytest.mark.timeout(60)


class _Loaded:
    """A replica that answers its status with a given queue depth."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def status(self, *, probe: bool = False) -> RolloutStatusInfo:
        return RolloutStatusInfo("r", "m", "hf", "float32", "cpu", 0, self.depth, 0.0, False, 0)


@pytest.fixture()
def silent() -> Iterator[str]:
    """An address whose listener accepts connections and never speaks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed on leaving: refused


def test_dead_and_silent_replicas_cost_a_probe_deadline_and_go_last(silent: str) -> None:
    dead = RemoteRolloutClient(_closed_port(), timeout_s=30.0)
    mute = RemoteRolloutClient(silent, timeout_s=30.0)
    replicas = [
        RolloutReplica("dead", dead, "dead"),
        RolloutReplica("busy", _Loaded(9)),  # type: ignore[arg-type]
        RolloutReplica("mute", mute, "mute"),
        RolloutReplica("idle", _Loaded(0)),  # type: ignore[arg-type]
    ]
    fleet = RolloutFleet(
        Workers(trainer=None, rollouts=replicas, reward=None),  # type: ignore[arg-type]
        push=lambda *_: None,
        version=lambda: 0,
    )
    try:
        t0 = time.monotonic()
        shards = fleet.shards(8)
        took = time.monotonic() - t0
    finally:
        dead.close()
        mute.close()
    assert [r.replica_id for r, _, _ in shards] == ["idle", "busy", "dead", "mute"]
    assert [(a, b) for _, a, b in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # One deadline for the silent replica, next to nothing for the refused one, with
    # room for a loaded machine
    # (retried with backoff it took about 3 s, and the silent one its 30 s timeout).
    assert took < 3 * PROBE_TIMEOUT_S, f"probing took {took:.2f}s"
