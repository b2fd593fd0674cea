"""rlfleet.common.rpc against real gRPC servers on 127.0.0.1, port 0.

A tiny RewardService servicer stands in for a real service: each sample's
``data_source`` says how to behave (ok, slow, invalid, boom, flaky, down, abort).
"""

from __future__ import annotations

import collections
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from rlfleet.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    RlfleetError,
    Unauthenticated,
    Unavailable,
)
from rlfleet.common.rpc import (
    HEALTH_SERVICE,
    REFLECTION_SERVICE,
    Server,
    TLSConfig,
    call_options,
    check_health,
    create_channel,
    create_server,
    error_info,
    grpc_method,
    to_rlfleet_error,
    wait_for_ready,
)
from rlfleet.v1 import reward_pb2, reward_pb2_grpc

pytestmark = pytest.mark.timeout(60)

REWARD_SERVICE = "rlfleet.v1.RewardService"
ADD_REWARD = reward_pb2_grpc.add_RewardServiceServicer_to_server
MiB = 1024 * 1024


class FakeReward(reward_pb2_grpc.RewardServiceServicer):
    """Scores ``len(response)``; ``data_source`` selects a misbehaviour."""

    def __init__(self) -> None:
        self.attempts: collections.Counter[str] = collections.Counter()
        self.started = threading.Event()  # a "slow" sample is being scored
        self.release = threading.Event()  # lets "slow" samples finish
        self._lock = threading.Lock()

    def _score(self, index: int, sample: reward_pb2.RewardSample, context: Any) -> Any:
        with self._lock:
            self.attempts[sample.id] += 1
            attempt = self.attempts[sample.id]
        behaviour = sample.data_source
        if behaviour == "slow":
            self.started.set()
            self.release.wait(timeout=20)
        elif behaviour == "invalid":
            raise InvalidArgument(
                f"unknown data source {behaviour!r} and no default scorer",
                field=f"samples[{index}].data_source",
                value=sample.prompt or behaviour,
                sample_index=index,
            )
        elif behaviour == "boom":
            raise ValueError(f"boom on sample {sample.id!r}")
        elif behaviour == "flaky" and attempt <= 2:
            raise Unavailable(f"warming up (attempt {attempt})")
        elif behaviour == "down":
            raise Unavailable(f"down (attempt {attempt})")
        elif behaviour == "abort":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "engine is asleep")
        return reward_pb2.ScoreResult(
            id=sample.id, index=index, score=float(len(sample.response)), scorer="len"
        )

    def Score(self, request: reward_pb2.ScoreRequest, context: Any) -> reward_pb2.ScoreResponse:
        results = [self._score(i, s, context) for i, s in enumerate(request.samples)]
        return reward_pb2.ScoreResponse(results=results)

    def ScoreStream(
        self, request_iterator: Iterator[reward_pb2.ScoreRequest], context: Any
    ) -> Iterator[reward_pb2.ScoreResult]:
        index = 0
        for request in request_iterator:
            for sample in request.samples:
                yield self._score(index, sample, context)
                index += 1

    def GetInfo(self, request: reward_pb2.GetRewardInfoRequest, context: Any) -> Any:
        return reward_pb2.RewardInfo(scorers=["len"], default_scorer="len")


class DecoratedReward(FakeReward):
    """Maps errors with the decorator instead of the interceptor."""

    @grpc_method
    def Score(self, request: reward_pb2.ScoreRequest, context: Any) -> reward_pb2.ScoreResponse:
        return super().Score(request, context)

    @grpc_method
    def ScoreStream(
        self, request_iterator: Iterator[reward_pb2.ScoreRequest], context: Any
    ) -> Iterator[reward_pb2.ScoreResult]:
        return super().ScoreStream(request_iterator, context)


def request(*behaviours: str, response: str = "abc", sample_id: str = "s") -> Any:
    return reward_pb2.ScoreRequest(
        samples=[
            reward_pb2.RewardSample(id=f"{sample_id}{i}", data_source=b, response=response)
            for i, b in enumerate(behaviours)
        ]
    )


@pytest.fixture
def servicer() -> Iterator[FakeReward]:
    s = FakeReward()
    yield s
    s.release.set()


@pytest.fixture
def server(servicer: FakeReward) -> Iterator[Server]:
    srv = create_server([(ADD_REWARD, servicer)])
    yield srv
    servicer.release.set()
    srv.stop(grace_s=0)


@pytest.fixture
def stub(server: Server) -> Iterator[reward_pb2_grpc.RewardServiceStub]:
    channel = create_channel(server.address, initial_backoff_s=0.01, max_backoff_s=0.05)
    yield reward_pb2_grpc.RewardServiceStub(channel)
    channel.close()


def rpc_error(call: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, **kwargs)
        if isinstance(result, Iterator):
            list(result)
    return info.value


# ------------------------------------------------------------------ basics


def test_port_zero_binds_a_real_port(server: Server, stub: Any) -> None:
    assert server.port > 0
    assert server.address == f"127.0.0.1:{server.port}"
    assert server.service_names == (REWARD_SERVICE,)
    info = stub.GetInfo(reward_pb2.GetRewardInfoRequest(), **call_options(10))
    assert list(info.scorers) == ["len"]
    response = stub.Score(request("ok", response="hello"), **call_options(10))
    assert response.results[0].score == 5.0


def test_binding_a_busy_port_fails(server: Server, servicer: FakeReward) -> None:
    with pytest.raises(OSError, match=f"127.0.0.1:{server.port}"):
        create_server([(ADD_REWARD, servicer)], port=server.port)


def test_health_serving_and_set_serving(server: Server) -> None:
    with create_channel(server.address) as channel:
        assert check_health(channel)
        assert check_health(channel, REWARD_SERVICE)
        assert not check_health(channel, "rlfleet.v1.NoSuchService")

        server.set_serving(REWARD_SERVICE, False)
        assert not check_health(channel, REWARD_SERVICE)
        raw = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=REWARD_SERVICE), timeout=10
        )
        assert raw.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert check_health(channel)  # the server as a whole still serves

        server.set_serving(REWARD_SERVICE, True)
        assert check_health(channel, REWARD_SERVICE)
    wait_for_ready(server.address, timeout_s=10, service=REWARD_SERVICE)


def test_wait_for_ready_times_out_on_a_dead_address() -> None:
    # A bound socket that never listens: connections are refused, and nobody
    # else can take the port meanwhile.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(Unavailable, match="did not report"):
            wait_for_ready(address, timeout_s=0.5)


def test_not_serving_at_start_until_ready(servicer: FakeReward) -> None:
    with create_server([(ADD_REWARD, servicer)], serving=False) as srv:
        with pytest.raises(Unavailable, match="NOT_SERVING"):
            wait_for_ready(srv.address, timeout_s=0.3)
        srv.set_serving("", True)
        wait_for_ready(srv.address, timeout_s=10)


def test_reflection_lists_services(server: Server) -> None:
    with create_channel(server.address) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert {REWARD_SERVICE, HEALTH_SERVICE, REFLECTION_SERVICE} <= set(services)


# ------------------------------------------------------------ message size


def test_message_limit_enforced_and_large_messages_under_it_pass(servicer: FakeReward) -> None:
    # The client allows more than the server, so the server's limit is what bites.
    with (
        create_server([(ADD_REWARD, servicer)], max_message_bytes=1 * MiB) as srv,
        create_channel(srv.address, max_message_bytes=8 * MiB) as channel,
    ):
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        ok = stub.Score(request("ok", response="x" * (MiB // 2)), timeout=10)
        assert ok.results[0].score == MiB // 2
        err = rpc_error(stub.Score, request("ok", response="x" * (2 * MiB)), timeout=10)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_default_limit_is_above_grpc_default(stub: Any) -> None:
    size = 8 * MiB  # gRPC's own default receive limit is 4 MiB
    response = stub.Score(request("ok", response="y" * size), **call_options(30))
    assert response.results[0].score == size


# ---------------------------------------------------------- stop & signals


def test_graceful_stop_finishes_in_flight_call(servicer: FakeReward) -> None:
    srv = create_server([(ADD_REWARD, servicer)])
    with create_channel(srv.address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=REWARD_SERVICE), timeout=30
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        in_flight = stub.Score.future(request("slow"), timeout=30)
        assert servicer.started.wait(timeout=10)

        stopper = threading.Thread(target=srv.stop, kwargs={"grace_s": 20})
        stopper.start()
        # Health turns NOT_SERVING as the stop begins ...
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        # ... new calls are refused once the gRPC server itself stops, which follows
        # the health change by a moment: poll, bounded, until a late call is refused.
        with create_channel(srv.address, retry_unavailable=False) as fresh:
            late_stub = reward_pb2_grpc.RewardServiceStub(fresh)
            codes = []
            for _ in range(50):
                try:
                    late_stub.Score(request("ok"), timeout=5)
                    codes.append(grpc.StatusCode.OK)
                    time.sleep(0.1)
                except grpc.RpcError as err:
                    codes.append(err.code())
                    break
            assert codes[-1] == grpc.StatusCode.UNAVAILABLE, codes
        # ... and the in-flight call completes within the grace.
        servicer.release.set()
        assert in_flight.result(timeout=20).results[0].score == 3.0
        stopper.join(timeout=20)
        assert not stopper.is_alive()
    assert srv.wait(timeout_s=5)


SIGTERM_SERVER = """
import sys, time
from rlfleet.common.rpc import create_server
from rlfleet.v1 import reward_pb2, reward_pb2_grpc

class Slow(reward_pb2_grpc.RewardServiceServicer):
    def Score(self, request, context):
        print("started", flush=True)
        time.sleep(1.0)
        return reward_pb2.ScoreResponse(results=[reward_pb2.ScoreResult(score=7.0)])

server = create_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, Slow())])
server.install_signal_handlers(grace_s=20)
print(server.port, flush=True)
server.wait()
print("stopped", flush=True)
"""


def test_sigterm_stops_gracefully(tmp_path: Path) -> None:
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(SIGTERM_SERVER))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(
        target=lambda: [lines.put(line.strip()) for line in stdout], daemon=True
    ).start()
    try:
        port = int(lines.get(timeout=20))
        with create_channel(f"127.0.0.1:{port}") as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            in_flight = stub.Score.future(request("ok"), timeout=30)
            assert lines.get(timeout=20) == "started"
            proc.send_signal(signal.SIGTERM)
            assert in_flight.result(timeout=20).results[0].score == 7.0
        assert proc.wait(timeout=20) == 0, proc.stderr.read() if proc.stderr else ""
        assert lines.get(timeout=5) == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


# ------------------------------------------------------ retries & deadlines


def test_unavailable_is_retried(servicer: FakeReward, stub: Any) -> None:
    response = stub.Score(request("flaky", sample_id="f"), **call_options(10))
    assert response.results[0].score == 3.0
    assert servicer.attempts["f0"] == 3


def test_retries_stop_at_max_attempts(servicer: FakeReward, server: Server) -> None:
    with create_channel(server.address, max_attempts=3, initial_backoff_s=0.01) as channel:
        err = rpc_error(
            reward_pb2_grpc.RewardServiceStub(channel).Score,
            request("down", sample_id="d"),
            timeout=10,
        )
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert servicer.attempts["d0"] == 3
    mapped = to_rlfleet_error(err)
    assert isinstance(mapped, Unavailable)
    assert mapped.recoverable


def test_no_retry_when_disabled(servicer: FakeReward, server: Server) -> None:
    with create_channel(server.address, retry_unavailable=False) as channel:
        err = rpc_error(
            reward_pb2_grpc.RewardServiceStub(channel).Score,
            request("flaky", sample_id="n"),
            timeout=10,
        )
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert servicer.attempts["n0"] == 1


def test_a_service_restarted_on_its_address_is_reached_at_once(servicer: FakeReward) -> None:
    """A launcher restarts a dead service on its port: a new channel to it (a driver
    adopting the replica) connects at once instead of inheriting the dead one's
    reconnect backoff (1.5-3.5 s with gRPC's shared subchannel pool), and a channel
    that saw it die reconnects within about a second."""
    first = create_server([(ADD_REWARD, servicer)])
    address = first.address
    old = create_channel(address, retry_unavailable=False)
    score = reward_pb2_grpc.RewardServiceStub(old).Score
    assert score(request("ok"), timeout=5).results[0].score == 3.0
    first.stop(grace_s=0)
    for _ in range(3):  # each failure pushes the old channel's backoff further
        with pytest.raises(grpc.RpcError):
            score(request("ok"), timeout=5)
    time.sleep(0.5)
    port = int(address.rpartition(":")[2])
    second = create_server([(ADD_REWARD, servicer)], port=port)
    try:
        t0 = time.monotonic()
        with create_channel(address, retry_unavailable=False) as fresh:
            out = reward_pb2_grpc.RewardServiceStub(fresh).Score(request("ok"), timeout=5)
        fresh_s = time.monotonic() - t0
        assert out.results[0].score == 3.0
        assert fresh_s < 1.0, f"a new channel took {fresh_s:.2f}s"
        deadline = time.monotonic() + 10
        while True:  # what a caller with an old client sees, polling
            try:
                score(request("ok"), timeout=5)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the old channel never reconnected"
                time.sleep(0.05)
        old_s = time.monotonic() - t0
        assert old_s < 3.0, f"the old channel took {old_s:.2f}s"
    finally:
        old.close()
        second.stop(grace_s=0)


def test_deadline_exceeded(servicer: FakeReward, stub: Any) -> None:
    err = rpc_error(stub.Score, request("slow"), **call_options(0.2))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    servicer.release.set()
    assert stub.Score(request("ok"), **call_options(10)).results[0].score == 3.0


# -------------------------------------------------------------- TLS / mTLS


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _issue(name: str, cn: str, ext: str, cwd: Path) -> None:
    (cwd / f"{name}.ext").write_text(ext)
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}",
        cwd=cwd,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-set_serial", str(abs(hash(name)) % 10**9 + 2), "-days", "2",
        "-out", f"{name}.pem", "-extfile", f"{name}.ext",
        cwd=cwd,
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA, a server certificate for localhost/127.0.0.1 and a client one."""
    d = tmp_path_factory.mktemp("certs")
    try:
        _openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=rlfleet-test-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            cwd=d,
        )  # fmt: skip
    except FileNotFoundError:
        pytest.skip("openssl CLI not found")
    _issue(
        "server",
        "localhost",
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n",
        d,
    )
    _issue(
        "client",
        "rlfleet-test-client",
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=clientAuth\n",
        d,
    )
    return d


def test_tls(certs: Path, servicer: FakeReward) -> None:
    server_tls = TLSConfig(cert=certs / "server.pem", key=certs / "server.key")
    with create_server([(ADD_REWARD, servicer)], tls=server_tls) as srv:
        for client_tls in (
            TLSConfig(ca=certs / "ca.pem"),  # verified against the IP SAN
            TLSConfig(ca=certs / "ca.pem", server_name_override="localhost"),
        ):
            with create_channel(srv.address, tls=client_tls) as channel:
                stub = reward_pb2_grpc.RewardServiceStub(channel)
                assert stub.Score(request("ok"), timeout=10).results[0].score == 3.0
                assert check_health(channel)
        # A plaintext client cannot talk to a TLS server.
        with create_channel(srv.address, retry_unavailable=False) as channel:
            err = rpc_error(
                reward_pb2_grpc.RewardServiceStub(channel).Score, request("ok"), timeout=5
            )
            assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls(certs: Path, servicer: FakeReward) -> None:
    server_tls = TLSConfig(
        cert=certs / "server.pem",
        key=certs / "server.key",
        ca=certs / "ca.pem",
        require_client_cert=True,
    )
    with create_server([(ADD_REWARD, servicer)], tls=server_tls) as srv:
        no_cert = TLSConfig(ca=certs / "ca.pem")
        with create_channel(srv.address, tls=no_cert, retry_unavailable=False) as channel:
            err = rpc_error(
                reward_pb2_grpc.RewardServiceStub(channel).Score, request("ok"), timeout=5
            )
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        with_cert = TLSConfig(
            ca=certs / "ca.pem", cert=certs / "client.pem", key=certs / "client.key"
        )
        with create_channel(srv.address, tls=with_cert) as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            assert stub.Score(request("ok"), timeout=10).results[0].score == 3.0


def test_tls_config_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs cert and key"):
        TLSConfig(ca=tmp_path / "ca.pem").server_credentials()
    with pytest.raises(ValueError, match="require_client_cert"):
        TLSConfig(cert="a", key="b", require_client_cert=True).server_credentials()
    with pytest.raises(ValueError, match=r"missing\.pem"):
        TLSConfig(ca=tmp_path / "missing.pem").channel_credentials()


# ------------------------------------------------------------ bearer token


def test_bearer_token(servicer: FakeReward) -> None:
    token = "s3cret-token"
    with create_server([(ADD_REWARD, servicer)], auth_token=token) as srv:
        for bad in (None, "wrong-token"):
            with create_channel(srv.address, auth_token=bad) as channel:
                stub = reward_pb2_grpc.RewardServiceStub(channel)
                err = rpc_error(stub.Score, request("ok"), timeout=10)
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
                assert token not in (err.details() or "")
                assert isinstance(to_rlfleet_error(err), Unauthenticated)
                err = rpc_error(stub.ScoreStream, iter([request("ok")]), timeout=10)
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
                # Health stays open; reflection does not.
                assert check_health(channel)
                with pytest.raises(grpc.RpcError) as refl:
                    ProtoReflectionDescriptorDatabase(channel).get_services()
                assert refl.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with create_channel(srv.address, auth_token=token) as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            assert stub.Score(request("ok"), timeout=10).results[0].score == 3.0
            results = list(stub.ScoreStream(iter([request("ok", "ok")]), timeout=10))
            assert [r.score for r in results] == [3.0, 3.0]
            assert REWARD_SERVICE in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_bad_tokens_are_refused_up_front() -> None:
    for bad in ("", "has space", "caf\u00e9"):
        with pytest.raises(ValueError, match="printable ASCII"):
            create_channel("127.0.0.1:1", auth_token=bad)


# ----------------------------------------------------------- error mapping


def test_invalid_argument_maps_with_error_info(stub: Any) -> None:
    err = rpc_error(stub.Score, request("ok", "invalid"), timeout=10)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    expected = "samples[1].data_source: unknown data source 'invalid' and no default scorer"
    assert err.details() == expected
    info = error_info(err)
    assert info is not None
    assert (info.code, info.field, info.value, info.sample_index, info.recoverable) == (
        "INVALID_ARGUMENT",
        "samples[1].data_source",
        "invalid",
        1,
        False,
    )
    assert info.message == expected
    mapped = to_rlfleet_error(err)
    assert isinstance(mapped, InvalidArgument)
    assert str(mapped) == expected
    assert (mapped.field, mapped.value, mapped.sample_index) == (
        "samples[1].data_source",
        "invalid",
        1,
    )


def test_huge_error_values_are_clipped(stub: Any) -> None:
    sample = reward_pb2.RewardSample(id="h", data_source="invalid", prompt="v" * 100_000)
    err = rpc_error(stub.Score, reward_pb2.ScoreRequest(samples=[sample]), timeout=10)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(err)
    assert info is not None
    assert info.value.startswith("vvv") and info.value.endswith("[truncated]")
    assert len(info.value) <= 512


def test_unexpected_exception_is_internal_and_server_survives(stub: Any) -> None:
    err = rpc_error(stub.Score, request("boom", sample_id="b"), timeout=10)
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == "ValueError: boom on sample 'b0'"
    info = error_info(err)
    assert info is not None and info.code == "INTERNAL" and not info.recoverable
    assert stub.Score(request("ok"), timeout=10).results[0].score == 3.0


def test_abort_keeps_its_status(stub: Any) -> None:
    err = rpc_error(stub.Score, request("abort"), timeout=10)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == "engine is asleep"
    assert error_info(err) is None
    assert isinstance(to_rlfleet_error(err), FailedPrecondition)


def test_streaming_errors_map_after_partial_results(stub: Any) -> None:
    call = stub.ScoreStream(iter([request("ok"), request("invalid")]), timeout=10)
    first = next(call)
    assert first.score == 3.0
    with pytest.raises(grpc.RpcError) as exc:
        next(call)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(exc.value)
    assert info is not None and info.field == "samples[1].data_source"

    err = rpc_error(stub.ScoreStream, iter([request("ok", "boom")]), timeout=10)
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "ValueError: boom" in (err.details() or "")
    results = list(stub.ScoreStream(iter([request("ok"), request("ok")]), timeout=10))
    assert len(results) == 2


def test_grpc_method_decorator_without_interceptor() -> None:
    servicer = DecoratedReward()
    with (
        create_server([(ADD_REWARD, servicer)], map_errors=False) as srv,
        create_channel(srv.address) as channel,
    ):
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        err = rpc_error(stub.Score, request("invalid"), timeout=10)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(err) is not None
        err = rpc_error(stub.ScoreStream, iter([request("ok", "boom")]), timeout=10)
        assert err.code() == grpc.StatusCode.INTERNAL
        assert stub.Score(request("ok"), timeout=10).results[0].score == 3.0


def test_errors_survive_pickling() -> None:
    import pickle

    err = InvalidArgument("bad", field="x", value=3, sample_index=2, code="BAD_X")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, InvalidArgument) and isinstance(back, RlfleetError)
    assert (str(back), back.value, back.sample_index, back.code) == ("x: bad", 3, 2, "BAD_X")


# ------------------------------------------------------------------ traces


class TracedReward(FakeReward):
    """Records the span its handler runs in and the trace metadata it received."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def GetInfo(self, request: reward_pb2.GetRewardInfoRequest, context: Any) -> Any:
        from rlfleet.common import tracing

        received = {k: v for k, v in context.invocation_metadata() if "trace" in k}
        self.seen.append((tracing.current(), received))
        return super().GetInfo(request, context)


def test_a_w3c_traceparent_joins_the_callers_trace_and_rlfleet_sends_both() -> None:
    """An OpenTelemetry-instrumented caller (a plain stub with ``traceparent``) gets the
    service's spans in its trace; rlfleet's own channels send ``rlfleet-trace`` and
    ``traceparent`` for the same span; a malformed or all-zero one is ignored."""
    from rlfleet.common import tracing

    servicer = TracedReward()
    srv = create_server([(ADD_REWARD, servicer)])
    trace, span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        plain = grpc.insecure_channel(srv.address)
        stub = reward_pb2_grpc.RewardServiceStub(plain)
        for value in (f"00-{trace}-{span}-01", f"00-{'0' * 32}-{span}-01", "00-xyz"):
            stub.GetInfo(reward_pb2.GetRewardInfoRequest(), metadata=[("traceparent", value)])
        plain.close()
        ours = create_channel(srv.address)
        mine = tracing.SpanContext("ab" * 16, "cd" * 8)
        with tracing.attached(mine):
            reward_pb2_grpc.RewardServiceStub(ours).GetInfo(reward_pb2.GetRewardInfoRequest())
        ours.close()
    finally:
        srv.stop(grace_s=0)
    [(joined, _), (zero, _), (bad, _), (ctx, received)] = servicer.seen
    assert joined == tracing.SpanContext(trace, span) and zero is None and bad is None
    assert ctx == mine
    assert received == {
        "rlfleet-trace": f"{mine.trace_id}-{mine.span_id}",
        "traceparent": f"00-{mine.trace_id}-{mine.span_id}-01",
    }
