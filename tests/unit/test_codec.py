"""Tests of rlfleet.common.codec (batch, wire): bit-exact round trips, chunking limits, corruption."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rlfleet.common.codec import wire
from rlfleet.common.codec.batch import (
    CodecError,
    pack_into,
    packed_size,
    tensor_specs,
    unpack,
)
from rlfleet.v1 import common_pb2

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TORCH_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
] + [
    dt
    for name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
    if isinstance(dt := getattr(torch, name, None), torch.dtype)
]
NUMPY_DTYPES = [
    np.dtype(d)
    for d in ("<f4", "<f8", "<f2", "i1", "u1", "<i2", "<i4", "<i8", "?", "<u2", "<u4", "<u8")
] + [np.dtype("<c8"), np.dtype("<c16"), np.dtype(">f4"), np.dtype(">i8")]


# --------------------------------------------------------------------------- helpers


def raw(x: Any) -> bytes:
    """C-order bytes of a tensor or array (so NaN payloads compare too)."""
    if isinstance(x, torch.Tensor):
        if x.numel() == 0:
            return b""
        fresh = torch.empty(x.shape, dtype=x.dtype).copy_(x.detach())  # standard strides
        return fresh.reshape(-1).view(torch.uint8).numpy().tobytes()
    a = np.ascontiguousarray(x)
    return a.astype(a.dtype.newbyteorder("<")).tobytes()


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == [k for k in want if not isinstance(want[k], list)] + [
        k for k in want if isinstance(want[k], list)
    ]
    for k, w in want.items():
        g = got[k]
        if isinstance(w, list):
            assert g == w, k
        elif isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), k
            assert (g.dtype, tuple(g.shape), g.device.type) == (w.dtype, tuple(w.shape), "cpu"), k
            assert raw(g) == raw(w), k
        else:
            assert isinstance(g, np.ndarray), k
            assert g.dtype == w.dtype.newbyteorder("<") and g.shape == w.shape, k
            assert raw(g) == raw(w), k


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def torch_tensors(draw: st.DrawFn, dtypes: list[torch.dtype] = TORCH_DTYPES) -> torch.Tensor:
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(shapes)
    layout = draw(st.sampled_from(["plain", "transposed", "sliced"]))
    full = (*shape[:-1], shape[-1] * 2) if layout == "sliced" and shape else shape
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(full, dtype=np.int64)) * itemsize
    seed = draw(st.integers(0, 2**32 - 1))
    data = np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)
    if n == 0:
        return torch.empty(full, dtype=dtype)
    t = torch.from_numpy(data).view(dtype).reshape(full)
    if layout == "sliced" and shape:
        t = t[..., ::2]
    elif layout == "transposed" and len(shape) >= 2:
        t = t.transpose(0, -1)
    return t


@st.composite
def numpy_arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(NUMPY_DTYPES))
    shape = draw(shapes)
    seed = draw(st.integers(0, 2**32 - 1))
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    a = np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8).view(dtype)
    a = a.reshape(shape)
    return a.T if draw(st.booleans()) else a


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
names = st.text(min_size=1, max_size=12)


@st.composite
def batches(draw: st.DrawFn, numpy_only: bool = False) -> dict[str, Any]:
    keys = draw(st.lists(names, unique=True, max_size=8))
    out: dict[str, Any] = {}
    for k in keys:
        kind = draw(st.sampled_from(["torch", "numpy", "strings", "json"]))
        if kind == "torch" and not numpy_only:
            out[k] = draw(torch_tensors())
        elif kind in ("torch", "numpy"):
            out[k] = draw(numpy_arrays())
        elif kind == "strings":
            out[k] = draw(st.lists(st.text(max_size=20), max_size=6))
        else:
            out[k] = draw(st.lists(json_values, min_size=1, max_size=5))
    return out


metas = st.dictionaries(st.text(max_size=8), st.text(max_size=16), max_size=4)


def expected(batch: dict[str, Any], to: str) -> dict[str, Any]:
    """What decoding should give: tensors in the requested kind, then lists."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, list):
            continue
        if to == "torch" and isinstance(v, np.ndarray):
            v = torch.from_numpy(np.array(v, dtype=v.dtype.newbyteorder("<"), order="C"))
        out[k] = v
    out.update({k: json.loads(json.dumps(v)) for k, v in batch.items() if isinstance(v, list)})
    return out


# --------------------------------------------------------------------------- whole batches


@FAST
@given(batch=batches(), meta=metas)
def test_encode_decode_batch_roundtrip(batch: dict[str, Any], meta: dict[str, str]) -> None:
    msg = wire.encode_batch(batch, meta)
    msg = common_pb2.TensorBatch.FromString(msg.SerializeToString())
    values, got_meta = wire.decode_batch(msg, to="torch")
    assert got_meta == meta
    assert_same(values, expected(batch, "torch"))


@FAST
@given(batch=batches(numpy_only=True), meta=metas)
def test_numpy_roundtrip(batch: dict[str, Any], meta: dict[str, str]) -> None:
    values, got_meta = wire.decode_batch(wire.encode_batch(batch, meta), to="numpy")
    assert got_meta == meta
    assert_same(values, expected(batch, "numpy"))
    for v in values.values():
        if isinstance(v, np.ndarray):
            assert v.flags.writeable and v.flags.c_contiguous


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_torch_dtype_odd_layouts(dtype: torch.dtype) -> None:
    base = torch.arange(24, dtype=torch.float64).reshape(2, 3, 4).to(dtype)
    batch = {
        "zero_d": base.reshape(-1)[5].clone(),
        "empty": base[:, :0],
        "transposed": base.transpose(0, 2),
        "sliced": base[:, 1:, ::3],
        "expanded": base[:1, :1, :1].expand(2, 3, 4),
        # Contiguous, but with odd strides on its size-1 dims.
        "size1_strides": torch.empty_strided((1, 4, 1), (99, 1, 7), dtype=dtype).copy_(
            base[:1, 0, :].reshape(1, 4, 1)
        ),
        "grad": torch.ones(3, dtype=torch.float32, requires_grad=True)
        if dtype.is_floating_point
        else base,
    }
    for chunks in (
        wire.iter_chunks(batch, max_chunk_bytes=300),
        wire.iter_chunk_bytes(batch, max_chunk_bytes=300),
    ):
        values, _ = wire.assemble_chunks(chunks)
        assert_same(values, batch)
    values, _ = wire.decode_batch(wire.encode_batch(batch))
    assert_same(values, batch)


def test_float_specials_bit_exact() -> None:
    t = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45])
    bits = t.view(torch.int32).clone()
    bits[0] = 0x7FC01234  # a NaN with a payload
    t = bits.view(torch.float32)
    values, _ = wire.assemble_chunks(wire.iter_chunk_bytes({"t": t, "h": t.to(torch.bfloat16)}))
    assert raw(values["t"]) == raw(t)
    assert raw(values["h"]) == raw(t.to(torch.bfloat16))


def test_complex_conj_and_neg_views_resolved() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    values, _ = wire.decode_batch(wire.encode_batch({"c": z.conj(), "n": z.conj().imag}))
    assert torch.equal(values["c"], z.conj().resolve_conj())
    assert torch.equal(values["n"], torch.tensor([-2.0, 4.0]))


def test_decoded_tensors_own_writable_memory() -> None:
    src = torch.arange(10, dtype=torch.int64)
    for values in (
        wire.decode_batch(wire.encode_batch({"x": src}))[0],
        wire.assemble_chunks(wire.iter_chunk_bytes({"x": src}))[0],
    ):
        x = values["x"]
        x += 1  # writable, and no warning about non-writable buffers
        assert torch.equal(src, torch.arange(10))


def test_decode_numpy_refuses_bfloat16() -> None:
    msg = wire.encode_batch({"h": torch.ones(2, dtype=torch.bfloat16)})
    with pytest.raises(CodecError, match=r"'h'.*BFLOAT16.*to='torch'"):
        wire.decode_batch(msg, to="numpy")
    values, _ = wire.decode_batch(msg, to="torch")
    assert values["h"].dtype == torch.bfloat16


def test_columns_strings_and_json() -> None:
    batch = {
        "prompt": ["a", "b\u00e9", ""],
        "extra": [{"split": "train", "index": 3}, None, [1, 2.5, "x"]],
        "scores": [np.float32(0.5), np.arange(2)],  # numpy inside rows -> tolist()
        "none": [],
    }
    values, _ = wire.decode_batch(wire.encode_batch(batch), to="numpy")
    assert values == {
        "prompt": ["a", "b\u00e9", ""],
        "extra": [{"split": "train", "index": 3}, None, [1, 2.5, "x"]],
        "scores": [0.5, [0, 1]],
        "none": [],
    }
    msg = wire.encode_batch(batch)
    kinds = {c.name: c.WhichOneof("values") for c in msg.columns}
    assert kinds == {"prompt": "strings", "extra": "json", "scores": "json", "none": "strings"}


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (3, "value 'v' is a int"),
        ("text", "value 'v' is a str"),
        ({"a": 1}, "value 'v' is a dict"),
        (np.array(["a"]), "numpy dtype <U1"),
        (np.array([object()]), "numpy dtype object"),
        ([object()], "column 'v' row 0: not JSON-encodable"),
        (torch.ones(2).to_sparse(), "layout"),
    ],
)
def test_unsupported_values(value: Any, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        wire.encode_batch({"v": value})
    with pytest.raises(CodecError, match=match):
        list(wire.iter_chunk_bytes({"v": value}))


def test_bad_meta_and_bad_key() -> None:
    with pytest.raises(CodecError, match="meta"):
        wire.encode_batch({}, {"a": 1})  # type: ignore[dict-item]
    with pytest.raises(CodecError, match="keys must be str"):
        wire.encode_batch({1: torch.ones(1)})  # type: ignore[dict-item]


def test_decode_batch_rejects_wrong_length_and_duplicates() -> None:
    msg = wire.encode_batch({"x": torch.ones(3)})
    msg.tensors[0].data = msg.tensors[0].data[:-1]
    with pytest.raises(CodecError, match=r"'x': 11 data bytes.*FLOAT32 \[3\] needs 12"):
        wire.decode_batch(msg)
    msg = wire.encode_batch({"x": torch.ones(3)})
    msg.tensors.append(msg.tensors[0])
    with pytest.raises(CodecError, match="duplicate name 'x'"):
        wire.decode_batch(msg)
    msg.tensors[1].dtype = 99  # type: ignore[assignment]
    with pytest.raises(CodecError):
        wire.decode_batch(msg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_move_to_cpu() -> None:
    t = torch.arange(6, device="cuda").reshape(2, 3).t()
    values, _ = wire.assemble_chunks(wire.iter_chunk_bytes({"t": t}, max_chunk_bytes=256))
    assert values["t"].device.type == "cpu" and torch.equal(values["t"], t.cpu())


# --------------------------------------------------------------------------- chunks


@FAST
@given(
    batch=batches(),
    meta=metas,
    limit=st.integers(256, 3000),
    digest=st.sampled_from(["chunks", "data"]),
)
def test_chunk_roundtrip_and_limits(
    batch: dict[str, Any], meta: dict[str, str], limit: int, digest: str
) -> None:
    try:
        msgs = list(wire.iter_chunks(batch, meta, max_chunk_bytes=limit, digest=digest))  # type: ignore[arg-type]
    except CodecError as exc:  # meta or a single row too big for a tiny chunk: said so
        assert "holds" in str(exc) or "at least" in str(exc)
        event("limit too small for this batch")
        return
    wires = list(
        wire.iter_chunk_bytes(
            batch, meta, max_chunk_bytes=limit, stream_id=msgs[0].stream_id, digest=digest
        )  # type: ignore[arg-type]
    )
    assert len(msgs) == len(wires) == msgs[-1].num_chunks
    assert [m.seq for m in msgs] == list(range(len(msgs)))
    assert [m.last for m in msgs] == [False] * (len(msgs) - 1) + [True]
    for m, w in zip(msgs, wires, strict=True):
        assert m.ByteSize() <= limit and len(w) <= limit
        assert w == m.SerializeToString(deterministic=True)  # the hand-built wire format
        assert common_pb2.TensorBatchChunk.FromString(w) == m
    assert msgs[-1].total_bytes == sum(len(p.data) for m in msgs for p in m.pieces)
    assert msgs[-1].digest.startswith(f"{digest}:")
    want = expected(batch, "torch")
    for chunks in (msgs, wires, [wire.parse_chunk(w) for w in wires]):
        values, got_meta = wire.assemble_chunks(chunks)
        assert got_meta == meta
        assert_same(values, want)


def test_many_chunks_split_big_and_pack_small() -> None:
    batch = {f"s{i}": torch.full((3,), i, dtype=torch.int16) for i in range(30)}
    batch["big"] = torch.randn(1000)  # 4000 bytes: must split at 1 KB
    batch.update({f"t{i}": torch.ones(2) for i in range(3)})
    msgs = list(wire.iter_chunks(batch, {"k": "v"}, max_chunk_bytes=1024))
    assert all(m.ByteSize() <= 1024 for m in msgs)
    assert len(msgs) >= 5
    big = [p for m in msgs for p in m.pieces if p.name == "big"]
    assert len(big) >= 4 and [p.offset for p in big] == sorted(p.offset for p in big)
    assert sum(len(p.data) for p in big) == 4000
    for m in msgs:  # small tensors are never split
        assert all(len(p.data) == p.nbytes for p in m.pieces if p.name != "big")
    assert len(msgs[0].pieces) > 10  # packed together
    assert dict(msgs[0].meta) == {"k": "v"} and all(not m.meta for m in msgs[1:])
    values, _ = wire.assemble_chunks(msgs)
    assert_same(values, batch)


def test_big_columns_split_across_chunks() -> None:
    rows = [f"row {i} " + "x" * (i * 7) for i in range(60)]
    docs = [{"i": i, "text": "y" * 50} for i in range(40)]
    batch = {"w": torch.randn(500), "text": rows, "docs": docs}
    msgs = list(wire.iter_chunks(batch, max_chunk_bytes=1024))
    assert all(m.ByteSize() <= 1024 for m in msgs)
    assert sum(1 for m in msgs for c in m.columns if c.name == "text") > 3
    first_piece = next(i for i, m in enumerate(msgs) if m.pieces)
    assert all(not m.columns for m in msgs[first_piece + 1 :])  # columns lead the stream
    values, _ = wire.assemble_chunks(msgs)
    assert values["text"] == rows and values["docs"] == docs


def test_limits_that_cannot_fit_say_why() -> None:
    with pytest.raises(CodecError, match=r"column 'c' row 1 needs \d+ bytes"):
        list(wire.iter_chunks({"c": ["a", "z" * 2000]}, max_chunk_bytes=1024))
    with pytest.raises(CodecError, match="meta needs"):
        list(wire.iter_chunks({}, {"k": "v" * 2000}, max_chunk_bytes=1024))
    with pytest.raises(CodecError, match="max_chunk_bytes=100"):
        list(wire.iter_chunks({}, max_chunk_bytes=100))
    with pytest.raises(CodecError, match=r"tensor 'n+': a piece header of 611 bytes"):
        list(wire.iter_chunks({"n" * 600: torch.ones(100)}, max_chunk_bytes=700))


def test_meta_that_nearly_fills_the_first_chunk() -> None:
    meta = {"k": "v" * 850}
    batch = {
        "small": torch.arange(100, dtype=torch.int32),
        "rows": ["r" * 300],
        "big": torch.randn(600),
    }
    msgs = list(wire.iter_chunks(batch, meta, max_chunk_bytes=1024))
    assert all(m.ByteSize() <= 1024 for m in msgs)
    values, got_meta = wire.assemble_chunks(msgs)
    assert got_meta == meta
    assert_same(values, batch)


def test_empty_batch_is_one_last_chunk() -> None:
    (msg,) = wire.iter_chunks({}, {"step": "3"}, stream_id="s")
    assert msg.last and msg.num_chunks == 1 and msg.total_bytes == 0 and msg.stream_id == "s"
    assert wire.assemble_chunks([msg]) == ({}, {"step": "3"})


def test_default_limit_fits_grpc_default() -> None:
    batch = {"w": torch.randn(3_000_000), "b": torch.randn(10)}
    wires = list(wire.iter_chunk_bytes(batch))
    assert len(wires) == 4 and all(len(w) <= wire.DEFAULT_MAX_CHUNK_BYTES for w in wires)
    assert max(len(w) for w in wires) > wire.DEFAULT_MAX_CHUNK_BYTES - 200  # chunks are filled
    values, _ = wire.assemble_chunks(wires)
    assert torch.equal(values["w"], batch["w"])


def test_wire_bytes_equal_the_messages_for_pieces_of_many_blocks() -> None:
    """Pieces larger than the copy-and-checksum block (256 KiB), split and whole, with
    both digests: the bytes built in place equal protobuf's serialization."""
    gen = torch.Generator().manual_seed(0)
    batch = {
        "w": torch.randn(1_100_000, generator=gen),  # 4.4 MB: split over two chunks
        "h": torch.randn(300_000, generator=gen).to(torch.bfloat16),  # 600 KB: whole
        "ids": torch.arange(7),
        "rows": ["a", "b"],
    }
    for digest in ("chunks", "data"):
        msgs = list(wire.iter_chunks(batch, {"m": "1"}, stream_id="s", digest=digest))  # type: ignore[arg-type]
        wires = list(wire.iter_chunk_bytes(batch, {"m": "1"}, stream_id="s", digest=digest))  # type: ignore[arg-type]
        assert len(wires) == len(msgs) >= 2
        same = [
            w == m.SerializeToString(deterministic=True) for m, w in zip(msgs, wires, strict=True)
        ]
        assert same == [True] * len(msgs)
        values, meta = wire.assemble_chunks(wires)
        assert meta == {"m": "1"} and values["rows"] == ["a", "b"]
        assert_same(
            {k: values[k] for k in ("w", "h", "ids")}, {k: batch[k] for k in ("w", "h", "ids")}
        )


def test_assembler_decodes_into_given_buffers() -> None:
    batch = {"w": torch.randn(100_000), "ids": np.arange(5, dtype=np.int64), "c": ["x"]}
    wires = list(wire.iter_chunk_bytes(batch, max_chunk_bytes=65536))
    out = {"w": torch.empty(100_000), "ids": np.zeros(5, dtype=np.int64)}
    # No allocation is charged for them: the limit only has to cover the rest.
    asm = wire.ChunkAssembler(out=out, max_bytes=64 * len(wires) * 1024)
    assert [asm.add(w) for w in wires][-1] is True
    values, _ = asm.result()
    assert values["w"] is out["w"] and values["ids"] is out["ids"] and values["c"] == ["x"]
    assert torch.equal(out["w"], batch["w"]) and np.array_equal(out["ids"], batch["ids"])
    # Odd strides on a size-1 dim: still the destination's own memory that is written.
    odd = torch.zeros(1, 4).as_strided((1, 4), (99, 1))
    assert odd.is_contiguous()
    wire.ChunkAssembler(out={"m": odd}).add(next(wire.iter_chunk_bytes({"m": torch.ones(1, 4)})))
    assert torch.equal(odd, torch.ones(1, 4))
    # The destination must match what the stream declares, and be writable in place.
    for bad, match in [
        (torch.empty(99_999), r"'w' is FLOAT32 \[100000\], its destination FLOAT32 \[99999\]"),
        (torch.empty(100_000, dtype=torch.float64), "destination FLOAT64"),
        (torch.empty(2, 100_000)[:, 0], "contiguous"),
        (np.zeros(100_000, dtype=">f4"), "little-endian"),
        ([0.0] * 100_000, "expected a torch tensor or a numpy array"),
    ]:
        with pytest.raises(CodecError, match=match) as info:
            asm = wire.ChunkAssembler(out={"w": bad})
            for w in wires:
                asm.add(w)
        assert info.value.field == "w"


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_an_unusable_destination_fails_only_for_a_tensor_the_stream_sends() -> None:
    """Destinations are looked at once, up front; one the stream never fills may be
    anything, one it fills must be usable (the error names it)."""
    wires = list(wire.iter_chunk_bytes({"w": torch.randn(10)}))
    bad = torch.zeros(10, requires_grad=True)
    sparse = torch.eye(3).to_sparse_csr()  # torch itself refuses to say if it is contiguous
    out = {"w": torch.empty(10), "unused": bad, "unused_sparse": sparse}
    asm = wire.ChunkAssembler(out=out)
    assert [asm.add(w) for w in wires][-1] is True
    assert asm.result()[0]["w"] is out["w"]
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])  # torch raises
    for dst, what in [
        (bad, "contiguous: True"),
        (sparse, "layout torch.sparse_csr"),
        (nested, "cannot take bytes: RuntimeError"),
    ]:
        asm = wire.ChunkAssembler(out={"w": dst})
        with pytest.raises(CodecError, match="destination 'w'") as info:
            asm.add(wires[0])
        assert info.value.field == "w" and what in str(info.value)


def test_wire_bytes_equal_the_messages_when_a_chunk_checksums_no_bytes() -> None:
    """Chunks of empty tensors only have a crc32c of 0, which protobuf leaves out of
    the wire: the hand-built tail must leave it out too."""
    batch = {f"empty.tensor.with.a.long.name.{i}": torch.empty(0) for i in range(40)}
    batch["w"] = torch.randn(300)
    msgs = list(wire.iter_chunks(batch, stream_id="s", max_chunk_bytes=512))
    wires = list(wire.iter_chunk_bytes(batch, stream_id="s", max_chunk_bytes=512))
    assert any(m.crc32c == 0 and not m.last for m in msgs)  # the case under test
    assert len(wires) == len(msgs)
    for m, w in zip(msgs, wires, strict=True):
        assert w == m.SerializeToString(deterministic=True)
    values, _ = wire.assemble_chunks(wires)
    assert_same(values, batch)


def test_corrupt_piece_is_refused_when_decoding_into_a_buffer() -> None:
    msgs = list(wire.iter_chunks({"w": torch.ones(1000)}, max_chunk_bytes=1024))
    msgs[1].pieces[0].data = b"\x01" + msgs[1].pieces[0].data[1:]
    asm = wire.ChunkAssembler(out={"w": torch.zeros(1000)})
    asm.add(msgs[0])
    with pytest.raises(CodecError, match="crc32c"):
        asm.add(msgs[1])
    with pytest.raises(CodecError, match="failed"):
        asm.result()


def test_stream_digests_keep_their_known_values() -> None:
    """What the stream digest covers, byte for byte, is part of the wire format: a
    fixed stream (tensors split across chunks, columns, meta) keeps the digests it
    had when the format was set, under both schemes, and the assembler agrees."""
    batch = {
        "a": torch.arange(3000, dtype=torch.float32),
        "b": torch.ones(7, dtype=torch.int8),
        "c": ["x", "y"],
        "d": torch.zeros(2, 3, dtype=torch.bfloat16),
    }
    known = {
        "chunks": "chunks:5da20b1b09f13d50409debab06d6c4b3d7fd259aa3da728ac767f10f7ac58920",
        "data": "data:284799bc3b151c45fe4e4c6249b623b7312cd636c7d2f4c6106332c70c51c2b6",
    }
    for scheme, want in known.items():
        msgs = list(
            wire.iter_chunks(
                batch, {"k": "v", "a": "b"}, max_chunk_bytes=1024, stream_id="s", digest=scheme
            )  # type: ignore[arg-type]
        )
        assert len(msgs) == 14 and msgs[-1].digest == want
        wires = list(
            wire.iter_chunk_bytes(
                batch, {"k": "v", "a": "b"}, max_chunk_bytes=1024, stream_id="s", digest=scheme
            )  # type: ignore[arg-type]
        )
        assert wire.parse_chunk(wires[-1]).digest == want
        values, meta = wire.assemble_chunks(wires)
        assert torch.equal(values["a"], batch["a"]) and meta == {"k": "v", "a": "b"}


def test_hand_built_chunk_views_with_any_contiguous_data_assemble() -> None:
    """A ChunkView built by hand may carry piece data as any contiguous buffer (here
    float32 views): it counts as its bytes. Data that is not contiguous is refused
    as a CodecError naming the tensor, before anything is copied, and the refusal
    sticks."""
    batch = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(100, dtype=torch.int8)}

    def views() -> list[wire.ChunkView]:
        msgs = wire.iter_chunks(batch, max_chunk_bytes=450, stream_id="s")
        return [wire.ChunkView.from_proto(m) for m in msgs]

    chunks = views()
    assert len(chunks) == 2 and [p.name for p in chunks[0].pieces] == ["w"]
    piece = chunks[0].pieces[0]
    piece.data = memoryview(np.frombuffer(bytes(piece.data), dtype=np.float32))
    values, _ = wire.assemble_chunks(chunks)
    assert torch.equal(values["w"], batch["w"]) and torch.equal(values["b"], batch["b"])
    chunks = views()
    piece = chunks[0].pieces[0]
    piece.data = memoryview(np.frombuffer(bytes(piece.data) * 2, dtype=np.uint8))[::2]
    asm = wire.ChunkAssembler()
    with pytest.raises(CodecError, match="'w' piece data is not contiguous"):
        asm.add(chunks[0])
    with pytest.raises(CodecError, match="failed earlier"):
        asm.add(chunks[1])


def test_parse_chunk_accepts_other_field_orders() -> None:
    # Pieces after the tail and data before the header: still a valid encoding.
    (msg,) = wire.iter_chunks({"x": torch.arange(4)}, {"m": "1"}, stream_id="s")
    piece = msg.pieces[0]
    data_first = (
        common_pb2.TensorPiece(data=piece.data).SerializeToString()
        + common_pb2.TensorPiece(
            name=piece.name, dtype=piece.dtype, shape=piece.shape, nbytes=piece.nbytes
        ).SerializeToString()
    )
    rest = common_pb2.TensorBatchChunk()
    rest.CopyFrom(msg)
    del rest.pieces[:]
    encoded = rest.SerializeToString() + b"\x22" + wire.encode_varint(len(data_first)) + data_first
    assert common_pb2.TensorBatchChunk.FromString(encoded) == msg
    view = wire.parse_chunk(encoded)
    assert view.to_proto() == msg
    values, meta = wire.assemble_chunks([view])
    assert torch.equal(values["x"], torch.arange(4)) and meta == {"m": "1"}
    # As bytes, the assembler copies from the views the parser made: the data first,
    # or given twice (protobuf keeps the last), lands where it should.
    values, _ = wire.assemble_chunks([encoded])
    assert torch.equal(values["x"], torch.arange(4))

    class Sub(bytes):  # a subclass of bytes is read through its buffer too
        pass

    values, _ = wire.assemble_chunks([Sub(encoded)])
    assert torch.equal(values["x"], torch.arange(4))
    twice = common_pb2.TensorPiece(data=bytes(len(piece.data))).SerializeToString() + data_first
    encoded = rest.SerializeToString() + b"\x22" + wire.encode_varint(len(twice)) + twice
    assert common_pb2.TensorBatchChunk.FromString(encoded) == msg
    values, _ = wire.assemble_chunks([encoded])
    assert torch.equal(values["x"], torch.arange(4))


def test_parse_chunk_refuses_what_protobuf_refuses_and_reads_long_varints() -> None:
    """The field scanner's varint skipping: a 10-byte varint (the longest) is read as
    protobuf reads it; a truncated one, an 11-byte one and a length past the end
    are refused as protobuf refuses them."""
    ten = b"\x10" + b"\xff" * 9 + b"\x01"  # seq = 2**64 - 1, kept as uint32 by protobuf
    assert wire.parse_chunk(ten).seq == common_pb2.TensorBatchChunk.FromString(ten).seq
    for bad, why in [
        (b"\x10\x80", "truncated varint"),
        (b"\x10" + b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
        (b"\x0a\x05abc", "runs past the end"),
    ]:
        with pytest.raises(Exception):  # noqa: B017 - protobuf's own error type varies
            common_pb2.TensorBatchChunk.FromString(bad)
        with pytest.raises(CodecError, match=why):
            wire.parse_chunk(bad)


def test_parse_chunk_reads_what_protobuf_reads_on_mutated_chunks() -> None:
    """The parser's shortcut for the common chunk and its general path, against
    protobuf on a few thousand mutations of real chunks (bytes changed, inserted,
    dropped, cut): what the parser accepts is exactly what protobuf reads, and what
    protobuf refuses the parser refuses. Piece data stay views of the chunk's bytes."""
    batch = {"w": torch.arange(40, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int8)}
    chunks = list(wire.iter_chunk_bytes(batch, max_chunk_bytes=200, stream_id="sid"))
    assert len(chunks) >= 3
    rng = np.random.default_rng(7)
    shortcut = 0
    for i in range(3000):
        data = bytearray(chunks[i % len(chunks)])
        for _ in range(int(rng.integers(1, 3))):
            at = int(rng.integers(0, len(data)))
            kind = int(rng.integers(0, 4))
            if kind == 0:
                data[at] = int(rng.integers(0, 256))
            elif kind == 1:
                data.insert(at, int(rng.choice([0x80, 0x0A, 0x10, 0x22, 0x32, 0x38, 0xFF])))
            elif kind == 2:
                del data[at]
            else:
                del data[at:]
                break
        b = bytes(data)
        try:
            want: common_pb2.TensorBatchChunk | None = common_pb2.TensorBatchChunk.FromString(b)
        except Exception:  # protobuf's own error type varies
            want = None
        if want is not None:
            want.DiscardUnknownFields()  # skipped by both, kept by protobuf's message
        fast = wire._parse_plain_chunk(memoryview(b))
        if fast is not None:
            shortcut += 1
            assert want is not None and fast.to_proto() == want, b
            assert all(isinstance(p.data, memoryview) and p.data.obj is b for p in fast.pieces)
        try:
            got: wire.ChunkView | None = wire.parse_chunk(b)
        except CodecError:
            got = None
        if got is not None:
            assert want is not None and got.to_proto() == want, b
        elif want is not None:
            # Stricter than protobuf only on groups (wire types 3 and 4), which the
            # chunk format never uses.
            assert any(k & 7 in (3, 4) for k in b), b
    assert shortcut > 300  # the shortcut itself was exercised, not only the fallback


# --------------------------------------------------------------------------- corruption


def stream(digest: str = "chunks") -> list[common_pb2.TensorBatchChunk]:
    batch = {
        "a": torch.arange(300, dtype=torch.float32),
        "b": torch.ones(7, dtype=torch.int8),
        "c": ["x"],
    }
    msgs = list(wire.iter_chunks(batch, max_chunk_bytes=512, stream_id="s", digest=digest))  # type: ignore[arg-type]
    assert len(msgs) >= 3
    return msgs


def test_flipped_data_byte_is_caught_by_crc() -> None:
    msgs = stream()
    data = bytearray(msgs[1].pieces[0].data)
    data[5] ^= 0x01
    msgs[1].pieces[0].data = bytes(data)
    with pytest.raises(
        CodecError, match=r"chunk seq 1: crc32c of piece data is 0x[0-9a-f]{8}, the chunk says"
    ):
        wire.assemble_chunks(msgs)


@pytest.mark.parametrize("digest", ["chunks", "data"])
def test_tampering_that_fixes_crc_is_caught_by_digest(digest: str) -> None:
    import google_crc32c

    msgs = stream(digest)
    data = bytearray(msgs[1].pieces[0].data)
    data[5] ^= 0x01
    msgs[1].pieces[0].data = bytes(data)
    crc = 0
    for p in msgs[1].pieces:
        crc = google_crc32c.extend(crc, p.data)
    msgs[1].crc32c = crc
    with pytest.raises(CodecError, match="digest"):
        wire.assemble_chunks(msgs)


def test_flipped_bytes_anywhere_in_wire_never_pass_silently() -> None:
    wires = [m.SerializeToString(deterministic=True) for m in stream()]
    target = wires[1]
    for pos in range(0, len(target), 7):
        bad = bytearray(target)
        bad[pos] ^= 0x40
        chunks = [*wires[:1], bytes(bad), *wires[2:]]
        try:
            values, _ = wire.assemble_chunks(chunks)
        except CodecError:
            continue
        # The only flips that may pass are ones that change nothing we deliver.
        good, _ = wire.assemble_chunks(wires)
        assert values.keys() == good.keys(), pos
        assert all(raw(values[k]) == raw(good[k]) for k in ("a", "b")), pos


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda m: m.pop(1), "chunk seq 2 arrived, expected seq 1"),
        (lambda m: m.insert(1, m.pop(2)), "chunk seq 2 arrived, expected seq 1"),
        (lambda m: m.pop(), "without its last chunk"),
        (lambda m: m.append(m[-1]), "after the last chunk"),
        (
            lambda m: setattr(m[-1], "total_bytes", m[-1].total_bytes + 1),
            "total_bytes=1208, received 1207",
        ),
        (lambda m: setattr(m[-1], "num_chunks", 99), "num_chunks=99"),
        (lambda m: setattr(m[-1], "digest", "chunks:" + "0" * 64), "digest"),
        (lambda m: setattr(m[-1], "digest", ""), "no digest"),
        (lambda m: setattr(m[-1], "digest", "md5:abc"), "unknown digest scheme 'md5'"),
        (lambda m: setattr(m[1], "stream_id", "other"), "stream_id 'other', expected 's'"),
        (lambda m: setattr(m[1].pieces[0], "offset", m[1].pieces[0].offset + 4), "expected"),
        (lambda m: setattr(m[1].pieces[0], "nbytes", 4), "nbytes"),
        (lambda m: m[1].pieces[0].shape.append(2), "earlier pieces said"),
    ],
)
def test_stream_violations(mutate: Any, match: str) -> None:
    msgs = stream()
    mutate(msgs)
    with pytest.raises(CodecError, match=match):
        wire.assemble_chunks(msgs)


@pytest.mark.parametrize("digest", ["chunks", "data"])
def test_header_and_meta_tampering_is_caught_by_digest(digest: str) -> None:
    batch = {"a": torch.arange(300, dtype=torch.float32), "b": torch.ones(8, dtype=torch.int8)}
    msgs = list(wire.iter_chunks(batch, {"m": "1"}, max_chunk_bytes=512, digest=digest))  # type: ignore[arg-type]
    piece = next(p for m in msgs for p in m.pieces if p.name == "b")
    piece.dtype = common_pb2.UINT8  # same size: only the digest can tell
    with pytest.raises(CodecError, match="digest"):
        wire.assemble_chunks(msgs)
    piece.dtype = common_pb2.INT8
    piece.shape[:] = [2, 4]  # same nbytes
    with pytest.raises(CodecError, match="digest"):
        wire.assemble_chunks(msgs)
    piece.shape[:] = [8]
    msgs[0].meta["m"] = "2"
    with pytest.raises(CodecError, match="digest"):
        wire.assemble_chunks(msgs)
    msgs[0].meta["m"] = "1"
    assert wire.assemble_chunks(msgs)[1] == {"m": "1"}


def test_truncated_wire_chunk() -> None:
    encoded = next(wire.iter_chunk_bytes({"x": torch.ones(100)}))
    for cut in (1, 10, len(encoded) // 2, len(encoded) - 1):
        with pytest.raises(CodecError):
            wire.assemble_chunks([encoded[:cut]])


def test_incomplete_tensor_and_overflow() -> None:
    msgs = stream()
    msgs[-1].pieces[-1].data = msgs[-1].pieces[-1].data + b"\0\0\0\0"
    msgs[-1].crc32c = 0
    with pytest.raises(CodecError):
        wire.assemble_chunks(msgs)
    asm = wire.ChunkAssembler()
    asm.add(stream()[0])
    with pytest.raises(CodecError, match="incomplete"):
        asm.result()


def test_assembler_reports_completion() -> None:
    msgs = stream()
    asm = wire.ChunkAssembler()
    assert [asm.add(m) for m in msgs] == [False] * (len(msgs) - 1) + [True]
    values, _ = asm.result(to="numpy")
    assert values["c"] == ["x"] and values["a"].dtype == np.float32


def test_max_bytes_refuses_a_declared_tensor_before_allocating_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    allocated: list[int] = []
    real_empty = np.empty

    def spy(n: Any, *args: Any, **kwargs: Any) -> Any:
        allocated.append(int(n))
        return real_empty(n, *args, **kwargs)

    msgs = list(wire.iter_chunks({"x": torch.zeros(4096)}, max_chunk_bytes=1024))
    asm = wire.ChunkAssembler(max_bytes=8192)
    monkeypatch.setattr(wire.np, "empty", spy)
    with pytest.raises(wire.StreamTooLarge, match="over the limit of 8192") as info:
        asm.add(msgs[0])
    held = info.value.value
    assert info.value.field == "x" and isinstance(held, int) and held > 16384
    assert isinstance(info.value, CodecError) and allocated == []
    with pytest.raises(CodecError, match="failed earlier"):
        asm.add(msgs[1])


def test_max_bytes_counts_tensors_columns_and_chunks_as_they_arrive() -> None:
    batch = {"a": torch.zeros(256), "b": torch.zeros(256), "rows": ["r" * 100] * 20}
    msgs = list(wire.iter_chunks(batch, max_chunk_bytes=600))
    values, _ = wire.assemble_chunks(msgs)
    enough = wire.ChunkAssembler(max_bytes=1_000_000)
    assert [enough.add(m) for m in msgs][-1] is True
    assert torch.equal(enough.result()[0]["b"], values["b"])
    fields = []
    for cap in (100, 2500, 3100):
        asm = wire.ChunkAssembler(max_bytes=cap)
        with pytest.raises(wire.StreamTooLarge) as info:
            for m in msgs:
                asm.add(m)
        held = info.value.value
        assert isinstance(held, int) and held > cap
        fields.append(info.value.field)
    assert fields[0] in ("chunks", "rows") and set(fields[1:]) <= {"a", "b", "rows", "chunks"}
    # Empty chunks are charged too: an endless stream of them is refused.
    asm = wire.ChunkAssembler(max_bytes=10_000)
    with pytest.raises(wire.StreamTooLarge, match="over the limit") as empty:
        for seq in range(1000):
            asm.add(common_pb2.TensorBatchChunk(stream_id="s", seq=seq, crc32c=0))
    assert empty.value.field == "chunks"


def test_max_bytes_refuses_a_declared_total_over_the_cap() -> None:
    msgs = stream()
    msgs[0].total_bytes = 10**12
    with pytest.raises(wire.StreamTooLarge, match="total_bytes=1000000000000") as info:
        wire.ChunkAssembler(max_bytes=10**9).add(msgs[0])
    assert info.value.field == "total_bytes"


def test_seq_errors_name_the_field() -> None:
    msgs = stream()
    asm = wire.ChunkAssembler()
    with pytest.raises(CodecError) as info:
        asm.add(msgs[1])
    assert (info.value.field, info.value.value) == ("seq", 1)
    done = wire.ChunkAssembler()
    for m in msgs:
        done.add(m)
    with pytest.raises(CodecError, match="after the last chunk") as info:
        done.add(msgs[0])
    assert info.value.field == "seq"


# --------------------------------------------------------------------------- raw layer


def test_raw_pack_unpack() -> None:
    batch = {
        "a": torch.randn(3, 5).t(),
        "b": np.arange(7, dtype=np.int16),
        "c": torch.ones((), dtype=torch.bfloat16),
    }
    specs = tensor_specs(batch)
    assert all(s.offset % 64 == 0 for s in specs)
    buf = bytearray(packed_size(specs))
    pack_into(batch, buf, specs)
    assert_same(unpack(buf, specs), {k: torch.as_tensor(v) for k, v in batch.items()})
    views = unpack(buf, specs, copy=False)
    views["b"][0] = 100  # zero-copy: writes land in the buffer
    assert unpack(buf, specs[:2], to="numpy")["b"][0] == 100
    with pytest.raises(CodecError, match="tensors only"):
        tensor_specs({"x": ["a"]})
    with pytest.raises(CodecError, match="smaller"):
        pack_into(batch, bytearray(10), specs)


# --------------------------------------------------------------------------- torch-free


def test_import_and_numpy_path_without_torch() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import numpy as np
        from rlfleet.common.codec import wire
        from rlfleet.common.codec.batch import CodecError
        batch = {"x": np.arange(6, dtype=np.float32).reshape(2, 3).T, "s": ["a", "b"], "j": [{"k": 1}]}
        values, meta = wire.decode_batch(wire.encode_batch(batch, {"m": "1"}), to="numpy")
        assert np.array_equal(values["x"], batch["x"]) and values["s"] == ["a", "b"], values
        assert values["j"] == [{"k": 1}] and meta == {"m": "1"}
        values, _ = wire.assemble_chunks(wire.iter_chunk_bytes(batch, max_chunk_bytes=256), to="numpy")
        assert np.array_equal(values["x"], batch["x"])
        try:
            wire.decode_batch(wire.encode_batch(batch))
        except CodecError as exc:
            assert "needs torch" in str(exc)
        else:
            raise AssertionError("to='torch' without torch should fail")
        assert sys.modules["torch"] is None
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("elements", [1, 20, 30, 4_000, 40_000, 300_000])
@pytest.mark.parametrize("on_policy", [False, True])
def test_an_envelope_frames_each_chunk_in_place(elements: int, on_policy: bool) -> None:
    """Chunks built inside ``TrainStepRequest`` and ``WeightChunk`` envelopes parse as
    those messages with protobuf itself (the padded length varint included), and the
    chunk inside is byte for byte the chunk built without an envelope. The sizes put
    chunk lengths on both sides of varint width boundaries (128, 16384)."""
    from rlfleet.trainer.serde import parse_train_step_request, train_step_envelope
    from rlfleet.v1 import rollout_pb2, trainer_pb2
    from rlfleet.weightsync.wire import weight_envelope

    batch = {"x": torch.arange(elements, dtype=torch.int32), "y": torch.ones(elements // 3)}
    plain = list(wire.iter_chunk_bytes(batch, max_chunk_bytes=100_000, stream_id="s"))
    framed = list(
        wire.iter_chunk_bytes(
            batch,
            max_chunk_bytes=100_000,
            stream_id="s",
            envelope=train_step_envelope(on_policy=on_policy, total_steps=300 * elements),
        )
    )
    weights = list(
        wire.iter_chunk_bytes(
            batch, max_chunk_bytes=100_000, stream_id="s", envelope=weight_envelope(7)
        )
    )
    assert len(plain) == len(framed) == len(weights)
    for chunk, step, weight in zip(plain, framed, weights, strict=True):
        assert chunk in step and chunk in weight  # the same bytes, framed
        msg = trainer_pb2.TrainStepRequest.FromString(step)
        assert msg.chunk == common_pb2.TensorBatchChunk.FromString(chunk)
        assert msg.on_policy is on_policy
        assert msg.total_steps == 300 * elements
        part = parse_train_step_request(step)
        assert part.on_policy is on_policy
        assert part.total_steps == 300 * elements
        assert part.chunk.crc32c == wire.parse_chunk(chunk).crc32c
        w = rollout_pb2.WeightChunk.FromString(weight)
        assert w.version == 7 and w.chunk == msg.chunk
    parts = [parse_train_step_request(step).chunk for step in framed]
    values, _ = wire.assemble_chunks(parts)
    assert all(torch.equal(values[k], v) for k, v in batch.items())


def test_a_padded_varint_has_the_width_asked_for() -> None:
    assert wire._padded_varint(5, 1) == b"\x05"
    assert wire._padded_varint(5, 3) == b"\x85\x80\x00"
    assert wire._padded_varint(300, 2) == wire.encode_varint(300)
    with pytest.raises(ValueError, match="width 1 cannot hold"):
        wire._padded_varint(300, 1)


def test_names_and_slots_count_toward_the_assemblers_limit() -> None:
    """Tensors of no bytes under long names are memory too: they are charged (name
    and slot), so a stream of them is refused at the limit, not held without bound."""
    batch = {f"t{i:04d}" + "x" * 2000: torch.empty(0) for i in range(100)}
    asm = wire.ChunkAssembler(max_bytes=100_000)
    with pytest.raises(wire.StreamTooLarge):
        for chunk in wire.iter_chunk_bytes(batch, max_chunk_bytes=1 << 20):
            asm.add(chunk)
    small = wire.ChunkAssembler(max_bytes=100_000)
    for chunk in wire.iter_chunk_bytes(dict(list(batch.items())[:10]), max_chunk_bytes=1 << 20):
        small.add(chunk)
    assert small.complete and 10 * 2005 < small.held <= 100_000
