"""Weight push: the actor's full weights to every rollout replica, in buckets, in parallel.

Wire format (rollout.proto ``UpdateWeights``, a client stream of ``WeightChunk``): one
call per replica and version. The parameters, in Hugging Face names and the rollout's
dtype, are cut into *buckets* of at most ``bucket_bytes`` (a tensor larger than that
is a bucket of its own); each bucket is one codec chunk stream
(:func:`rlfleet.common.codec.iter_chunks`, its own ``stream_id``, crc32 per chunk,
sha256 on its last chunk) whose meta says::

    rlfleet.weights.version  the version, as on every WeightChunk
    rlfleet.weights.bucket   0, 1, 2, ...
    rlfleet.weights.final    "1" on the last bucket only, with
    rlfleet.weights.tensors  the number of tensors of the whole update

The sub-streams follow each other in the one call; the receiver verifies each, and
applies the update only when the final bucket arrived and every check passed
(:class:`WeightStreamReceiver`). A model that fits one bucket is exactly one codec
stream, which any plain ``ChunkAssembler`` receiver accepts.

Memory: buckets are gathered (from FSDP shards) and encoded one at a time, and every
chunk is encoded once and handed to all replicas' senders through small bounded
queues; the next bucket is gathered only after every replica took the chunks of this
one. Extra memory is one bucket plus a few chunks, whatever the model size.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from rlfleet.common.codec import ChunkAssembler, ChunkLike, CodecError, iter_chunks
from rlfleet.common.errors import InvalidArgument
from rlfleet.common.rpc import create_channel, to_rlfleet_error
from rlfleet.v1 import rollout_pb2, rollout_pb2_grpc

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "PushSummary",
    "ReplicaResult",
    "WeightStreamReceiver",
    "iter_buckets",
    "push_weights",
]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 << 20
_QUEUE_CHUNKS = 4
_META = "rlfleet.weights."


@dataclass
class ReplicaResult:
    replica_id: str
    address: str
    ok: bool = False
    error: str = ""
    seconds: float = 0.0


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
) -> PushSummary:
    """Stream ``named`` tensors to every ``(replica_id, address)`` in ``targets`` in parallel.

    ``named`` is consumed lazily, one bucket at a time (see the module docstring). A
    failing replica is reported in its :class:`ReplicaResult`; the others go on.
    ``on_bucket(nbytes)`` is called with each bucket's size once it is gathered.
    """
    summary = PushSummary(version=version)
    senders = [_Sender(rid, addr, timeout_s, auth_token) for rid, addr in targets]
    for s in senders:
        s.thread.start()
    try:
        index = 0
        for bucket, final in iter_buckets(named, bucket_bytes):
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            if on_bucket is not None:
                on_bucket(nbytes)
            summary.bytes += nbytes
            summary.tensors += len(bucket)
            summary.max_bucket_bytes = max(summary.max_bucket_bytes, nbytes)
            meta = {f"{_META}version": str(version), f"{_META}bucket": str(index)}
            if final:
                meta[f"{_META}final"] = "1"
                meta[f"{_META}tensors"] = str(summary.tensors)
            for chunk in iter_chunks(dict(bucket), meta):
                msg = rollout_pb2.WeightChunk(version=version, chunk=chunk)
                for s in senders:
                    s.put(msg)
            del bucket
            index += 1
        summary.buckets = index
    finally:
        for s in senders:
            s.put(_Sender._END)
        for s in senders:
            s.thread.join()
    summary.results = [s.result for s in senders]
    return summary


class WeightStreamReceiver:
    """Receiving side of the bucketed stream (see the module docstring).

    :meth:`receive` takes ``(version, chunk)`` pairs, verifies every bucket with a
    :class:`ChunkAssembler`, checks bucket order, the final marker, the tensor count and
    one version throughout, and returns ``(version, tensors)``; it raises
    ``InvalidArgument`` (nothing applied) otherwise.
    """

    def __init__(self) -> None:
        self.buckets = 0

    def receive(self, stream: Iterable[tuple[int, ChunkLike]]) -> tuple[int, dict[str, Any]]:
        tensors: dict[str, Any] = {}
        version: int | None = None
        asm = ChunkAssembler()
        final = False
        expected_tensors = -1
        for v, chunk in stream:
            if version is None:
                version = v
            elif v != version:
                raise InvalidArgument(
                    f"chunk of version {v} in an update of version {version}", field="version"
                )
            if final:
                raise InvalidArgument("chunks after the final bucket", field="chunks")
            try:
                done = asm.add(chunk)
            except CodecError as e:
                raise InvalidArgument(f"weight update rejected: {e}", field="chunks") from e
            if not done:
                continue
            values, meta = asm.result(to="torch")
            bucket = int(meta.get(f"{_META}bucket", "0"))
            if bucket != self.buckets:
                raise InvalidArgument(
                    f"bucket {bucket} arrived, expected {self.buckets}", field="bucket"
                )
            dup = set(values) & set(tensors)
            if dup:
                raise InvalidArgument(f"tensors sent twice: {sorted(dup)[:3]}", field="weights")
            tensors.update(values)
            self.buckets += 1
            # A plain single-stream sender has no meta: its one stream is the update.
            final = f"{_META}bucket" not in meta or meta.get(f"{_META}final") == "1"
            expected_tensors = int(meta.get(f"{_META}tensors", len(tensors)))
            asm = ChunkAssembler()
        if version is None:
            raise InvalidArgument("empty weight update", field="chunks")
        if not final:
            raise InvalidArgument(
                f"weight update {version} ended after {self.buckets} buckets without the "
                "final one; nothing applied",
                field="chunks",
            )
        if expected_tensors != len(tensors):
            raise InvalidArgument(
                f"weight update {version} has {len(tensors)} tensors, the sender said "
                f"{expected_tensors}",
                field="weights",
            )
        return version, tensors
