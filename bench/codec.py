"""Codec benchmark: prints one JSON object on stdout (progress goes to stderr).

(a) encode + decode of a transformer-like state dict through the chunked codec,
    against a copy of the same bytes into preallocated, already touched buffers
    (``np.copyto`` per tensor: one single-threaded memcpy, the physical limit of
    moving the bytes once), in the same run. The codec paths: decoding into the same
    kind of preallocated buffers (``ChunkAssembler(out=...)``, the target's path),
    into fresh buffers (the default ``assemble_chunks``), with ``digest="data"``, and
    through protobuf objects. ``two_copies_two_crcs`` is the one-thread floor of any
    checksummed gRPC path: each block copied into a 4 MB staging buffer (the message
    gRPC needs) and out into the destination, with CRC-32C on both sides while the
    block is in cache -- what the codec must do at least (with the C extension,
    ``copy_crc32c: "native"`` in the output, each copy checksums as it goes);
(b) a large transfer over a loopback gRPC stream of codec chunks, reassembled on
    the server, against the same bytes over a raw TCP socket.

    python bench/codec.py                      # 256 MB state dict, 1 GiB transfers
    python bench/codec.py --size-mb 64 --transfer-mb 64 --repeats 3   # quick
    python bench/codec.py --transfer-mb 0      # (a) only

Target (issue 14): ``codec_into_vs_copy`` (encode + decode into preallocated
buffers over the copy baseline) >= 0.5.

MB is 10**6 bytes. ``MBps`` is the median of ``--repeats`` timed runs after one
warm-up (``best_MBps`` the fastest); the methods are interleaved run by run, so
background load hits them alike. The ratios use the medians.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import grpc
import numpy as np
import torch
from google.protobuf.internal import api_implementation

from rlfleet.common.codec import wire as codec
from rlfleet.common.crc32c import COPY_IMPLEMENTATION, copy_crc_views
from rlfleet.common.crc32c import IMPLEMENTATION as CRC32C_IMPLEMENTATION
from rlfleet.v1 import common_pb2

METHOD = "/rlfleet.bench.CodecBench/Push"
TIMEOUT_S = 300.0


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def state_dict(size_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A small decoder-only transformer's weights, about ``size_bytes`` in all:
    an fp32 embedding (~40%), bf16 attention/MLP matrices, fp32 norms and biases."""
    gen = torch.Generator().manual_seed(seed)
    hidden = 1024 if size_bytes >= 64 * 2**20 else 256
    sd: dict[str, torch.Tensor] = {}
    vocab = max(1, int(size_bytes * 0.4) // (hidden * 4))
    sd["model.embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen)
    used = vocab * hidden * 4
    layer_bytes = 12 * hidden * hidden * 2 + 9 * hidden * 4
    i = 0
    while used + layer_bytes <= size_bytes:
        p = f"model.layers.{i}."
        bf16 = {
            "self_attn.qkv_proj.weight": (3 * hidden, hidden),
            "self_attn.o_proj.weight": (hidden, hidden),
        }
        bf16 |= {
            "mlp.up_proj.weight": (4 * hidden, hidden),
            "mlp.down_proj.weight": (hidden, 4 * hidden),
        }
        for name, shape in bf16.items():
            sd[p + name] = torch.randn(*shape, generator=gen).to(torch.bfloat16)
        sd[p + "self_attn.qkv_proj.bias"] = torch.randn(3 * hidden, generator=gen)
        sd[p + "input_layernorm.weight"] = torch.ones(hidden)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        for j in range(4):  # many small tensors, as in real checkpoints (scales, biases)
            sd[p + f"mlp.scale_{j}"] = torch.randn(hidden, generator=gen)
        used += layer_bytes
        i += 1
    rest = (size_bytes - used) // (hidden * 4)
    if rest:
        sd["lm_head.weight"] = torch.randn(rest, hidden, generator=gen)
    sd["model.norm.weight"] = torch.ones(hidden)
    return sd


def nbytes(batch: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - start
    del out
    return elapsed


def interleaved(
    methods: dict[str, Callable[[], Any]], repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """(median, best) seconds per method: one warm-up each, then ``repeats`` rounds."""
    for fn in methods.values():
        timed(fn)
    times: dict[str, list[float]] = {k: [] for k in methods}
    for r in range(repeats):
        for name, fn in methods.items():
            times[name].append(timed(fn))
        log(
            f"  round {r + 1}/{repeats}: "
            + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items())
        )
    return {k: statistics.median(v) for k, v in times.items()}, {
        k: min(v) for k, v in times.items()
    }


# --------------------------------------------------------------------------- (a)


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def bench_encode_decode(sd: dict[str, torch.Tensor], repeats: int, chunk: int) -> dict[str, Any]:
    size = nbytes(sd)
    decoded, _ = codec.assemble_chunks(codec.iter_chunk_bytes(sd, max_chunk_bytes=chunk))
    assert all(torch.equal(decoded[k], v) for k, v in sd.items()), "round trip changed data"
    del decoded
    # Destinations written once before timing (warm pages), reused by every run.
    dest = {k: torch.empty_like(v) for k, v in sd.items()}
    for v in dest.values():
        v.zero_()
    pairs = [(_u8(v), _u8(dest[k])) for k, v in sd.items()]

    def copy_into() -> None:
        for src, dst in pairs:
            np.copyto(dst, src)

    staging = np.zeros(chunk, dtype=np.uint8).data
    views = [(src.data, dst.data) for src, dst in pairs]

    def two_copies_two_crcs() -> None:
        for src, dst in views:
            for start in range(0, len(src), chunk):
                n = min(chunk, len(src) - start)
                # The codec's own copy: a 256 KiB block at a time, view to view.
                copy_crc_views(src[start : start + n], staging[:n], 0)
                copy_crc_views(staging[:n], dst[start : start + n], 0)

    def codec_into() -> dict[str, Any]:
        asm = codec.ChunkAssembler(out=dest)
        for c in codec.iter_chunk_bytes(sd, max_chunk_bytes=chunk):
            asm.add(c)
        return asm.result()[0]

    methods = {
        "copy_into_buffers": copy_into,
        "two_copies_two_crcs": two_copies_two_crcs,
        "codec_wire_into_buffers": codec_into,
        "codec_wire": lambda: codec.assemble_chunks(
            codec.iter_chunk_bytes(sd, max_chunk_bytes=chunk)
        ),
        "codec_wire_data_digest": lambda: codec.assemble_chunks(
            codec.iter_chunk_bytes(sd, max_chunk_bytes=chunk, digest="data")
        ),
        "codec_proto_objects": lambda: codec.assemble_chunks(
            common_pb2.TensorBatchChunk.FromString(m.SerializeToString())
            for m in codec.iter_chunks(sd, max_chunk_bytes=chunk)
        ),
    }
    med, best = interleaved(methods, repeats)
    assert all(torch.equal(dest[k], v) for k, v in sd.items()), "decode into buffers changed data"
    mbps = {k: round(size / 1e6 / v, 1) for k, v in med.items()}
    base = mbps["copy_into_buffers"]
    ratio = round(mbps["codec_wire_into_buffers"] / base, 3)
    return {
        "bytes": size,
        "tensors": len(sd),
        "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in sd.values()}),
        "chunks": sum(1 for _ in codec.iter_chunk_bytes(sd, max_chunk_bytes=chunk)),
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "MBps": mbps,
        "best_MBps": {k: round(size / 1e6 / v, 1) for k, v in best.items()},
        "codec_into_vs_copy": ratio,
        "floor_vs_copy": round(mbps["two_copies_two_crcs"] / base, 3),
        "codec_into_vs_floor": round(
            mbps["codec_wire_into_buffers"] / mbps["two_copies_two_crcs"], 3
        ),
        "codec_fresh_vs_copy": round(mbps["codec_wire"] / base, 3),
        "codec_data_digest_vs_copy": round(mbps["codec_wire_data_digest"] / base, 3),
        "codec_proto_objects_vs_copy": round(mbps["codec_proto_objects"] / base, 3),
        "target": "codec_into_vs_copy >= 0.5",
        "met": ratio >= 0.5,
    }


# --------------------------------------------------------------------------- (b)


class _Push:
    """Server side: reassemble each incoming stream, reply with what arrived."""

    def __call__(self, chunks: Iterator[Any], context: grpc.ServicerContext) -> bytes:
        asm = codec.ChunkAssembler()
        count = 0
        for chunk in chunks:
            asm.add(chunk)
            count += 1
        values, _ = asm.result()
        size = sum(v.numel() * v.element_size() for v in values.values())
        return json.dumps({"chunks": count, "bytes": size}).encode()


def _generic_handler() -> grpc.GenericRpcHandler:
    push = _Push()
    return grpc.method_handlers_generic_handler(
        "rlfleet.bench.CodecBench",
        {
            # Wire path: chunks stay bytes until parse_chunk, piece data never copied by upb.
            "PushWire": grpc.stream_unary_rpc_method_handler(
                push, request_deserializer=codec.parse_chunk
            ),
            # Object path: what generated stubs do (FromString / SerializeToString).
            "PushProto": grpc.stream_unary_rpc_method_handler(
                push, request_deserializer=common_pb2.TensorBatchChunk.FromString
            ),
        },
    )


def _start_grpc_server() -> tuple[Any, str, str]:
    generic = _generic_handler()
    try:
        from rlfleet.common import rpc

        def add(_servicer: Any, server: Any) -> None:
            server.add_generic_rpc_handlers((generic,))

        server = rpc.create_server([(add, None)], host="127.0.0.1", port=0, max_workers=4)
        return server, server.address, "rlfleet.common.rpc.create_server"
    except ImportError as exc:  # the helper module is optional for this benchmark
        log(f"rlfleet.common.rpc unusable ({exc}); using grpc.server")
    from concurrent.futures import ThreadPoolExecutor

    limit = 64 * 2**20
    opts = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=opts)
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", "grpc.server"


def _tcp_receiver(listener: socket.socket, total: int, runs: int) -> None:
    """Accept ``runs`` connections; each sends an 8-byte length then the bytes, which
    land by recv_into in one buffer allocated and touched once (the best case for a
    bulk transport); ack each with one byte."""
    buf = np.ones(total, dtype=np.uint8).data
    head = bytearray(8)
    for _ in range(runs):
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(TIMEOUT_S)
            conn.recv_into(head, 8, socket.MSG_WAITALL)
            (size,) = struct.unpack("<Q", head)
            if size != total:
                raise ConnectionError(f"announced {size} bytes, expected {total}")
            got = 0
            while got < size:
                n = conn.recv_into(buf[got:])
                if n == 0:
                    raise ConnectionError(f"peer closed after {got} of {size} bytes")
                got += n
            conn.sendall(b"k")


def _server_process(conn: Connection) -> None:
    """A separate process, as a real service would be: a gRPC server and a TCP
    receiver, driven by commands over ``conn``."""
    server, address, kind = _start_grpc_server()
    conn.send((address, kind))
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            break
        with socket.create_server(("127.0.0.1", 0)) as listener:  # cmd == "tcp"
            listener.settimeout(TIMEOUT_S)
            conn.send(listener.getsockname()[1])
            _tcp_receiver(listener, *arg)
    server.stop(1.0) if kind == "grpc.server" else server.stop(grace_s=1.0)


def _tcp_sender(views: list[memoryview], port: int) -> None:
    total = sum(len(v) for v in views)
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(struct.pack("<Q", total))
        for v in views:
            sock.sendall(v)
        if sock.recv(1) != b"k":
            raise ConnectionError("no ack from the TCP receiver")


def bench_transfer(
    sd: dict[str, torch.Tensor], target: int, repeats: int, chunk: int
) -> dict[str, Any]:
    # The same tensors several times over (views, no extra memory) up to the target size.
    batch: dict[str, torch.Tensor] = {}
    while nbytes(batch) < target:
        r = len(batch) // len(sd)
        batch.update({f"copy{r}.{k}": v for k, v in sd.items()})
    size = nbytes(batch)
    views = [t.reshape(-1).view(torch.uint8).numpy().data for t in batch.values()]

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_server_process, args=(child_conn,), daemon=True)
    proc.start()
    try:
        if not conn.poll(120):
            raise TimeoutError("benchmark server process did not start within 120 s")
        address, server_kind = conn.recv()
        conn.send(("tcp", (size, repeats + 1)))
        if not conn.poll(60):
            raise TimeoutError("TCP receiver did not start within 60 s")
        tcp_port = conn.recv()
        channel = make_channel(address)
        push_wire = channel.stream_unary(
            "/rlfleet.bench.CodecBench/PushWire", request_serializer=codec.serialize_chunk
        )
        push_proto = channel.stream_unary(
            "/rlfleet.bench.CodecBench/PushProto",
            request_serializer=common_pb2.TensorBatchChunk.SerializeToString,
        )
        replies: list[bytes] = []
        methods = {
            "grpc_wire": lambda: replies.append(
                push_wire(codec.iter_chunk_bytes(batch, max_chunk_bytes=chunk), timeout=TIMEOUT_S)
            ),
            "grpc_proto_objects": lambda: replies.append(
                push_proto(codec.iter_chunks(batch, max_chunk_bytes=chunk), timeout=TIMEOUT_S)
            ),
            "tcp": lambda: _tcp_sender(views, tcp_port),
        }
        med, best = interleaved(methods, repeats)
        got = [json.loads(r) for r in replies]
        assert all(g["bytes"] == size for g in got), got
        channel.close()
        conn.send(("stop", None))
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
    mbps = {k: round(size / 1e6 / v, 1) for k, v in med.items()}
    return {
        "bytes": size,
        "chunks": got[0]["chunks"],
        "server": f"{server_kind}, in a separate process",
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "MBps": mbps,
        "best_MBps": {k: round(size / 1e6 / v, 1) for k, v in best.items()},
        "grpc_vs_tcp": round(mbps["grpc_wire"] / mbps["tcp"], 3),
        "grpc_proto_objects_vs_tcp": round(mbps["grpc_proto_objects"] / mbps["tcp"], 3),
    }


def make_channel(address: str) -> grpc.Channel:
    try:
        from rlfleet.common import rpc

        return rpc.create_channel(address, retry_unavailable=False)
    except ImportError:
        limit = 64 * 2**20
        opts = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        return grpc.insecure_channel(address, options=opts)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mb", type=float, default=256, help="state dict size for (a), MiB")
    ap.add_argument(
        "--transfer-mb", type=float, default=1024, help="bytes moved in (b), MiB; 0 skips (b)"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--transfer-repeats", type=int, default=3, help="at most this many for (b)")
    ap.add_argument("--chunk-bytes", type=int, default=codec.DEFAULT_MAX_CHUNK_BYTES)
    args = ap.parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]

    log(f"building a {args.size_mb:g} MiB state dict")
    sd = state_dict(int(args.size_mb * 2**20))
    log("(a) encode+decode vs a copy into preallocated buffers")
    a = bench_encode_decode(sd, args.repeats, args.chunk_bytes)
    b = None
    if args.transfer_mb > 0:
        log(f"(b) {args.transfer_mb:g} MiB over gRPC vs TCP")
        b = bench_transfer(
            sd,
            int(args.transfer_mb * 2**20),
            max(1, min(args.repeats, args.transfer_repeats)),
            args.chunk_bytes,
        )
    out: dict[str, Any] = {
        "benchmark": "codec",
        "date": dt.date.today().isoformat(),
        "host": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_start": load_start,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "grpcio": grpc.__version__,
            "protobuf_backend": api_implementation.Type(),
            "crc32c": CRC32C_IMPLEMENTATION,
            "copy_crc32c": COPY_IMPLEMENTATION,  # "native": one pass, the C extension
        },
        "chunk_bytes": args.chunk_bytes,
        "encode_decode": a,
        "transfer": b,
    }
    out["host"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
