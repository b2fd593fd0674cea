"""Bulk weight data plane: negotiated over gRPC, bytes moved elsewhere.

Protocol (``OpenWeightTransfer`` -> move bytes -> ``CommitWeightTransfer``):

1. The sender offers: version, the tensors (name, dtype, shape) in the order their
   bytes will follow, packed back to back with no padding, ``total_bytes``, its
   transports in preference order and its host name. Nothing is read or hashed yet.
2. The receiver checks the version and every name / dtype / shape against the model
   *before* any byte moves, picks the first transport it can serve and answers a
   plan: ``transfer_id``, transport, endpoint and, for TCP, a one-time token.
3. The sender moves the bytes and extends each tensor's CRC-32C with each block
   right after moving it (while it is still in cache); over TCP a checksum thread
   does this, so that the checksum of one block runs while the next one is sent
   (:data:`crc32c_extend` releases the GIL). The receiver computes its own CRC-32C
   per tensor as the bytes arrive, so no full pass over the bytes happens before
   or after the move on either side.
   **TCP**: the sender connects to ``endpoint`` (``host:port`` of a one-shot
   listener), writes the token, then the raw bytes from the tensors' own storage,
   and closes. The receiver reads into its staging buffer and checksums each read
   right after ``recv_into``.
   **SHM** (sender on the same host): ``endpoint`` names a POSIX shared-memory
   segment the receiver owns: a header of ``_SHM_HEADER`` bytes whose first 8 hold
   the count of bytes written so far (little-endian uint64), then the tensor
   bytes. The sender maps it (``/dev/shm/<name>``), copies block by block and
   bumps the count after each block; a receiver thread checksums behind the count.
4. ``CommitWeightTransfer`` carries the sender's per-tensor CRC-32Cs: the receiver
   waits for the bytes, checks the count and every checksum (``DataLoss`` naming
   the tensor otherwise), views its buffer as tensors without a copy and hands them
   to :meth:`WeightReceiver.apply`, which swaps them in atomically.

**Staging buffers are reused.** First-touching a fresh 1 GiB buffer costs seconds
of page faults on a small VM against ~0.1 s for a warm copy, so a finished
transfer's buffer (TCP) or segment (SHM) is kept and handed to the next transfer
that fits in it. The replica thus holds one staging buffer of the last update's
size per transport between updates. A buffer goes back to the pool only once
nothing can write into it any more (its receive thread ended, or the sender
committed) and the apply, which copies out of it, returned: engines must not keep
references to the tensors they are given. Concurrent transfers each get their own
buffer (a fresh one when the spare is taken).

Uncommitted transfers expire after ``timeout_s``; their buffers are released, not
reused (a late sender could still be writing).

**NCCL / CUDA IPC** plug in at step 2/3 the same way (see docs/rollout.md): a plan
whose endpoint is a rendezvous (NCCL: ``host:port`` of a TCPStore plus a group
name; CUDA IPC: serialized ``cudaIpcMemHandle``s that the sender creates and the
receiver opens), bytes moved device to device, and the same commit; only the
``_open_*`` / ``_wait_*`` pair of the new transport is added.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import hmac
import logging
import math
import mmap
import os
import queue
import secrets
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any

import google_crc32c
import numpy as np

from rlfleet.common.codec import TensorSpec, tensor_specs, unpack
from rlfleet.common.errors import DataLoss, DeadlineExceeded, InvalidArgument, NotFound
from rlfleet.rollout.engine import Engine
from rlfleet.rollout.weights import UpdateResult, WeightReceiver
from rlfleet.v1 import common_pb2

__all__ = [
    "CRC_RELEASES_GIL",
    "TRANSPORTS",
    "BulkReceiver",
    "TransferOffer",
    "TransferPlan",
    "crc32c_extend",
    "make_offer",
    "send_shm",
    "send_tcp",
    "spec_nbytes",
    "tensor_bytes",
    "tensor_crcs",
]

logger = logging.getLogger(__name__)

#: Transport names, in the default sender preference order.
TRANSPORTS: tuple[str, ...] = ("shm", "tcp", "grpc")
_SERVED = ("shm", "tcp", "grpc")
# Receiver: largest socket read, checksummed right after (still in a 32 MiB L3).
# Capping reads at 1 MiB measured slower than this (more calls and wake-ups).
_BLOCK = 16 << 20
# TCP sender: bytes per ``sendall``, each then checksummed by the CRC thread.
# 4 MiB: fewer syscalls and wake-ups than 1 MiB; still in cache when checksummed.
_SEND_BLOCK = 4 << 20
# SHM sender: bytes copied, then checksummed, per step (small: still in cache).
_SHM_BLOCK = 1 << 20
_SHM_HEADER = 4096  # bytes before the tensor bytes in a segment (page-aligned data)
_SHM_POLL_S = 0.0005  # receiver's checksum thread: wait between looks at the count


@dataclass(frozen=True, slots=True)
class TransferOffer:
    """A sender's proposal (``WeightTransferOffer``)."""

    version: int
    tensors: list[TensorSpec]  # offsets packed back to back, in byte order
    total_bytes: int
    transports: list[str]
    sender_host: str = ""


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """The receiver's answer (``WeightTransferPlan``)."""

    transfer_id: str
    transport: str
    endpoint: str = ""
    token: str = ""


def _torch_dtype_name(code: int) -> str:
    return str(common_pb2.DType.Name(code)).lower()


def tensor_bytes(t: Any) -> memoryview:
    """The C-order bytes of a torch tensor or numpy array as a flat uint8 view
    (no copy when already contiguous on the CPU)."""
    if isinstance(t, np.ndarray):
        return memoryview(np.ascontiguousarray(t).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _u8(data: memoryview) -> np.ndarray:
    # google_crc32c takes bytes or numpy arrays, not memoryviews.
    return np.frombuffer(data, dtype=np.uint8)


def _load_crc32c_extend() -> tuple[Callable[[int, np.ndarray], int], bool]:
    """``crc32c_extend(crc, uint8 array)`` and whether it releases the GIL.

    google-crc32c's ``extend`` holds the GIL for anything but a ``bytes`` object
    (it guards against a buffer changing under it), so a checksum thread would
    stall the thread moving bytes. The same C function, ``crc32c_extend`` of the
    library its extension links, called through ``ctypes`` runs without the GIL.
    A changing buffer is harmless here: the sender checksums after sending, the
    receiver after receiving, and any difference is a mismatch that rejects the
    update. Checked against the extension on a known value; if the library
    cannot be loaded, the extension's ``extend``."""
    fallback = google_crc32c.extend
    try:
        from google_crc32c import _crc32c

        fn = ctypes.CDLL(_crc32c.__file__).crc32c_extend
    except (ImportError, OSError, AttributeError):
        return fallback, False
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]

    def extend(crc: int, data: np.ndarray) -> int:
        # ``data`` is a C-contiguous uint8 array, alive for the call (the caller's).
        return int(fn(crc, data.ctypes.data, data.nbytes))

    probe = np.frombuffer(b"123456789", dtype=np.uint8)
    if extend(0, probe) != 0xE3069283 or extend(0, probe) != int(fallback(0, probe)):
        return fallback, False
    return extend, True


#: CRC-32C extend over a uint8 array; ``CRC_RELEASES_GIL`` says whether it runs
#: without the GIL (so that a thread can checksum while another moves bytes).
crc32c_extend, CRC_RELEASES_GIL = _load_crc32c_extend()


def tensor_crcs(named_tensors: Mapping[str, Any], specs: Sequence[TensorSpec]) -> list[int]:
    """CRC-32C of each tensor's bytes, in ``specs`` order (what a sender commits)."""
    return [crc32c_extend(0, _u8(tensor_bytes(named_tensors[s.name]))) for s in specs]


class _CrcThread:
    """Per-tensor CRC-32C computed in a thread of its own, block by block, behind
    the caller that moves the blocks (``put`` right after a block is sent or
    copied, while it is still in cache). With a GIL-free ``crc32c_extend`` the
    checksum of block i runs while block i+1 moves."""

    def __init__(self, n_tensors: int) -> None:
        self.values = [0] * n_tensors
        self._queue: queue.SimpleQueue[tuple[int, np.ndarray] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rlfleet-send-crc", daemon=True)
        self._thread.start()

    def put(self, index: int, block: np.ndarray) -> None:
        self._queue.put((index, block))

    def result(self) -> list[int]:
        """Wait for every block put so far; the per-tensor CRC-32Cs."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.values

    def close(self) -> None:
        """Stop without a result (the move failed)."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain: the caller learns of the error in result()
            index, block = item
            try:
                self.values[index] = crc32c_extend(self.values[index], block)
            except BaseException as e:  # re-raised in the caller's thread
                self._error = e


def make_offer(
    named_tensors: Mapping[str, Any], version: int, transports: Sequence[str] = TRANSPORTS
) -> TransferOffer:
    """The offer for ``named_tensors``: layout only, no pass over the bytes."""
    specs = tensor_specs(named_tensors, align=1)
    total = specs[-1].offset + specs[-1].nbytes if specs else 0
    return TransferOffer(
        version=version,
        tensors=specs,
        total_bytes=total,
        transports=list(transports),
        sender_host=socket.gethostname(),
    )


# --------------------------------------------------------------------- sender side


def send_tcp(
    plan: TransferPlan,
    named_tensors: Mapping[str, Any],
    specs: Sequence[TensorSpec],
    *,
    timeout_s: float = 600.0,
) -> list[int]:
    """Connect to the plan's endpoint, present the token, stream the bytes in order.

    Returns:
        The CRC-32C of each tensor as sent, in ``specs`` order (for the commit).
    """
    host, _, port = plan.endpoint.rpartition(":")
    checksums = _CrcThread(len(specs))
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(plan.token.encode())
            for index, s in enumerate(specs):
                data = tensor_bytes(named_tensors[s.name])
                array = _u8(data)
                for i in range(0, len(data), _SEND_BLOCK):
                    sock.sendall(data[i : i + _SEND_BLOCK])  # no copy: the tensor's storage
                    checksums.put(index, array[i : i + _SEND_BLOCK])
            sock.shutdown(socket.SHUT_WR)
            # Wait for the receiver to close: it has everything once it does.
            sock.recv(1)
    except BaseException:
        checksums.close()
        raise
    return checksums.result()


def send_shm(
    plan: TransferPlan, named_tensors: Mapping[str, Any], specs: Sequence[TensorSpec]
) -> list[int]:
    """Copy the bytes into the receiver's shared-memory segment, block by block,
    publishing the count of bytes written after each block.

    Returns:
        The CRC-32C of each tensor as copied, in ``specs`` order (for the commit).
    """
    # Mapped by path rather than through SharedMemory: attaching with SharedMemory
    # registers the segment with this process's resource tracker, which would unlink
    # it (and warn) when this process exits.
    path = f"/dev/shm/{plan.endpoint.lstrip('/')}"
    total = specs[-1].offset + specs[-1].nbytes if specs else 0
    if total == 0:
        return [0] * len(specs)
    crcs: list[int] = []
    fd = os.open(path, os.O_RDWR)
    try:
        # MAP_POPULATE: map every page in one call rather than fault them in one by
        # one during the copy (the segment's pages exist once it has been used).
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        with mmap.mmap(fd, _SHM_HEADER + total, flags=flags) as mm:
            written = np.frombuffer(mm, dtype="<u8", count=1)
            dst = np.frombuffer(mm, dtype=np.uint8, offset=_SHM_HEADER, count=total)
            try:
                for s in specs:
                    crcs.append(_copy_tensor(s, named_tensors[s.name], dst, written))
            finally:
                del written, dst  # the mmap cannot close while numpy views it
    finally:
        os.close(fd)
    return crcs


def _copy_tensor(spec: TensorSpec, tensor: Any, dst: np.ndarray, written: np.ndarray) -> int:
    # Checksummed inline: a checksum thread here (as ``send_tcp`` has) measured no
    # faster, the copy and the CRC competing for the same cores.
    src = _u8(tensor_bytes(tensor))
    crc = 0
    for i in range(0, spec.nbytes, _SHM_BLOCK):
        block = src[i : i + _SHM_BLOCK]
        start = spec.offset + i
        dst[start : start + len(block)] = block
        # Published after the bytes (x86 keeps the order of stores; elsewhere the
        # receiver re-reads a mismatching tensor at commit).
        written[0] = start + len(block)
        crc = crc32c_extend(crc, block)
    return crc


# --------------------------------------------------------------------- receiver side


class _TensorCrcs:
    """Per-tensor CRC-32C of a packed byte stream, fed in order as bytes arrive."""

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        self.ends = [s.offset + s.nbytes for s in specs]
        self.values = [0] * len(specs)
        self.fed = 0  # bytes checksummed so far

    def feed(self, buf: np.ndarray, end: int) -> None:
        """Checksum ``buf[self.fed:end]``, split at tensor boundaries."""
        pos = self.fed
        i = bisect.bisect_right(self.ends, pos)  # first tensor ending after pos
        while pos < end:
            stop = min(end, self.ends[i])
            self.values[i] = crc32c_extend(self.values[i], buf[pos:stop])
            pos = stop
            i += 1
        self.fed = max(self.fed, end)


@dataclass
class _Transfer:
    id: str
    offer: TransferOffer
    transport: str
    created: float
    token: str = ""
    storage: np.ndarray | None = None  # tcp: the staging array (may be larger than needed)
    buffer: Any = None  # np.uint8 array (tcp) or memoryview of the segment (shm), exact size
    shm: shared_memory.SharedMemory | None = None
    listener: socket.socket | None = None
    done: threading.Event = field(default_factory=threading.Event)  # no writer left (tcp)
    stop: threading.Event = field(default_factory=threading.Event)  # shm checksum thread
    checker: threading.Thread | None = None
    crcs: _TensorCrcs | None = None
    received: int = 0
    error: str = ""


class BulkReceiver:
    """Receiver side of the bulk data plane for one engine.

    Args:
        receiver: applies verified tensors (shared with the gRPC chunk path).
        engine: checks the offered names / dtypes / shapes before bytes move.
        host: interface the TCP listeners bind (the replica's advertised host).
        timeout_s: an open transfer not committed within this is dropped.
    """

    def __init__(
        self,
        receiver: WeightReceiver,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
    ) -> None:
        self._receiver = receiver
        self._engine = engine
        self._host = host
        self._timeout_s = timeout_s
        self._node = socket.gethostname()
        self._lock = threading.Lock()
        self._transfers: dict[str, _Transfer] = {}
        # One spare staging buffer per transport, from the last finished transfer.
        self._spare_array: np.ndarray | None = None
        self._spare_shm: shared_memory.SharedMemory | None = None

    def open(self, offer: TransferOffer) -> TransferPlan:
        self._expire()
        self._receiver.check_version(offer.version)
        self._check_layout(offer)
        self._engine.check_weights(
            {s.name: (_torch_dtype_name(s.dtype), s.shape) for s in offer.tensors}
        )
        transport = self._choose(offer)
        t = _Transfer(uuid.uuid4().hex, offer, transport, time.monotonic())
        if transport == "tcp":
            self._open_tcp(t)
        elif transport == "shm":
            self._open_shm(t)
        with self._lock:
            self._transfers[t.id] = t
        endpoint = ""
        if t.listener is not None:
            host, port = t.listener.getsockname()[:2]
            endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        elif t.shm is not None:
            endpoint = t.shm.name
        logger.info(
            "weight transfer %s: version %d, %d bytes over %s",
            t.id,
            offer.version,
            offer.total_bytes,
            transport,
        )
        return TransferPlan(t.id, transport, endpoint, t.token)

    def commit(self, transfer_id: str, crc32c: Sequence[int]) -> UpdateResult:
        """Verify the transfer against the sender's per-tensor CRC-32Cs and apply it."""
        with self._lock:
            t = self._transfers.pop(transfer_id, None)
        if t is None:
            raise NotFound(
                f"no open weight transfer {transfer_id!r} (unknown, committed or expired)",
                field="transfer_id",
                value=transfer_id,
            )
        try:
            return self._verify_and_apply(t, crc32c)
        finally:
            # The sender committed, so it no longer writes: the buffer can be reused
            # once its receive / checksum thread has ended.
            self._release(t, reuse=True)

    def _verify_and_apply(self, t: _Transfer, crc32c: Sequence[int]) -> UpdateResult:
        # A function of its own so that the tensor views into the buffer are gone
        # before the caller releases it (a shared-memory segment cannot close while
        # views of it exist).
        if t.transport == "grpc":
            raise InvalidArgument(
                "this transfer was planned for the gRPC chunk stream: use UpdateWeights",
                field="transfer_id",
                value=t.id,
            )
        specs = t.offer.tensors
        if len(crc32c) != len(specs):
            raise InvalidArgument(
                f"the commit carries {len(crc32c)} CRC-32Cs for {len(specs)} offered tensors",
                field="crc32c",
                value=len(crc32c),
            )
        total = t.offer.total_bytes
        remaining = max(0.0, self._timeout_s - (time.monotonic() - t.created))
        if t.transport == "tcp":
            if not t.done.wait(remaining):
                raise DeadlineExceeded(
                    f"transfer {t.id}: {t.received} of {total} bytes arrived within "
                    f"{self._timeout_s}s",
                    field="transfer_id",
                )
        else:
            # The sender has finished writing (it committed): the checksum thread
            # catches up with the count and ends.
            t.stop.set()
            if t.checker is not None:
                t.checker.join(remaining)
                if t.checker.is_alive():
                    raise DeadlineExceeded(f"transfer {t.id}: checksum thread still running")
            if t.received < total and not t.error:
                t.error = f"sender committed after writing {t.received} of {total} bytes"
        if t.error:
            raise DataLoss(f"transfer {t.id}: {t.error}", code="TRANSFER_FAILED")
        assert t.crcs is not None
        got = t.crcs.values
        bad = [i for i, (a, b) in enumerate(zip(got, crc32c, strict=True)) if a != b]
        if bad and t.transport == "shm":
            # The thread read behind the sender's published count; where memory order
            # is weaker than x86's it may have read a block early. Re-read those
            # tensors now that the sender is done (the commit orders it) before
            # calling them corrupt.
            buf = np.frombuffer(t.buffer, dtype=np.uint8)
            for i in bad:
                s = specs[i]
                got[i] = crc32c_extend(0, buf[s.offset : s.offset + s.nbytes])
            del buf
            bad = [i for i in bad if got[i] != crc32c[i]]
        if bad:
            names = ", ".join(repr(specs[i].name) for i in bad[:3])
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            i = bad[0]
            raise DataLoss(
                f"transfer {t.id} ({t.transport}): CRC-32C mismatch in {len(bad)} of "
                f"{len(specs)} tensors ({names}{more}; first: received {got[i]:#010x}, "
                f"sender sent {crc32c[i]:#010x}); nothing applied",
                code="CHECKSUM_MISMATCH",
            )
        tensors = unpack(t.buffer, specs, to="torch", copy=False)
        return self._receiver.apply(
            tensors, t.offer.version, start=t.created, transport=t.transport
        )

    def close(self) -> None:
        with self._lock:
            transfers, self._transfers = list(self._transfers.values()), {}
        for t in transfers:
            self._release(t, reuse=False)
        with self._lock:
            spare_shm, self._spare_shm, self._spare_array = self._spare_shm, None, None
        if spare_shm is not None:
            _destroy_shm(spare_shm)

    # ------------------------------------------------------------------ internals

    def _check_layout(self, offer: TransferOffer) -> None:
        offset = 0
        for i, s in enumerate(offer.tensors):
            expected = spec_nbytes(s.name, s.dtype, s.shape, field=f"tensors[{i}]")
            if s.nbytes != expected or s.offset != offset:
                raise InvalidArgument(
                    f"tensor {s.name!r}: nbytes={s.nbytes} offset={s.offset}, expected "
                    f"nbytes={expected} offset={offset} (packed in order, no padding)",
                    field=f"tensors[{i}]",
                    value=s.name,
                )
            offset += s.nbytes
        if offset != offer.total_bytes:
            raise InvalidArgument(
                f"total_bytes={offer.total_bytes}, the tensors add up to {offset}",
                field="total_bytes",
                value=offer.total_bytes,
            )

    def _choose(self, offer: TransferOffer) -> str:
        for name in offer.transports:
            if name == "shm" and offer.sender_host != self._node:
                continue
            if name in _SERVED:
                return name
        raise InvalidArgument(
            f"none of the offered transports {offer.transports} is served here "
            f"(served: {list(_SERVED)}; shm only from host {self._node!r})",
            field="transports",
            value=offer.transports,
        )

    def _release(self, t: _Transfer, *, reuse: bool) -> None:
        """Free ``t``'s listener and buffer; with ``reuse``, keep the buffer as the
        spare when no thread can still write into it or checksum it."""
        if t.listener is not None:
            with contextlib.suppress(OSError):
                t.listener.close()
        t.stop.set()
        views_gone = True
        if isinstance(t.buffer, memoryview):
            try:
                t.buffer.release()
            except BufferError:  # tensors still view it (an exception's traceback holds them)
                views_gone = False
        t.buffer = None
        t.crcs = None
        storage, t.storage = t.storage, None
        if storage is not None and reuse and t.done.is_set():
            with self._lock:
                if self._spare_array is None or self._spare_array.nbytes <= storage.nbytes:
                    self._spare_array = storage
        shm, t.shm = t.shm, None
        if shm is None:
            return
        checker_done = t.checker is None or not t.checker.is_alive()
        if reuse and checker_done and views_gone:
            with self._lock:
                old = self._spare_shm
                if old is None or old.size <= shm.size:
                    self._spare_shm, shm = shm, old  # destroy the smaller one
        if shm is not None:
            _destroy_shm(shm)

    def _take_array(self, nbytes: int) -> np.ndarray:
        with self._lock:
            spare, self._spare_array = self._spare_array, None
        if spare is not None and spare.nbytes >= nbytes:
            return spare
        # None spare (or a concurrent transfer holds it): a fresh one; a spare too
        # small is dropped first, so its memory goes before the new one is touched.
        del spare
        return np.empty(nbytes, dtype=np.uint8)

    def _take_shm(self, nbytes: int) -> shared_memory.SharedMemory:
        with self._lock:
            spare, self._spare_shm = self._spare_shm, None
        if spare is not None:
            if spare.size >= nbytes:
                return spare
            _destroy_shm(spare)
        return shared_memory.SharedMemory(
            name=f"rlfleet_{uuid.uuid4().hex[:16]}", create=True, size=nbytes
        )

    def _open_shm(self, t: _Transfer) -> None:
        total = t.offer.total_bytes
        t.shm = self._take_shm(_SHM_HEADER + total)
        buf = t.shm.buf
        assert buf is not None
        struct.pack_into("<Q", buf, 0, 0)  # nothing written yet
        t.buffer = buf[_SHM_HEADER : _SHM_HEADER + total]
        t.crcs = _TensorCrcs(t.offer.tensors)
        t.checker = threading.Thread(
            target=self._check_shm, args=(t,), name=f"rlfleet-crc-{t.id[:8]}", daemon=True
        )
        t.checker.start()

    def _check_shm(self, t: _Transfer) -> None:
        """Checksum the segment behind the sender's published count until all bytes
        are in or the transfer is committed / dropped."""
        assert t.shm is not None and t.shm.buf is not None and t.crcs is not None
        total = t.offer.total_bytes
        count = np.frombuffer(t.shm.buf, dtype="<u8", count=1)
        data = np.frombuffer(t.shm.buf, dtype=np.uint8, offset=_SHM_HEADER, count=total)
        try:
            while t.received < total:
                stopping = t.stop.is_set()  # read before the count: see the last write
                written = int(count[0])
                if written > total:
                    t.error = f"sender reported {written} bytes written of {total} offered"
                    return
                if written > t.received:
                    t.crcs.feed(data, written)
                    t.received = written
                elif stopping:
                    return
                else:
                    time.sleep(_SHM_POLL_S)
        finally:
            del count, data

    def _open_tcp(self, t: _Transfer) -> None:
        t.token = secrets.token_hex(16)
        t.storage = self._take_array(t.offer.total_bytes)
        t.buffer = t.storage[: t.offer.total_bytes]
        t.crcs = _TensorCrcs(t.offer.tensors)
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((self._host, 0))
        listener.listen(1)
        listener.settimeout(self._timeout_s)
        t.listener = listener
        threading.Thread(
            target=self._serve_tcp, args=(t,), name=f"rlfleet-weights-{t.id[:8]}", daemon=True
        ).start()

    def _serve_tcp(self, t: _Transfer) -> None:
        assert t.listener is not None and t.crcs is not None
        buf = t.buffer
        crcs = t.crcs
        try:
            deadline = t.created + self._timeout_s
            while True:  # bounded by the listener's timeout; wrong tokens are dropped
                conn, _ = t.listener.accept()
                with conn:
                    conn.settimeout(max(1.0, deadline - time.monotonic()))
                    token = _recv_exact(conn, len(t.token))
                    if not hmac.compare_digest(token, t.token.encode()):
                        logger.warning("transfer %s: connection with a wrong token dropped", t.id)
                        continue
                    view = memoryview(buf)
                    total = t.offer.total_bytes
                    while t.received < total:
                        n = conn.recv_into(view[t.received : t.received + _BLOCK])
                        if n == 0:
                            break
                        t.received += n
                        # Checksummed as it lands, while the sender fills the socket
                        # again (the block is still in cache).
                        crcs.feed(buf, t.received)
                    view.release()
                    if t.received < total:
                        t.error = f"sender closed after {t.received} of {total} bytes"
                    elif conn.recv(1):
                        t.error = f"sender sent more than the {total} bytes offered"
                    break
        except (OSError, ConnectionError) as e:
            t.error = f"{type(e).__name__}: {e} after {t.received} bytes"
        finally:
            with contextlib.suppress(OSError):
                t.listener.close()
            t.done.set()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [k for k, t in self._transfers.items() if now - t.created > self._timeout_s]
            dropped = [self._transfers.pop(k) for k in old]
        for t in dropped:
            logger.warning("weight transfer %s expired uncommitted", t.id)
            self._release(t, reuse=False)


def _destroy_shm(shm: shared_memory.SharedMemory) -> None:
    with contextlib.suppress(OSError, BufferError):
        shm.close()
    with contextlib.suppress(OSError):
        shm.unlink()


_ITEMSIZE = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
    "int16": 2, "int32": 4, "int64": 8, "bool": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip


def spec_nbytes(name: str, dtype: int, shape: Sequence[int], *, field: str = "tensors") -> int:
    """Bytes of a tensor of ``dtype`` (a ``DType`` value) and ``shape``; raises
    ``InvalidArgument`` for an unknown dtype or a negative dimension."""
    try:
        itemsize = _ITEMSIZE[_torch_dtype_name(dtype)]
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


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            break
        buf += part
    return bytes(buf)
