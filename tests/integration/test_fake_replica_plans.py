"""A replica is not trusted to say where the trainer writes or connects. A fake one
(a stolen rollout credential registers it) answers weight offers with plans that
name a file on the trainer's host as its shared-memory segment, or another service's
address as its TCP endpoint with bytes of its choosing as the token: the sender
refuses each plan, writes nothing and connects nowhere."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from rlfleet.common.rpc import create_server
from rlfleet.v1 import rollout_pb2, rollout_pb2_grpc
from rlfleet.weightsync import sender
from rlfleet.weightsync.wire import TransferPlan


class _Fake(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self) -> None:
        self.plan = rollout_pb2.WeightTransferPlan()
        self.commits = 0

    def OpenWeightTransfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.plan

    def CommitWeightTransfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.commits += 1
        return rollout_pb2.UpdateWeightsResponse(weight_version=1)

    def AbortWeightTransfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        return rollout_pb2.AbortWeightTransferResponse()


@pytest.fixture()
def fake() -> Iterator[tuple[_Fake, str]]:
    servicer = _Fake()
    server = create_server(
        [(lambda s, srv: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(s, srv), servicer)]
    )
    try:
        yield servicer, server.address
    finally:
        server.stop(0)


def _plan(transport: int, endpoint: str, token: str) -> Any:
    return rollout_pb2.WeightTransferPlan(
        transfer_id="t1", transport=transport, endpoint=endpoint, token=token
    )


WEIGHTS = {"w": torch.ones(1024, 1024)}


def test_a_plan_naming_a_file_as_its_segment_writes_nothing(
    fake: tuple[_Fake, str], tmp_path: Path
) -> None:
    servicer, address = fake
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"\0" * 8 + b"{" * 32 + b"\0" * (8 << 20))
    before = victim.read_bytes()
    relative = "../.." + str(victim)
    for endpoint, token in ((relative, "{"), (relative, "{" * 32), (str(victim), "0" * 32)):
        servicer.plan = _plan(rollout_pb2.WEIGHT_TRANSPORT_SHM, endpoint, token)
        with pytest.raises(sender.PlanRefused, match=r"segment|token|offered"):
            sender.send_update(address, WEIGHTS, 1, transports=["shm", "tcp"])
    # A plan for a transport the offer did not name (shared memory, offered TCP only).
    servicer.plan = _plan(rollout_pb2.WEIGHT_TRANSPORT_SHM, "rlfleet_" + "0" * 16, "0" * 32)
    with pytest.raises(sender.PlanRefused, match="not offered"):
        sender.send_update(address, WEIGHTS, 1, transports=["tcp"])
    assert victim.read_bytes() == before
    assert servicer.commits == 0


def test_a_plan_pointing_elsewhere_connects_nowhere(fake: tuple[_Fake, str]) -> None:
    servicer, address = fake
    listener = socket.create_server(("127.0.0.2", 0))  # "another service", another host
    listener.settimeout(0.2)
    got: list[bytes] = []

    def accept() -> None:
        for _ in range(20):
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            got.append(conn.recv(1 << 16))
            conn.close()

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        port = listener.getsockname()[1]
        for token in ("FLUSHALL\r\nCONFIG SET dir /tmp\r\n", "a" * 32):
            servicer.plan = _plan(rollout_pb2.WEIGHT_TRANSPORT_TCP, f"127.0.0.2:{port}", token)
            with pytest.raises(sender.PlanRefused, match=r"token|host"):
                sender.send_update(address, WEIGHTS, 1, transports=["tcp"])
    finally:
        thread.join()
        listener.close()
    assert got == [] and servicer.commits == 0


def test_plans_as_replicas_make_them_pass() -> None:
    ok = TransferPlan("t", "tcp", "127.0.0.1:9", "ab" * 16)
    sender.check_plan(ok, ["tcp"], "127.0.0.1")
    sender.check_plan(ok, ["tcp"], "localhost")  # another name for the same address
    shm = TransferPlan("t", "shm", "/rlfleet_0123456789abcdef", "ab" * 16)
    sender.check_plan(shm, ["shm", "tcp"], "127.0.0.1")
