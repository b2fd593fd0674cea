"""A lost rollout replica's replacement on Ray (no Ray here: the cluster's placing and
starting are stand-ins, since this tests only the order of tries; the real ones run
in tests/integration/test_ray_cluster.py): the node it was lost on is avoided, and a
start that fails (Ray still counted the dead node alive) is tried again."""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace
from typing import Any

from rlfleet.launch.ray_cluster import RayCluster, _Service


def _cluster(fails: int) -> tuple[RayCluster, list[Any]]:
    cluster = object.__new__(RayCluster)
    cluster.REPLACE_PAUSE_S = 0.0
    cluster._lock = threading.Lock()
    cluster._services = []
    cluster._stopped = False
    cluster.events = Counter()
    cluster.config = SimpleNamespace(ray=SimpleNamespace(start_timeout_s=1.0))
    calls: list[Any] = []

    def live(ray: Any, pool: str, avoid: Any = None) -> set[int]:
        calls.append(("avoid", avoid))
        return {1}

    def relaunch(ray: Any, svc: _Service, *, timeout_s: float) -> _Service:
        calls.append(("start", svc.bundle))
        if sum(1 for c in calls if c[0] == "start") <= fails:
            raise RuntimeError("The actor died because its node has died")
        return svc

    cluster._live_bundles = live  # type: ignore[method-assign]
    cluster._relaunch = relaunch  # type: ignore[method-assign]
    cluster.gpus = SimpleNamespace(place_rollout=lambda pool, taken, allowed: (min(allowed), 0))
    return cluster, calls


def _lost() -> _Service:
    return _Service("rollout-0", "rollout", None, "rollout_pool", 0, info={"node_id": "dead"})


def test_the_lost_node_is_avoided_and_a_failed_start_tried_again() -> None:
    cluster, calls = _cluster(fails=2)
    cluster._replace_rollout(None, _lost())
    assert calls.count(("avoid", "dead")) == 3 and calls.count(("start", 1)) == 3
    assert cluster.events["replaced"] == 1 and cluster.events["replacement_failed"] == 0


def test_after_its_tries_the_replacement_is_given_up_once() -> None:
    cluster, calls = _cluster(fails=99)
    cluster._replace_rollout(None, _lost())
    assert calls.count(("start", 1)) == RayCluster.REPLACE_TRIES
    assert cluster.events["replacement_failed"] == 1 and cluster.events["replaced"] == 0
