"""Roles on real gRPC and HTTP servers: who may call what, the caller's role inside
handlers, malformed requests, and the authenticated HTTP endpoint."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from rlfleet.common.auth import caller_role, credential_set, generate_tokens
from rlfleet.common.http import MAX_CONNECTIONS, http_get, serve_http
from rlfleet.common.rpc import Security, create_channel, create_server, error_info
from rlfleet.v1 import reward_pb2, reward_pb2_grpc


class WhoAmI(reward_pb2_grpc.RewardServiceServicer):
    """Answers with the caller's role as the scorer name."""

    def Score(self, request: Any, context: Any) -> Any:
        return reward_pb2.ScoreResponse(
            results=[reward_pb2.ScoreResult(scorer=str(caller_role()), index=len(request.samples))]
        )

    def ScoreStream(self, request_iterator: Any, context: Any) -> Iterator[Any]:
        for _ in request_iterator:
            yield reward_pb2.ScoreResult(scorer=str(caller_role()))

    def GetInfo(self, request: Any, context: Any) -> Any:
        return reward_pb2.RewardInfo(default_scorer=str(caller_role()))


@pytest.fixture()
def served() -> Iterator[tuple[str, dict[str, str]]]:
    tokens = generate_tokens()
    creds = credential_set(tokens)
    server = create_server(
        [(reward_pb2_grpc.add_RewardServiceServicer_to_server, WhoAmI())],
        security=Security(credentials=creds["reward"]),
    )
    try:
        yield server.address, tokens
    finally:
        server.stop(0)


def _stub(address: str, token: str | None) -> Any:
    if token is None:
        channel = create_channel(address, security=Security(insecure=True))
    else:
        channel = create_channel(address, auth_token=token)
    return reward_pb2_grpc.RewardServiceStub(channel)


def test_roles_are_told_apart_and_checked_per_method(served: tuple[str, dict[str, str]]) -> None:
    address, tokens = served
    for role in ("driver", "trainer", "rollout"):
        out = _stub(address, tokens[role]).Score(reward_pb2.ScoreRequest(), timeout=5)
        assert out.results[0].scorer == role
        streamed = list(_stub(address, tokens[role]).ScoreStream(iter([reward_pb2.ScoreRequest()])))
        assert [r.scorer for r in streamed] == [role]
    for role in ("observer", "scheduler", "reward"):
        with pytest.raises(grpc.RpcError) as info:
            _stub(address, tokens[role]).Score(reward_pb2.ScoreRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        details = error_info(info.value)
        assert details is not None and details.field == "role" and details.value == role
        info_ok = _stub(address, tokens[role]).GetInfo(reward_pb2.GetRewardInfoRequest(), timeout=5)
        assert info_ok.default_scorer == role
    for token in (None, "x" * 43, tokens["driver"][:-1]):
        with pytest.raises(grpc.RpcError) as info:
            _stub(address, token).GetInfo(reward_pb2.GetRewardInfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_malformed_protobuf_is_invalid_argument(served: tuple[str, dict[str, str]]) -> None:
    address, tokens = served
    channel = create_channel(address, auth_token=tokens["driver"])
    raw = channel.unary_unary(
        "/rlfleet.v1.RewardService/Score", request_serializer=None, response_deserializer=None
    )
    for garbage in (b"\xff\xff\xff\xff", b"\x0a\x05ab", bytes(range(256))):
        with pytest.raises(grpc.RpcError) as info:
            raw(garbage, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, garbage
        details = error_info(info.value)
        assert details is not None and details.field == "request"
    stream = channel.stream_stream(
        "/rlfleet.v1.RewardService/ScoreStream",
        request_serializer=None,
        response_deserializer=None,
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stream(iter([b"\xff\xff\xff"]), timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Unauthenticated garbage is refused for the token first.
    bare = create_channel(address, security=Security(insecure=True)).unary_unary(
        "/rlfleet.v1.RewardService/Score", request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.RpcError) as info:
        bare(b"\xff\xff", timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_http_endpoint_needs_a_token_and_is_bounded() -> None:
    tokens = generate_tokens()
    security = Security(credentials=credential_set(tokens)["scheduler"])
    page = (200, "text/plain", b"hello\n")
    endpoint = serve_http("127.0.0.1", 0, {"/metrics": lambda: page}, security=security)
    url = f"http://{endpoint.address}/metrics"
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url, timeout=5)
        assert info.value.code == 401 and info.value.headers["WWW-Authenticate"] == "Bearer"
        bad = urllib.request.Request(url, headers={"Authorization": "Bearer nope"})
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(bad, timeout=5)
        observer = Security(credentials=credential_set(tokens)["observer"])
        assert http_get(endpoint.address, "/metrics", security=observer) == b"hello\n"
        post = urllib.request.Request(url, data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError, match="405"):
            urllib.request.urlopen(post, timeout=5)
        # Idle connections without a token never lock a caller with one out: beyond
        # the cap, each new connection closes the oldest idle one.
        idle = [
            socket.create_connection(("127.0.0.1", endpoint.port)) for _ in range(MAX_CONNECTIONS)
        ]
        try:
            deadline = time.monotonic() + 30
            while endpoint.connections < MAX_CONNECTIONS:  # every idle one is held
                assert time.monotonic() < deadline, endpoint.connections
                time.sleep(0.05)
            for _ in range(3):
                assert http_get(endpoint.address, "/metrics", security=observer) == b"hello\n"
            idle[0].settimeout(5)
            assert idle[0].recv(1) == b""  # the oldest stranger was closed, unanswered
            extra = [socket.create_connection(("127.0.0.1", endpoint.port)) for _ in range(8)]
            assert http_get(endpoint.address, "/metrics", security=observer) == b"hello\n"
            deadline = time.monotonic() + 10  # the pushed-out ones' threads end
            while endpoint.connections > MAX_CONNECTIONS:
                assert time.monotonic() < deadline, endpoint.connections
                time.sleep(0.05)
            for s in extra:
                s.close()
        finally:
            for s in idle:
                s.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                assert http_get(endpoint.address, "/metrics", security=observer) == b"hello\n"
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        endpoint.stop()
