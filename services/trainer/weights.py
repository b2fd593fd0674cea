"""Weight push: the actor's full weights to every rollout replica, in buckets, in parallel.

Wire format: the bucketed weight stream of :mod:`rlfleet.common.weight_stream` (one
``UpdateWeights`` call per replica and version, each bucket of at most
``bucket_bytes`` one complete codec stream; a tensor larger than that is a bucket of
its own). The parameters are in Hugging Face names and the rollout's dtype. A model
that fits one bucket is exactly one codec stream, which any plain ``ChunkAssembler``
receiver accepts.

Bulk data plane: when ``transports`` name ``tcp`` or ``shm`` and the whole model fits
in one bucket, the bucket goes through the rollout's negotiated data plane
(:func:`rlfleet.rollout.client.push_weights`: shared memory on the same host, else a
raw TCP stream; the replica may still answer ``grpc``). A model of several buckets
always takes the gRPC stream: a bulk transfer (``OpenWeightTransfer``) is one whole,
self-contained update, checked against the model's full parameter list before any
byte moves, so it has no notion of a partial bucket to stage until the last one
arrives. Carrying buckets there needs a bucket index / final flag in
``WeightTransferOffer`` and a staging area across transfers on the replica (see
docs/rollout.md); until then, set ``bucket_bytes`` above the model size to use it.

Memory: buckets are gathered (from FSDP shards) and encoded one at a time, and every
chunk is encoded once and handed to all replicas' senders through small bounded
queues; the next bucket is gathered only after every replica took the chunks of this
one. Extra memory is one bucket plus a few chunks, whatever the model size.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from rlfleet.common.codec import iter_chunks
from rlfleet.common.errors import RlfleetError
from rlfleet.common.rpc import create_channel, to_rlfleet_error
from rlfleet.common.weight_stream import bucket_meta
from rlfleet.v1 import rollout_pb2, rollout_pb2_grpc

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "PushSummary",
    "ReplicaResult",
    "iter_buckets",
    "iter_weight_chunks",
    "push_weights",
]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 << 20
_QUEUE_CHUNKS = 4
_BULK = ("shm", "tcp")
_TRANSPORTS = ("shm", "tcp", "grpc")


@dataclass
class ReplicaResult:
    replica_id: str
    address: str
    ok: bool = False
    error: str = ""
    seconds: float = 0.0
    transport: str = "grpc"  # the path that moved the bytes


@dataclass
class PushSummary:
    version: int
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    max_bucket_bytes: int = 0
    results: list[ReplicaResult] = field(default_factory=list)


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Group ``(name, tensor)`` pairs into buckets of at most ``bucket_bytes``; yields
    ``(bucket, is_final)``. Pulls one tensor beyond the current bucket at most."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    current: list[tuple[str, torch.Tensor]] = []
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

    def __init__(self, replica_id: str, address: str, timeout_s: float, token: str | None) -> None:
        self.result = ReplicaResult(replica_id, address)
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=_QUEUE_CHUNKS)
        self._timeout_s = timeout_s
        self._token = token
        self.thread = threading.Thread(target=self._run, name=f"push-{replica_id}", daemon=True)

    def _requests(self) -> Iterator[rollout_pb2.WeightChunk]:
        while True:
            item = self.queue.get()
            if item is self._END:
                return
            yield item

    def _run(self) -> None:
        start = time.perf_counter()
        channel = create_channel(self.result.address, auth_token=self._token)
        try:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            stub.UpdateWeights(self._requests(), timeout=self._timeout_s)
            self.result.ok = True
        except grpc.RpcError as e:
            err = to_rlfleet_error(e)
            self.result.error = f"{type(err).__name__}: {err}"
        except Exception as e:  # reported per replica; the push to the others goes on
            self.result.error = f"{type(e).__name__}: {e}"
        finally:
            channel.close()
            self.result.seconds = time.perf_counter() - start

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
    named: Iterable[tuple[str, torch.Tensor]],
    targets: Sequence[tuple[str, str]],
    version: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout_s: float = 600.0,
    auth_token: str | None = None,
    on_bucket: Callable[[int], None] | None = None,
    transports: Sequence[str] = ("grpc",),
) -> PushSummary:
    """Stream ``named`` tensors to every ``(replica_id, address)`` in ``targets`` in parallel.

    ``named`` is consumed lazily, one bucket at a time (see the module docstring). A
    failing replica is reported in its :class:`ReplicaResult`; the others go on.
    ``on_bucket(nbytes)`` is called with each bucket's size once it is gathered.
    ``transports`` (names ``shm``, ``tcp``, ``grpc``, preference order) lets a
    one-bucket model take the bulk data plane; several buckets always go over gRPC.
    """
    unknown = [t for t in transports if t not in _TRANSPORTS]
    if unknown or not transports:
        raise ValueError(
            f"transports must be a non-empty subset of {_TRANSPORTS}, got {transports}"
        )
    buckets = iter_buckets(named, bucket_bytes)
    if any(t in _BULK for t in transports):
        first, final = next(buckets)
        if final:
            return _push_bulk(
                dict(first), targets, version, transports, timeout_s, auth_token, on_bucket
            )
        logger.info(
            "weight push %d: the model is more than one bucket of %d bytes; the bulk data "
            "plane takes whole updates only, using the gRPC stream",
            version,
            bucket_bytes,
        )
        buckets = itertools.chain([(first, final)], buckets)
    return _push_stream(buckets, targets, version, timeout_s, auth_token, on_bucket)


def iter_weight_chunks(
    named: Iterable[tuple[str, torch.Tensor]],
    version: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[rollout_pb2.WeightChunk]:
    """The ``UpdateWeights`` messages of one bucketed update, lazily (the gRPC stream
    :func:`push_weights` sends to every replica)."""
    return _encode(iter_buckets(named, bucket_bytes), version, PushSummary(version), None)


def _encode(
    buckets: Iterable[tuple[list[tuple[str, torch.Tensor]], bool]],
    version: int,
    summary: PushSummary,
    on_bucket: Callable[[int], None] | None,
) -> Iterator[rollout_pb2.WeightChunk]:
    for index, (bucket, final) in enumerate(buckets):
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        if on_bucket is not None:
            on_bucket(nbytes)
        summary.bytes += nbytes
        summary.tensors += len(bucket)
        summary.max_bucket_bytes = max(summary.max_bucket_bytes, nbytes)
        summary.buckets = index + 1
        meta = bucket_meta(version, index, final=final, tensors=summary.tensors)
        for chunk in iter_chunks(dict(bucket), meta):
            yield rollout_pb2.WeightChunk(version=version, chunk=chunk)
        del bucket


def _push_stream(
    buckets: Iterator[tuple[list[tuple[str, torch.Tensor]], bool]],
    targets: Sequence[tuple[str, str]],
    version: int,
    timeout_s: float,
    auth_token: str | None,
    on_bucket: Callable[[int], None] | None,
) -> PushSummary:
    summary = PushSummary(version=version)
    senders = [_Sender(rid, addr, timeout_s, auth_token) for rid, addr in targets]
    for s in senders:
        s.thread.start()
    try:
        for msg in _encode(buckets, version, summary, on_bucket):
            for s in senders:
                s.put(msg)
    finally:
        for s in senders:
            s.put(_Sender._END)
        for s in senders:
            s.thread.join()
    summary.results = [s.result for s in senders]
    return summary


def _push_bulk(
    tensors: dict[str, torch.Tensor],
    targets: Sequence[tuple[str, str]],
    version: int,
    transports: Sequence[str],
    timeout_s: float,
    auth_token: str | None,
    on_bucket: Callable[[int], None] | None,
) -> PushSummary:
    """The whole model (one bucket) to every replica over the negotiated data plane."""
    # Deferred: the rollout client pulls in the rollout package, which a trainer that
    # only streams over gRPC does not need.
    from rlfleet.rollout.client import push_weights as push_to_replica

    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if on_bucket is not None:
        on_bucket(nbytes)
    summary = PushSummary(
        version=version, bytes=nbytes, tensors=len(tensors), buckets=1, max_bucket_bytes=nbytes
    )

    def one(rid: str, address: str) -> ReplicaResult:
        result = ReplicaResult(rid, address)
        start = time.perf_counter()
        try:
            update = push_to_replica(
                address,
                tensors,
                version,
                transports=transports,
                timeout_s=timeout_s,
                auth_token=auth_token,
            )
            result.ok, result.transport = True, update.transport
        except RlfleetError as e:  # reported per replica; the push to the others goes on
            result.error = f"{type(e).__name__}: {e}"
        except (OSError, ValueError) as e:  # a socket or shared-memory failure
            result.error = f"{type(e).__name__}: {e}"
        result.seconds = time.perf_counter() - start
        return result

    with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
        summary.results = list(pool.map(lambda t: one(*t), targets))
    return summary
