"""A lost rollout replica's replacement on Ray (no Ray here: the cluster's placing and
starting are stand-ins, since this tests only the order of tries; the real ones run
in tests/integration/test_ray_cluster.py): the node it was lost on is avoided, and a
start that fails (Ray still counted the dead node alive) is tried again."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from rlfleet.launch.ray_cluster import RayCluster, _Service


def _cluster(fails: int) -> tuple[RayCluster, list[Any]]:
    cluster = object.__new__(RayCluster)
    cluster.REPLACE_PAUSE_S = 0.0
    cluster._lock = threading.RLock()  # as RayCluster's
    cluster._services = []
    cluster._stopped = False
    cluster.events = Counter()
    cluster._replacing_names = {"rollout-0"}  # counted by _lost before the thread starts
    cluster._restarting = set()
    cluster._held = {}
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
    assert not cluster._replacing_names  # no longer counted as the fleet's


def test_after_its_tries_the_replacement_is_given_up_once() -> None:
    cluster, calls = _cluster(fails=99)
    cluster._replace_rollout(None, _lost())
    assert calls.count(("start", 1)) == RayCluster.REPLACE_TRIES
    assert cluster.events["replacement_failed"] == 1 and cluster.events["replaced"] == 0
    assert not cluster._replacing_names


def test_replacements_are_due_only_for_lost_replicas_within_the_budget() -> None:
    """The launchers' rule for a desired count left short (local and Ray alike): a
    scale-up that was refused (nothing lost) is not retried as a replacement, which
    spent the restart budget before; lost replicas are replaced at most
    services.max_restarts times in all, and not while a failed start's wait runs."""
    import time

    from rlfleet.launch.cluster import replacements_due

    config = SimpleNamespace(services=SimpleNamespace(max_restarts=3))

    def due(owned: int, desired: int, lost: int, started: int, retry_at: float = 0.0) -> int:
        return replacements_due(
            owned, desired, lost=lost, started=started, config=config, retry_at=retry_at
        )  # type: ignore[arg-type]

    assert due(1, 4, lost=0, started=0) == 0  # short by a refusal: nothing lost
    assert due(2, 3, lost=1, started=0) == 1
    assert due(1, 3, lost=2, started=1) == 1  # one of the two replaced already
    assert due(0, 8, lost=8, started=1) == 2  # the budget: 3 in all
    assert due(3, 3, lost=2, started=0) == 0  # not short
    assert due(2, 3, lost=1, started=0, retry_at=time.monotonic() + 60) == 0


def _gpu_cluster() -> tuple[RayCluster, list[Any]]:
    """Two nodes of 2 GPUs for rollout, one GPU a replica: four places in all, with the
    real placement (GpuPlan); starting is a stand-in that records where it starts."""
    from rlfleet.common.config import config_from_dict
    from rlfleet.launch.ray_cluster import GpuPlan

    cfg = config_from_dict(
        {
            "actor": {"model_path": "m", "ppo_mini_batch_size": 16},
            "trainer": {"device": "cuda"},
            "algorithm": {"adv_estimator": "grpo"},
            "rollout": {"n": 4},
            "data": {"train_batch_size": 64},
            "resource_pools": {"train_pool": [2], "rollout_pool": [2, 2]},
            "mapping": {"actor": "train_pool", "rollout": "rollout_pool"},
        }
    )
    cluster, _ = _cluster(fails=0)
    cluster.config = cfg
    cluster.gpus = GpuPlan(cfg)
    cluster._live_bundles = lambda ray, pool, avoid=None: {0, 1}  # type: ignore[method-assign]
    started: list[Any] = []

    def relaunch(ray: Any, svc: _Service, *, timeout_s: float) -> _Service:
        started.append((svc.bundle, svc.slot))
        with cluster._lock:
            cluster._services.append(svc)  # in the fleet, as _launch does
        return svc

    cluster._relaunch = relaunch  # type: ignore[method-assign]
    return cluster, started


def _replica(name: str, bundle: int, slot: int) -> _Service:
    return _Service(
        name,
        "rollout",
        None,
        "rollout_pool",
        bundle,
        slot=slot,
        info={},
        launch={"config_text": ""},
    )


def test_a_replacement_is_not_placed_on_a_restarting_replicas_gpu() -> None:
    """rollout-1 is between its restart's stop and start (out of the running list, its
    place held); rollout-0 and rollout-2 run; rollout-3 was lost. Its replacement must
    take the one free place, not rollout-1's. (Before: the restarting one's GPU was
    given away, and two replicas came up on one GPU.)"""
    cluster, started = _gpu_cluster()
    cluster._services = [_replica("rollout-0", 0, 0), _replica("rollout-2", 1, 0)]
    cluster._held = {"rollout-1": [(0, 1)]}  # what a restart holds while it runs
    cluster._replace_rollout(None, _replica("rollout-3", 1, 1))
    assert started == [(1, 1)]
    assert cluster._held == {"rollout-1": [(0, 1)]}  # the replacement's own place let go


def test_places_chosen_for_starting_replicas_are_held_until_they_run() -> None:
    """Two placements at once (a scale-up and a replacement): the second does not get
    the place the first chose but has not started in yet."""
    cluster, _ = _gpu_cluster()
    cluster._services = [_replica("rollout-0", 0, 0)]
    first = cluster._rollout_places("rollout_pool", 2, "scale-up")
    second = cluster._rollout_places("rollout_pool", 1, "replacement")
    assert len(set(first + second)) == 3 and (0, 0) not in first + second
    cluster._unhold("scale-up")
    cluster._unhold("replacement")
    assert cluster._held == {}


def _record_starts(cluster: RayCluster) -> list[tuple[int, int]]:
    """Starting a new replica only records its place (a stand-in for the actor)."""
    started: list[tuple[int, int]] = []

    def launch(ray: Any, pool: str, place: tuple[int, int], *rest: Any) -> _Service:
        started.append(place)
        return _replica(f"rollout-new-{len(started)}", *place)

    cluster._launch_rollout = launch  # type: ignore[method-assign]
    cluster._finish = lambda ray, svc, deadline: None  # type: ignore[method-assign]
    return started


def test_a_scale_up_counts_the_replicas_that_are_restarting(tmp_path: Any) -> None:
    """Scaling to the pool's four places while one replica restarts starts one new
    replica, on the one free place: the restarting one comes back by itself. (Before
    holding places: two, one on the restarting one's GPU; holding them without
    counting: none, refused for want of room.)"""
    cluster, _ = _gpu_cluster()
    cluster.run_dir = tmp_path
    cluster._services = [_replica("rollout-0", 0, 0), _replica("rollout-2", 1, 0)]
    cluster._restarting = {"rollout-1"}
    cluster._held = {"rollout-1": [(0, 1)]}
    cluster._next_rollout = 3
    started = _record_starts(cluster)
    cluster.scale_rollout(4)
    assert started == [(1, 1)]
    assert cluster._held == {"rollout-1": [(0, 1)]}  # the scale-up's own hold let go
    cluster.scale_rollout(3)  # two run, one restarts: nothing to start
    assert started == [(1, 1)]


def test_a_scale_counts_a_returning_replica_once_and_scales_down_around_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart that is starting is in the running list and still marked restarting:
    counted once, so scaling to four starts the one missing replica (not none). A
    scale-down while one restarts stops only as many running ones as the fleet has
    too many, counting the one coming back. (Ray's calls are stand-ins here: the
    real scale-down runs in tests/integration/test_ray_cluster.py.)"""
    cluster, _ = _gpu_cluster()
    cluster.run_dir = tmp_path
    cluster._replacing_names = set()
    cluster._next_rollout = 4
    cluster._services = [_replica(f"rollout-{i}", i // 2, i % 2) for i in range(3)]
    cluster._restarting = {"rollout-1"}  # its new process is in the list, starting
    started = _record_starts(cluster)
    cluster.scale_rollout(4)
    assert started == [(1, 1)]

    cluster._deregister = lambda address: None  # type: ignore[method-assign]
    cluster.grace_s = 0.0
    cluster._services = [_replica(f"rollout-{i}", i // 2, i % 2) for i in (0, 2, 3)]
    cluster._restarting = {"rollout-1"}  # out of the list: between stop and start
    for svc in cluster._services:
        svc.actor = SimpleNamespace(stop=SimpleNamespace(remote=lambda grace: None))
    monkeypatch.setitem(
        sys.modules, "ray", SimpleNamespace(get=lambda *a, **k: None, kill=lambda actor: None)
    )
    cluster.scale_rollout(3)  # 3 running + 1 restarting: one too many
    assert cluster.rollout_replicas() == ["rollout-0", "rollout-2"]  # the newest left
    assert cluster.events["scaled_down"] == 1
