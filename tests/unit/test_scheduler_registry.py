"""Registry semantics with a fake clock, and the scheduler core around it."""

from __future__ import annotations

import threading

import pytest

from rlfleet.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
)
from rlfleet.scheduler.placement import Device, NodeInventory, PlacementError
from rlfleet.scheduler.registry import (
    Registry,
    SchedulerCore,
    ServiceLoad,
    ServiceSpec,
    ServiceState,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def spec(role: str = "rollout", port: int = 1, **kw: object) -> ServiceSpec:
    return ServiceSpec(role=role, address=f"127.0.0.1:{port}", node="n0", **kw)  # type: ignore[arg-type]


def test_register_assigns_ids_per_role() -> None:
    reg = Registry(clock=Clock())
    a = reg.register(spec("rollout", 1))
    b = reg.register(spec("rollout", 2))
    c = reg.register(spec("trainer", 3))
    assert [a.service_id, b.service_id, c.service_id] == ["rollout-1", "rollout-2", "trainer-1"]
    assert a.state is ServiceState.ALIVE
    assert [e.service_id for e in reg.list_services("rollout")] == ["rollout-1", "rollout-2"]
    assert len(reg.list_services()) == 3


def test_missed_heartbeats_mark_dead_and_a_heartbeat_revives() -> None:
    clock = Clock()
    reg = Registry(heartbeat_interval_s=1.0, missed_heartbeats=3, clock=clock)
    sid = reg.register(spec()).service_id
    clock.now += 2.9
    assert reg.heartbeat(sid, ServiceLoad(queue_depth=4, tokens_per_second=12.5, weight_version=3))
    clock.now += 3.0
    entry = reg.get(sid)
    assert entry is not None and entry.alive
    assert entry.load == ServiceLoad(4, 12.5, 3)
    clock.now += 0.1  # 3.1 s of silence > 3 x 1 s
    assert reg.expire() == [sid]
    assert reg.get(sid).state is ServiceState.DEAD  # type: ignore[union-attr]
    assert reg.list_services(alive_only=True) == []
    assert reg.heartbeat(sid)  # known, and alive again
    assert reg.get(sid).alive  # type: ignore[union-attr]


def test_dead_entries_are_forgotten_and_unknown_ids_say_so() -> None:
    clock = Clock()
    reg = Registry(
        heartbeat_interval_s=1.0, missed_heartbeats=1, forget_dead_after_s=10, clock=clock
    )
    sid = reg.register(spec()).service_id
    clock.now += 2
    assert reg.list_services()[0].state is ServiceState.DEAD
    clock.now += 11
    assert reg.list_services() == []
    assert reg.heartbeat(sid) is False


def test_deregister_and_reregister() -> None:
    reg = Registry(clock=Clock())
    sid = reg.register(spec(port=1)).service_id
    assert reg.deregister(sid) is True
    assert reg.deregister(sid) is False
    # A service asking for its old id (scheduler restarted) keeps it.
    again = reg.register(spec(port=1, service_id="rollout-9"))
    assert again.service_id == "rollout-9"
    # Registering again at the same address replaces the entry and keeps the id.
    replaced = reg.register(spec(port=1, pid=42))
    assert replaced.service_id == "rollout-9" and len(reg.list_services()) == 1
    assert reg.list_services()[0].spec.pid == 42


def test_register_validation() -> None:
    reg = Registry(clock=Clock())
    with pytest.raises(InvalidArgument, match="cannot register"):
        reg.register(spec("critic"))
    with pytest.raises(InvalidArgument, match="cannot register"):
        reg.register(spec("scheduler"))
    with pytest.raises(InvalidArgument, match="address"):
        reg.register(ServiceSpec(role="reward", address=""))
    reg.register(spec("trainer", 5, service_id="x-1"))
    with pytest.raises(InvalidArgument, match="belongs to a trainer"):
        reg.register(spec("rollout", 6, service_id="x-1"))


def test_registry_is_thread_safe() -> None:
    reg = Registry(clock=Clock())

    def work(base: int) -> None:
        for i in range(50):
            sid = reg.register(spec(port=base + i)).service_id
            reg.heartbeat(sid)

    threads = [threading.Thread(target=work, args=(1000 * t + 1,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [e.service_id for e in reg.list_services()]
    assert len(ids) == 200 and len(set(ids)) == 200


def test_core_training_status_and_weight_version() -> None:
    core = SchedulerCore(Registry(clock=Clock()))
    assert core.training_status().state == "idle"
    core.set_training_status(state="running", total_steps=10)
    status = core.set_training_status(global_step=3, weight_version=3, metrics={"reward": 0.5})
    assert (status.state, status.global_step, status.total_steps) == ("running", 3, 10)
    assert dict(status.metrics) == {"reward": 0.5} and core.weight_version == 3
    with pytest.raises(InvalidArgument):
        core.set_training_status(state="exploded")  # type: ignore[arg-type]


def test_core_plans_against_registered_devices_and_binds_services() -> None:
    core = SchedulerCore(Registry(clock=Clock()), device="cpu", nodes=[])
    core.register(spec("trainer", 1, devices=(Device("cpu", 0),), capabilities={"roles": "actor"}))
    core.register(spec("rollout", 2, devices=(Device("cpu", 1),)))
    with pytest.raises(FailedPrecondition, match="no placement yet"):
        core.placement()
    placement = core.plan(
        {"train_pool": [1], "rollout_pool": [1]},
        {"actor": "train_pool", "critic": "train_pool", "rollout": "rollout_pool"},
    )
    by_role = {a.role: a for a in placement.assignments}
    assert by_role["actor"].service_id == "trainer-1"
    assert [d.index for d in by_role["actor"].devices] == [0]
    assert by_role["rollout"].service_id == "rollout-1"
    assert [d.index for d in by_role["rollout"].devices] == [1]
    assert by_role["critic"].service_id == ""  # the trainer does not serve the critic
    assert not placement.colocated
    assert core.placement().plan == placement.plan
    with pytest.raises(PlacementError, match="rollout_pool needs 2 cpu cores on node 0, only 1"):
        core.plan(
            {"train_pool": [1], "rollout_pool": [2]},
            {"actor": "train_pool", "rollout": "rollout_pool"},
        )


def test_core_falls_back_to_given_nodes() -> None:
    node = NodeInventory("here", (Device("cpu", 0), Device("cpu", 1)))
    core = SchedulerCore(Registry(clock=Clock()), nodes=[node])
    placement = core.plan({"global_pool": [2]}, {"actor": "global_pool", "rollout": "global_pool"})
    assert placement.colocated
    assert all(a.service_id == "" for a in placement.assignments)


def test_entries_are_owned_by_their_lease() -> None:
    reg = Registry(clock=Clock())
    mine = reg.register(spec("rollout", 7), caller="rollout")
    assert mine.lease
    # Another replica (same role, no lease) can neither take its address nor act for it.
    with pytest.raises(PermissionDenied, match="another owner"):
        reg.register(spec("rollout", 7), caller="rollout")
    with pytest.raises(PermissionDenied, match="another owner"):
        reg.register(spec("rollout", 8, service_id=mine.service_id), caller="rollout")
    with pytest.raises(PermissionDenied, match="lease"):
        reg.heartbeat(mine.service_id, caller="rollout")
    with pytest.raises(PermissionDenied, match="lease"):
        reg.deregister(mine.service_id, lease="guess", caller="rollout")
    assert reg.heartbeat(mine.service_id, lease=mine.lease, caller="rollout")
    # Its owner re-registers with the lease; the driver may act on any entry.
    again = reg.register(spec("rollout", 7), caller="rollout", lease=mine.lease)
    assert again.service_id == mine.service_id
    assert reg.deregister(mine.service_id, caller="driver")


def test_service_roles_register_only_themselves_and_bounds_hold() -> None:
    reg = Registry(clock=Clock(), max_services=2)
    with pytest.raises(PermissionDenied, match="only register itself"):
        reg.register(spec("trainer", 1), caller="rollout")
    with pytest.raises(InvalidArgument, match="devices"):
        reg.register(
            spec("rollout", 1, devices=tuple(Device("cpu", i, "cpu") for i in range(2000)))
        )
    with pytest.raises(InvalidArgument, match="characters"):
        reg.register(spec("rollout", 1, capabilities={"k": "v" * 10_000}))
    with pytest.raises(InvalidArgument, match="host:port"):
        reg.register(spec("rollout", 1, metrics_address="169.254.169.254"))
    reg.register(spec("rollout", 1))
    reg.register(spec("rollout", 2))
    with pytest.raises(ResourceExhausted, match="at most 2"):
        reg.register(spec("rollout", 3))


def test_text_fields_are_bounded_each() -> None:
    reg = Registry(clock=Clock())
    long = "a" * 300
    cases = {
        "info.address": ServiceSpec(role="rollout", address=f"{long}:1"),
        "info.node": ServiceSpec(role="rollout", address="127.0.0.1:1", node=long),
        "info.service_id": spec("rollout", 1, service_id=long),
        "info.devices[0].name": spec("rollout", 1, devices=(Device("cpu", 0, long),)),
    }
    for field_name, s in cases.items():
        with pytest.raises(InvalidArgument) as info:
            reg.register(s)
        assert info.value.field == field_name


def _fattest(port: int, host: str = "127.0.0.1") -> ServiceSpec:
    """An entry with every field at its bound."""
    return ServiceSpec(
        role="rollout",
        address=f"{host}:{port}",
        node="n" * 256,
        metrics_address=f"{host}:{port}",
        devices=tuple(Device("cuda", i, "d" * 256, 2**62) for i in range(1024)),
        capabilities={f"{i:0>256}": "v" * 1024 for i in range(64)},
    )


def test_a_full_registry_still_lists_in_one_answer() -> None:
    """Entries at every bound fill the byte budget before the entry count: the next
    one is RESOURCE_EXHAUSTED, and the full registry's ListServices answer stays far
    below gRPC's 64 MiB (the estimate bounds the real protobuf size)."""
    from rlfleet.scheduler.registry import MAX_REGISTRY_BYTES, spec_bytes
    from rlfleet.scheduler.serde import entry_to_proto
    from rlfleet.v1 import scheduler_pb2

    reg = Registry(clock=Clock())
    port = 1
    with pytest.raises(ResourceExhausted, match="bytes"):
        while port < 1000:
            reg.register(_fattest(port), caller="driver")
            port += 1
    entries = reg.list_services()
    assert 0 < len(entries) == port - 1 < 1000
    answer = scheduler_pb2.ListServicesResponse(services=[entry_to_proto(e) for e in entries])
    assert answer.ByteSize() <= MAX_REGISTRY_BYTES + 256 * len(entries) < 32 << 20
    assert all(entry_to_proto(e).info.ByteSize() <= spec_bytes(e.spec) for e in entries)


def test_a_service_credential_holds_a_bounded_number_of_entries_per_host() -> None:
    from rlfleet.scheduler.registry import MAX_PER_HOST

    reg = Registry(clock=Clock())
    for port in range(1, MAX_PER_HOST + 1):
        reg.register(spec("rollout", port), caller="rollout")
    with pytest.raises(ResourceExhausted) as info:
        reg.register(spec("rollout", MAX_PER_HOST + 1), caller="rollout")
    assert info.value.field == "info.address" and "127.0.0.1" in str(info.value)
    # Another host, and the driver (which launches services), still may.
    reg.register(ServiceSpec(role="rollout", address="127.0.0.2:1", node="n1"), caller="rollout")
    reg.register(spec("rollout", MAX_PER_HOST + 1), caller="driver")


def test_one_service_credential_cannot_fill_the_registry() -> None:
    """The fattest entries a rollout credential may register on its host stop at
    MAX_HOST_BYTES there; rollout credentials on many hosts stop short of the reserve,
    so the driver still registers (a restarted trainer, say)."""
    from rlfleet.scheduler.registry import (
        MAX_HOST_BYTES,
        MAX_REGISTRY_BYTES,
        PRIVILEGED_RESERVE_BYTES,
        spec_bytes,
    )

    reg = Registry(clock=Clock())
    port = 1
    with pytest.raises(ResourceExhausted) as info:
        while port < 1000:
            reg.register(_fattest(port), caller="rollout")
            port += 1
    assert info.value.field == "info.address" and "127.0.0.1" in str(info.value)
    held = sum(spec_bytes(e.spec) for e in reg.list_services())
    assert held <= MAX_HOST_BYTES < held + spec_bytes(_fattest(port))
    # Many hosts (one stolen credential on each) stop at the reserve, not at the top.
    hosts = iter(f"127.0.{i // 250}.{i % 250 + 2}" for i in range(10_000))
    with pytest.raises(ResourceExhausted) as info:
        for host in hosts:
            for p in range(1, 3):
                reg.register(_fattest(p, host), caller="rollout")
    assert "for a rollout credential" in str(info.value) and info.value.field == "info"
    held = sum(spec_bytes(e.spec) for e in reg.list_services())
    assert held <= MAX_REGISTRY_BYTES - PRIVILEGED_RESERVE_BYTES
    reg.register(ServiceSpec(role="trainer", address="127.0.0.1:9999"), caller="driver")


def test_status_metrics_and_heartbeat_load_are_bounded() -> None:
    """The training status is kept and sent to every GetTrainingStatus: its metrics
    are bounded in count and name length; a heartbeat's tokens/s feeds the autoscaler
    (finite, >= 0)."""
    from rlfleet.scheduler.registry import MAX_METRIC_NAME_CHARS, MAX_STATUS_METRICS

    core = SchedulerCore(Registry(clock=Clock()))
    with pytest.raises(InvalidArgument) as info:
        core.set_training_status(metrics={f"m{i}": 1.0 for i in range(MAX_STATUS_METRICS + 1)})
    assert (info.value.field, info.value.code) == ("metrics", "TOO_LARGE")
    with pytest.raises(InvalidArgument) as info:
        core.set_training_status(metrics={"x" * (MAX_METRIC_NAME_CHARS + 1): 1.0})
    assert info.value.field.startswith("metrics[") and info.value.code == "TOO_LARGE"
    core.set_training_status(metrics={f"m{i}": float("nan") for i in range(MAX_STATUS_METRICS)})

    reg = Registry(clock=Clock())
    sid = reg.register(spec()).service_id
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(InvalidArgument) as info:
            reg.heartbeat(sid, ServiceLoad(tokens_per_second=bad))
        assert info.value.field == "load.tokens_per_second"
    assert reg.heartbeat(sid, ServiceLoad(tokens_per_second=12.5))

    # A service on several nodes (a trainer's ranks) lists each node's devices: one
    # index may repeat.
    reg.register(spec(port=8, devices=[Device("cpu", 0), Device("cpu", 1), Device("cpu", 0)]))
