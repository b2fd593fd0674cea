"""Clients of the reward service: one interface, in-process or over gRPC.

    client = RemoteRewardClient("127.0.0.1:50053")          # remote, torch-free
    client = InProcessRewardClient(RewardManager())    # same calls, no sockets
    results = client.score([Sample("openai/gsm8k", "... #### 18", "18")])

Both raise the same :mod:`rlfleet.common.errors` classes (``InvalidArgument`` with
``field`` and ``sample_index``, ``DeadlineExceeded``, ...).

Rows from files (``rlfleet reward score``) become samples with
:func:`sample_from_row`: ``{data_source, response | solution_str | responses,
ground_truth | reward_model.ground_truth, prompt?, extra_info?, id?}``; a verl
parquet row's chat-list ``prompt`` becomes ``prompt_messages``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeAlias

import grpc

from rlfleet.common.errors import InvalidArgument, RlfleetError, Unavailable
from rlfleet.common.rpc import (
    TLSConfig,
    Watchdog,
    call_options,
    create_channel,
    health_probe,
    to_rlfleet_error,
)
from rlfleet.reward.core import RewardManager
from rlfleet.reward.serde import result_from_proto, sample_to_proto
from rlfleet.reward.types import ChatMessage, RewardInfo, Sample, ScoreResult
from rlfleet.v1 import reward_pb2, reward_pb2_grpc

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "InProcessRewardClient",
    "RemoteRewardClient",
    "RewardClient",
    "as_sample",
    "sample_from_row",
]

SampleLike: TypeAlias = Sample | dict[str, Any]


class RewardClient(Protocol):
    def score(
        self, samples: Sequence[SampleLike], *, timeout_s: float | None = ...
    ) -> list[ScoreResult]: ...

    def score_stream(
        self, batches: Iterable[Sequence[SampleLike]], *, timeout_s: float | None = ...
    ) -> Iterator[ScoreResult]: ...

    def info(self) -> RewardInfo: ...

    def close(self) -> None: ...


def _row_value(row: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in row and row[key] is not None:
            return row[key]
    return None


def sample_from_row(row: dict[str, Any], index: int = 0) -> Sample:
    """A sample from a jsonl / parquet row (keys as in the module docstring)."""
    response = _row_value(row, "response", "solution_str", "responses")
    if isinstance(response, list) and len(response) == 1:
        response = response[0]
    if response is None:
        raise InvalidArgument(
            "row has no response (keys: response, solution_str or responses)",
            field=f"samples[{index}].response",
            sample_index=index,
        )
    ground_truth = row.get("ground_truth")
    reward_model = row.get("reward_model")
    if ground_truth is None and isinstance(reward_model, dict):
        ground_truth = reward_model.get("ground_truth")
    prompt = row.get("prompt") or ""
    messages: list[ChatMessage] = []
    if isinstance(prompt, list):  # verl parquet: a chat list
        messages = [ChatMessage(str(m["role"]), str(m["content"])) for m in prompt]
        prompt = "\n".join(m.content for m in messages)
    extra = row.get("extra_info") or {}
    return Sample(
        data_source=str(row.get("data_source") or ""),
        response=response,
        ground_truth=_plain(ground_truth),
        prompt=str(prompt),
        prompt_messages=messages,
        extra_info=_plain(extra) if isinstance(extra, dict) else {},
        id=str(row.get("id", "") or ""),
    )


def _plain(value: Any) -> Any:
    """numpy arrays / scalars (from parquet) -> lists / Python scalars."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def as_sample(value: SampleLike, index: int = 0) -> Sample:
    return value if isinstance(value, Sample) else sample_from_row(value, index)


class InProcessRewardClient:
    """The client interface over a :class:`RewardManager` in this process."""

    def __init__(self, manager: RewardManager) -> None:
        self.manager = manager

    def score(
        self, samples: Sequence[SampleLike], *, timeout_s: float | None = None
    ) -> list[ScoreResult]:
        return self.manager.score(
            [as_sample(s, i) for i, s in enumerate(samples)], timeout_s=timeout_s
        )

    def score_stream(
        self, batches: Iterable[Sequence[SampleLike]], *, timeout_s: float | None = None
    ) -> Iterator[ScoreResult]:
        offset = 0
        for batch in batches:
            samples = [as_sample(s, offset + i) for i, s in enumerate(batch)]
            yield from self.manager.score(samples, timeout_s=timeout_s, offset=offset)
            offset += len(samples)

    def info(self) -> RewardInfo:
        return self.manager.info()

    def close(self) -> None:
        self.manager.close()


#: ``connections=0`` opens at most this many, whatever the service reports.
_MAX_AUTO_CONNECTIONS = 32


def _shifted(error: Any, offset: int) -> Any:
    """``error`` of a part that starts at sample ``offset``, indexed in the whole batch."""
    if not offset or error.sample_index is None:
        return error
    index = error.sample_index + offset
    field = error.field
    if field:
        field = field.replace(f"samples[{error.sample_index}]", f"samples[{index}]", 1)
    message = error.message.replace(f"samples[{error.sample_index}]", f"samples[{index}]")
    message = message.replace(f"sample {error.sample_index}", f"sample {index}")
    return type(error)(
        message,
        field=field,
        value=error.value,
        sample_index=index,
        code=error.code,
        recoverable=error.recoverable,
    )


DEFAULT_CONNECT_TIMEOUT_S = 5.0
"""How long a call waits for a connection to the service before failing ``Unavailable``."""


class _Connection:
    """A channel, its stub, and whether gRPC reports it connected (READY) now, watched
    from its first use (:meth:`watch`) on.

    Not from the start: gRPC watches a channel from a thread of its own, and one that
    has not yet begun to watch when the channel closes (a client closed before any
    call) dies of "Cannot monitor channel state: Channel closed!"."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.stub = reward_pb2_grpc.RewardServiceStub(channel)
        self.ready = threading.Event()
        self._watched = False
        self._lock = threading.Lock()

    def watch(self) -> None:
        with self._lock:
            if not self._watched:
                self._watched = True
                self.channel.subscribe(self._on_state, try_to_connect=False)

    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.READY:
            self.ready.set()
        else:
            self.ready.clear()

    def close(self) -> None:
        with self._lock:
            watched, self._watched = self._watched, True  # none from now on
        if watched:
            with contextlib.suppress(Exception):
                self.channel.unsubscribe(self._on_state)
        self.channel.close()


class RemoteRewardClient:
    """The client interface over gRPC (torch-free).

    A dead or unreachable service fails a call within ``connect_timeout_s`` with
    :class:`~rlfleet.common.errors.Unavailable` naming the service and its address:
    each call first waits, at most that long, for a connection (the service being
    up) unless one is open already, then runs with its own deadline
    (``timeout_s``), so a slow service that is up gets its whole time.

    Args:
        address: ``"host:port"``.
        auth_token: bearer token, when the service requires one.
        tls: TLS material; None: plaintext.
        timeout_s: default per-call deadline.
        connect_timeout_s: how long a call waits for a connection to the service.
        options: more channel arguments. A service run with ``--processes N`` is
            balanced per connection, and channels in one process with the same
            arguments share one: ``[("grpc.use_local_subchannel_pool", 1)]`` gives
            this client a connection of its own.
        connections: for a service run with ``--processes N``: this many connections
            of the client's own; :meth:`score` cuts a batch of at least
            ``2 * min_part`` samples into up to that many contiguous parts, sent at
            once, one per connection (results and error indices are the whole
            batch's). 1: one connection, one request per batch. 0: as many as the
            service reports running (``GetInfo``'s ``processes``, asked once, at the
            first :meth:`score`).
        min_part: the smallest part worth a request of its own.
    """

    def __init__(
        self,
        address: str,
        *,
        auth_token: str | None = None,
        tls: TLSConfig | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        options: Sequence[tuple[str, Any]] = (),
        connections: int = 1,
        min_part: int = 64,
    ) -> None:
        if connections < 0:
            raise ValueError(
                f"connections must be >= 0 (0: as the service reports), got {connections}"
            )
        if not connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.min_part = max(1, min_part)
        self._auto = connections == 0
        extra: list[tuple[str, Any]] = []
        if connections != 1:
            extra.append(("grpc.use_local_subchannel_pool", 1))
        if not any(key == "grpc.max_reconnect_backoff_ms" for key, _ in options):
            # After a long outage gRPC waits up to 2 minutes between attempts: a
            # service back up would still be refused. Two attempts per connect window.
            backoff_ms = max(100, int(connect_timeout_s * 500))
            extra.append(("grpc.max_reconnect_backoff_ms", backoff_ms))
        self._open = functools.partial(
            create_channel, address, tls=tls, auth_token=auth_token, options=[*options, *extra]
        )
        self._connections = [_Connection(self._open()) for _ in range(max(1, connections))]
        self._lock = threading.Lock()

    @property
    def connections(self) -> int:
        """Connections open now (``connections=0`` opens the rest at the first score)."""
        return len(self._connections)

    def _connected(self, connection: _Connection) -> reward_pb2_grpc.RewardServiceStub:
        """The connection's stub once it is connected; ``Unavailable`` when it cannot be."""
        connection.watch()
        if not connection.ready.is_set():
            future = grpc.channel_ready_future(connection.channel)
            try:
                future.result(timeout=self.connect_timeout_s)
            except grpc.FutureTimeoutError:
                future.cancel()
                raise Unavailable(
                    f"reward service at {self.address} is unreachable: no connection "
                    f"within {self.connect_timeout_s:g}s (is it running?)",
                    value=self.address,
                ) from None
        return connection.stub

    def _error(self, exc: grpc.RpcError, offset: int = 0) -> RlfleetError:
        error = _shifted(to_rlfleet_error(exc), offset)
        if isinstance(error, Unavailable) and not error.field:
            return Unavailable(
                f"reward service at {self.address} is unavailable: {error.message}",
                value=self.address,
                code=error.code,
            )
        return error

    def _call_options(self, timeout_s: float | None) -> dict[str, Any]:
        # Connected first (above), so a call fails at once if the connection drops
        # instead of waiting its whole deadline for the service to come back.
        return call_options(timeout_s or self.timeout_s, wait_for_ready=False)

    def _connect_all(self) -> None:
        """``connections=0``: open one connection per server process, once."""
        with self._lock:
            if not self._auto:
                return
            wanted = min(self.info().processes, _MAX_AUTO_CONNECTIONS)
            while len(self._connections) < wanted:
                connection = _Connection(self._open())
                self._connections.append(connection)
            self._auto = False

    def score(
        self, samples: Sequence[SampleLike], *, timeout_s: float | None = None
    ) -> list[ScoreResult]:
        if self._auto:
            self._connect_all()
        protos = [sample_to_proto(as_sample(s, i)) for i, s in enumerate(samples)]
        parts = min(len(self._connections), len(protos) // self.min_part) or 1
        bounds = [len(protos) * k // parts for k in range(parts + 1)]
        stubs = [self._connected(c) for c in self._connections[:parts]]
        options = self._call_options(timeout_s)
        futures = [
            stub.Score.future(reward_pb2.ScoreRequest(samples=protos[lo:hi]), **options)
            for stub, lo, hi in zip(stubs, bounds, bounds[1:], strict=False)
        ]
        results: list[ScoreResult] = []

        def cancel_all() -> None:
            for f in futures:
                f.cancel()

        # A service that stops answering (SIGSTOP, hung) fails the call within a few
        # liveness windows instead of its whole deadline.
        watchdog = Watchdog(
            health_probe(self._connections[0].channel, self.connect_timeout_s),
            cancel_all,
            self.connect_timeout_s,
            f"reward service at {self.address}",
        )
        with watchdog:
            for future, offset in zip(futures, bounds, strict=False):
                try:
                    response = future.result()
                except (grpc.RpcError, grpc.FutureCancelledError) as exc:
                    cancel_all()
                    if watchdog.verdict is not None:
                        raise watchdog.error(self.address) from exc
                    assert isinstance(exc, grpc.RpcError)
                    raise self._error(exc, offset) from exc
                for r in response.results:
                    result = result_from_proto(r)
                    result.index += offset
                    results.append(result)
        return results

    def score_stream(
        self, batches: Iterable[Sequence[SampleLike]], *, timeout_s: float | None = None
    ) -> Iterator[ScoreResult]:
        """Send batches as a stream; results come back as they finish (``index`` is global)."""

        def requests() -> Iterator[reward_pb2.ScoreRequest]:
            offset = 0
            for batch in batches:
                yield reward_pb2.ScoreRequest(
                    samples=[
                        sample_to_proto(as_sample(s, offset + i)) for i, s in enumerate(batch)
                    ],
                    pack_results=True,
                )
                offset += len(batch)

        stub = self._connected(self._connections[0])
        call = stub.ScoreStream(requests(), **self._call_options(timeout_s))
        try:
            for result in call:
                yield result_from_proto(result)
                for packed in result.more:  # results ready with it (pack_results)
                    yield result_from_proto(packed)
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        finally:
            with contextlib.suppress(Exception):
                call.cancel()

    def info(self) -> RewardInfo:
        stub = self._connected(self._connections[0])
        try:
            msg = stub.GetInfo(reward_pb2.GetRewardInfoRequest(), **self._call_options(None))
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        return RewardInfo(
            scorers=tuple(msg.scorers),
            data_sources=dict(msg.data_sources),
            default_scorer=msg.default_scorer,
            reward_model=msg.reward_model,
            max_batch_size=msg.max_batch_size,
            sample_timeout_s=msg.sample_timeout_s,
            processes=msg.processes or 1,
        )

    def close(self) -> None:
        for connection in self._connections:
            connection.close()

    def __enter__(self) -> RemoteRewardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
