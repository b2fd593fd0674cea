"""Role -> worker resolution and resource pools for the driver (no models)."""

from __future__ import annotations

from typing import Any

import pytest

from rlfleet.common.config import config_from_dict
from rlfleet.driver.clients import (
    ResourcePoolManager,
    Role,
    RolloutReplica,
    remote_workers,
    resolve_workers,
)


class _Client:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Trainer(_Client):
    def train_step(self, batch: Any) -> None:  # marks it as a trainer client
        pass


class _Rollout(_Client):
    def generate(self, *a: Any, **k: Any) -> None:
        pass


class _Reward(_Client):
    def score(self, samples: Any) -> list[float]:
        return []


def test_pools_placement() -> None:
    cfg = config_from_dict({})
    assert ResourcePoolManager.from_config(cfg).placement == "disaggregated"
    colo = ResourcePoolManager({"global_pool": [8]}, {Role.Actor: "global_pool",
                                                      Role.Rollout: "global_pool"})  # fmt: skip
    assert colo.placement == "colocated"
    assert colo.total_devices("global_pool") == 8
    combined = ResourcePoolManager({"g": [1]}, {Role.ActorRolloutRef: "g"})
    assert combined.placement == "colocated"
    assert combined.pool_of(Role.Actor) is None and combined.pool_of("actor_rollout_ref") == "g"


def test_resolve_clients_and_factories() -> None:
    cfg = config_from_dict({})
    trainer = _Trainer("t")
    made: list[str] = []

    def rollout_factory(config: Any) -> list[_Rollout]:
        made.append("rollout")
        return [_Rollout("r0"), _Rollout("r1")]

    mapping = {
        Role.ActorRolloutRef: trainer,
        Role.Critic: trainer,
        Role.Rollout: rollout_factory,
        Role.RewardModel: lambda config: _Reward("rw"),
    }
    w = resolve_workers(mapping, cfg)
    assert w.trainer is trainer
    assert [r.replica_id for r in w.rollouts] == ["rollout-0", "rollout-1"]
    assert isinstance(w.reward, _Reward)
    assert made == ["rollout"]
    w.close()
    assert all(r.client.closed for r in w.rollouts)  # type: ignore[attr-defined]
    assert not trainer.closed  # given, not built: the caller owns it


def test_resolve_rejects_two_trainers_and_missing_roles() -> None:
    cfg = config_from_dict({})
    with pytest.raises(ValueError, match="one trainer"):
        resolve_workers({Role.Actor: _Trainer("a"), Role.Critic: _Trainer("b"),
                         Role.Rollout: _Rollout("r")}, cfg)  # fmt: skip
    with pytest.raises(ValueError, match="no rollout"):
        resolve_workers({Role.Actor: _Trainer("a")}, cfg)
    with pytest.raises(ValueError, match="no trainer"):
        resolve_workers({Role.Rollout: _Rollout("r")}, cfg)


def test_remote_specs_build_lazy_channels() -> None:
    cfg = config_from_dict({})
    spec = remote_workers("127.0.0.1:1", ["127.0.0.1:2", "127.0.0.1:3"], "127.0.0.1:4")
    w = resolve_workers(spec, cfg)  # gRPC channels connect lazily: nothing is contacted
    try:
        assert [r.address for r in w.rollouts] == ["127.0.0.1:2", "127.0.0.1:3"]
        assert isinstance(w.rollouts[0], RolloutReplica)
    finally:
        w.close()


def test_a_reward_client_starts_no_watcher_thread_before_its_first_call() -> None:
    """gRPC watches a channel's state from a thread of its own; one that had not begun
    to watch when the channel closed died of "Cannot monitor channel state: Channel
    closed!" (seen in CI after a client built and closed unused), and closing a watched
    channel waits for the watcher's next poll (up to 0.2 s). A connection's state is
    watched from its first use, so a client not yet used starts no thread."""
    import threading

    from rlfleet.reward.client import RemoteRewardClient

    died: list[BaseException | None] = []
    before = threading.excepthook
    threading.excepthook = lambda args: died.append(args.exc_value)
    try:
        for _ in range(5):  # nothing listens on port 4; nothing is contacted
            threads = set(threading.enumerate())
            client = RemoteRewardClient("127.0.0.1:4", connections=2)
            try:
                started = [t.name for t in threading.enumerate() if t not in threads]
            finally:
                client.close()
            assert started == []
    finally:
        threading.excepthook = before
    assert died == []
