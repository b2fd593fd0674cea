"""Hostile bytes on the bulk plane's TCP listener, plain and under TLS, through a real
rollout replica on 127.0.0.1: seeded connections that send random bytes (short,
token-length, long), a TLS hello in clear, a partial token, or nothing and close, all
while one transfer is open. None may be taken for the sender, none may crash the
replica or hold it up: the real sender's push goes through afterwards and the replica
serves its weights. Bounded: a fixed count of connections, each with a time-out."""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rlfleet.common.rpc import TLSConfig  # noqa: E402
from rlfleet.common.secrets_cli import make_tls  # noqa: E402
from rlfleet.rollout.core import RolloutCore  # noqa: E402
from rlfleet.rollout.hf_engine import HFEngine  # noqa: E402
from rlfleet.rollout.server import start_rollout_server  # noqa: E402
from rlfleet.v1 import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from rlfleet.weightsync import wire  # noqa: E402
from rlfleet.weightsync.sender import make_offer  # noqa: E402
from rlfleet.weightsync.tcp import send_tcp  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SEED = 20261125
CONNECTIONS = 120


def _hostile(rng: random.Random, token: bytes) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:
        return b""  # connect and close
    if kind == 1:
        return rng.randbytes(rng.randrange(1, len(token)))  # short of a token
    if kind == 2:
        return rng.randbytes(len(token))  # a wrong token
    if kind == 3:
        return token[: rng.randrange(1, len(token))] + rng.randbytes(8)  # a near miss
    if kind == 4:
        return b"\x16\x03\x01" + rng.randbytes(rng.randrange(0, 600))  # a garbled TLS hello
    return rng.randbytes(rng.randrange(len(token), 1 << 16))  # a flood


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TLSConfig:
    try:
        files = make_tls(tmp_path_factory.mktemp("tls"), [])
    except OSError as e:
        pytest.skip(f"cannot make certificates: {e}")
    return TLSConfig(
        cert=files["cert"], key=files["key"], ca=files["ca"],
        require_client_cert=True, server_name_override="rlfleet",
    )  # fmt: skip


@contextlib.contextmanager
def _replica(model: Path, tls: TLSConfig | None) -> Iterator[tuple[RolloutCore, str, HFEngine]]:
    engine = HFEngine(model)
    core = RolloutCore(
        engine,
        bulk_tls=tls.ssl_server_context() if tls is not None else None,
        bulk_token_timeout_s=0.5,
    )
    server = start_rollout_server(core)
    try:
        yield core, server.address, engine
    finally:
        server.stop(grace_s=1.0)
        core.close()


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "tls"])
def test_random_bytes_on_the_listener_never_become_the_sender(
    tiny_model_dir: Path, tls: TLSConfig, secure: bool
) -> None:
    import grpc

    rng = random.Random(SEED + secure)
    with _replica(tiny_model_dir, tls if secure else None) as (core, address, engine):
        w = {n: p.detach() + 0.01 for n, p in engine.model.named_parameters()}
        offer = make_offer(w, 7, ("tcp",))
        channel = grpc.insecure_channel(address)
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        plan = wire.plan_from_proto(stub.OpenWeightTransfer(wire.offer_to_proto(offer), timeout=30))
        host, _, port = plan.endpoint.rpartition(":")
        assert host.startswith("127.")
        refused = 0
        for _ in range(CONNECTIONS):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                with contextlib.suppress(OSError):
                    s.sendall(_hostile(rng, plan.token.encode()))
                    s.shutdown(socket.SHUT_WR)
                    # Dropped by the replica (a close, or a reset mid-flood), never held.
                    while s.recv(1 << 16):
                        pass
                refused += 1
        assert refused == CONNECTIONS
        crcs = send_tcp(
            plan, w, offer.tensors, timeout_s=60,
            tls=tls.ssl_client_context() if secure else None,
            server_name="rlfleet" if secure else None,
        )  # fmt: skip
        result = stub.CommitWeightTransfer(
            rollout_pb2.WeightTransferCommit(transfer_id=plan.transfer_id, crc32c=crcs),
            timeout=60,
        )
        channel.close()
        assert result.version == 7 and core.status().weight_version == 7
