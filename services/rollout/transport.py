"""Bulk weight data plane: negotiated over gRPC, bytes moved elsewhere.

Protocol (``OpenWeightTransfer`` -> move bytes -> ``CommitWeightTransfer``):

1. The sender offers: version, the tensors (name, dtype, shape) in the order their
   bytes will follow, packed back to back with no padding, ``total_bytes``, the
   sha256 of all those bytes, its transports in preference order and its host name.
2. The receiver checks the version and every name / dtype / shape against the model
   *before* any byte moves, picks the first transport it can serve and answers a
   plan: ``transfer_id``, transport, endpoint and, for TCP, a one-time token.
3. **TCP**: the sender connects to ``endpoint`` (``host:port`` of a one-shot
   listener), writes the token, then the raw bytes, and closes. The receiver reads
   into one preallocated buffer while a second thread hashes what has arrived
   (hashlib releases the GIL), so verification overlaps the transfer.
   **SHM** (sender on the same host): ``endpoint`` names a POSIX shared-memory
   segment of ``total_bytes`` the receiver created; the sender maps it
   (``/dev/shm/<name>``) and copies the bytes in.
4. ``CommitWeightTransfer``: the receiver waits for the bytes, checks count and
   sha256 (``DataLoss`` otherwise), views its buffer as tensors without a copy and
   hands them to :meth:`WeightReceiver.apply`, which swaps them in atomically.

Uncommitted transfers expire after ``timeout_s``; their buffers are released.

**NCCL / CUDA IPC** plug in at step 2/3 the same way (see docs/rollout.md): a plan
whose endpoint is a rendezvous (NCCL: ``host:port`` of a TCPStore plus a group
name; CUDA IPC: serialized ``cudaIpcMemHandle``s that the sender creates and the
receiver opens), bytes moved device to device, and the same commit; only the
``_open_*`` / ``_wait_*`` pair of the new transport is added.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import math
import mmap
import os
import queue
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from rlfleet.common.codec import TensorSpec, tensor_specs, unpack
from rlfleet.common.errors import DataLoss, DeadlineExceeded, InvalidArgument, NotFound
from rlfleet.rollout.engine import Engine
from rlfleet.rollout.weights import UpdateResult, WeightReceiver
from rlfleet.v1 import common_pb2

__all__ = [
    "TRANSPORTS",
    "BulkReceiver",
    "TransferOffer",
    "TransferPlan",
    "make_offer",
    "send_shm",
    "send_tcp",
    "spec_nbytes",
    "tensor_bytes",
]

logger = logging.getLogger(__name__)

#: Transport names, in the default sender preference order.
TRANSPORTS: tuple[str, ...] = ("shm", "tcp", "grpc")
_SERVED = ("shm", "tcp", "grpc")
_BLOCK = 8 << 20  # socket reads / hash updates


@dataclass(frozen=True, slots=True)
class TransferOffer:
    """A sender's proposal (``WeightTransferOffer``)."""

    version: int
    tensors: list[TensorSpec]  # offsets packed back to back, in byte order
    total_bytes: int
    sha256: str
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


def make_offer(
    named_tensors: Mapping[str, Any], version: int, transports: Sequence[str] = TRANSPORTS
) -> TransferOffer:
    """The offer for ``named_tensors`` (hashes every byte once)."""
    specs = tensor_specs(named_tensors, align=1)
    h = hashlib.sha256()
    for s in specs:
        h.update(tensor_bytes(named_tensors[s.name]))
    total = specs[-1].offset + specs[-1].nbytes if specs else 0
    return TransferOffer(
        version=version,
        tensors=specs,
        total_bytes=total,
        sha256=h.hexdigest(),
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
) -> None:
    """Connect to the plan's endpoint, present the token, stream the bytes in order."""
    host, _, port = plan.endpoint.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(plan.token.encode())
        for s in specs:
            data = tensor_bytes(named_tensors[s.name])
            if len(data):
                sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        # Wait for the receiver to close: it has everything once it does.
        sock.recv(1)


def send_shm(
    plan: TransferPlan, named_tensors: Mapping[str, Any], specs: Sequence[TensorSpec]
) -> None:
    """Copy the bytes into the receiver's shared-memory segment."""
    # Mapped by path rather than through SharedMemory: attaching with SharedMemory
    # registers the segment with this process's resource tracker, which would unlink
    # it (and warn) when this process exits.
    path = f"/dev/shm/{plan.endpoint.lstrip('/')}"
    total = specs[-1].offset + specs[-1].nbytes if specs else 0
    if total == 0:
        return
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, total) as mm:
            dst = np.frombuffer(mm, dtype=np.uint8)
            for s in specs:
                dst[s.offset : s.offset + s.nbytes] = np.frombuffer(
                    tensor_bytes(named_tensors[s.name]), dtype=np.uint8
                )
            del dst
    finally:
        os.close(fd)


# --------------------------------------------------------------------- receiver side


@dataclass
class _Transfer:
    id: str
    offer: TransferOffer
    transport: str
    created: float
    token: str = ""
    buffer: Any = None  # np.uint8 array (tcp) or memoryview of the segment (shm)
    shm: shared_memory.SharedMemory | None = None
    listener: socket.socket | None = None
    done: threading.Event = field(default_factory=threading.Event)
    received: int = 0
    digest: str = ""
    error: str = ""

    def release(self) -> None:
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.close()
        if isinstance(self.buffer, memoryview):
            self.buffer.release()
        self.buffer = None
        if self.shm is not None:
            with contextlib.suppress(OSError, BufferError):
                self.shm.close()
            with contextlib.suppress(OSError):
                self.shm.unlink()
            self.shm = None


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

    def commit(self, transfer_id: str) -> UpdateResult:
        with self._lock:
            t = self._transfers.pop(transfer_id, None)
        if t is None:
            raise NotFound(
                f"no open weight transfer {transfer_id!r} (unknown, committed or expired)",
                field="transfer_id",
                value=transfer_id,
            )
        try:
            return self._verify_and_apply(t)
        finally:
            t.release()

    def _verify_and_apply(self, t: _Transfer) -> UpdateResult:
        # A function of its own so that the tensor views into the buffer are gone
        # before the caller releases it (a shared-memory segment cannot close while
        # views of it exist).
        if t.transport == "grpc":
            raise InvalidArgument(
                "this transfer was planned for the gRPC chunk stream: use UpdateWeights",
                field="transfer_id",
                value=t.id,
            )
        total = t.offer.total_bytes
        if t.transport == "tcp":
            remaining = self._timeout_s - (time.monotonic() - t.created)
            if not t.done.wait(max(0.0, remaining)):
                raise DeadlineExceeded(
                    f"transfer {t.id}: {t.received} of {total} bytes arrived within "
                    f"{self._timeout_s}s",
                    field="transfer_id",
                )
            if t.error:
                raise DataLoss(f"transfer {t.id}: {t.error}", code="TRANSFER_FAILED")
            digest = t.digest
        else:
            h = hashlib.sha256()
            for i in range(0, total, _BLOCK):
                h.update(t.buffer[i : i + _BLOCK])
            digest = h.hexdigest()
        if digest != t.offer.sha256:
            raise DataLoss(
                f"transfer {t.id} ({t.transport}): sha256 of the {total} bytes received "
                f"is {digest}, the offer said {t.offer.sha256}; nothing applied",
                code="CHECKSUM_MISMATCH",
            )
        tensors = unpack(t.buffer, t.offer.tensors, to="torch", copy=False)
        return self._receiver.apply(
            tensors, t.offer.version, start=t.created, transport=t.transport
        )

    def close(self) -> None:
        with self._lock:
            transfers, self._transfers = list(self._transfers.values()), {}
        for t in transfers:
            t.release()

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

    def _open_shm(self, t: _Transfer) -> None:
        size = max(1, t.offer.total_bytes)
        t.shm = shared_memory.SharedMemory(name=f"rlfleet_{t.id[:16]}", create=True, size=size)
        buf = t.shm.buf
        assert buf is not None
        t.buffer = buf[: t.offer.total_bytes]

    def _open_tcp(self, t: _Transfer) -> None:
        t.token = secrets.token_hex(16)
        t.buffer = np.empty(t.offer.total_bytes, dtype=np.uint8)
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
        assert t.listener is not None
        hashes: queue.Queue[memoryview | None] = queue.Queue()
        h = hashlib.sha256()

        def hasher() -> None:
            while (block := hashes.get()) is not None:
                h.update(block)

        hash_thread = threading.Thread(target=hasher, daemon=True)
        hash_thread.start()
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
                    view = memoryview(t.buffer)
                    total = t.offer.total_bytes
                    while t.received < total:
                        n = conn.recv_into(view[t.received : t.received + _BLOCK])
                        if n == 0:
                            break
                        hashes.put(view[t.received : t.received + n])
                        t.received += n
                    if t.received < total:
                        t.error = f"sender closed after {t.received} of {total} bytes"
                    elif conn.recv(1):
                        t.error = f"sender sent more than the {total} bytes offered"
                    break
        except (OSError, ConnectionError) as e:
            t.error = f"{type(e).__name__}: {e} after {t.received} bytes"
        finally:
            hashes.put(None)
            hash_thread.join()
            t.digest = h.hexdigest()
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
            t.release()


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
