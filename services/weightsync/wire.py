"""The weight-sync wire format: one definition for the sender and every receiver.

Everything both ends must agree on lives here, and nothing else: the transport
names and their ``WeightTransport`` codes, the bucketed chunk stream, the bulk
plane's offer / plan / commit messages (and their protobuf conversion, the only
place in :mod:`rlfleet.weightsync` that sees those messages), tensor sizes by dtype,
and the hand-framed ``WeightChunk``. Importable without torch.

**Transports.** ``shm`` (shared memory, same host), ``tcp`` (a raw byte stream),
``grpc`` (the ``UpdateWeights`` chunk stream, portable): :data:`AUTO` is that order,
the best first. A sender offers a preference list; the replica plans the first it
can serve (:mod:`rlfleet.weightsync.receiver`). :func:`transports_for` turns the
config's ``rollout.weight_transport`` (``auto`` or one name) into that list.

**The bucketed chunk stream** (rollout.proto ``UpdateWeights``, a client stream of
``WeightChunk``): one call per replica and version. The parameters are cut into
*buckets*; each bucket is one complete codec chunk stream
(:func:`rlfleet.common.codec.wire.iter_chunks`: its own ``stream_id``, crc32c per chunk, a
digest on its last chunk) whose meta says::

    rlfleet.weights.version  the version, as on every WeightChunk
    rlfleet.weights.bucket   0, 1, 2, ...
    rlfleet.weights.final    "1" on the last bucket only, with
    rlfleet.weights.tensors  the number of tensors of the whole update

The streams follow each other in the one call. A stream without
``rlfleet.weights.bucket`` is a whole update by itself (a plain single-stream sender
such as :func:`rlfleet.weightsync.sender.stream_weights`).

:class:`WeightStreamReceiver` stages every bucket, verifies each, and returns the
union only once the final bucket arrived and every check passed; the caller then
checks the union against its model and swaps (all or nothing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rlfleet.common.codec.batch import CodecError, TensorSpec
from rlfleet.common.codec.wire import (
    ChecksumMismatch,
    ChunkAssembler,
    ChunkLike,
    ChunkView,
    Envelope,
    StreamTooLarge,
    encode_varint,
    parse_envelope,
)
from rlfleet.common.errors import DataLoss, InvalidArgument, ResourceExhausted
from rlfleet.v1 import common_pb2, rollout_pb2

__all__ = [
    "AUTO",
    "BULK",
    "META_BUCKET",
    "META_FINAL",
    "META_TENSORS",
    "META_VERSION",
    "TRANSPORT_CODES",
    "TRANSPORT_NAMES",
    "WEIGHT_TRANSPORT_MODES",
    "AbortResult",
    "TransferOffer",
    "TransferPlan",
    "UpdateResult",
    "WeightChunkView",
    "WeightStreamReceiver",
    "WeightTransportMode",
    "abort_from_proto",
    "abort_to_proto",
    "bucket_meta",
    "check_transports",
    "dtype_name",
    "offer_from_proto",
    "offer_to_proto",
    "parse_weight_chunk",
    "plan_from_proto",
    "plan_to_proto",
    "spec_nbytes",
    "transport_codes",
    "transport_names",
    "transports_for",
    "update_from_proto",
    "update_to_proto",
    "weight_envelope",
]

# ----------------------------------------------------------------------- transports

_T = rollout_pb2
#: Transport name -> ``WeightTransport`` code: every name the protocol knows.
TRANSPORT_CODES: dict[str, int] = {
    "grpc": _T.WEIGHT_TRANSPORT_GRPC,
    "tcp": _T.WEIGHT_TRANSPORT_TCP,
    "shm": _T.WEIGHT_TRANSPORT_SHM,
    "nccl": _T.WEIGHT_TRANSPORT_NCCL,
    "cuda_ipc": _T.WEIGHT_TRANSPORT_CUDA_IPC,
}
#: ``WeightTransport`` code -> transport name.
TRANSPORT_NAMES: dict[int, str] = {code: name for name, code in TRANSPORT_CODES.items()}
#: The transports implemented end to end, best first: the sender's default offer.
AUTO: tuple[str, ...] = ("shm", "tcp", "grpc")
#: The bulk data plane (bytes moved outside gRPC, one transfer per bucket).
BULK: tuple[str, ...] = ("shm", "tcp")

WeightTransportMode = Literal["auto", "shm", "tcp", "grpc"]
#: Values of ``rollout.weight_transport``.
WEIGHT_TRANSPORT_MODES: tuple[str, ...] = ("auto", *AUTO)


def transports_for(mode: str) -> tuple[str, ...]:
    """The offer for ``rollout.weight_transport``: ``auto`` is :data:`AUTO` (shared
    memory on the replica's host, else TCP, else the gRPC stream, chosen per
    replica); a transport name forces that one alone (a replica that cannot serve
    it fails rather than falling back)."""
    if mode == "auto":
        return AUTO
    if mode in AUTO:
        return (mode,)
    raise ValueError(f"weight transport must be one of {WEIGHT_TRANSPORT_MODES}, got {mode!r}")


def check_transports(names: Sequence[str]) -> None:
    """Raise ``ValueError`` unless ``names`` is a non-empty list of implemented
    transports (a sender's offer)."""
    unknown = [t for t in names if t not in AUTO]
    if unknown or not names:
        raise ValueError(
            f"transports must be a non-empty subset of {', '.join(AUTO)}; got {list(names)}"
        )


def transport_codes(names: Iterable[str]) -> list[int]:
    """Transport names -> ``WeightTransport`` values (``ValueError`` for a name the
    protocol does not know)."""
    names = list(names)
    unknown = [n for n in names if n not in TRANSPORT_CODES]
    if unknown:
        raise ValueError(f"unknown weight transports {unknown}; known: {sorted(TRANSPORT_CODES)}")
    return [TRANSPORT_CODES[n] for n in names]


def transport_names(codes: Iterable[int], *, field: str = "transports") -> list[str]:
    """``WeightTransport`` values -> names; an empty list is :data:`AUTO` (the best
    available, chosen per replica). A code that is not implemented end to end
    (unspecified, NCCL, CUDA IPC) is ``InvalidArgument``."""
    names = []
    for code in codes:
        name = TRANSPORT_NAMES.get(code)
        if name not in AUTO:
            raise InvalidArgument(
                f"weight transport {code} ({name or 'unknown'}) is not implemented "
                f"(implemented: {', '.join(AUTO)})",
                field=field,
                value=code,
            )
        names.append(name)
    return names or list(AUTO)


# ------------------------------------------------------------------ the chunk stream

META_VERSION = "rlfleet.weights.version"
META_BUCKET = "rlfleet.weights.bucket"
META_FINAL = "rlfleet.weights.final"
META_TENSORS = "rlfleet.weights.tensors"


def bucket_meta(version: int, bucket: int, *, final: bool, tensors: int = 0) -> dict[str, str]:
    """The codec meta of bucket number ``bucket``; ``tensors`` (the count of the whole
    update) is only written on the final bucket."""
    meta = {META_VERSION: str(version), META_BUCKET: str(bucket)}
    if final:
        meta[META_FINAL] = "1"
        meta[META_TENSORS] = str(tensors)
    return meta


def _int_meta(meta: dict[str, str], key: str, version: int) -> int:
    """A non-negative integer written as senders write it: ASCII digits only (Python's
    ``int`` would also take ``-0``, `` 1_0`` or other scripts' digits)."""
    text = meta[key]
    if not (text.isascii() and text.isdigit() and len(text) <= 20):
        raise InvalidArgument(
            f"weight update {version}: meta {key}={text[:32]!r} is not a non-negative integer",
            field=key,
            value=text[:32],
        )
    return int(text)


class WeightStreamReceiver:
    """Receives one bucketed weight update (the module docstring's format).

    Checks, nothing applied on any failure:

    - one version on every chunk, and in each bucket's meta (``InvalidArgument``);
    - each bucket's codec checks: seq, crc32c, byte ranges, digest (``DataLoss``,
      code ``CORRUPT_CHUNK``);
    - buckets numbered 0, 1, 2, ... in order, no tensor twice, nothing after the
      final bucket, and the final bucket's tensor count (``InvalidArgument``);
    - the stream does not end inside a bucket or before the final one (``DataLoss``,
      code ``INCOMPLETE_UPDATE``).

    Args:
        on_version: called with the version on the first chunk, before anything is
            staged (a replica refuses a stale version there rather than after the
            whole model arrived).

    Attributes:
        buckets: complete buckets received so far.
        chunks: chunks received so far.
    """

    def __init__(
        self, on_version: Callable[[int], None] | None = None, *, max_bytes: int | None = None
    ) -> None:
        self._on_version = on_version
        self._max_bytes = max_bytes
        self.buckets = 0
        self.chunks = 0

    def _assembler(self, received: int) -> ChunkAssembler:
        if self._max_bytes is None:
            return ChunkAssembler()
        # At least 1: with the budget spent, any further chunk is over it (each is
        # charged more than a byte), while an update that ends exactly here passes.
        return ChunkAssembler(max_bytes=max(1, self._max_bytes - received))

    def receive(self, stream: Iterable[tuple[int, ChunkLike]]) -> tuple[int, dict[str, Any]]:
        """Consume ``(version, TensorBatchChunk)`` pairs; return ``(version, tensors)``
        (torch tensors wrapping the receiver's buffers) of the complete update."""
        tensors: dict[str, Any] = {}
        version: int | None = None
        received = 0  # bytes of the complete buckets
        asm = self._assembler(received)
        final = False
        expected_tensors = -1
        pending = 0  # chunks of the bucket being assembled
        for v, chunk in stream:
            if version is None:
                version = v
                if self._on_version is not None:
                    self._on_version(v)
            elif v != version:
                raise InvalidArgument(
                    f"chunk {self.chunks} has version {v}, the update began with {version}",
                    field="version",
                    value=v,
                )
            if final:
                raise InvalidArgument(
                    f"weight update {version}: chunk {self.chunks} arrived after the final "
                    f"bucket ({self.buckets} buckets)",
                    field="chunks",
                )
            try:
                done = asm.add(chunk)
            except StreamTooLarge as e:
                raise ResourceExhausted(
                    f"weight update {version} refused in bucket {self.buckets}: {e} (the "
                    f"replica takes at most {self._max_bytes} bytes per update)",
                    field=e.field or "chunks",
                    value=e.value,
                    code="UPDATE_TOO_LARGE",
                ) from e
            except ChecksumMismatch as e:  # damaged on the way
                raise DataLoss(
                    f"weight update {version} rejected in bucket {self.buckets}: {e}",
                    code="CORRUPT_CHUNK",
                ) from e
            except CodecError as e:  # a malformed chunk: the sender's mistake
                raise InvalidArgument(
                    f"weight update {version} refused in bucket {self.buckets}: {e}",
                    field=e.field or "chunk",
                    value=e.value,
                    code="MALFORMED_CHUNK",
                ) from e
            self.chunks += 1
            pending += 1
            if not done:
                continue
            pending = 0
            values, meta = asm.result(to="torch")
            columns = [k for k, v in values.items() if not hasattr(v, "numel")]
            if columns:
                raise InvalidArgument(
                    f"weight update {version} bucket {self.buckets}: column {columns[0]!r} is "
                    "not a tensor (weight updates carry tensors only)",
                    field="chunk.columns",
                    value=columns[0],
                )
            received += asm.held  # tensor bytes, names and slots: what the bucket holds
            asm = self._assembler(received)
            final = self._check_bucket(version, meta, values, tensors)
            tensors.update(values)
            self.buckets += 1
            if final:
                expected_tensors = (
                    _int_meta(meta, META_TENSORS, version) if META_TENSORS in meta else len(tensors)
                )
        if version is None:
            raise InvalidArgument("empty weight update: no chunks", field="chunks")
        if not final:
            where = (
                "inside a bucket, without its last chunk" if pending else "without the final bucket"
            )
            raise DataLoss(
                f"weight update {version} ended after {self.chunks} chunks and "
                f"{self.buckets} complete buckets, {where}; nothing applied",
                code="INCOMPLETE_UPDATE",
            )
        if expected_tensors != len(tensors):
            raise InvalidArgument(
                f"weight update {version} has {len(tensors)} tensors, the sender said "
                f"{expected_tensors}",
                field="weights",
                value=len(tensors),
            )
        return version, tensors

    def _check_bucket(
        self, version: int, meta: dict[str, str], values: dict[str, Any], seen: dict[str, Any]
    ) -> bool:
        """Check one complete bucket against those before it; True if it is the final one."""
        if META_BUCKET not in meta:
            # A plain single-stream sender: its one stream is the whole update.
            if self.buckets:
                raise InvalidArgument(
                    f"weight update {version}: a stream without bucket meta after "
                    f"{self.buckets} buckets",
                    field="chunks",
                )
            return True
        bucket = _int_meta(meta, META_BUCKET, version)
        if bucket != self.buckets:
            raise InvalidArgument(
                f"weight update {version}: bucket {bucket} arrived, expected {self.buckets}",
                field="bucket",
                value=bucket,
            )
        if META_VERSION in meta and _int_meta(meta, META_VERSION, version) != version:
            raise InvalidArgument(
                f"bucket {bucket} says version {meta[META_VERSION]}, its chunks {version}",
                field="version",
                value=meta[META_VERSION],
            )
        dup = sorted(set(values) & set(seen))
        if dup:
            raise InvalidArgument(
                f"weight update {version}: tensors sent twice (bucket {bucket}): {dup[:3]}",
                field="weights",
                value=dup[:3],
            )
        return meta.get(META_FINAL) == "1"


def weight_envelope(version: int) -> Envelope:
    """Codec chunks framed as ``WeightChunk{version = 1, chunk = 2}`` in place
    (:class:`~rlfleet.common.codec.wire.Envelope`), so that no chunk is copied again
    to frame it."""
    return Envelope(field=2, prefix=(b"\x08" + encode_varint(version)) if version else b"")


@dataclass(frozen=True, slots=True)
class WeightChunkView:
    """A parsed ``WeightChunk``: its version and its chunk, whose tensor bytes are
    views into the received message (see :func:`parse_weight_chunk`)."""

    version: int
    chunk: ChunkView


def parse_weight_chunk(data: bytes | memoryview) -> WeightChunkView:
    """A ``WeightChunk`` (any valid encoding) with its chunk parsed by
    :func:`~rlfleet.common.codec.wire.parse_chunk`, the tensor bytes not copied (the
    rollout service's request deserializer for ``UpdateWeights``). Raises
    ``CodecError`` on malformed bytes."""
    chunk, head = parse_envelope(data, 2, rollout_pb2.WeightChunk)
    return WeightChunkView(head.version, chunk)


# ------------------------------------------------------------------- the bulk plane


@dataclass(frozen=True, slots=True)
class TransferOffer:
    """A sender's proposal (``WeightTransferOffer``)."""

    version: int
    tensors: list[TensorSpec]  # offsets packed back to back, in byte order
    total_bytes: int
    transports: list[str]
    # The sender's host identity (:func:`rlfleet.weightsync.shm.host_identity`):
    # shared memory is planned only when it equals the replica's.
    sender_host: str = ""
    # A bucketed update (several transfers): this bucket's index, whether it is the
    # last, and the update's id (from bucket 0's plan). The defaults, bucket 0 and
    # final with no id, are a whole update in one transfer.
    bucket: int = 0
    final: bool = True
    update_id: str = ""

    @property
    def whole(self) -> bool:
        """One transfer that is the whole update (not a bucket of a larger one)."""
        return self.final and self.bucket == 0 and not self.update_id


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """The receiver's answer (``WeightTransferPlan``)."""

    transfer_id: str
    transport: str
    endpoint: str = ""
    # TCP: the one-time token the sender presents first. SHM: the nonce in the
    # segment's header, which the sender checks before writing.
    token: str = ""
    update_id: str = ""  # a bucketed update's id, for its later buckets' offers


@dataclass(frozen=True, slots=True)
class AbortResult:
    """What aborting a bucketed update did (``AbortWeightTransferResponse``)."""

    aborted: bool  # False: no such update in progress, nothing done
    staged_buckets: int = 0  # committed buckets dropped
    freed_bytes: int = 0  # staging bytes the update held (staged and in flight)


@dataclass(frozen=True, slots=True)
class UpdateResult:
    """What an applied update did (``UpdateWeightsResponse``)."""

    version: int  # now serving
    bytes: int
    tensors: int
    seconds: float  # from the first byte staged to the swap done
    transport: str = "grpc"
    # A bulk bucket that is not its update's last: verified and staged, nothing
    # applied (``version`` is the one still serving; bytes / tensors the bucket's).
    staged: bool = False
    # The engine took the staged tensors as its weights, no copy (``Engine.update_weights``).
    adopted: bool = False


_ITEMSIZE = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
    "int16": 2, "int32": 4, "int64": 8, "bool": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip


def dtype_name(code: int) -> str:
    """A ``DType`` value's torch name (``bfloat16``, ...); ``ValueError`` if unknown."""
    return str(common_pb2.DType.Name(code)).lower()


def spec_nbytes(name: str, dtype: int, shape: Sequence[int], *, field: str = "tensors") -> int:
    """Bytes of a tensor of ``dtype`` (a ``DType`` value) and ``shape``; raises
    ``InvalidArgument`` for an unknown dtype or a negative dimension."""
    try:
        itemsize = _ITEMSIZE[dtype_name(dtype)]
    except (ValueError, KeyError) as e:
        raise InvalidArgument(
            f"tensor {name!r}: unsupported dtype {dtype}", field=f"{field}.dtype", value=dtype
        ) from e
    if any(d < 0 for d in shape):
        raise InvalidArgument(
            f"tensor {name!r}: negative dimension in shape {list(shape)}",
            field=f"{field}.shape",
            value=list(shape),
        )
    return math.prod(shape) * itemsize


def update_to_proto(r: UpdateResult) -> rollout_pb2.UpdateWeightsResponse:
    return rollout_pb2.UpdateWeightsResponse(
        version=r.version, bytes=r.bytes, tensors=r.tensors, seconds=r.seconds, staged=r.staged
    )


def update_from_proto(
    msg: rollout_pb2.UpdateWeightsResponse, transport: str = "grpc"
) -> UpdateResult:
    return UpdateResult(
        version=msg.version,
        bytes=msg.bytes,
        tensors=msg.tensors,
        seconds=msg.seconds,
        transport=transport,
        staged=msg.staged,
    )


def offer_to_proto(o: TransferOffer) -> rollout_pb2.WeightTransferOffer:
    return rollout_pb2.WeightTransferOffer(
        version=o.version,
        tensors=[
            rollout_pb2.TensorSpec(name=s.name, dtype=s.dtype, shape=s.shape) for s in o.tensors
        ],
        total_bytes=o.total_bytes,
        transports=transport_codes(o.transports),
        sender_host=o.sender_host,
        bucket=o.bucket,
        more_buckets=not o.final,
        update_id=o.update_id,
    )


def offer_from_proto(msg: rollout_pb2.WeightTransferOffer) -> TransferOffer:
    """Offsets are recomputed (packed in order, no padding); dtypes and shapes are
    checked later against the model. Transports the receiver does not serve (NCCL,
    CUDA IPC) are kept: the plan picks among the ones it serves."""
    specs: list[TensorSpec] = []
    offset = 0
    for i, t in enumerate(msg.tensors):
        shape = tuple(int(d) for d in t.shape)
        nbytes = spec_nbytes(t.name, t.dtype, shape, field=f"tensors[{i}]")
        specs.append(TensorSpec(t.name, t.dtype, shape, nbytes, offset))
        offset += nbytes
    unknown = [c for c in msg.transports if c not in TRANSPORT_NAMES]
    if unknown:
        raise InvalidArgument(
            f"unknown transports {unknown}", field="transports", value=list(msg.transports)
        )
    return TransferOffer(
        version=msg.version,
        tensors=specs,
        total_bytes=msg.total_bytes,
        transports=[TRANSPORT_NAMES[c] for c in msg.transports],
        sender_host=msg.sender_host,
        bucket=msg.bucket,
        final=not msg.more_buckets,
        update_id=msg.update_id,
    )


def plan_to_proto(p: TransferPlan) -> rollout_pb2.WeightTransferPlan:
    return rollout_pb2.WeightTransferPlan(
        transfer_id=p.transfer_id,
        transport=TRANSPORT_CODES[p.transport],
        endpoint=p.endpoint,
        token=p.token,
        update_id=p.update_id,
    )


def plan_from_proto(msg: rollout_pb2.WeightTransferPlan) -> TransferPlan:
    return TransferPlan(
        transfer_id=msg.transfer_id,
        transport=TRANSPORT_NAMES.get(msg.transport, "grpc"),
        endpoint=msg.endpoint,
        token=msg.token,
        update_id=msg.update_id,
    )


def abort_to_proto(r: AbortResult) -> rollout_pb2.AbortWeightTransferResponse:
    return rollout_pb2.AbortWeightTransferResponse(
        aborted=r.aborted, staged_buckets=r.staged_buckets, freed_bytes=r.freed_bytes
    )


def abort_from_proto(msg: rollout_pb2.AbortWeightTransferResponse) -> AbortResult:
    return AbortResult(
        aborted=msg.aborted, staged_buckets=msg.staged_buckets, freed_bytes=msg.freed_bytes
    )
