"""A replica that freezes mid-push (SIGSTOP, a stuck device) stops reading and answers
nothing, and fails no call: the push's other replicas waited for it until the push's
deadline (600 s by default: every replica's buckets move together). The push now
probes the replicas still moving it and gives up on the frozen one within seconds;
the real replica gets the weights. Frozen replicas are stand-ins here (servers whose
handlers block: a stopped process cannot be timed to freeze mid-transfer), the real
one is the tiny model behind a real gRPC server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

torch = pytest.importorskip("torch")

from rlfleet.common.rpc import create_server  # noqa: E402
from rlfleet.rollout.core import RolloutCore  # noqa: E402
from rlfleet.rollout.hf_engine import HFEngine  # noqa: E402
from rlfleet.rollout.server import start_rollout_server  # noqa: E402
from rlfleet.v1 import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from rlfleet.weightsync import sender  # noqa: E402

pytestmark = pytest.mark.timeout(300)

#: The push's deadline: the old behaviour waited this long for a frozen replica.
DEADLINE_S = 90.0


class _Frozen(rollout_pb2_grpc.RolloutServiceServicer):
    """Every call blocks until released: a stopped process, as its callers see it.
    With ``tcp_plan`` it first plans a TCP transfer to a listener that accepts and
    never reads (frozen after its plan, as the bytes move)."""

    def __init__(self, tcp_plan: bool = False) -> None:
        self.release = threading.Event()
        self.listener: socket.socket | None = None
        self.tcp_plan = tcp_plan
        if tcp_plan:
            self.listener = socket.create_server(("127.0.0.1", 0))

    def _freeze(self) -> None:
        self.release.wait(DEADLINE_S + 30)

    def GetStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._freeze()
        return rollout_pb2.RolloutStatus()

    def OpenWeightTransfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        if self.listener is None:
            self._freeze()
            return rollout_pb2.WeightTransferPlan()
        port = self.listener.getsockname()[1]
        return rollout_pb2.WeightTransferPlan(
            transfer_id="t1",
            transport=rollout_pb2.WEIGHT_TRANSPORT_TCP,
            endpoint=f"127.0.0.1:{port}",
            token="0" * 32,
        )

    def CommitWeightTransfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._freeze()
        return rollout_pb2.UpdateWeightsResponse()

    def AbortWeightTransfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._freeze()
        return rollout_pb2.AbortWeightTransferResponse()

    def UpdateWeights(self, request_iterator: Any, context: grpc.ServicerContext) -> Any:
        self._freeze()  # reads nothing: the sender's flow-control window fills
        return rollout_pb2.UpdateWeightsResponse()


@contextlib.contextmanager
def _serve_frozen(tcp_plan: bool = False) -> Iterator[str]:
    servicer = _Frozen(tcp_plan)
    server = create_server(
        [(lambda s, srv: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(s, srv), servicer)]
    )
    try:
        yield server.address
    finally:
        servicer.release.set()
        server.stop(0)
        if servicer.listener is not None:
            servicer.listener.close()


@pytest.fixture()
def replica(tiny_model_dir: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    engine = HFEngine(tiny_model_dir)
    core = RolloutCore(engine, replica_id="real")
    g = torch.Generator().manual_seed(3)
    weights = {
        n: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
        for n, p in engine.model.named_parameters()
    }
    server = start_rollout_server(core)
    try:
        yield server.address, weights
    finally:
        server.stop(0)
        core.close()


@pytest.mark.parametrize(
    ("transports", "frozen_kinds"),
    [
        (["shm", "tcp", "grpc"], ("at its offer", "mid-TCP")),
        (["grpc"], ("mid-stream",)),
    ],
)
def test_a_replica_frozen_mid_push_is_given_up_and_the_others_get_the_weights(
    replica: tuple[str, dict[str, Any]], transports: list[str], frozen_kinds: tuple[str, ...]
) -> None:
    address, weights = replica
    with contextlib.ExitStack() as stack:
        frozen = [
            (kind, stack.enter_context(_serve_frozen(tcp_plan=(kind == "mid-TCP"))))
            for kind in frozen_kinds
        ]
        targets = [("real", address), *((kind, a) for kind, a in frozen)]
        start = time.monotonic()
        summary = sender.push_weights(
            list(weights.items()), targets, 1, transports=transports, timeout_s=DEADLINE_S
        )
        took = time.monotonic() - start
    results = {r.replica_id: r for r in summary.results}
    assert results["real"].ok, results["real"].error
    for kind in frozen_kinds:
        assert not results[kind].ok
        assert "did not answer two liveness probes" in results[kind].error, results[kind].error
    # Probes every 2 s, two missed 1 s deadlines: given up within seconds, not at the
    # push's deadline.
    assert took < 30.0, took
    with grpc.insecure_channel(address) as channel:
        status = rollout_pb2_grpc.RolloutServiceStub(channel).GetStatus(
            rollout_pb2.GetRolloutStatusRequest(), timeout=10
        )
    assert status.weight_version == 1
