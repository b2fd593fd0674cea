"""The SchedulerService over real gRPC on 127.0.0.1 (port 0), plus its HTTP /sd and /metrics."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

import pytest

from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.common.rpc import create_server
from rlfleet.scheduler.client import RemoteSchedulerClient
from rlfleet.scheduler.placement import Device, NodeInventory
from rlfleet.scheduler.registry import (
    LIVENESS_CAPABILITY,
    LIVENESS_PROBE,
    Registry,
    SchedulerCore,
    ServiceLoad,
    ServiceSpec,
    ServiceState,
    TrainingStatus,
)
from rlfleet.scheduler.server import SchedulerServer, start_scheduler_server
from rlfleet.v1 import scheduler_pb2

pytestmark = pytest.mark.timeout(60)

NODE = NodeInventory("n0", (Device("cpu", 0), Device("cpu", 1)))


@pytest.fixture()
def server() -> Iterator[SchedulerServer]:
    core = SchedulerCore(
        Registry(heartbeat_interval_s=0.2, missed_heartbeats=2), device="cpu", nodes=[NODE]
    )
    with start_scheduler_server(core, metrics_port=0, probe_interval_s=0.1) as s:
        yield s


def test_register_heartbeat_list_deregister(server: SchedulerServer) -> None:
    server.core.set_training_status(weight_version=7)
    with RemoteSchedulerClient(server.address) as client:
        resp = client.register(
            ServiceSpec(
                role="rollout",
                address="127.0.0.1:1",
                node="n0",
                devices=(Device("cpu", 1),),
                capabilities={"engine": "hf"},
                metrics_address="127.0.0.1:2",
                pid=123,
            )
        )
        assert resp.service_id == "rollout-1"
        assert resp.heartbeat_interval_s == pytest.approx(0.2)
        assert resp.weight_version == 7
        assert client.heartbeat("rollout-1", ServiceLoad(3, 40.0, 7))
        assert not client.heartbeat("nobody")
        [entry] = client.list_services("rollout")
        assert entry.service_id == "rollout-1" and entry.state is ServiceState.ALIVE
        assert entry.spec.devices == (Device("cpu", 1),) and entry.spec.pid == 123
        assert entry.spec.capabilities == {"engine": "hf"}
        assert entry.load == ServiceLoad(3, 40.0, 7)
        assert client.list_services("trainer") == []
        client.deregister("rollout-1")
        client.deregister("rollout-1")  # idempotent
        assert client.list_services() == []


def test_in_process_and_remote_clients_agree(server: SchedulerServer) -> None:
    """One SchedulerClient protocol: the core in-process and the service over gRPC give
    the same answers to the same calls."""
    from rlfleet.scheduler.client import InProcessSchedulerClient, SchedulerClient
    from rlfleet.scheduler.registry import TrainingStatus

    server.core.register(ServiceSpec(role="rollout", address="127.0.0.1:1", node="n0"))
    local: SchedulerClient = InProcessSchedulerClient(server.core)
    with RemoteSchedulerClient(server.address) as remote:
        assert (
            [e.service_id for e in local.list_services("rollout", alive_only=True)]
            == [e.service_id for e in remote.list_services("rollout", alive_only=True)]
            == ["rollout-1"]
        )
        status = TrainingStatus(
            global_step=3, total_steps=10, weight_version=3, metrics={"m": 1.5}, state="running"
        )
        assert local.set_training_status(status) == remote.training_status() == status
        assert local.set_scale("rollout", 2)[0] == remote.scale("rollout")[0] == 2
        with pytest.raises(InvalidArgument):
            local.list_services("nope")  # type: ignore[arg-type]


def test_silent_service_goes_dead(server: SchedulerServer) -> None:
    with RemoteSchedulerClient(server.address) as client:
        client.register(ServiceSpec(role="rollout", address="127.0.0.1:1"))
        deadline = time.monotonic() + 5
        while client.list_services()[0].state is ServiceState.ALIVE:
            assert time.monotonic() < deadline, "not DEAD after 2 missed heartbeats"
            time.sleep(0.05)
        assert client.list_services(alive_only=True) == []


def test_probed_services_stay_alive_while_healthy(server: SchedulerServer) -> None:
    healthy = create_server([])
    probe = {LIVENESS_CAPABILITY: LIVENESS_PROBE}
    try:
        with RemoteSchedulerClient(server.address) as client:
            client.register(ServiceSpec(role="reward", address=healthy.address, capabilities=probe))
            client.register(ServiceSpec(role="trainer", address="127.0.0.1:9", capabilities=probe))
            time.sleep(1.0)  # 5 x the heartbeat interval
            states = {e.spec.role: e.state for e in client.list_services()}
            assert states == {"reward": ServiceState.ALIVE, "trainer": ServiceState.DEAD}
    finally:
        healthy.stop(0)


def test_an_openai_url_is_a_url_whoever_registers_it(server: SchedulerServer) -> None:
    """The driver (here: no auth, every caller privileged) is not held to its own host,
    but an openai_url it registers is still checked: agents are sent there."""
    with RemoteSchedulerClient(server.address) as client:
        for url in ("ftp://x", "http://nohostport", "not a url"):
            with pytest.raises(InvalidArgument) as info:
                client.register(
                    ServiceSpec(
                        role="rollout", address="127.0.0.1:7", capabilities={"openai_url": url}
                    )
                )
            assert info.value.field == "info.capabilities[openai_url]"
        client.register(
            ServiceSpec(
                role="rollout",
                address="127.0.0.1:8",
                capabilities={"openai_url": "http://127.0.0.1:9/v1"},
            )
        )


def test_plan_refuses_pools_and_roles_by_name(server: SchedulerServer) -> None:
    """A pool that lists no node, a role that does not exist, a mapping to a pool that
    is not there: refused by name (they were planned as nothing, or ignored)."""
    with RemoteSchedulerClient(server.address) as client:
        for pools, mapping, field in [
            ({"p": []}, {"actor": "p"}, "resource_pools[p].gpus_per_node"),
            ({"p": [1]}, {"wizard": "p"}, "mapping[wizard]"),
            ({"p": [1]}, {"actor": "q"}, "mapping[actor]"),
            ({"": [1]}, {"actor": ""}, "resource_pools"),
        ]:
            with pytest.raises(InvalidArgument) as info:
                client.plan(pools, mapping)
            assert info.value.field == field, (pools, mapping, info.value)


def test_plan_placement_and_refusal(server: SchedulerServer) -> None:
    with RemoteSchedulerClient(server.address) as client:
        with pytest.raises(FailedPrecondition, match="no placement yet"):
            client.placement()
        client.register(
            ServiceSpec(
                role="rollout", address="127.0.0.1:1", node="n0", devices=(Device("cpu", 1),)
            )
        )
        client.register(
            ServiceSpec(
                role="trainer", address="127.0.0.1:2", node="n0", devices=(Device("cpu", 0),)
            )
        )
        placement = client.plan(
            {"train_pool": [1], "rollout_pool": [1]},
            {"actor": "train_pool", "rollout": "rollout_pool"},
        )
        assert not placement.colocated
        got = {
            (a.role, a.pool, a.service_id, tuple(d.index for d in a.devices))
            for a in placement.assignments
        }
        assert got == {
            ("actor", "train_pool", "trainer-1", (0,)),
            ("rollout", "rollout_pool", "rollout-1", (1,)),
        }
        assert client.placement() == placement
        colocated = client.plan(
            {"global_pool": [2]}, {"actor": "global_pool", "rollout": "global_pool"}
        )
        assert colocated.colocated
        with pytest.raises(FailedPrecondition) as info:
            client.plan(
                {"train_pool": [1], "rollout_pool": [2]},
                {"actor": "train_pool", "rollout": "rollout_pool"},
            )
        assert (
            # pools travel in a proto map: planned by name
            "pool train_pool needs 1 cpu core on node 0, only 0 free after rollout_pool took 2"
            in str(info.value)
        )
        assert info.value.code == "PLACEMENT_REFUSED"
        with pytest.raises(InvalidArgument, match="no pool"):
            client.plan({"train_pool": [1]}, {"actor": "train_pool", "rollout": "x"})


def test_training_status_sd_and_metrics(server: SchedulerServer) -> None:
    server.core.set_training_status(
        state="running", global_step=2, total_steps=5, metrics={"critic/score/mean": 0.25}
    )
    with RemoteSchedulerClient(server.address) as client:
        status = client.training_status()
        assert (status.state, status.global_step, status.total_steps) == ("running", 2, 5)
        assert dict(status.metrics) == {"critic/score/mean": 0.25}
        client.register(
            ServiceSpec(role="rollout", address="127.0.0.1:1", metrics_address="127.0.0.1:9101")
        )
        client.register(ServiceSpec(role="reward", address="127.0.0.1:2"))  # no metrics
    with urllib.request.urlopen(f"http://{server.metrics_address}/sd", timeout=5) as r:
        groups = json.loads(r.read())
    targets = {g["targets"][0]: g["labels"]["role"] for g in groups}
    assert targets == {server.metrics_address: "scheduler", "127.0.0.1:9101": "rollout"}
    with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'rlfleet_scheduler_registered_services{role="rollout",state="alive"} 1.0' in text


def test_driver_in_another_process_publishes_training_status(server: SchedulerServer) -> None:
    with RemoteSchedulerClient(server.address) as client:
        sent = TrainingStatus(
            global_step=3,
            total_steps=10,
            weight_version=3,
            metrics={"reward": 0.5},
            state="running",
        )
        assert client.set_training_status(sent) == sent
        assert client.training_status() == sent
        assert server.core.training_status() == sent
        with pytest.raises(InvalidArgument, match="unknown training state 'sleepy'"):
            client._call("SetTrainingStatus", scheduler_pb2.TrainingStatus(state="sleepy"))
