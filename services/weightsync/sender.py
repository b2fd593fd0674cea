"""The sending side of weight sync: the trainer's push to every rollout replica.

:func:`push_weights` sends the actor's weights (in Hugging Face names and the
rollout's dtype) to every target in parallel, cut into *buckets* of at most
``bucket_bytes`` (a tensor larger than that is a bucket of its own), whatever the
model's size. Each replica gets the best transport it can take, chosen per
replica from the preference list ``transports`` (default :data:`AUTO`: shared
memory when the replica shares this host's ``/dev/shm``, else TCP, else the gRPC
stream):

* **bulk plane** (``shm`` / ``tcp``): every bucket is one transfer
  (:class:`BulkUpdate`: offer, move, commit). A one-bucket model is one
  whole-update transfer; with several buckets, bucket 0 opens a bucketed update
  on the replica, which stages each verified bucket and applies the union
  atomically when the final bucket commits (see :mod:`rlfleet.weightsync.receiver`).
  The bucket's checksums are computed once, in a thread, for all replicas
  (:class:`~rlfleet.weightsync.checksum.SourceCrcs`);
* **fallback**, decided at bucket 0 and only where ``grpc`` is in the list: a
  replica that does not serve the bulk plane (``UNIMPLEMENTED``, or it plans
  ``grpc``), or whose TCP endpoint cannot be reached, gets the gRPC stream; a
  segment that turns out not to be shared (:class:`~rlfleet.weightsync.shm.
  ShmUnavailable`) is cancelled and the bucket offered again without ``shm``;
* **gRPC stream** (``UpdateWeights``): the bucketed chunk stream of
  :mod:`rlfleet.weightsync.wire`, every chunk encoded once and handed to all
  replicas' senders through small bounded queues.

A target given up before its final bucket (its bucket failed, or the push itself
stops: an error gathering a bucket, KeyboardInterrupt) is sent
``AbortWeightTransfer``, best effort, so that it frees the staged buckets at once.
A failing replica is reported in its :class:`ReplicaResult` and the others go on.
A replica that freezes mid-push (SIGSTOP, a stuck device) fails no call: it stops
reading. Every :data:`PROBE_EVERY_S` the replicas still moving the push are probed
(``GetStatus`` within :data:`PROBE_TIMEOUT_S`, a second try after a missed deadline,
on a connection of their own); one that does not answer is given up (its calls
cancelled, its thread no longer waited for), so the others' buckets do not wait for
it until the push's deadline.

Memory: buckets are gathered (from FSDP shards) and encoded one at a time; the
next bucket is gathered only after every replica took the chunks of this one
(bulk: after every replica committed it; the replicas' transfers of a bucket run
in parallel, reading the same tensors). Extra memory is one bucket plus a few
chunks, whatever the model size.

Every push logs one line per replica: version, replica, transport, bytes,
seconds and GB/s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import grpc

from rlfleet.common.codec.batch import tensor_specs
from rlfleet.common.codec.wire import (
    DEFAULT_MAX_CHUNK_BYTES,
    iter_chunk_bytes,
    iter_chunks,
    serialize_chunk,
)
from rlfleet.common.errors import RlfleetError
from rlfleet.common.rpc import TLSConfig, create_channel, current_security, to_rlfleet_error
from rlfleet.v1 import rollout_pb2, rollout_pb2_grpc
from rlfleet.weightsync import wire
from rlfleet.weightsync.checksum import SourceCrcs
from rlfleet.weightsync.shm import ShmUnavailable, host_identity, send_shm
from rlfleet.weightsync.tcp import TcpUnreachable, TransferWatch, send_tcp
from rlfleet.weightsync.wire import AUTO, BULK, AbortResult, TransferOffer, UpdateResult

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BulkUpdate",
    "PushSummary",
    "ReplicaResult",
    "iter_buckets",
    "iter_weight_chunks",
    "make_offer",
    "push_weights",
    "send_update",
    "stream_weights",
]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 << 20
_QUEUE_CHUNKS = 4
_UPDATE_WEIGHTS = "/rlfleet.v1.RolloutService/UpdateWeights"
# An abort is one small RPC, sent while giving up: it must not hold the caller long.
_ABORT_TIMEOUT_S = 10.0
#: How often a push probes the replicas still moving it, and each probe's deadline
#: (module docstring); a push that ends sooner sends no probe (only the GetStatus
#: that opens each probe's connection as it starts).
PROBE_EVERY_S = 2.0
PROBE_TIMEOUT_S = 1.0
#: The deadline of the call that opens a probe's connection as the push starts
#: (cancelled when the push ends, if it is still waiting).
_PROBE_CONNECT_S = 60.0


def make_offer(
    named_tensors: Mapping[str, Any],
    version: int,
    transports: Sequence[str] = AUTO,
    *,
    bucket: int = 0,
    final: bool = True,
    update_id: str = "",
) -> TransferOffer:
    """The offer for ``named_tensors``: layout only, no pass over the bytes. The
    defaults offer a whole update; ``bucket`` / ``final`` / ``update_id`` one bucket
    of a bucketed update (:mod:`rlfleet.weightsync.receiver`)."""
    specs = tensor_specs(named_tensors, align=1)
    total = specs[-1].offset + specs[-1].nbytes if specs else 0
    return TransferOffer(
        version=version,
        tensors=specs,
        total_bytes=total,
        transports=list(transports),
        sender_host=host_identity(),
        bucket=bucket,
        final=final,
        update_id=update_id,
    )


def _tls_client() -> tuple[ssl.SSLContext, str | None] | None:
    """The TLS client context (and the name to verify replicas by) of this process's
    security, for the TCP transport; None where the process has no TLS."""
    security = current_security()
    tls = security.client_tls() if security is not None else None
    if tls is None:
        return None
    return _client_context(tls), tls.server_name_override


@functools.lru_cache(maxsize=4)
def _client_context(tls: TLSConfig) -> ssl.SSLContext:
    return tls.ssl_client_context()


def _error(e: grpc.RpcError) -> RlfleetError:
    return to_rlfleet_error(e)


class BulkUpdate:
    """One weight update to one replica over the bulk data plane, one transfer per
    bucket (``OpenWeightTransfer`` -> move the bytes -> ``CommitWeightTransfer``).

    A model in one bucket is one ``send(..., final=True)``: a whole update, as any
    replica takes it. Several buckets: ``send(bucket, final=False)`` for each but
    the last; the replica stages each one (verified, not applied) and applies the
    union when the final bucket commits.

    Bucket 0 settles the transport (the module docstring): :meth:`send` returns None
    when this replica is to get the gRPC stream instead (nothing was sent), and
    drops ``shm`` from the offers when the planned segment was not shared.

    A sender that gives up a started bucketed update calls :meth:`abort`, so that
    the replica frees the staged buckets at once rather than at its transfer
    time-out. :meth:`send` does so itself when a bucket fails (any exception,
    KeyboardInterrupt included), and so does leaving a ``with BulkUpdate(...)``
    block before the final bucket committed.

    Args:
        stub: the replica's ``RolloutService`` stub.
        transports: preference order; ``grpc`` allows the fallback to the stream.
    """

    def __init__(
        self,
        stub: rollout_pb2_grpc.RolloutServiceStub,
        version: int,
        transports: Sequence[str] = AUTO,
        *,
        timeout_s: float = 600.0,
        host: str | None = None,
    ) -> None:
        wire.check_transports(transports)
        self._stub = stub
        self._host = host  # the replica's (as dialed): a TCP plan must point there
        self.version = version
        self._transports = list(transports)
        self._timeout_s = timeout_s
        self.update_id = ""
        self.buckets = 0  # buckets committed
        self.transport = ""  # of the last bucket
        self.note = ""  # why this replica did not get the first transport offered
        self.done = False  # the final bucket committed (or the update was aborted)
        self.watch = TransferWatch()  # bytes moved; cut() ends a TCP send at once

    @property
    def pending(self) -> bool:
        """A bucketed update the replica stages for us: started, neither applied nor
        given up."""
        return bool(self.update_id) and not self.done

    def abort(self, reason: str = "") -> AbortResult | None:
        """Give up the update: ask the replica to drop its staged buckets now.
        Best effort and at most once: a failed abort is logged, not raised (the
        replica's transfer time-out still frees the buckets). None when there was
        nothing to abort (no bucketed update started, or it finished) or the abort
        itself failed."""
        if not self.pending:
            return None
        self.done = True
        return self._abort(self.update_id, reason)

    def _abort(self, ident: str, reason: str) -> AbortResult | None:
        request = rollout_pb2.AbortWeightTransferRequest(update_id=ident, reason=reason)
        try:
            msg = self._stub.AbortWeightTransfer(
                request, timeout=min(self._timeout_s, _ABORT_TIMEOUT_S)
            )
        except grpc.RpcError as e:
            logger.warning(
                "abort of weight transfer %s failed (%s); the replica frees it at its time-out",
                ident,
                _error(e),
            )
            return None
        return wire.abort_from_proto(msg)

    def __enter__(self) -> BulkUpdate:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self.pending:
            what = "no final bucket" if exc_type is None else exc_type.__name__
            self.abort(f"the sender left the update ({what})")

    def send(
        self, named_tensors: Mapping[str, Any], *, final: bool, crcs: SourceCrcs | None = None
    ) -> UpdateResult | None:
        """Move one bucket and commit it. Returns the replica's report (``staged``
        for a bucket before the final one), or None when this replica is to get the
        gRPC stream (bucket 0 only; nothing was sent: send the whole update there).

        Args:
            crcs: the bucket's checksums when it goes to several replicas (computed
                once); None: computed here while the bytes move.

        Any failure (including KeyboardInterrupt) aborts a started bucketed update
        (:meth:`abort`) before it propagates.

        Raises:
            RlfleetError: as the replica raised it (a refused offer, ``DataLoss`` at
                commit); the replica then dropped every bucket it staged.
            OSError: the socket or the shared-memory segment failed.
        """
        if self.done:
            raise RuntimeError(f"weight update {self.update_id or '(whole)'} already ended")
        try:
            return self._send(named_tensors, final, crcs)
        except BaseException as e:
            self.abort(f"bucket {self.buckets} failed: {type(e).__name__}: {e}")
            raise

    def _send(
        self, named_tensors: Mapping[str, Any], final: bool, crcs: SourceCrcs | None
    ) -> UpdateResult | None:
        while True:
            offer = make_offer(
                named_tensors,
                self.version,
                self._transports,
                bucket=self.buckets,
                final=final,
                update_id=self.update_id,
            )
            try:
                plan = wire.plan_from_proto(
                    self._stub.OpenWeightTransfer(
                        wire.offer_to_proto(offer), timeout=self._timeout_s
                    )
                )
            except grpc.RpcError as e:
                if self._may_fall_back() and e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.note = "the replica does not serve the bulk plane"
                    return None
                raise _error(e) from e
            if plan.transport not in BULK:
                if self.buckets:
                    raise RuntimeError(
                        f"the replica answered {plan.transport!r} for bucket {self.buckets}"
                    )
                self.note = f"the replica planned {plan.transport}"
                return None
            # Known from bucket 0's plan on: a failure from here on is abortable.
            self.update_id = plan.update_id or self.update_id
            check_plan(plan, self._transports, self._host)
            try:
                if plan.transport == "tcp":
                    tls = _tls_client()
                    sums = send_tcp(
                        plan,
                        named_tensors,
                        offer.tensors,
                        timeout_s=self._timeout_s,
                        crcs=crcs,
                        tls=tls[0] if tls is not None else None,
                        server_name=tls[1] if tls is not None else None,
                        watch=self.watch,
                    )
                else:
                    sums = send_shm(
                        plan, named_tensors, offer.tensors, crcs=crcs, moved=self.watch.moved
                    )
            except (ShmUnavailable, TcpUnreachable) as e:
                if self.buckets:
                    raise
                # Nothing was written: cancel the planned transfer and try the next way.
                self._abort(plan.update_id or plan.transfer_id, f"{type(e).__name__}: {e}")
                self.update_id = ""
                if isinstance(e, ShmUnavailable):
                    logger.warning("shared memory not shared with this replica (%s): next", e)
                    self._transports = [t for t in self._transports if t != "shm"]
                    self.note = f"shared memory not shared ({e})"
                    if self._transports:
                        continue
                    raise
                if not self._may_fall_back():
                    raise
                self.note = f"TCP endpoint unreachable ({e})"
                return None
            try:
                msg = self._stub.CommitWeightTransfer(
                    rollout_pb2.WeightTransferCommit(transfer_id=plan.transfer_id, crc32c=sums),
                    timeout=self._timeout_s,
                )
            except grpc.RpcError as e:
                raise _error(e) from e
            self.buckets += 1
            self.transport = plan.transport
            self.done = final
            return wire.update_from_proto(msg, plan.transport)

    def _may_fall_back(self) -> bool:
        return self.buckets == 0 and "grpc" in self._transports


def send_update(
    target: str | grpc.Channel,
    named_tensors: Mapping[str, Any],
    version: int,
    *,
    transports: Sequence[str] = AUTO,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    timeout_s: float = 600.0,
    auth_token: str | None = None,
) -> UpdateResult:
    """Send ``named_tensors`` as weight ``version`` to one rollout replica, in one piece.

    Tries the bulk data plane when ``transports`` name ``shm`` or ``tcp`` (the
    replica picks the first it can serve; ``shm`` only on the same host), and the
    gRPC chunk stream when the list is only ``grpc`` or the replica chose it.
    (:func:`push_weights` sends larger models bucket by bucket, to many replicas.)

    Returns:
        The replica's report (version now serving, bytes, tensors, seconds); its
        ``transport`` says which path moved the bytes.

    Raises:
        InvalidArgument: a name / dtype / shape the model does not have (nothing sent).
        DataLoss: the bytes arrived corrupted; the old weights keep serving.
        FailedPrecondition: ``version`` is older than the one serving.
    """
    wire.check_transports(transports)
    channel = (
        target if not isinstance(target, str) else create_channel(target, auth_token=auth_token)
    )
    try:
        if any(t in BULK for t in transports):
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            host = target.rpartition(":")[0] if isinstance(target, str) else None
            bulk = BulkUpdate(stub, version, transports, timeout_s=timeout_s, host=host)
            result = bulk.send(named_tensors, final=True)
            if result is not None:
                return result
        return stream_weights(channel, named_tensors, version, max_chunk_bytes, timeout_s)
    finally:
        if isinstance(target, str):
            with contextlib.suppress(Exception):
                channel.close()


def stream_weights(
    channel: grpc.Channel,
    named_tensors: Mapping[str, Any],
    version: int,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    timeout_s: float = 600.0,
) -> UpdateResult:
    """The whole update as one codec stream over ``UpdateWeights`` (the portable path)."""
    update = channel.stream_unary(
        _UPDATE_WEIGHTS,
        request_serializer=serialize_chunk,
        response_deserializer=rollout_pb2.UpdateWeightsResponse.FromString,
    )
    chunks = iter_chunk_bytes(
        dict(named_tensors), max_chunk_bytes=max_chunk_bytes, envelope=wire.weight_envelope(version)
    )
    try:
        return wire.update_from_proto(update(chunks, timeout=timeout_s), "grpc")
    except grpc.RpcError as e:
        raise _error(e) from e


# ------------------------------------------------------------------ the trainer's push


@dataclass
class ReplicaResult:
    replica_id: str
    address: str
    ok: bool = False
    error: str = ""
    seconds: float = 0.0
    transport: str = "grpc"  # the path that moved the bytes
    note: str = ""  # why the replica did not get the first transport offered


@dataclass
class PushSummary:
    version: int
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    max_bucket_bytes: int = 0
    results: list[ReplicaResult] = field(default_factory=list)


def iter_buckets(
    named: Iterable[tuple[str, Any]], bucket_bytes: int
) -> Iterator[tuple[list[tuple[str, Any]], bool]]:
    """Group ``(name, tensor)`` pairs into buckets of at most ``bucket_bytes``; yields
    ``(bucket, is_final)``. Pulls one tensor beyond the current bucket at most."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    current: list[tuple[str, Any]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if current and size + n > bucket_bytes:
            yield current, False
            current, size = [], 0
        current.append((name, t))
        size += n
    yield current, True


class _Sender:
    """One replica's UpdateWeights call, fed from a bounded queue on its own thread."""

    _END = object()

    def __init__(self, result: ReplicaResult, timeout_s: float, token: str | None) -> None:
        self.result = result
        self.result.transport = "grpc"
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=_QUEUE_CHUNKS)
        self._timeout_s = timeout_s
        self._start = time.perf_counter()
        self._lock = threading.Lock()
        self.abandoned = False
        self.taken = 0  # messages the call took from the queue
        self.channel = create_channel(self.result.address, auth_token=token)
        self.thread = threading.Thread(
            target=self._run, name=f"push-{result.replica_id}", daemon=True
        )

    @property
    def address(self) -> str:
        return self.result.address

    def moving(self) -> bool:
        return self.thread.is_alive() and not self.abandoned

    def progress(self) -> Any:
        return self.taken

    def abandon(self, why: str, seen: Any = None) -> None:
        """Give this replica up (it stopped answering and took nothing since its
        progress was ``seen``): its call is cancelled, so its thread ends and
        :meth:`put` stops blocking on it."""
        with self._lock:
            if not self.moving() or self.result.ok or (seen is not None and self.taken != seen):
                return
            self.abandoned = True
            self.result.error = f"Unresponsive: {why}"
            self.result.seconds = time.perf_counter() - self._start
        _log_abandon(self.result, why)
        self.channel.close()

    def _requests(self) -> Iterator[rollout_pb2.WeightChunk]:
        while True:
            item = self.queue.get()
            if item is self._END:
                return
            self.taken += 1
            yield item

    def _run(self) -> None:
        error = ""
        try:
            stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
            stub.UpdateWeights(self._requests(), timeout=self._timeout_s)
        except grpc.RpcError as e:
            err = to_rlfleet_error(e)
            error = f"{type(err).__name__}: {err}"
        except Exception as e:  # reported per replica; the push to the others goes on
            error = f"{type(e).__name__}: {e}"
        finally:
            with self._lock:
                if not self.abandoned:  # (given up: its error and seconds say why)
                    self.result.ok, self.result.error = not error, error
                    self.result.seconds = time.perf_counter() - self._start
            self.channel.close()
            # gRPC's thread that reads _requests() may still wait on the queue (a call
            # that failed or was cancelled): an END ends it.
            with contextlib.suppress(queue.Empty):
                while True:
                    self.queue.get_nowait()
            with contextlib.suppress(queue.Full):
                self.queue.put_nowait(self._END)

    def put(self, item: Any) -> bool:
        """Queue ``item``; False once the call has ended (failed), so nobody blocks on it."""
        while self.thread.is_alive():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


def push_weights(
    named: Iterable[tuple[str, Any]],
    targets: Sequence[tuple[str, str]],
    version: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout_s: float = 600.0,
    auth_token: str | None = None,
    on_bucket: Callable[[int], None] | None = None,
    transports: Sequence[str] = AUTO,
) -> PushSummary:
    """Stream ``named`` tensors to every ``(replica_id, address)`` in ``targets`` in parallel.

    ``named`` is consumed lazily, one bucket at a time (see the module docstring). A
    failing replica is reported in its :class:`ReplicaResult`; the others go on.
    ``on_bucket(nbytes)`` is called with each bucket's size once it is gathered.
    ``transports`` (names ``shm``, ``tcp``, ``grpc``, preference order; default
    :data:`~rlfleet.weightsync.wire.AUTO`) is offered to every replica, and each
    takes the first it can (module docstring).
    """
    wire.check_transports(transports)
    buckets = iter_buckets(named, bucket_bytes)
    start = time.perf_counter()
    if any(t in BULK for t in transports):
        summary = _push_bulk(
            buckets, targets, version, transports, timeout_s, auth_token, on_bucket
        )
    else:
        summary = _push_stream(buckets, targets, version, timeout_s, auth_token, on_bucket)
    _log(summary, time.perf_counter() - start)
    return summary


def _log(summary: PushSummary, seconds: float) -> None:
    for r in summary.results:
        if r.ok:
            logger.info(
                "weight push v%d -> %s (%s): %s, %d bytes in %.3f s (%.2f GB/s)%s",
                summary.version,
                r.replica_id,
                r.address,
                r.transport,
                summary.bytes,
                r.seconds,
                summary.bytes / 1e9 / max(r.seconds, 1e-9),
                f"; {r.note}" if r.note else "",
            )
        else:
            logger.warning(
                "weight push v%d -> %s (%s) failed after %.3f s: %s",
                summary.version,
                r.replica_id,
                r.address,
                r.seconds,
                r.error,
            )
    logger.debug(
        "weight push v%d: %d buckets, %d bytes to %d replicas in %.3f s",
        summary.version,
        summary.buckets,
        summary.bytes,
        len(summary.results),
        seconds,
    )


def iter_weight_chunks(
    named: Iterable[tuple[str, Any]],
    version: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[rollout_pb2.WeightChunk]:
    """The ``UpdateWeights`` messages of one bucketed update, lazily (the gRPC stream
    :func:`push_weights` sends to every replica)."""
    summary = PushSummary(version)
    for index, (bucket, final) in enumerate(iter_buckets(named, bucket_bytes)):
        tensors = dict(bucket)
        del bucket
        _count(summary, tensors, index, None)
        yield from _bucket_chunks(tensors, version, index, final, summary.tensors)


def _count(
    summary: PushSummary,
    tensors: dict[str, Any],
    index: int,
    on_bucket: Callable[[int], None] | None,
) -> None:
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if on_bucket is not None:
        on_bucket(nbytes)
    summary.bytes += nbytes
    summary.tensors += len(tensors)
    summary.max_bucket_bytes = max(summary.max_bucket_bytes, nbytes)
    summary.buckets = index + 1


def _bucket_chunks(
    tensors: dict[str, Any], version: int, index: int, final: bool, total_tensors: int
) -> Iterator[rollout_pb2.WeightChunk]:
    meta = wire.bucket_meta(version, index, final=final, tensors=total_tensors)
    for chunk in iter_chunks(tensors, meta):
        yield rollout_pb2.WeightChunk(version=version, chunk=chunk)


def _push_stream(
    buckets: Iterator[tuple[list[tuple[str, Any]], bool]],
    targets: Sequence[tuple[str, str]],
    version: int,
    timeout_s: float,
    auth_token: str | None,
    on_bucket: Callable[[int], None] | None,
) -> PushSummary:
    summary = PushSummary(version=version)
    senders = [_Sender(ReplicaResult(rid, addr), timeout_s, auth_token) for rid, addr in targets]
    for s in senders:
        s.thread.start()
    with _Liveness(lambda: senders, auth_token):
        try:
            for index, (bucket, final) in enumerate(buckets):
                tensors = dict(bucket)
                del bucket
                _count(summary, tensors, index, on_bucket)
                _feed(senders, _bucket_chunks(tensors, version, index, final, summary.tensors))
                del tensors
        finally:  # (watched meanwhile: a replica that froze is given up)
            _end_streams(senders)
    summary.results = [s.result for s in senders]
    return summary


class PlanRefused(Exception):
    """A replica's transfer plan this sender will not follow (see :func:`check_plan`)."""


_SHM_SEGMENT = re.compile(r"rlfleet_[0-9a-f]{16}")
_PLAN_TOKEN = re.compile(r"[0-9a-f]{32}")


def _addresses(host: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return set()


def check_plan(plan: wire.TransferPlan, offered: Sequence[str], host: str | None) -> None:
    """Follow a replica's plan only as far as the offer allows: a transport that was
    offered, a token of the form the replica makes (32 hex digits), a shared-memory
    segment named as replicas name theirs (a plain name in ``/dev/shm``: no path),
    and a TCP endpoint on the replica's own host (``host``, as dialed; the same name
    or an address both resolve to). A registered replica is not trusted to say where
    the trainer writes or connects: a fake one could have named a file on the
    trainer's host, or another service to send its bytes to.

    Raises:
        PlanRefused: naming what is wrong.
    """
    if plan.transport not in offered:
        raise PlanRefused(f"the replica planned {plan.transport!r}, not offered ({offered})")
    if not _PLAN_TOKEN.fullmatch(plan.token):
        raise PlanRefused("the plan's token is not 32 hex digits")
    if plan.transport == "shm" and not _SHM_SEGMENT.fullmatch(plan.endpoint.removeprefix("/")):
        raise PlanRefused(f"the plan's segment {plan.endpoint[:80]!r} is not a replica's segment")
    if plan.transport == "tcp" and host is not None:
        ep_host = plan.endpoint.rpartition(":")[0].strip("[]")
        wanted = host.strip("[]")
        if ep_host != wanted and not (_addresses(ep_host) & _addresses(wanted)):
            raise PlanRefused(
                f"the plan's endpoint {plan.endpoint[:80]!r} is not on the replica's host {host}"
            )


class _BulkTarget:
    """One replica's update over the bulk data plane, a transfer per bucket; or its
    gRPC stream, when bucket 0 settled on the stream for it."""

    def __init__(
        self,
        replica_id: str,
        address: str,
        version: int,
        transports: Sequence[str],
        timeout_s: float,
        token: str | None,
    ) -> None:
        self.result = ReplicaResult(replica_id, address)
        self._timeout_s, self._token = timeout_s, token
        self._start = time.perf_counter()
        self.channel = create_channel(address, auth_token=token)
        stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        host = address.rpartition(":")[0]
        self.update = BulkUpdate(stub, version, transports, timeout_s=timeout_s, host=host)
        self.stream: _Sender | None = None
        self.failed = False
        self.abandoned = False
        self._lock = threading.Lock()
        self._crcs: SourceCrcs | None = None  # the bucket moving now's
        self._sending = 0  # the ident of the thread moving it

    @property
    def address(self) -> str:
        return self.result.address

    def moving(self) -> bool:
        return self.stream is None and not self.failed and not self.result.ok

    def progress(self) -> Any:
        return self.update.buckets, self.update.watch.bytes

    def abandon(self, why: str, seen: Any = None) -> None:
        """Give this replica up (it stopped answering, and moved nothing since its
        progress was ``seen``): its calls are cancelled and its TCP socket cut, the
        bucket's checksums no longer wait for it if it computes them, and the push
        stops waiting for its thread."""
        with self._lock:
            if not self.moving() or (seen is not None and self.progress() != seen):
                return
            self.failed = self.abandoned = True
            self.result.error = f"Unresponsive (bucket {self.update.buckets}): {why}"
            self.result.transport = self.update.transport or self.result.transport
            self.result.note = self.update.note
            self.result.seconds = time.perf_counter() - self._start
            crcs, sending = self._crcs, self._sending
        _log_abandon(self.result, why)
        if crcs is not None:  # had this transfer claimed them, the others would wait
            crcs.release(sending)
        self.update.watch.cut()
        self.channel.close()

    def send(self, tensors: dict[str, Any], final: bool, crcs: SourceCrcs | None) -> bool:
        """Move and commit one bucket; False when this replica is to get the gRPC
        stream (bucket 0 only; nothing was sent). A failure is recorded, not raised."""
        with self._lock:
            self._crcs, self._sending = crcs, threading.get_ident()
        try:
            if self.update.send(tensors, final=final, crcs=crcs) is None:
                return False
            with self._lock:
                if final and not self.abandoned:
                    self.result.ok, self.result.transport = True, self.update.transport
        except Exception as e:  # reported per replica; the push to the others goes on
            with self._lock:
                if not self.abandoned:  # (given up: its error says why)
                    self.failed = True
                    where = f"bucket {self.update.buckets}"
                    self.result.error = f"{type(e).__name__} ({where}): {e}"
        finally:
            with self._lock:
                self._crcs = None
                if not self.abandoned:  # (given up: its fields were set then)
                    self.result.note = self.update.note
                    self.result.seconds = time.perf_counter() - self._start
        return True

    def settled(self, future: Future[bool]) -> bool:
        """``future``'s result (this target's :meth:`send`), or True as soon as this
        target is given up (its thread, maybe blocked writing to it, is not waited for)."""
        while True:
            try:
                return future.result(timeout=0.1)
            except FutureTimeout:
                if self.abandoned:
                    return True

    def fall_back(self) -> _Sender:
        logger.info(
            "weight push v%d -> %s (%s): the gRPC stream (%s)",
            self.update.version,
            self.result.replica_id,
            self.result.address,
            self.update.note,
        )
        self.stream = _Sender(self.result, self._timeout_s, self._token)
        self.stream._start = self._start
        self.stream.thread.start()
        return self.stream

    def finish(self) -> ReplicaResult:
        """End this target's part; a bucketed update left unfinished (the push
        stopped before its final bucket) is aborted on the replica (not on one given
        up: it would not answer; its transfer time-out frees what it staged)."""
        if self.update.pending and not self.abandoned:
            self.update.abort("the pusher stopped before the final bucket")
            if not self.result.error:
                self.result.error = f"push stopped after {self.update.buckets} buckets"
        if self.stream is not None:
            self.stream.put(_Sender._END)
            self.stream.thread.join()
        self.channel.close()
        return self.result


def _push_bulk(
    buckets: Iterator[tuple[list[tuple[str, Any]], bool]],
    targets: Sequence[tuple[str, str]],
    version: int,
    transports: Sequence[str],
    timeout_s: float,
    auth_token: str | None,
    on_bucket: Callable[[int], None] | None,
) -> PushSummary:
    """Every bucket to every replica over the negotiated data plane (module docstring).

    Per bucket: the checksums start in a thread of their own, the replicas'
    transfers run in parallel from the same tensors, the gRPC streams of replicas
    that settled on them are fed meanwhile, and the next bucket is gathered once all
    of them are done with this one."""
    summary = PushSummary(version=version)
    replicas = [
        _BulkTarget(rid, addr, version, transports, timeout_s, auth_token) for rid, addr in targets
    ]
    pool = ThreadPoolExecutor(max_workers=max(1, len(replicas)))
    watched = _Liveness(lambda: [r.stream or r for r in replicas], auth_token)
    try:
        with watched:
            try:
                _move_buckets(buckets, replicas, summary, pool, version, on_bucket)
            finally:  # (watched meanwhile: a stream that froze is given up)
                _end_streams([r.stream for r in replicas if r.stream is not None])
    finally:
        summary.results = [r.finish() for r in replicas]
        # A given-up replica's thread (its socket cut, its calls cancelled) ends soon:
        # not waited for.
        pool.shutdown(wait=not any(r.abandoned for r in replicas))
    return summary


def _end_streams(streams: Sequence[_Sender]) -> None:
    """End every stream's call: the end of the update to all, then wait for each."""
    for s in streams:
        s.put(_Sender._END)
    for s in streams:
        s.thread.join()


def _move_buckets(
    buckets: Iterator[tuple[list[tuple[str, Any]], bool]],
    replicas: Sequence[_BulkTarget],
    summary: PushSummary,
    pool: ThreadPoolExecutor,
    version: int,
    on_bucket: Callable[[int], None] | None,
) -> None:
    """Each bucket to every replica: the bulk ones' transfers in parallel on ``pool``,
    the streams fed meanwhile; bucket 0's refusals move to the stream."""
    for index, (bucket, final) in enumerate(buckets):
        tensors = dict(bucket)
        del bucket
        _count(summary, tensors, index, on_bucket)
        live = [r for r in replicas if r.stream is None and not r.failed]
        crcs = SourceCrcs.of(tensors, tensor_specs(tensors, align=1)) if live else None
        try:
            moving = [(r, pool.submit(r.send, tensors, final, crcs)) for r in live]
            streams = [r.stream for r in replicas if r.stream is not None]
            if streams:
                _feed(streams, _bucket_chunks(tensors, version, index, final, summary.tensors))
            refused = [r for r, f in moving if not r.settled(f)]
        finally:
            if crcs is not None:
                crcs.close()
        if refused:  # bucket 0: these replicas take the gRPC stream
            _feed(
                [r.fall_back() for r in refused],
                _bucket_chunks(tensors, version, index, final, summary.tensors),
            )
        del tensors, moving


def _log_abandon(result: ReplicaResult, why: str) -> None:
    logger.warning(
        "weight push -> %s (%s): given up mid-push: %s", result.replica_id, result.address, why
    )


class _Liveness:
    """While a push runs (``with``), every :data:`PROBE_EVERY_S` probe the targets
    still moving it that moved nothing since the last round (``GetStatus`` within
    :data:`PROBE_TIMEOUT_S`, a second try after a missed deadline, all at once, each
    on a connection of its own, opened by a first ``GetStatus`` when the push starts)
    and abandon those that answer neither and still moved nothing. A replica that
    answers anything is alive.

    Targets have ``address``, ``moving()``, ``progress()`` (a value that changes as
    the push moves bytes to it) and ``abandon(why, seen)``."""

    def __init__(
        self,
        targets: Callable[[], Sequence[Any]],
        token: str | None,
        every_s: float | None = None,
    ) -> None:
        self._targets = targets
        self._token = token
        self._every_s = PROBE_EVERY_S if every_s is None else every_s
        self._stop = threading.Event()
        self._channels: dict[str, grpc.Channel] = {}
        self._connecting: list[Any] = []
        self._thread = threading.Thread(target=self._run, name="rlfleet-push-probe", daemon=True)

    def __enter__(self) -> _Liveness:
        # Connected before the push saturates the link, by a first GetStatus: not by
        # grpc.channel_ready_future, since gRPC watches such a channel's state from a
        # thread that polls every 0.2 s, and closing the channel waited for that
        # thread (0.2 s at the end of every push, 10% of a PPO step on a tiny model).
        for target in self._targets():
            stub = rollout_pb2_grpc.RolloutServiceStub(self._channel(target.address))
            self._connecting.append(
                stub.GetStatus.future(
                    rollout_pb2.GetRolloutStatusRequest(),
                    timeout=_PROBE_CONNECT_S,
                    wait_for_ready=True,
                )
            )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for future in self._connecting:
            future.cancel()
        for channel in self._channels.values():
            channel.close()

    def _channel(self, address: str) -> grpc.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = create_channel(address, auth_token=self._token, retry_unavailable=False)
            self._channels[address] = channel
        return channel

    def _run(self) -> None:
        last: dict[int, Any] = {id(t): t.progress() for t in self._targets()}
        while not self._stop.wait(self._every_s):
            stalled = []
            for t in self._targets():
                now = t.progress()
                if t.moving() and id(t) in last and last[id(t)] == now:
                    stalled.append((t, now))
                last[id(t)] = now
            if not stalled:
                continue
            with ThreadPoolExecutor(len(stalled)) as ex:
                answers = list(ex.map(lambda ts: self._probe(ts[0].address), stalled))
            for (target, seen), why in zip(stalled, answers, strict=True):
                if why is not None and not self._stop.is_set():
                    target.abandon(why, seen)

    def _probe(self, address: str) -> str | None:
        stub = rollout_pb2_grpc.RolloutServiceStub(self._channel(address))
        for attempt in range(2):  # a busy host may answer late once; a frozen one never does
            try:
                stub.GetStatus(
                    rollout_pb2.GetRolloutStatusRequest(),
                    timeout=PROBE_TIMEOUT_S,
                    wait_for_ready=True,
                )
                return None
            except grpc.RpcError as e:
                # No answer in time, or no connection (a process gone, a host away):
                # one more try, then it is given up.
                if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    return None  # it answered (an error is an answer)
                if attempt:
                    return f"it did not answer two liveness probes of {PROBE_TIMEOUT_S:g}s"
        return None


def _feed(senders: Sequence[_Sender], chunks: Iterable[rollout_pb2.WeightChunk]) -> None:
    for msg in chunks:
        for s in senders:
            s.put(msg)
