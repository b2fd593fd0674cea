"""Resource pools and placement: colocated, disaggregated, refusals that name the shortfall."""

from __future__ import annotations

import pytest

from rlfleet.common.errors import InvalidArgument
from rlfleet.scheduler.placement import (
    Device,
    NodeInventory,
    PlacementError,
    cuda_visible_devices,
    local_node,
    plan_placement,
    split_devices,
)

DISAGG = {
    "actor": "train_pool",
    "critic": "train_pool",
    "ref": "train_pool",
    "rollout": "rollout_pool",
    "reward_model": None,
}


def cpu_node(n: int, name: str = "n0") -> NodeInventory:
    return NodeInventory(name, tuple(Device("cpu", i) for i in range(n)))


def gpu_node(n: int, name: str) -> NodeInventory:
    cpus = tuple(Device("cpu", i) for i in range(8))
    return NodeInventory(name, cpus + tuple(Device("cuda", i) for i in range(n)))


def cores(devices: tuple[Device, ...]) -> list[int]:
    return [d.index for d in devices]


def test_disaggregated_pools_get_disjoint_cores_on_two_cores() -> None:
    plan = plan_placement(
        {"train_pool": [1], "rollout_pool": [1]}, DISAGG, device="cpu", nodes=[cpu_node(2)]
    )
    assert plan.mode == "disaggregated" and not plan.colocated
    assert cores(plan.devices_of("actor")) == [0]
    assert cores(plan.devices_of("rollout")) == [1]
    assert plan.pools["train_pool"].roles == ("actor", "critic", "ref")
    assert plan.role_pool["critic"] == "train_pool"


def test_one_global_pool_is_colocated_and_shares_devices() -> None:
    mapping = dict.fromkeys(("actor", "critic", "ref", "rollout"), "global_pool")
    plan = plan_placement({"global_pool": [2]}, mapping, device="cpu", nodes=[cpu_node(2)])
    assert plan.mode == "colocated"
    assert plan.devices_of("actor") == plan.devices_of("rollout")
    assert cores(plan.devices_of("rollout")) == [0, 1]


def test_refusal_names_pool_and_shortfall() -> None:
    with pytest.raises(PlacementError) as info:
        plan_placement(
            {"train_pool": [2], "rollout_pool": [4]}, DISAGG, device="cpu", nodes=[cpu_node(4)]
        )
    assert str(info.value) == (
        "placement refused: pool rollout_pool needs 4 cpu cores on node 0, "
        "only 2 free after train_pool took 2"
    )
    assert info.value.status == "FAILED_PRECONDITION"
    assert info.value.code == "PLACEMENT_REFUSED"


def test_refusal_of_the_first_pool_says_what_the_node_has() -> None:
    with pytest.raises(
        PlacementError,
        match=r"pool train_pool needs 3 cpu cores on node 0, "
        r"only 2 free \(n0 has 2 cpu cores\)",
    ):
        plan_placement(
            {"train_pool": [3], "rollout_pool": [1]}, DISAGG, device="cpu", nodes=[cpu_node(2)]
        )


def test_every_shortfall_is_reported_at_once() -> None:
    with pytest.raises(PlacementError) as info:
        plan_placement(
            {"train_pool": [3], "rollout_pool": [3]}, DISAGG, device="cpu", nodes=[cpu_node(2)]
        )
    assert len(info.value.shortfalls) == 2
    assert "train_pool" in info.value.shortfalls[0] and "rollout_pool" in info.value.shortfalls[1]


def test_gpu_pools_over_two_nodes() -> None:
    nodes = [gpu_node(4, "a"), gpu_node(4, "b")]
    plan = plan_placement(
        {"train_pool": [2, 2], "rollout_pool": [2, 2]}, DISAGG, device="cuda", nodes=nodes
    )
    train = plan.pools["train_pool"]
    assert [(i, name, cores(devs)) for i, name, devs in train.nodes] == [
        (0, "a", [0, 1]),
        (1, "b", [0, 1]),
    ]
    assert cores(plan.pools["rollout_pool"].devices_on("b")) == [2, 3]
    assert all(d.kind == "cuda" for d in plan.devices_of("rollout"))


def test_gpu_refusal_and_missing_nodes() -> None:
    nodes = [gpu_node(4, "a")]
    with pytest.raises(PlacementError) as info:
        plan_placement(
            {"train_pool": [4], "rollout_pool": [2], "extra": [1, 1]},
            {**DISAGG, "reward_model": "extra"},
            device="cuda",
            nodes=nodes,
        )
    assert info.value.shortfalls == [
        "pool rollout_pool needs 2 GPUs on node 0, only 0 free after train_pool took 4",
        "pool extra spans 2 nodes, only 1 available",
    ]


def test_fold_nodes_puts_every_entry_on_one_machine() -> None:
    plan = plan_placement(
        {"train_pool": [1], "rollout_pool": [1, 1]},
        DISAGG,
        device="cpu",
        nodes=[cpu_node(3)],
        fold_nodes=True,
    )
    rollout = plan.pools["rollout_pool"]
    assert [cores(devs) for _, _, devs in rollout.nodes] == [[1], [2]]
    with pytest.raises(PlacementError, match="rollout_pool needs 1 cpu core on node 0, only 0"):
        plan_placement(
            {"train_pool": [1], "rollout_pool": [1, 1]},
            DISAGG,
            device="cpu",
            nodes=[cpu_node(2)],
            fold_nodes=True,
        )


def test_unknown_pool_and_unused_pools() -> None:
    with pytest.raises(InvalidArgument, match=r"mapping\.rollout: no pool 'nope'"):
        plan_placement(
            {"train_pool": [1]}, {**DISAGG, "rollout": "nope"}, device="cpu", nodes=[cpu_node(2)]
        )
    plan = plan_placement(
        {"train_pool": [1], "rollout_pool": [1], "reward_pool": [8]},
        {**DISAGG, "reward_model": "reward_pool"},
        device="cpu",
        nodes=[cpu_node(2)],
        roles=("actor", "rollout"),  # reward model not enabled: its pool takes nothing
    )
    assert plan.unused_pools == ("reward_pool",)
    assert "critic" not in plan.role_pool


def test_split_devices() -> None:
    devs = tuple(Device("cpu", i) for i in range(5))
    assert [cores(g) for g in split_devices(devs, 2)] == [[0, 1, 2], [3, 4]]
    assert [cores(g) for g in split_devices(devs[:1], 3)] == [[0], [0], [0]]


def test_local_node_reads_affinity_and_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    node = local_node("cuda", name="me")
    assert cores(node.of_kind("cuda")) == [2, 3]
    assert len(node.of_kind("cpu")) >= 1
    assert cuda_visible_devices(node.of_kind("cuda")) == "2,3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    assert cuda_visible_devices(local_node("cuda").of_kind("cuda")) == "GPU-abc"
    assert local_node("cpu").of_kind("cuda") == ()
