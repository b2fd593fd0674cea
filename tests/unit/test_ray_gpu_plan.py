"""How the Ray launcher spends a pool's GPUs (``GpuPlan``): one owner per pool asks
Ray for them, colocated services share the owner's, rollout replicas fit the GPUs
they need, and one more than fits is refused instead of waiting forever."""

from __future__ import annotations

from typing import Any

import pytest

from rlfleet.common.config import config_from_dict
from rlfleet.launch.cluster import ServiceStartError
from rlfleet.launch.ray_cluster import GpuPlan


def _config(**sections: Any) -> Any:
    raw: dict[str, Any] = {
        "actor": {"model_path": "m"},
        "trainer": {"device": "cuda"},
        "algorithm": {"adv_estimator": "grpo"},
        "rollout": {"n": 4},
        "data": {"train_batch_size": 64},
    }
    raw["actor"]["ppo_mini_batch_size"] = 16
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return config_from_dict(raw)


def _fill(plan: GpuPlan, pool: str, count: int) -> list[tuple[int, int]]:
    taken: list[tuple[int, int]] = []
    for _ in range(count):
        taken.append(plan.place_rollout(pool, taken))
    return taken


def test_verls_colocated_two_nodes_of_eight() -> None:
    cfg = _config(trainer={"nnodes": 2, "n_gpus_per_node": 8})
    plan = GpuPlan(cfg)
    [pool] = cfg.resource_pools
    assert plan.owner(pool) == "trainer"
    assert plan.request("trainer", pool) == 1.0 and plan.request("rollout", pool) == 0.0
    assert plan.rank_bundles(pool, cfg.world_size("actor")) == [0] * 8 + [1] * 8
    places = _fill(plan, pool, cfg.rollout_replicas())
    assert len(places) == 16
    assert sorted(places) == [(b, s) for b in (0, 1) for s in range(8)]
    assert places[:4] == [(0, 0), (1, 0), (0, 1), (1, 1)]  # spread over the nodes
    with pytest.raises(ServiceStartError, match="no room"):
        plan.place_rollout(pool, places)
    # Replica in slot 3 of a node uses the trainer's 4th GPU there.
    owned = ["4", "5", "6", "7", "0", "1", "2", "3"]
    assert plan.shared_devices("rollout", 3, owned, "rollout-6") == ["7"]
    assert plan.shared_devices("reward", 0, owned, "reward") == ["4"]


def test_disaggregated_rollout_with_tensor_parallel_two() -> None:
    cfg = _config(
        resource_pools={"train_pool": [8], "rollout_pool": [8]},
        mapping={"actor": "train_pool", "rollout": "rollout_pool"},
        rollout={"tensor_parallel_size": 2, "engine": "vllm"},
    )
    plan = GpuPlan(cfg)
    assert plan.owner("rollout_pool") == "rollout"
    assert plan.request("rollout", "rollout_pool") == 2.0
    assert plan.request("trainer", "train_pool") == 1.0
    assert cfg.rollout_replicas() == 4 and plan.rollout_room("rollout_pool") == [4]
    places = _fill(plan, "rollout_pool", 4)
    assert places == [(0, 0), (0, 1), (0, 2), (0, 3)]
    with pytest.raises(ServiceStartError) as info:
        plan.place_rollout("rollout_pool", places)
    assert info.value.field == "rollout.replicas" and "8" in str(info.value)
    # A slot freed by a replica scaled away is the one given again.
    assert plan.place_rollout("rollout_pool", [places[0], places[2], places[3]]) == (0, 1)


def test_colocated_tensor_parallel_replicas_take_consecutive_gpus() -> None:
    cfg = _config(
        trainer={"nnodes": 1, "n_gpus_per_node": 8},
        rollout={"tensor_parallel_size": 4, "engine": "vllm"},
    )
    plan = GpuPlan(cfg)
    [pool] = cfg.resource_pools
    assert _fill(plan, pool, cfg.rollout_replicas()) == [(0, 0), (0, 1)]
    owned = [str(g) for g in range(8)]
    assert plan.shared_devices("rollout", 1, owned, "rollout-1") == ["4", "5", "6", "7"]
    with pytest.raises(ServiceStartError, match="needs 4 GPU"):
        plan.shared_devices("rollout", 1, owned[:6], "rollout-1")


def test_on_cpu_nothing_is_counted_and_replicas_spread() -> None:
    cfg = config_from_dict(
        {
            "actor": {"model_path": "m"},
            "trainer": {"device": "cpu"},
            "algorithm": {"adv_estimator": "grpo"},
            "resource_pools": {"train_pool": [2], "rollout_pool": [1, 1]},
            "mapping": {"actor": "train_pool", "rollout": "rollout_pool"},
            "rollout": {"replicas": 5, "n": 2},
        }
    )
    plan = GpuPlan(cfg)
    assert plan.request("rollout", "rollout_pool") == 0.0
    assert plan.request("trainer", "train_pool") == 0.0
    assert plan.rollout_room("rollout_pool") is None
    assert [b for b, _ in _fill(plan, "rollout_pool", 5)] == [0, 1, 0, 1, 0]
    assert plan.rank_bundles("train_pool", 1) == [0]


def test_the_ray_launcher_refuses_to_run_without_authentication(tmp_path: Any) -> None:
    """Services on Ray listen on their nodes' addresses: ``security.auth=false`` is
    refused before Ray is joined or started."""
    ray = pytest.importorskip("ray")
    from rlfleet.common.auth import CredentialError
    from rlfleet.common.config import ConfigError
    from rlfleet.launch.ray_cluster import RayCluster

    was = ray.is_initialized()
    # The config check refuses it at load, naming the key (exit 2, nothing created)...
    with pytest.raises(ConfigError, match=r"security\.auth: false is refused"):
        _config(trainer={"device": "cpu"}, security={"auth": False}, launcher="ray")
    # ... and the launcher itself, given such a config all the same.
    ok = _config(trainer={"device": "cpu"}, launcher="ray")
    cfg = ok.model_copy(update={"security": ok.security.model_copy(update={"auth": False})})
    with pytest.raises(CredentialError, match=r"security\.auth=false is refused"):
        RayCluster(cfg, tmp_path / "run").start(timeout_s=30)
    assert ray.is_initialized() == was


def test_pool_bundles_follow_ray_pool_strategy() -> None:
    from rlfleet.launch.ray_cluster import pool_bundles

    assert pool_bundles([4, 4], "cuda") == ([{"GPU": 4.0}, {"GPU": 4.0}], "STRICT_SPREAD")
    assert pool_bundles([4, 4], "cuda", "PACK")[1] == "PACK"
    assert pool_bundles([2], "cpu", "PACK") == ([{"CPU": 2.0}], "STRICT_PACK")
    cfg = _config(trainer={"device": "cpu"}, ray={"pool_strategy": "SPREAD"}, launcher="ray")
    assert cfg.ray.pool_strategy == "SPREAD"
    with pytest.raises(Exception, match="pool_strategy"):
        _config(trainer={"device": "cpu"}, ray={"pool_strategy": "ANYWHERE"})


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("ray://head:10001", "Ray Client addresses are not supported"),
        ("head", "expected auto or host:port"),
        ("head:0", "expected auto or host:port"),
        ("head:70000", "expected auto or host:port"),
        (":6379", "expected auto or host:port"),
    ],
)
def test_ray_address_is_auto_or_host_port(address: str, why: str) -> None:
    with pytest.raises(Exception, match=why):
        _config(trainer={"device": "cpu"}, ray={"address": address}, launcher="ray")
    assert _config(ray={"address": "head.example:6379"}).ray.address == "head.example:6379"
    assert _config(ray={"address": "[::1]:6379"}).ray.address == "[::1]:6379"


def test_driver_joins_a_loopback_head_as_a_loopback_node() -> None:
    """With a head on 127.0.0.0/8 the driver is node 127.0.0.1 (Ray's own guess would
    be the address of the interface towards the internet, where no raylet runs)."""
    from rlfleet.launch.ray_cluster import driver_ip

    assert driver_ip("127.0.0.1:6379") == "127.0.0.1"
    assert driver_ip("127.5.6.7:6379") == "127.0.0.1"
    assert driver_ip("localhost:6379") == "127.0.0.1"
    assert driver_ip("[::1]:6379") == "::1"
