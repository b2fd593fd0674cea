"""Before a weight push the driver drops the replicas the registry no longer lists
alive (frozen and declared dead, scaled down), so the push does not wait on them,
and adopts no newcomer there (its weights would be the next version's)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from rlfleet.driver.clients import RolloutReplica, Workers
from rlfleet.driver.fleet import RolloutFleet


class Registry:
    """A scheduler client's list_services over a set of alive addresses."""

    def __init__(self, alive: list[str]) -> None:
        self.alive = alive

    def list_services(self, role: str, alive_only: bool = False) -> list[Any]:
        assert role == "rollout" and alive_only
        return [SimpleNamespace(spec=SimpleNamespace(address=a)) for a in self.alive]


def _fleet(registry: Registry, addresses: list[str]) -> tuple[RolloutFleet, list[str]]:
    pushed: list[str] = []
    replicas = [RolloutReplica(f"r{i}", None, a) for i, a in enumerate(addresses)]  # type: ignore[arg-type]
    workers = Workers(trainer=None, rollouts=replicas, reward=None)  # type: ignore[arg-type]
    fleet = RolloutFleet(
        workers,
        push=lambda rs, v: pushed.extend(r.address for r in rs),  # type: ignore[misc]
        version=lambda: 1,
        scheduler=registry,  # type: ignore[arg-type]
    )
    return fleet, pushed


def test_a_replica_the_registry_gave_up_is_dropped_before_the_push() -> None:
    registry = Registry(["a:1", "b:2", "c:3"])
    fleet, pushed = _fleet(registry, ["a:1", "b:2", "c:3"])
    fleet.prune()
    assert [r.address for r in fleet.replicas] == ["a:1", "b:2", "c:3"]
    registry.alive = ["a:1", "c:3", "new:4"]  # b frozen and declared dead; a newcomer
    fleet.prune()
    assert [r.address for r in fleet.replicas] == ["a:1", "c:3"]
    assert pushed == []  # nobody adopted here
    registry.alive = []  # none alive: keep them, the push reports what fails
    fleet.prune()
    assert [r.address for r in fleet.replicas] == ["a:1", "c:3"]


def test_replicas_the_registry_never_listed_are_kept() -> None:
    fleet, _ = _fleet(Registry(["a:1"]), ["a:1", "configured:9"])
    fleet.prune()
    assert [r.address for r in fleet.replicas] == ["a:1", "configured:9"]
