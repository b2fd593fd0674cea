"""The wire format of batches: ``TensorBatch`` messages and chunk streams.

Values become typed bytes in :mod:`rlfleet.common.codec.batch` (value rules,
decode rules, flat buffers); this module frames those bytes as the v1 protobuf
messages and back. Torch-free at import time, like the batch module.

* **Whole batches** -- :func:`encode_batch` / :func:`decode_batch` for a
  ``TensorBatch`` that fits in one gRPC message.
* **Chunked streams** -- :func:`iter_chunks` (``TensorBatchChunk`` messages) or
  :func:`iter_chunk_bytes` (the same chunks already serialized, byte-identical to
  ``SerializeToString(deterministic=True)``), and :class:`ChunkAssembler` /
  :func:`assemble_chunks` on the receiving side, which accept messages, raw bytes
  or :class:`ChunkView` objects from :func:`parse_chunk`. The bytes path is the
  fast one: ``serialize_chunk`` / ``parse_chunk`` plug into gRPC as custom
  (de)serializers, so tensor bytes are copied once when a chunk is built and once
  when it is reassembled, and never pass through upb's bytes fields (which copy on
  every set and get).

Copies and checksums: building a chunk copies each piece into the chunk's bytes
and computes its CRC-32C on the bytes copied; assembling copies each piece once into
its tensor's buffer (freshly allocated, or the caller's via
``ChunkAssembler(out=...)``), again with the CRC-32C of the bytes copied. Both copy
between views of the bytes (:func:`~rlfleet.common.crc32c.copy_crc_views`): in one
pass where the C extension is built, else a 256 KiB block at a time, each block
checksummed right after it is written, while it is in cache. Decoded tensors own their
memory: they never alias a message or a received chunk. Every tensor byte is copied
exactly once on decode; for a single ``TensorBatch`` upb's getter makes one more
copy that cannot be avoided through its API.

Every malformed input raises :class:`~rlfleet.common.codec.batch.CodecError` (a
``ValueError``) with a message naming the tensor, column or chunk and the actual
values.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import struct
import sys
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, TypeVar, cast

import numpy as np
from google.protobuf.message import DecodeError, Message

from rlfleet.common.codec.batch import (
    Batch,
    CodecError,
    ColumnRows,
    TensorBytes,
    To,
    U8Array,
    as_value,
    check_byteorder,
    check_to,
    decode_rows,
    destination_bytes,
    dtype_name,
    expected_nbytes,
    split_batch,
)
from rlfleet.common.crc32c import copy_crc_views, crc32c_extend
from rlfleet.v1 import common_pb2

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "ChecksumMismatch",
    "ChunkAssembler",
    "ChunkLike",
    "ChunkView",
    "Digest",
    "Envelope",
    "PieceView",
    "StreamTooLarge",
    "assemble_chunks",
    "decode_batch",
    "encode_batch",
    "encode_varint",
    "iter_chunk_bytes",
    "iter_chunks",
    "parse_chunk",
    "parse_envelope",
    "proto_fields",
    "serialize_chunk",
]

Digest = Literal["chunks", "data"]

M = TypeVar("M", bound=Message)

#: Below gRPC's default 4 MiB receive limit, with room for the framing.
DEFAULT_MAX_CHUNK_BYTES = 4_000_000

# What the assembler charges against ``max_bytes`` for each chunk and each piece
# besides their bytes (bookkeeping), so that a stream of empty chunks is bounded too.
_CHUNK_CHARGE = 256
_PIECE_CHARGE = 128


class ChecksumMismatch(CodecError):
    """The bytes differ from what the sender checksummed (a chunk's crc32c, the
    stream's digest): corrupted in transit, where other codec errors are a malformed
    request."""


class StreamTooLarge(CodecError):
    """A chunk stream declared or sent more bytes than its assembler's ``max_bytes``."""


def _check_meta(meta: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(meta or {})
    for k, v in out.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise CodecError(f"meta must map str to str, got {k!r}: {v!r}")
    return out


def _column(c: ColumnRows) -> common_pb2.Column:
    rows = common_pb2.StringList(values=c.rows)
    if c.kind == "strings":
        return common_pb2.Column(name=c.name, strings=rows)
    return common_pb2.Column(name=c.name, json=rows)


def _column_rows(col: common_pb2.Column) -> tuple[str, list[str]]:
    kind = col.WhichOneof("values")
    if kind == "strings":
        return kind, list(col.strings.values)
    if kind == "json":
        return kind, list(col.json.values)
    raise CodecError(f"column {col.name!r} has neither strings nor json values")


# --------------------------------------------------------------------------- whole batches


def encode_batch(
    batch: Mapping[str, Any], meta: Mapping[str, str] | None = None
) -> common_pb2.TensorBatch:
    """Encode a batch into one ``TensorBatch`` message.

    Args:
        batch: name -> torch tensor | numpy array | list (see the module docstring).
            Tensors keep the mapping's order.
        meta: str -> str, carried as ``TensorBatch.meta``.

    Returns:
        The message. It must fit gRPC's message limit; use :func:`iter_chunks` or
        :func:`iter_chunk_bytes` for anything large.

    Raises:
        CodecError: for an unsupported value, dtype or meta entry.
    """
    tensors, columns = split_batch(batch)
    msg = common_pb2.TensorBatch()
    for t in tensors:
        msg.tensors.add(name=t.name, dtype=t.dtype, shape=t.shape, data=t.data.tobytes())
    msg.columns.extend(_column(c) for c in columns)
    msg.meta.update(_check_meta(meta))
    return msg


def decode_batch(msg: common_pb2.TensorBatch, *, to: To = "torch") -> tuple[Batch, dict[str, str]]:
    """Decode a ``TensorBatch``.

    Returns:
        ``(values, meta)``: tensors (as torch or numpy, per ``to``; see the module
        docstring) followed by columns (lists), each in message order.

    Raises:
        CodecError: a data length that does not match dtype x shape, an unknown
        dtype, a duplicate name, bad JSON, or bfloat16/float8 with ``to="numpy"``.
    """
    check_byteorder()
    check_to(to)
    values: Batch = {}
    for t in msg.tensors:
        shape = tuple(int(d) for d in t.shape)
        expected = expected_nbytes(t.name, t.dtype, shape)
        data = t.data  # upb hands back a fresh copy
        if len(data) != expected:
            raise CodecError(
                f"tensor {t.name!r}: {len(data)} data bytes, but {dtype_name(t.dtype)} "
                f"{list(shape)} needs {expected}"
            )
        if t.name in values:
            raise CodecError(f"duplicate name {t.name!r} in TensorBatch")
        buf = np.frombuffer(data, dtype=np.uint8).copy()  # owned, writable, aligned
        values[t.name] = as_value(buf, t.name, t.dtype, shape, to)
    for col in msg.columns:
        if col.name in values:
            raise CodecError(f"duplicate name {col.name!r} in TensorBatch")
        kind, rows = _column_rows(col)
        values[col.name] = decode_rows(col.name, kind, rows)
    return values, dict(msg.meta)


# --------------------------------------------------------------------------- chunk planning


def _varint_len(n: int) -> int:
    return (n.bit_length() + 6) // 7 or 1


def encode_varint(n: int) -> bytes:
    """Protobuf base-128 varint of ``n`` >= 0."""
    # Up to five bytes (any length below 256 MiB, any crc32c) without a loop: framing
    # is written per chunk and per piece.
    if n < 0x80:
        return bytes((n,))
    if n < 1 << 14:
        return bytes((n & 0x7F | 0x80, n >> 7))
    if n < 1 << 21:
        return bytes((n & 0x7F | 0x80, n >> 7 & 0x7F | 0x80, n >> 14))
    if n < 1 << 28:
        return bytes((n & 0x7F | 0x80, n >> 7 & 0x7F | 0x80, n >> 14 & 0x7F | 0x80, n >> 21))
    if n < 1 << 35:  # a crc32c is 5 bytes more often than not
        return bytes(
            (
                n & 0x7F | 0x80,
                n >> 7 & 0x7F | 0x80,
                n >> 14 & 0x7F | 0x80,
                n >> 21 & 0x7F | 0x80,
                n >> 28,
            )
        )
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _framed(payload_len: int) -> int:
    """Size of a length-delimited field with a one-byte tag."""
    return 1 + _varint_len(payload_len) + payload_len


def _piece_len(header_len: int, n: int) -> int:
    return header_len + (_framed(n) if n else 0)


def _max_piece_data(room: int, header_len: int) -> int:
    """Largest n > 0 whose framed piece fits in ``room`` bytes, or 0."""
    n = room - header_len - 2 - 2 * _varint_len(max(room, 1))
    if n <= 0:
        return 0
    while _framed(_piece_len(header_len, n + 1)) <= room:
        n += 1
    return n


def _piece_header(t: TensorBytes, offset: int) -> bytes:
    return common_pb2.TensorPiece(
        name=t.name,
        dtype=cast("common_pb2.DType", t.dtype),
        shape=t.shape,
        nbytes=t.nbytes,
        offset=offset,
    ).SerializeToString()


@dataclass(slots=True)
class _PlannedPiece:
    tensor: TensorBytes
    offset: int
    length: int
    # Field 4's tag and length, the piece header, and field 6's tag and length: all
    # the framing before the data, written when the chunk is built.
    prefix: bytes
    src: memoryview  # the piece's bytes in the tensor


def _planned_piece(
    t: TensorBytes, offset: int, length: int, header: bytes, whole: memoryview
) -> _PlannedPiece:
    prefix = b"\x22" + encode_varint(_piece_len(len(header), length)) + header
    if length:
        prefix += b"\x32" + encode_varint(length)
    return _PlannedPiece(t, offset, length, prefix, whole[offset : offset + length])


@dataclass(slots=True)
class _PlannedChunk:
    pieces: list[_PlannedPiece] = field(default_factory=list)
    columns: list[common_pb2.Column] = field(default_factory=list)
    pieces_size: int = 0  # the pieces' bytes on the wire, framing included

    def empty(self) -> bool:
        return not self.pieces and not self.columns

    def add(self, piece: _PlannedPiece) -> None:
        self.pieces.append(piece)
        self.pieces_size += len(piece.prefix) + piece.length


# The tail of a chunk with nothing but its crc32c: field 7's tag and a varint of up to
# 5 bytes.
_PLAIN_TAIL_ROOM = 6

# Fixed per-chunk reserve for the scalar fields: seq (1+5), last (2), crc32c (1+5),
# total_bytes (1+10), num_chunks (1+5) and digest (2 + "chunks:" + 64 hex).
_SCALAR_RESERVE = 6 + 2 + 6 + 11 + 6 + 2 + 7 + 64


def _plan(
    tensors: list[TensorBytes],
    columns: list[common_pb2.Column],
    meta: dict[str, str],
    max_chunk_bytes: int,
    stream_id: str,
) -> list[_PlannedChunk]:
    sid = len(stream_id.encode())
    cap = max_chunk_bytes - _SCALAR_RESERVE - (_framed(sid) if sid else 0)
    if cap < 64:
        raise CodecError(
            f"max_chunk_bytes={max_chunk_bytes} leaves {cap} bytes per chunk after framing; "
            f"use at least {max_chunk_bytes - cap + 64}"
        )
    meta_size = sum(
        _framed(_framed(len(k.encode())) + _framed(len(v.encode()))) for k, v in meta.items()
    )
    if meta_size > cap:
        raise CodecError(f"meta needs {meta_size} bytes but a chunk holds {cap}")
    min_split = min(4096, cap // 8)
    chunks: list[_PlannedChunk] = []
    cur = _PlannedChunk()
    room = cap - meta_size

    def next_chunk() -> None:
        nonlocal cur, room
        chunks.append(cur)
        cur, room = _PlannedChunk(), cap

    # Columns lead the stream; a column too big for the room left is split by rows
    # into consecutive Column entries with the same name.
    for col in columns:
        size = _framed(col.ByteSize())
        if size <= room:
            cur.columns.append(col)
            room -= size
            continue
        kind, rows = _column_rows(col)
        nlen = len(col.name.encode())
        name_part = _framed(nlen) if nlen else 0

        def col_size(list_len: int, name_part: int = name_part) -> int:
            return _framed(name_part + _framed(list_len))

        if not rows:
            if size > cap:
                raise CodecError(f"column {col.name!r} needs {size} bytes; a chunk holds {cap}")
            next_chunk()
            cur.columns.append(col)
            room -= size
            continue
        i = 0
        while i < len(rows):
            take: list[str] = []
            list_len = 0
            while i < len(rows):
                row_size = _framed(len(rows[i].encode()))
                if col_size(list_len + row_size) > room:
                    break
                take.append(rows[i])
                list_len += row_size
                i += 1
            if not take:
                if room == cap:  # a fresh chunk cannot hold it either
                    raise CodecError(
                        f"column {col.name!r} row {i} needs {col_size(_framed(len(rows[i].encode())))} "
                        f"bytes but a chunk holds {cap} (max_chunk_bytes={max_chunk_bytes})"
                    )
                next_chunk()
                continue
            part = common_pb2.Column(name=col.name)
            getattr(part, kind).values.extend(take)
            cur.columns.append(part)
            room -= col_size(list_len)
            if i < len(rows):
                next_chunk()

    for t in tensors:
        off = 0
        nbytes = t.nbytes
        whole = t.data.data  # the tensor's bytes, as a view made once
        # The header at offset 0 leaves out field 5 (proto3), the last of the header's
        # fields: at any other offset it is the same bytes followed by field 5.
        first = header = _piece_header(t, 0)
        while True:
            rem = nbytes - off
            need = _framed(_piece_len(len(header), rem))
            if need <= room:
                cur.add(_planned_piece(t, off, rem, header, whole))
                room -= need
                break
            if need <= cap and room < cap:
                next_chunk()  # keep tensors that fit one chunk whole
                continue
            n = _max_piece_data(room, len(header))
            if n < min_split:
                if room == cap:
                    raise CodecError(
                        f"tensor {t.name!r}: a piece header of {len(header)} bytes leaves no "
                        f"room for data in max_chunk_bytes={max_chunk_bytes}"
                    )
                next_chunk()
                continue
            cur.add(_planned_piece(t, off, n, header, whole))
            off += n
            header = first + b"\x28" + encode_varint(off)
            next_chunk()
    if not cur.empty() or not chunks:
        chunks.append(cur)
    return chunks


# --------------------------------------------------------------------------- chunk streams


@dataclass(slots=True)
class _Record:
    """What the stream digest covers of one chunk, besides the piece bytes."""

    seq: int
    crc: int
    meta: dict[str, str]
    col_bytes: list[bytes]
    # (name, dtype, shape, nbytes, offset, length) per piece
    pieces: list[tuple[str, int, tuple[int, ...], int, int, int]]


_DIGEST_RECORD = struct.Struct("<IIQQQ")
_DIGEST_LEN = struct.Struct("<Q")
_DIGEST_PIECE = struct.Struct("<iQQQQ")


def _digest(h: Any, rec: _Record, data: Sequence[memoryview | bytes] | None) -> None:
    """Feed one chunk to the stream's sha256: seq, crc32c, meta, serialized columns and
    every piece header, plus the piece bytes themselves for the ``data:`` scheme
    (the ``chunks:`` scheme binds them through the crc32c instead). Strings go as
    their length (``<Q``) and UTF-8 bytes; numbers little-endian, unpadded. The
    parts are joined and fed at once (a chunk's are a few dozen bytes)."""
    parts = [
        _DIGEST_RECORD.pack(rec.seq, rec.crc, len(rec.meta), len(rec.col_bytes), len(rec.pieces))
    ]
    for k in sorted(rec.meta):
        for text in (k, rec.meta[k]):
            b = text.encode()
            parts += (_DIGEST_LEN.pack(len(b)), b)
    for cb in rec.col_bytes:
        parts += (_DIGEST_LEN.pack(len(cb)), cb)
    for i, (name, dtype, shape, nbytes, offset, length) in enumerate(rec.pieces):
        b = name.encode()
        parts += (
            _DIGEST_LEN.pack(len(b)),
            b,
            _DIGEST_PIECE.pack(dtype, nbytes, offset, length, len(shape)),
        )
        if shape:
            parts.append(struct.pack(f"<{len(shape)}q", *shape))
        if data is not None:
            h.update(b"".join(parts))
            parts = []
            h.update(data[i])
    h.update(b"".join(parts))


def _prepare(
    batch: Mapping[str, Any],
    meta: Mapping[str, str] | None,
    max_chunk_bytes: int,
    stream_id: str | None,
    digest: str,
) -> tuple[str, dict[str, str], list[_PlannedChunk], int]:
    if digest not in ("chunks", "data"):
        raise CodecError(f"digest must be 'chunks' or 'data', got {digest!r}")
    sid = uuid.uuid4().hex if stream_id is None else stream_id
    tensors, columns = split_batch(batch)
    meta_d = _check_meta(meta)
    plan = _plan(tensors, [_column(c) for c in columns], meta_d, int(max_chunk_bytes), sid)
    return sid, meta_d, plan, sum(t.nbytes for t in tensors)


def _crc32c(views: Sequence[memoryview | bytes]) -> int:
    """CRC-32C of the views in order (:mod:`rlfleet.common.crc32c`: carry-less
    multiplication folding where the CPU has it, else its crc32 instruction)."""
    crc = 0
    for v in views:
        crc = crc32c_extend(crc, np.frombuffer(v, np.uint8))  # a view, no copy
    return crc


class _StreamDigest:
    """The stream's sha256 (see :func:`iter_chunks`), fed one planned chunk at a time."""

    def __init__(self, plan: list[_PlannedChunk], meta: dict[str, str], scheme: str) -> None:
        self._h = hashlib.sha256()
        self._plan = plan
        self._meta = meta
        self._scheme = scheme
        self._crcs: list[int] = []

    def add(self, seq: int, crc: int, views: Sequence[memoryview]) -> str:
        """Feed chunk ``seq``; returns the digest field: ``"<scheme>:<hex>"`` on the
        last chunk, else ``""``. The ``chunks`` scheme covers a few numbers per chunk:
        they are kept and hashed at the last chunk, in one go; ``data`` hashes each
        chunk's bytes as it comes, while they are in cache."""
        last = seq == len(self._plan) - 1
        if self._scheme == "data":
            _digest(self._h, self._record(seq, crc), views)
        else:
            self._crcs.append(crc)
            if last:
                for i, c in enumerate(self._crcs):
                    _digest(self._h, self._record(i, c), None)
        return f"{self._scheme}:{self._h.hexdigest()}" if last else ""

    def _record(self, seq: int, crc: int) -> _Record:
        pc = self._plan[seq]
        return _Record(
            seq,
            crc,
            self._meta if seq == 0 else {},
            [c.SerializeToString() for c in pc.columns],
            [
                (p.tensor.name, p.tensor.dtype, p.tensor.shape, p.tensor.nbytes, p.offset, p.length)
                for p in pc.pieces
            ],
        )


def _new_bytes(size: int) -> bytes:
    """A new bytes object of ``size`` bytes, uninitialised where the interpreter allows
    (``PyBytes_FromStringAndSize(NULL, size)``, CPython's documented way to make one
    to fill), else zeros. The caller overwrites every byte before anyone reads it;
    zero-filling a 4 MB chunk first would double the cost of building it."""
    if _uninitialized_bytes is None:
        return bytes(size)
    out: bytes = _uninitialized_bytes(None, size)
    return out


if sys.implementation.name == "cpython":
    _uninitialized_bytes: Any = ctypes.pythonapi.PyBytes_FromStringAndSize
    _uninitialized_bytes.restype = ctypes.py_object
    _uninitialized_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
else:  # pragma: no cover - other interpreters
    _uninitialized_bytes = None


def _piece_data(p: _PlannedPiece) -> U8Array:
    return p.tensor.data[p.offset : p.offset + p.length]


def iter_chunks(
    batch: Mapping[str, Any],
    meta: Mapping[str, str] | None = None,
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    stream_id: str | None = None,
    digest: Digest = "chunks",
) -> Iterator[common_pb2.TensorBatchChunk]:
    """Split a batch into ``TensorBatchChunk`` messages, each at most
    ``max_chunk_bytes`` serialized (``ByteSize()``, framing included).

    Layout: columns (then meta) lead the stream in the first chunk; columns too big
    for it are split by rows into consecutive ``Column`` entries with the same name,
    which the assembler concatenates. Tensors follow in mapping order; a tensor that
    fits in one chunk is never split (small ones are packed together), a bigger one
    fills the rest of the current chunk and continues as ``TensorPiece`` byte ranges
    in order. Every chunk carries the crc32c of its piece data; the last one has
    ``last=True``, ``num_chunks``, ``total_bytes`` (tensor bytes) and ``digest``.

    ``digest`` is ``"<scheme>:<64 hex>"``, a sha256 over every chunk's seq, crc32c,
    meta, serialized columns and piece headers (name, dtype, shape, nbytes, offset,
    length), so nothing the receiver delivers escapes it. ``digest="chunks"``
    (default, almost free): tensor bytes are covered through each chunk's crc32c.
    ``digest="data"``: the tensor bytes are hashed too, in stream order (about
    0.15 s per 256 MB on each side, measured; use it when the digest must identify
    the content itself, not just catch corruption).

    Args:
        stream_id: carried by every chunk; a random uuid4 hex when None.

    Raises:
        CodecError: bad values; ``max_chunk_bytes`` too small for the framing, for
        meta (which must fit in the first chunk), a single column row, or a piece
        header (long names).

    This path copies tensor bytes twice (into a bytes object, then into upb); the
    wire path :func:`iter_chunk_bytes` copies once.
    """
    sid, meta_d, plan, total = _prepare(batch, meta, max_chunk_bytes, stream_id, digest)
    stream_digest = _StreamDigest(plan, meta_d, digest)
    for seq, pc in enumerate(plan):
        views = [_piece_data(p).data for p in pc.pieces]
        crc = _crc32c(views)
        sha = stream_digest.add(seq, crc, views)
        msg = common_pb2.TensorBatchChunk(stream_id=sid, seq=seq, crc32c=crc)
        for p, v in zip(pc.pieces, views, strict=True):
            t = p.tensor
            msg.pieces.add(
                name=t.name,
                dtype=t.dtype,
                shape=t.shape,
                nbytes=t.nbytes,
                offset=p.offset,
                data=v.tobytes(),
            )
        msg.columns.extend(pc.columns)
        if seq == 0:
            msg.meta.update(meta_d)
        if sha:
            msg.last = True
            msg.total_bytes = total
            msg.num_chunks = len(plan)
            msg.digest = sha
        yield msg


@dataclass(frozen=True, slots=True)
class Envelope:
    """A message around each chunk of :func:`iter_chunk_bytes`, built in the same
    buffer (no copy of the chunk to frame it): every item becomes ``prefix``, then
    the chunk as the length-delimited field ``field``, then ``suffix``. ``prefix`` and
    ``suffix`` are serialized fields of the outer message (``WeightChunk.version``,
    ``TrainStepRequest.on_policy``).

    The field's length is written as a varint of a fixed width, the width of the
    chunk's largest possible length, since the exact length is known only after the
    tensor bytes are copied into place (the CRC-32C varint is 1 to 5 bytes long).
    Protobuf parsers accept such a varint (a non-minimal encoding is valid); the
    chunk inside stays byte-identical to its own serialization."""

    field: int
    prefix: bytes = b""
    suffix: bytes = b""


def parse_envelope(data: bytes | memoryview, field: int, outer: type[M]) -> tuple[ChunkView, M]:
    """The other side of :class:`Envelope`: the chunk in length-delimited field
    ``field`` of ``data`` parsed by :func:`parse_chunk` (tensor bytes as views), and
    the rest of the message parsed by protobuf as ``outer``. Accepts any valid
    encoding (fields in any order; the last chunk field wins, as protobuf merges).
    Raises :class:`CodecError` on malformed bytes or a message without a chunk."""
    buf = memoryview(data)
    chunk: ChunkView | None = None
    rest: list[memoryview] = []
    for number, wire_type, start, pos, stop in proto_fields(buf, 0, len(buf)):
        if number == field and wire_type == 2:
            chunk = parse_chunk(buf[pos:stop])
        else:
            rest.append(buf[start:stop])
    name = outer.DESCRIPTOR.name
    try:
        head = outer.FromString(b"".join(rest))
    except DecodeError as e:
        raise CodecError(f"malformed {name}: {e}") from e
    if chunk is None:
        raise CodecError(f"{name} without a chunk", field="chunk")
    return chunk, head


def _padded_varint(n: int, width: int) -> bytes:
    """``n`` as a varint of exactly ``width`` bytes (continuation bits on all but the
    last; ``width`` at least the minimal length)."""
    out = bytearray()
    for _ in range(width - 1):
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    if n > 0x7F:
        raise ValueError(f"varint of width {width} cannot hold the value")
    out.append(n)
    return bytes(out)


def iter_chunk_bytes(
    batch: Mapping[str, Any],
    meta: Mapping[str, str] | None = None,
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    stream_id: str | None = None,
    digest: Digest = "chunks",
    envelope: Envelope | None = None,
) -> Iterator[bytes]:
    """The chunks of :func:`iter_chunks`, already serialized: each item is
    byte-identical to ``chunk.SerializeToString(deterministic=True)`` of the matching
    message (same plan, same checksums), at most ``max_chunk_bytes`` long.

    Tensor bytes are copied once, straight from the tensor into the chunk, and
    checksummed block by block right after they are copied (see
    :data:`~rlfleet.common.crc32c.BLOCK`). Send the
    items through gRPC with :func:`serialize_chunk` (identity on bytes) as the
    request serializer; receive with :func:`parse_chunk` as the deserializer.

    With an ``envelope``, each item is that message around the chunk (see
    :class:`Envelope`); ``max_chunk_bytes`` still bounds the chunk itself.
    """
    sid, meta_d, plan, total = _prepare(batch, meta, max_chunk_bytes, stream_id, digest)
    yield from _chunk_bytes(sid, meta_d, plan, total, digest, envelope)


def _chunk_bytes(
    sid: str,
    meta_d: dict[str, str],
    plan: list[_PlannedChunk],
    total: int,
    digest: Digest,
    envelope: Envelope | None,
) -> Iterator[bytes]:
    stream_digest = _StreamDigest(plan, meta_d, digest)
    # Field 1 (stream_id) is the same in every chunk.
    sid_field = common_pb2.TensorBatchChunk(stream_id=sid).SerializeToString()

    def full_tail(crc: int, sha: str, seq: int, pc: _PlannedChunk) -> bytes:
        """Fields 5-10 of a chunk that has more than its crc32c to say."""
        msg = common_pb2.TensorBatchChunk(columns=pc.columns, crc32c=crc)
        if seq == 0:
            msg.meta.update(meta_d)
        if sha:
            msg.total_bytes = total
            msg.num_chunks = len(plan)
            msg.digest = sha
        return msg.SerializeToString(deterministic=True)

    final = len(plan) - 1
    for seq, pc in enumerate(plan):
        last = seq == final
        # Field order on the wire: 1-3 (head), 4 (pieces), 5-10 (tail), written by hand
        # as protobuf would (proto3: zero and false fields left out).
        head = sid_field
        if seq:
            head += b"\x10" + encode_varint(seq)
        if last:
            head += b"\x18\x01"
        # Most chunks end with their crc32c alone (field 7, written here); the first
        # (meta), those with columns and the last (totals, digest) go through protobuf.
        plain = not (pc.columns or last or (seq == 0 and meta_d))
        # Room for the largest tail: a 5-byte crc32c varint and a digest of the final length.
        if plain:
            room = _PLAIN_TAIL_ROOM
        else:
            room = len(full_tail(0xFFFFFFFF, f"{digest}:{'0' * 64}" if last else "", seq, pc))
        size = len(head) + pc.pieces_size
        # A BytesIO over a bytes object it alone holds writes in place and hands that
        # object back from getvalue(): the chunk is built where gRPC will read it,
        # with no join copy (CPython; elsewhere getvalue() copies, still correct).
        # The framing goes first, leaving a hole for each piece's data; then the data
        # is copied into the holes, view to view (``copy_crc_views``: no raw
        # addresses), and checksummed as it is copied.
        width = _varint_len(size + room)
        outer = b""
        if envelope is not None:
            outer = envelope.prefix + encode_varint(envelope.field << 3 | 2) + b"\0" * width
        suffix = envelope.suffix if envelope is not None else b""
        out = io.BytesIO(_new_bytes(len(outer) + size + room + len(suffix)))
        out.write(outer)
        out.write(head)
        holes = []
        for p in pc.pieces:
            out.write(p.prefix)
            holes.append(out.tell())
            out.seek(p.length, io.SEEK_CUR)
        data_end = out.tell()
        crc = 0
        with out.getbuffer() as buf:
            if len(buf) < data_end:  # each hole must be whole: the source is read as long
                raise AssertionError(f"chunk buffer of {len(buf)} bytes, holes up to {data_end}")
            for p, at in zip(pc.pieces, holes, strict=True):
                crc = copy_crc_views(p.src, buf[at : at + p.length], crc)
        views = [_piece_data(p).data for p in pc.pieces] if digest == "data" else []
        out.seek(data_end)
        sha = stream_digest.add(seq, crc, views)
        if plain:
            out.write(b"\x38" + encode_varint(crc) if crc else b"")
        else:
            out.write(full_tail(crc, sha, seq, pc))
        if envelope is not None:
            chunk_len = out.tell() - len(outer)
            out.write(suffix)
            end = out.tell()
            out.seek(len(outer) - width)
            out.write(_padded_varint(chunk_len, width))
            out.seek(end)
        out.truncate()
        yield out.getvalue()


# --------------------------------------------------------------------------- parsing


@dataclass(slots=True)
class PieceView:
    """A ``TensorPiece`` whose ``data`` is a view into the received chunk bytes."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    nbytes: int
    offset: int
    data: memoryview | bytes


@dataclass(slots=True)
class ChunkView:
    """A parsed ``TensorBatchChunk``: the scalar fields, columns and meta as usual,
    the piece data as zero-copy views (see :func:`parse_chunk`)."""

    stream_id: str
    seq: int
    last: bool
    pieces: list[PieceView]
    columns: list[common_pb2.Column]
    meta: dict[str, str]
    crc32c: int
    total_bytes: int
    num_chunks: int
    digest: str

    @classmethod
    def from_proto(cls, msg: common_pb2.TensorBatchChunk) -> ChunkView:
        pieces = [
            PieceView(p.name, p.dtype, tuple(p.shape), p.nbytes, p.offset, p.data)
            for p in msg.pieces
        ]
        return cls._with_pieces(msg, pieces)

    @classmethod
    def _with_pieces(cls, msg: common_pb2.TensorBatchChunk, pieces: list[PieceView]) -> ChunkView:
        """The scalar fields, columns and meta of ``msg`` with the given pieces."""
        return cls(
            msg.stream_id,
            msg.seq,
            msg.last,
            pieces,
            list(msg.columns),
            dict(msg.meta),
            msg.crc32c,
            msg.total_bytes,
            msg.num_chunks,
            msg.digest,
        )

    def to_proto(self) -> common_pb2.TensorBatchChunk:
        msg = common_pb2.TensorBatchChunk(
            stream_id=self.stream_id,
            seq=self.seq,
            last=self.last,
            columns=self.columns,
            meta=self.meta,
            crc32c=self.crc32c,
            total_bytes=self.total_bytes,
            num_chunks=self.num_chunks,
            digest=self.digest,
        )
        for p in self.pieces:
            msg.pieces.add(
                name=p.name,
                dtype=p.dtype,
                shape=p.shape,
                nbytes=p.nbytes,
                offset=p.offset,
                data=bytes(p.data),
            )
        return msg


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` (up to 10 bytes, as protobuf reads them) and the position
    after it; CodecError if it is truncated or longer."""
    value, after = _bounded_varint(buf, pos, end, 70)
    if value >= 0:
        return value, after
    if after - pos >= 10:
        raise CodecError("varint longer than 10 bytes in chunk")
    raise CodecError("truncated varint in chunk")


def proto_fields(buf: memoryview, pos: int, end: int) -> list[tuple[int, int, int, int, int]]:
    """The fields of the protobuf message in ``buf[pos:end]``, as (field number, wire
    type, field start, value start, value end), for parsers that keep bytes fields as
    views (raises ``CodecError`` on malformed bytes)."""
    fields = []
    while pos < end:
        start = pos
        key = buf[pos]
        if key < 0x80:  # one-byte keys and lengths, the common case, read inline
            pos += 1
        else:
            key, pos = _read_varint(buf, pos, end)
        wire = key & 7
        if wire == 2:
            if pos < end and buf[pos] < 0x80:
                stop = pos + 1 + buf[pos]
                pos += 1
            else:
                length, pos = _read_varint(buf, pos, end)
                stop = pos + length
        elif wire == 0:  # skipped, not decoded: its end is the first byte below 0x80
            stop = pos
            while stop < end and buf[stop] >= 0x80:
                stop += 1
            if stop >= end or stop - pos >= 10:
                _read_varint(buf, pos, end)  # raises: truncated, or longer than 10 bytes
            stop += 1
        elif wire == 1:
            stop = pos + 8
        elif wire == 5:
            stop = pos + 4
        else:
            raise CodecError(f"unsupported wire type {wire} for field {key >> 3} in chunk")
        if stop > end:
            raise CodecError(f"field {key >> 3} runs past the end of the chunk ({stop} > {end})")
        fields.append((key >> 3, wire, start, pos, stop))
        pos = stop
    return fields


def parse_chunk(data: bytes | bytearray | memoryview) -> ChunkView:
    """Parse a serialized ``TensorBatchChunk`` without copying piece data.

    Accepts any valid encoding of the message (fields in any order, unknown fields
    skipped). Piece ``data`` are memoryviews into ``data``, which they keep alive;
    everything else goes through protobuf. Usable as a gRPC request/response
    deserializer. Raises :class:`CodecError` on malformed bytes.
    """
    buf = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    view = _parse_plain_chunk(buf)
    if view is not None:
        return view
    rest: list[memoryview] = []
    pieces: list[PieceView] = []
    try:
        for number, wire, start, pos, stop in proto_fields(buf, 0, len(buf)):
            if number == 4 and wire == 2:
                pieces.append(_parse_piece(buf, pos, stop))
            else:
                rest.append(buf[start:stop])
        msg = common_pb2.TensorBatchChunk.FromString(b"".join(rest))
    except DecodeError as exc:
        raise CodecError(f"malformed TensorBatchChunk: {exc}") from exc
    return ChunkView._with_pieces(msg, pieces)


def _bounded_varint(buf: memoryview, pos: int, end: int, bits: int) -> tuple[int, int]:
    """The varint at ``pos`` if it is within ``end`` and short enough to carry at most
    ``bits`` bits (35: five bytes, any uint32; 63: nine bytes, read the same as an
    int64 or a uint64), as (value, position after it); (-1, pos) otherwise."""
    result = shift = 0
    while pos < end and shift < bits:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
    return -1, pos


def _parse_plain_chunk(buf: memoryview) -> ChunkView | None:
    """The common chunk -- stream_id, seq, last, pieces and crc32c, each field with
    its usual tag and short varints, pieces with their data last -- read field by
    field without protobuf objects: most of a chunk's parse, which runs right after
    megabytes of copying and so with cold caches. None for anything else (columns,
    meta, totals, unknown fields, long varints, other layouts, malformed bytes): the
    general parse then reads it as protobuf does. What is read here is what protobuf
    reads (the last of a repeated scalar wins; uint32 keeps 32 bits)."""
    end = len(buf)
    pos = 0
    sid = ""
    seq = crc = 0
    last = False
    pieces: list[PieceView] = []
    try:
        while pos < end:
            key = buf[pos]
            if key == 0x22 or key == 0x0A:  # a piece, or stream_id
                if pos + 1 < end and buf[pos + 1] < 0x80:  # a one-byte length, inline
                    length, at = buf[pos + 1], pos + 2
                else:
                    length, at = _bounded_varint(buf, pos + 1, end, 35)
                stop = at + length
                if length < 0 or stop > end:
                    return None
                if key == 0x22:
                    piece = _parse_plain_piece(buf, at, stop)
                    if piece is None:
                        return None
                    pieces.append(piece)
                else:
                    sid = str(buf[at:stop], "utf-8")
                pos = stop
            elif key == 0x10 or key == 0x18 or key == 0x38:  # seq, last, crc32c
                if pos + 1 < end and buf[pos + 1] < 0x80:
                    value, pos = buf[pos + 1], pos + 2
                else:
                    value, pos = _bounded_varint(buf, pos + 1, end, 35)
                if value < 0:
                    return None
                if key == 0x10:
                    seq = value & 0xFFFFFFFF
                elif key == 0x18:
                    last = value != 0
                else:
                    crc = value & 0xFFFFFFFF
            else:
                return None
    except UnicodeDecodeError:
        return None
    return ChunkView(sid, seq, last, pieces, [], {}, crc, 0, 0, "")


def _parse_plain_piece(buf: memoryview, begin: int, end: int) -> PieceView | None:
    """A piece whose fields carry their usual tags and varints short enough to be
    read exactly (dtype up to 4 bytes, sizes and dimensions up to 9), with the data
    field, read once, last (as every encoder writes it), read field by field here:
    protobuf's parser, called once per piece between megabytes of copying, would run
    from cold caches each time (a third of the parse). None for any other layout,
    which the general parse reads through protobuf."""
    name = ""
    dtype = nbytes = offset = 0
    shape: list[int] = []
    pos = begin
    while pos < end:
        key = buf[pos]
        pos += 1
        if key == 0x32:  # data: the rest of the piece, or not this layout
            if pos < end and buf[pos] < 0x80:
                length, at = buf[pos], pos + 1
            else:
                length, at = _bounded_varint(buf, pos, end, 35)
            if length < 0 or at + length != end:
                return None
            return PieceView(name, dtype, tuple(shape), nbytes, offset, buf[at:end])
        if key == 0x0A or key == 0x1A:  # name; shape, packed
            if pos < end and buf[pos] < 0x80:
                length, at = buf[pos], pos + 1
            else:
                length, at = _bounded_varint(buf, pos, end, 35)
            stop = at + length
            if length < 0 or stop > end:
                return None
            if key == 0x0A:
                try:
                    name = str(buf[at:stop], "utf-8")
                except UnicodeDecodeError:
                    return None
            else:  # repeated: a second run of dimensions adds to the first
                while at < stop:
                    value, at = _bounded_varint(buf, at, stop, 63)
                    if value < 0:
                        return None
                    shape.append(value)
            pos = stop
        elif key == 0x10 or key == 0x20 or key == 0x28:  # dtype, nbytes, offset
            if pos < end and buf[pos] < 0x80:
                value, pos = buf[pos], pos + 1
            else:
                value, pos = _bounded_varint(buf, pos, end, 63)
            if value < 0:
                return None
            if key == 0x20:
                nbytes = value
            elif key == 0x28:
                offset = value
            elif value < 1 << 28:  # an enum is an int32: longer ones go to protobuf
                dtype = value
            else:
                return None
        else:
            return None
    return None


def _parse_piece(buf: memoryview, begin: int, end: int) -> PieceView:
    header: list[memoryview] = []
    data_start = data_end = begin
    for number, wire, start, pos, stop in proto_fields(buf, begin, end):
        if number == 6 and wire == 2:
            data_start, data_end = pos, stop  # last one wins, as protobuf merges bytes fields
        else:
            header.append(buf[start:stop])
    p = common_pb2.TensorPiece.FromString(b"".join(header))
    data = buf[data_start:data_end]
    return PieceView(p.name, p.dtype, tuple(p.shape), p.nbytes, p.offset, data)


def serialize_chunk(chunk: common_pb2.TensorBatchChunk | bytes) -> bytes:
    """gRPC request serializer for chunk streams: bytes from
    :func:`iter_chunk_bytes` pass through untouched; messages are serialized."""
    if isinstance(chunk, bytes):
        return chunk
    return chunk.SerializeToString()


# --------------------------------------------------------------------------- assembly


#: What one received tensor costs beyond its bytes and name (its slot, the Python
#: objects around it), charged against an assembler's ``max_bytes``.
SLOT_OVERHEAD_BYTES = 256


@dataclass(slots=True)
class _Slot:
    dtype: int
    shape: tuple[int, ...]
    nbytes: int
    buf: U8Array
    view: memoryview  # buf's bytes, made once
    filled: int = 0
    value: Any = None  # the caller's destination (``out``), returned as it is


ChunkLike: TypeAlias = common_pb2.TensorBatchChunk | ChunkView | bytes | bytearray | memoryview


class ChunkAssembler:
    """Reassemble one stream of chunks into ``(values, meta)``.

    Feed chunks in order with :meth:`add`; it returns True once the last chunk is in
    and every check passed, then call :meth:`result`. Each tensor gets one
    preallocated buffer and every piece is copied into it once, its CRC-32C computed
    on the bytes just written, block by block.

    ``out`` (name -> a contiguous CPU tensor or array) gives tensors their buffer:
    the stream's bytes land there directly, without an allocation (and without a
    charge against ``max_bytes``); the stream must declare the destination's dtype
    and shape. Destinations are taken as they are when the assembler is made (do
    not resize them while it runs); one that cannot take bytes fails only if the
    stream sends its tensor. If the stream fails (a :class:`CodecError`), a destination may hold
    partial or unverified bytes.

    Checks, each raising :class:`CodecError` naming the chunk / tensor and the
    values: seq is 0, 1, 2, ... with one stream_id; the crc32c of each chunk's piece
    data; per tensor a consistent dtype/shape/nbytes (= prod(shape) x itemsize) and
    pieces that arrive in byte order with no gap, overlap or overflow; on the last
    chunk ``num_chunks``, ``total_bytes``, every tensor complete, and ``digest``;
    nothing after the last chunk.

    ``max_bytes`` bounds what the stream may make the assembler hold, checked as chunks
    arrive, before anything is allocated for them: each tensor's declared ``nbytes``
    (charged when its first piece arrives, since its buffer is allocated then), the
    serialized columns and meta, and a fixed charge per chunk and piece; a chunk that
    declares ``total_bytes`` over the limit is refused as it arrives. Over the limit:
    :class:`StreamTooLarge` (a CodecError) naming the tensor, column or field.
    """

    def __init__(
        self, *, max_bytes: int | None = None, out: Mapping[str, Any] | None = None
    ) -> None:
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
        self.max_bytes = max_bytes
        self._out = dict(out or {})
        # Each destination's bytes, found once, before any chunk (so a destination is
        # taken as it is when the assembler is made): a burst of small torch calls
        # here costs a fraction of the same calls made between the copies of large
        # chunks, which leave the caches cold. A destination that is unusable fails
        # only if the stream sends its tensor.
        self._dst: dict[str, _Slot | CodecError] = {}
        for name, value in self._out.items():
            try:
                d = destination_bytes(name, value)
                self._dst[name] = _Slot(
                    d.dtype, d.shape, d.nbytes, d.data, d.data.data, value=value
                )
            except CodecError as exc:
                self._dst[name] = exc
            except Exception as exc:  # what torch raises for tensors it cannot describe
                self._dst[name] = CodecError(
                    f"destination {name!r} cannot take bytes: {type(exc).__name__}: {exc}",
                    field=name,
                )
        self._held = 0  # bytes charged against max_bytes so far
        self._next_seq = 0
        self._error: CodecError | None = None
        self._stream_id: str | None = None
        self._done = False
        self._slots: dict[str, _Slot] = {}
        self._columns: dict[str, tuple[str, list[str]]] = {}
        self._meta: dict[str, str] = {}
        self._bytes = 0
        # For the stream digest, checked at the end: per chunk, what it covers.
        self._records: list[_Record] = []

    @property
    def complete(self) -> bool:
        return self._done

    def add(self, chunk: ChunkLike) -> bool:
        """Add the next chunk (a message, its serialized bytes, or a ChunkView).
        Returns True when the stream is complete and verified."""
        if isinstance(chunk, bytes | bytearray | memoryview):
            view = parse_chunk(chunk)
        elif isinstance(chunk, ChunkView):
            view = chunk
        else:
            view = ChunkView.from_proto(chunk)
        if self._error is not None:
            raise CodecError(f"stream failed earlier: {self._error}")
        try:
            return self._add(view)
        except CodecError as exc:
            self._error = exc  # buffers may hold unverified bytes: refuse to go on
            raise

    def _where(self, view: ChunkView) -> str:
        return f"stream {self._stream_id or view.stream_id!r} chunk seq {view.seq}"

    def _add(self, view: ChunkView) -> bool:
        # The common chunk (pieces only, nothing wrong) costs a few attribute reads
        # and comparisons here: error texts are built only on the way out, and the
        # stream digest is fed at the end (_finish) from the records kept anyway.
        if self._done:
            raise CodecError(
                f"{self._where(view)} arrived after the last chunk (seq {self._next_seq - 1})",
                field="seq",
                value=view.seq,
            )
        if view.seq != self._next_seq:
            raise CodecError(
                f"{self._where(view)} arrived, expected seq {self._next_seq}",
                field="seq",
                value=view.seq,
            )
        if self._stream_id is None:
            self._stream_id = view.stream_id
        elif view.stream_id != self._stream_id:
            raise CodecError(
                f"{self._where(view)} has stream_id {view.stream_id!r}, expected "
                f"{self._stream_id!r}"
            )
        if self.max_bytes is not None and view.total_bytes > self.max_bytes:
            raise StreamTooLarge(
                f"{self._where(view)} declares total_bytes={view.total_bytes}, over the limit "
                f"of {self.max_bytes} bytes",
                field="total_bytes",
                value=view.total_bytes,
            )
        col_bytes = [c.SerializeToString() for c in view.columns] if view.columns else []
        if self.max_bytes is not None:
            meta_bytes = sum(len(k) + len(v) for k, v in view.meta.items())
            where = self._where(view)
            self._charge(
                _CHUNK_CHARGE + _PIECE_CHARGE * len(view.pieces) + meta_bytes,
                "chunks",
                f"{where} ({len(view.pieces)} pieces, {meta_bytes} bytes of meta)",
            )
            for col, data in zip(view.columns, col_bytes, strict=True):
                self._charge(
                    len(data), col.name, f"{where}: column {col.name!r} ({len(data)} bytes)"
                )
        for col in view.columns:
            self._add_column(col, view)
        # Check every piece and find its place first, then copy and checksum in one
        # pass; bytes that fail the crc32c are never handed out (the error sticks).
        sources = []
        places = []
        headers = []  # what the stream digest covers of each piece
        for p in view.pieces:
            src = p.data
            if type(src) is not memoryview or src.format != "B" or not src.c_contiguous:
                src = self._piece_bytes(p, view)  # a ChunkView built by hand
            sources.append(src)
            places.append(self._place(p, view, src.nbytes))
            headers.append((p.name, p.dtype, p.shape, p.nbytes, p.offset, src.nbytes))
        crc = 0
        for src, dst in zip(sources, places, strict=True):
            # _place checked that the piece fits in its tensor's bytes from ``dst`` on.
            crc = copy_crc_views(src, dst, crc)
        if crc != view.crc32c:
            raise ChecksumMismatch(
                f"{self._where(view)}: crc32c of piece data is {crc:#010x}, the chunk says "
                f"{view.crc32c:#010x}"
            )
        if view.meta:
            self._meta.update(view.meta)
        self._records.append(_Record(view.seq, crc, view.meta, col_bytes, headers))
        self._next_seq += 1
        if view.last:
            self._finish(view, self._where(view))
        return self._done

    def _add_column(self, col: common_pb2.Column, view: ChunkView) -> None:
        kind, rows = _column_rows(col)
        if col.name in self._slots:
            raise CodecError(f"{self._where(view)}: column {col.name!r} has the name of a tensor")
        have = self._columns.get(col.name)
        if have is None:
            self._columns[col.name] = (kind, rows)
        elif have[0] != kind:
            raise CodecError(
                f"{self._where(view)}: column {col.name!r} continues as {kind}, began as {have[0]}"
            )
        else:
            have[1].extend(rows)

    def _piece_bytes(self, p: PieceView, view: ChunkView) -> memoryview:
        """A piece's data as a flat view of its bytes (``bytes``, or a view of any
        contiguous buffer); CodecError for data that is not contiguous."""
        data = memoryview(p.data)
        if not data.c_contiguous:
            raise CodecError(
                f"{self._where(view)}: tensor {p.name!r} piece data is not contiguous bytes",
                field=p.name,
            )
        return data if data.format == "B" and data.ndim == 1 else data.cast("B")

    def _place(self, p: PieceView, view: ChunkView, n: int) -> memoryview:
        """Check a piece of ``n`` bytes against its tensor (allocating the tensor's
        buffer at its first piece) and return the bytes it fills."""
        name = p.name
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = self._first_piece(p, view)
        elif (p.dtype, p.shape, p.nbytes) != (slot.dtype, slot.shape, slot.nbytes):
            raise CodecError(
                f"{self._where(view)}: tensor {name!r} piece says {dtype_name(p.dtype)} "
                f"{list(p.shape)} nbytes={p.nbytes}, earlier pieces said "
                f"{dtype_name(slot.dtype)} {list(slot.shape)} nbytes={slot.nbytes}",
                field=name,
                value=list(p.shape),
            )
        elif slot.filled == slot.nbytes:
            raise CodecError(
                f"{self._where(view)}: tensor {name!r} got a piece at offset {p.offset} after it was "
                "complete",
                field=name,
                value=p.offset,
            )
        offset = p.offset
        if offset != slot.filled:
            raise CodecError(
                f"{self._where(view)}: tensor {name!r} piece starts at offset {offset}, expected "
                f"{slot.filled} (pieces must arrive in order, without gaps or overlaps)",
                field=name,
                value=offset,
            )
        if offset + n > slot.nbytes:
            raise CodecError(
                f"{self._where(view)}: tensor {name!r} piece [{offset}, {offset + n}) overflows its "
                f"{slot.nbytes} bytes",
                field=name,
                value=offset + n,
            )
        slot.filled += n
        self._bytes += n
        return slot.view[offset : offset + n]

    def _first_piece(self, p: PieceView, view: ChunkView) -> _Slot:
        """The slot of a tensor whose first piece ``p`` is: the caller's destination,
        or a new buffer charged against ``max_bytes``, once ``p`` passed the checks."""
        name = p.name
        dst = self._dst.get(name)
        if (
            type(dst) is _Slot  # the usual case: a destination of the declared type
            and (p.dtype, p.shape, p.nbytes) == (dst.dtype, dst.shape, dst.nbytes)
            and name not in self._columns
        ):
            return dst
        expected = expected_nbytes(name, p.dtype, p.shape)
        if p.nbytes != expected:
            raise CodecError(
                f"{self._where(view)}: tensor {name!r} says nbytes={p.nbytes}, but "
                f"{dtype_name(p.dtype)} {list(p.shape)} needs {expected}",
                field=name,
                value=p.nbytes,
            )
        if name in self._columns:
            raise CodecError(
                f"{self._where(view)}: tensor {name!r} has the name of a column", field=name
            )
        if dst is not None:
            if isinstance(dst, CodecError):
                raise dst
            raise CodecError(
                f"{self._where(view)}: tensor {name!r} is {dtype_name(p.dtype)} {list(p.shape)}, its "
                f"destination {dtype_name(dst.dtype)} {list(dst.shape)}",
                field=name,
                value=list(p.shape),
            )
        # Its name and bookkeeping too: many empty tensors with long names are memory as
        # well (a zero-byte tensor cost nothing before).
        if self.max_bytes is not None:
            self._charge(
                p.nbytes + len(name) + SLOT_OVERHEAD_BYTES,
                name,
                f"{self._where(view)}: tensor {name!r} {dtype_name(p.dtype)} "
                f"{list(p.shape)} ({p.nbytes} bytes)",
            )
        try:
            buffer = np.empty(p.nbytes, dtype=np.uint8)
        except MemoryError as e:
            raise StreamTooLarge(
                f"{self._where(view)}: tensor {name!r} declares {p.nbytes} bytes, more than this "
                "process can hold",
                field=name,
                value=p.nbytes,
            ) from e
        return _Slot(p.dtype, p.shape, p.nbytes, buffer, buffer.data)

    @property
    def held(self) -> int:
        """Bytes charged against ``max_bytes`` so far (tensor bytes, names, slots)."""
        return self._held

    def _charge(self, nbytes: int, field: str, what: str) -> None:
        """Count ``nbytes`` more against ``max_bytes``; StreamTooLarge if over."""
        if self.max_bytes is None:
            return
        held = self._held + nbytes
        if held > self.max_bytes:
            raise StreamTooLarge(
                f"{what} would make the stream hold {held} bytes, over the limit of "
                f"{self.max_bytes} bytes",
                field=field,
                value=held,
            )
        self._held = held

    def _finish(self, view: ChunkView, where: str) -> None:
        count = view.seq + 1
        if view.num_chunks != count:
            raise CodecError(f"{where}: last chunk says num_chunks={view.num_chunks}, got {count}")
        if view.total_bytes != self._bytes:
            raise CodecError(
                f"{where}: last chunk says total_bytes={view.total_bytes}, received {self._bytes}"
            )
        short = [
            f"{k!r} ({s.filled}/{s.nbytes})" for k, s in self._slots.items() if s.filled < s.nbytes
        ]
        if short:
            raise CodecError(f"{where}: stream ended with incomplete tensors: {', '.join(short)}")
        scheme, _, want = view.digest.rpartition(":")
        if scheme in ("chunks", "data"):
            h = hashlib.sha256()
            for rec in self._records:
                views = (
                    [self._slots[n].buf[o : o + ln].data for n, _, _, _, o, ln in rec.pieces]
                    if scheme == "data"
                    else None
                )
                _digest(h, rec, views)
            got = h.hexdigest()
        elif not view.digest:
            raise CodecError(f"{where}: last chunk has no digest")
        else:
            raise CodecError(f"{where}: unknown digest scheme {scheme!r} in {view.digest!r}")
        if got != want:
            raise ChecksumMismatch(
                f"{where}: digest {scheme}:{got} != {view.digest!r} in the chunk"
            )
        self._done = True

    def result(self, *, to: To = "torch") -> tuple[Batch, dict[str, str]]:
        """``(values, meta)`` of the complete stream: tensors in order of first
        piece, then columns in order of first appearance. Tensors wrap the
        assembler's buffers without copying (calling again returns views of the
        same memory); a tensor decoded into ``out`` is the caller's object itself,
        whatever ``to`` says. Raises :class:`CodecError` if the stream is not complete."""
        check_to(to)
        if self._error is not None:
            raise CodecError(f"stream failed: {self._error}")
        if not self._done:
            raise CodecError(
                f"stream {self._stream_id!r} is incomplete: {self._next_seq} chunks in, "
                "no verified last chunk"
            )
        values: Batch = {
            name: as_value(s.buf, name, s.dtype, s.shape, to) if s.value is None else s.value
            for name, s in self._slots.items()
        }
        for name, (kind, rows) in self._columns.items():
            values[name] = decode_rows(name, kind, rows)
        return values, dict(self._meta)


def assemble_chunks(
    chunks: Iterable[ChunkLike], *, to: To = "torch"
) -> tuple[Batch, dict[str, str]]:
    """Reassemble a whole stream (see :class:`ChunkAssembler`); raises
    :class:`CodecError` if it ends before its last chunk or goes on after it."""
    check_to(to)
    asm = ChunkAssembler()
    for chunk in chunks:
        asm.add(chunk)
    if not asm.complete:
        raise CodecError(f"chunk stream ended after {asm._next_seq} chunks without its last chunk")
    return asm.result(to=to)
