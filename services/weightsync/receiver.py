"""The receiving side of weight sync: stage, verify, check against the model, swap.

Every path ends in :meth:`WeightReceiver.apply` (the gRPC chunk stream,
:meth:`WeightReceiver.receive_chunks`; the bulk plane, :class:`BulkReceiver`;
in-process tensors):

1. **stage**: the bytes land in buffers owned by the receiver, never in the model;
   a bucketed update (:mod:`rlfleet.weightsync.wire`) stages every bucket;
2. **verify**: the codec's checks (per-chunk crc32, per-tensor byte ranges, counts,
   each stream's digest; bucket order, the final bucket and the tensor count), or
   the bulk plane's per-tensor CRC-32C, computed by both ends as bytes move; a
   failure raises :class:`DataLoss` (gRPC ``DATA_LOSS``) naming the chunk / tensor;
3. **check**: every name, dtype and shape against the model, and that every
   parameter is covered; every floating value finite, and not every floating
   tensor all zeros (what a crashed or uninitialised trainer sends;
   :func:`rlfleet.weightsync.checksum.scan_values`, about 0.1 s per GB on a CPU
   core, done as the bytes land on the bulk plane) (``InvalidArgument`` naming the
   tensor);
4. **swap**: copy into the parameters under the engine's lock, between two
   generation batches, and bump the version; or, for a bulk TCP update on an
   engine that can (the HF engine on CPU), make the verified staging tensors the
   parameters (no copy; the old ones become the next staging buffer).

Until step 4 the old weights keep serving; a failed update leaves no trace.
Versions may repeat (a re-sync) but never go back: an older version is refused
with ``FailedPrecondition`` (code ``STALE_VERSION``). Nor may they leap: a version
more than ``max_version_step`` (default :data:`DEFAULT_MAX_VERSION_STEP`) above the
one serving is refused with ``InvalidArgument`` (code ``VERSION_JUMP``), so that one
bad push (2**63) cannot lock out every later real one.

**The bulk plane** (``OpenWeightTransfer`` -> move bytes -> ``CommitWeightTransfer``):

1. The sender offers: version, the tensors (name, dtype, shape) in the order their
   bytes will follow, packed back to back with no padding, ``total_bytes``, its
   transports in preference order and its host identity. Nothing is read or
   hashed yet.
2. :meth:`BulkReceiver.open` checks the version and every name / dtype / shape
   against the model *before* any byte moves, picks the first offered transport
   it can serve (shared memory only for a sender with this host's identity,
   :mod:`rlfleet.weightsync.shm`) and answers a plan: ``transfer_id``, transport,
   endpoint and a one-time token (TCP: the sender's first bytes; shared memory:
   the nonce in the segment's header).
3. The sender moves the bytes (:mod:`rlfleet.weightsync.tcp`,
   :mod:`rlfleet.weightsync.shm`); a verifier thread here follows the bytes as they
   land, extending each tensor's CRC-32C and scanning its values
   (:class:`rlfleet.weightsync.checksum.StreamVerifier`), so no pass over the bytes
   happens after the move.
4. :meth:`BulkReceiver.commit` carries the sender's per-tensor CRC-32Cs: the
   receiver waits for the bytes, checks the count and every checksum (``DataLoss``
   naming the tensor otherwise), views its buffer as tensors without a copy and
   hands them to :meth:`WeightReceiver.apply`, which swaps them in atomically.

**Buckets.** A model larger than one transfer moves as several, one per bucket of
one update (``TransferOffer.bucket`` / ``final`` / ``update_id``): bucket 0 opens the
update (its plan names the ``update_id``), each later bucket names it and the next
index. Each offer is checked against the model without the coverage check and
against the earlier buckets (version, order, no tensor twice); the final offer
also for the union's coverage. A committed bucket before the final one is
*staged*: verified, kept in its buffer, nothing applied. The final commit applies
the union in one :meth:`WeightReceiver.apply`. Any failure drops every staged
bucket of the update; so does the sender's :meth:`BulkReceiver.abort` (it gave up:
the buckets go at once), and ``timeout_s`` without an offer or commit (a reaper
thread checks, so a dead pusher's buckets do not wait for more traffic).

**Staging buffers are reused.** First-touching a fresh 1 GiB buffer costs seconds
of page faults on a small VM against ~0.1 s for a warm copy, so a finished
update's buffers (TCP) or segments (SHM), one per bucket, are kept and each new
transfer gets the smallest that fits. The replica thus holds one update's staging
(the last update's size) per transport between updates. A buffer goes back to the
pool only once nothing can write into it any more (its receive thread ended, or
the sender committed) and the apply, which copies out of it, returned: engines
must not keep references to the tensors they are given. Concurrent transfers each
get their own buffer (a fresh one when the spare is taken).

Uncommitted transfers expire after ``timeout_s``; their buffers are released, not
reused (a late sender could still be writing).

**NCCL / CUDA IPC** plug in at step 2/3 the same way (see docs/rollout.md): a plan
whose endpoint is a rendezvous (NCCL: ``host:port`` of a TCPStore plus a group
name; CUDA IPC: serialized ``cudaIpcMemHandle``s that the sender creates and the
receiver opens), bytes moved device to device, and the same commit; only the
``_open_*`` / ``_wait_*`` pair of the new transport is added.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any

import numpy as np

from rlfleet.common.codec.batch import unpack
from rlfleet.common.codec.wire import ChunkLike
from rlfleet.common.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from rlfleet.weightsync import shm as shm_transport
from rlfleet.weightsync import tcp as tcp_transport
from rlfleet.weightsync.checksum import (
    PolledCount,
    Progress,
    StreamVerifier,
    ValueScan,
    scan_values,
)
from rlfleet.weightsync.shm import host_identity
from rlfleet.weightsync.tcp import TOKEN_TIMEOUT_S
from rlfleet.weightsync.wire import (
    BULK,
    AbortResult,
    TransferOffer,
    TransferPlan,
    UpdateResult,
    WeightStreamReceiver,
    dtype_name,
    spec_nbytes,
)

if TYPE_CHECKING:
    from rlfleet.rollout.engine import Engine

__all__ = [
    "DEFAULT_MAX_VERSION_STEP",
    "SERVED",
    "BulkReceiver",
    "WeightReceiver",
    "check_weight_values",
]

logger = logging.getLogger(__name__)

#: How far one update may raise the weight version.
DEFAULT_MAX_VERSION_STEP = 1 << 20
#: Transports a replica serves, in no particular order (the sender's offer orders).
SERVED: tuple[str, ...] = ("shm", "tcp", "grpc")
#: Bulk transfers open at once at most (each holds a model-sized staging buffer at
#: worst, a listener and a thread until committed, aborted or expired); one trainer
#: pushing keeps one open (one bucket at a time).
MAX_OPEN_TRANSFERS = 4
#: Bucketed updates staged at once (a newer one drops the one touched longest ago).
MAX_STAGED_UPDATES = 2
#: ``UpdateWeights`` streams received at once at most (each buffers up to a model's
#: bytes before it is checked); one trainer pushing keeps one open.
MAX_OPEN_STREAMS = 2


class WeightReceiver:
    """Applies weight updates to one engine, one update at a time.

    Args:
        engine: the engine whose weights it replaces.
        max_version_step: an update's version may exceed the serving one by this
            much at most.
    """

    def __init__(self, engine: Engine, *, max_version_step: int = DEFAULT_MAX_VERSION_STEP) -> None:
        if max_version_step < 0:
            raise ValueError(f"max_version_step must be >= 0, got {max_version_step}")
        self._engine = engine
        self.max_version_step = max_version_step
        self._lock = threading.Lock()
        self._streams = threading.BoundedSemaphore(MAX_OPEN_STREAMS)
        self.updates = 0
        self.last: UpdateResult | None = None

    @property
    def version(self) -> int:
        return self._engine.info().weight_version

    def _max_bytes(self) -> int | None:
        """Bytes one update may carry: the model's own (each parameter at most once
        per name, in the model's dtype) plus room for the stream's framing; None when
        the engine does not say."""
        weight_bytes = getattr(self._engine, "weight_bytes", None)
        if not callable(weight_bytes):
            return None
        total = int(weight_bytes())
        return total + total // 8 + 16 * 1024 * 1024

    def check_version(self, version: int) -> None:
        current = self.version
        if version < current:
            raise FailedPrecondition(
                f"weight version {version} is older than the version serving ({current})",
                field="version",
                value=version,
                code="STALE_VERSION",
            )
        if version > current + self.max_version_step:
            raise InvalidArgument(
                f"weight version {version} is more than {self.max_version_step} above the "
                f"version serving ({current})",
                field="version",
                value=version,
                code="VERSION_JUMP",
            )

    def receive_chunks(self, stream: Iterable[tuple[int, ChunkLike]]) -> UpdateResult:
        """Stage a ``(version, TensorBatchChunk)`` stream (the ``UpdateWeights`` RPC),
        verify it and apply it. Every chunk must carry the same version.

        The stream is one codec stream, or several (buckets, the trainer's push; see
        :mod:`rlfleet.weightsync.wire`): every bucket is staged and verified, and
        only the union of all of them, checked against the model, is swapped in."""
        start = time.perf_counter()
        if not self._streams.acquire(blocking=False):
            raise ResourceExhausted(
                f"{MAX_OPEN_STREAMS} weight streams are being received here, the most a "
                "replica takes at once: retry when one has ended",
                field="UpdateWeights",
                value=MAX_OPEN_STREAMS,
                code="TOO_MANY_TRANSFERS",
            )
        try:  # held until applied: a received model waiting for the lock counts too
            receiver = WeightStreamReceiver(
                on_version=self.check_version, max_bytes=self._max_bytes()
            )
            version, tensors = receiver.receive(stream)
            return self.apply(tensors, version, start=start, transport="grpc")
        finally:
            self._streams.release()

    def apply(
        self,
        tensors: Mapping[str, Any],
        version: int,
        *,
        start: float | None = None,
        transport: str = "grpc",
        on_release: Callable[[], None] | None = None,
        values: ValueScan | None = None,
    ) -> UpdateResult:
        """Check verified tensors against the model and swap them in (all or nothing).

        ``on_release``: the caller hands the tensors over, and the engine may adopt
        them as its weights (``UpdateResult.adopted``); see ``Engine.update_weights``.
        ``values``: the value scan of (some of) the tensors, done as they arrived
        (:func:`check_weight_values`)."""
        start = time.perf_counter() if start is None else start
        with self._lock:
            self.check_version(version)
            check_weight_values(tensors, values)
            adopted = bool(self._engine.update_weights(tensors, version, on_release=on_release))
            nbytes = sum(int(t.numel()) * int(t.element_size()) for t in tensors.values())
            result = UpdateResult(
                version=version,
                bytes=nbytes,
                tensors=len(tensors),
                seconds=time.perf_counter() - start,
                transport=transport,
                adopted=adopted,
            )
            self.updates += 1
            self.last = result
            return result


def check_weight_values(tensors: Mapping[str, Any], values: ValueScan | None = None) -> None:
    """Refuse values no trained model holds: raise ``InvalidArgument`` naming the first
    floating tensor with a NaN or an infinity (code ``NON_FINITE_WEIGHTS``), or, when
    every floating tensor is all zeros, the first of them (code ``ZERO_WEIGHTS``).

    ``values``: what a scan already found for the tensors it names (the bulk plane
    scans as the bytes land); every other floating tensor is scanned here, one pass
    over its bytes on its device (:func:`rlfleet.weightsync.checksum.scan_values`)."""
    scan = values or ValueScan()
    bad = set(scan.nonfinite)
    floating = [(n, t) for n, t in tensors.items() if t.is_floating_point() and t.numel()]
    nonzero = scan.nonzero
    for name, t in floating:
        if name in scan.names:
            finite = name not in bad
        else:
            finite, any_nonzero = scan_values(t)
            nonzero = nonzero or any_nonzero
        if not finite:
            raise InvalidArgument(
                f"tensor {name!r} holds non-finite values (NaN or Inf); nothing applied",
                field=f"weights[{name!r}]",
                value=name,
                code="NON_FINITE_WEIGHTS",
            )
    if floating and not nonzero:
        name = floating[0][0]
        raise InvalidArgument(
            f"every floating tensor of the update is all zeros ({len(floating)} tensors, "
            f"first {name!r}); nothing applied",
            field=f"weights[{name!r}]",
            value=name,
            code="ZERO_WEIGHTS",
        )


# --------------------------------------------------------------------- the bulk plane


@dataclass
class _Transfer:
    id: str
    offer: TransferOffer
    transport: str
    created: float
    token: str = ""
    # The private staging array (may be larger than needed): TCP's, or the copy of a
    # shared-memory transfer that is checked and used (``private_shm``).
    storage: np.ndarray | None = None
    # The staged bytes, exact size: a view of ``storage``, or a memoryview of the
    # segment (shared memory without ``private_shm``).
    buffer: Any = None
    shm: shared_memory.SharedMemory | None = None
    segment: memoryview | None = None  # the segment's data bytes (shared memory)
    listener: socket.socket | None = None
    # No writer left: TCP's receive thread ended; shared memory with a private copy:
    # the copy is complete (the segment is no longer read).
    done: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)  # no more bytes will come
    verifier: StreamVerifier | None = None
    progress: Progress = field(default_factory=Progress)  # tcp: bytes received so far
    error: str = ""
    update: _Update | None = None  # the bucketed update this transfer is a bucket of
    commit_deadline: float = math.inf  # monotonic: the committing caller's deadline
    # The committing caller went away (its RPC was cancelled): stop waiting for bytes.
    cancelled: Callable[[], bool] | None = None


@dataclass
class _Update:
    """A bucketed update being staged: each committed bucket keeps its buffer (and the
    verified tensors viewing it) until the final bucket commits or the update drops."""

    id: str
    version: int
    created: float
    touched: float  # last offer or commit of one of its buckets (expiry)
    specs: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # offered so far
    tensors: dict[str, Any] = field(default_factory=dict)  # verified, of the staged buckets
    values: ValueScan = field(default_factory=ValueScan)  # their value scans
    staged: list[_Transfer] = field(default_factory=list)  # committed buckets, in order
    open: _Transfer | None = None  # the bucket in flight


class BulkReceiver:
    """Receiver side of the bulk data plane for one engine.

    Args:
        receiver: applies verified tensors (shared with the gRPC chunk path).
        engine: checks the offered names / dtypes / shapes before bytes move.
        host: interface the TCP listeners bind (the replica's advertised host).
        timeout_s: an open transfer not committed within this is dropped, and so is
            a bucketed update with no offer or commit for this long (its pusher died).
        token_timeout_s: a TCP connection that has not sent the transfer's token
            within this is dropped (others keep waiting for the sender's).
        private_shm: copy a shared-memory transfer out of the segment as it lands
            (the verifier thread, overlapping the sender's writes) and check and apply
            the private copy, which an engine may then adopt as its weights, as over
            TCP; without it the segment is checked and the engine copies from it.
            None: when the engine runs on the CPU (where the HF engine adopts; on a
            GPU the copy to the device is the one that counts).
        tls: a server context for the TCP listeners (the replica's certificate):
            senders must connect with TLS (and, under mTLS, a client certificate);
            None: plain TCP (a cluster without TLS).
    """

    def __init__(
        self,
        receiver: WeightReceiver,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
        token_timeout_s: float = TOKEN_TIMEOUT_S,
        private_shm: bool | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._tls = tls
        self._private_shm = engine.info().device == "cpu" if private_shm is None else private_shm
        self._receiver = receiver
        self._token_timeout_s = token_timeout_s
        self._engine = engine
        self._host = host
        self._timeout_s = timeout_s
        self._host_id = host_identity()
        if self._host_id:  # what replicas killed with their resource tracker left
            shm_transport.remove_orphans()
        self._lock = threading.Lock()
        self._transfers: dict[str, _Transfer] = {}
        self._updates: dict[str, _Update] = {}
        # Bulk transfers being committed (out of ``_transfers``, still holding a buffer
        # and a caller's thread) and offers being opened: both count toward the limit.
        self._committing = 0
        self._reserved = 0
        # Spare staging buffers per transport: those of the last finished update.
        self._spare_arrays: list[np.ndarray] = []
        self._spare_shms: list[shared_memory.SharedMemory] = []
        # Expiry also runs without traffic, so that the buckets a dead pusher staged
        # do not hold their memory until the next offer.
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="rlfleet-bulk-reaper", daemon=True)
        self._reaper.start()

    def open(self, offer: TransferOffer) -> TransferPlan:
        """Check an offer against the model and plan its transfer (module docstring).

        A bucket of a bucketed update is checked against the buckets before it
        (version, order, no tensor twice) and the final one for the union's coverage
        of the model; any failure drops the update's staged buckets."""
        self._expire()
        update: _Update | None = None
        if offer.update_id:
            with self._lock:
                update = self._updates.get(offer.update_id)
            if update is None:
                raise NotFound(
                    f"no bucketed weight update {offer.update_id!r} (unknown, failed, "
                    f"applied or expired); bucket {offer.bucket} refused",
                    field="update_id",
                    value=offer.update_id,
                )
        try:
            return self._open(offer, update)
        except BaseException:
            if update is not None:
                self._drop_update(update, "its bucket's offer was refused")
            raise

    def _open(self, offer: TransferOffer, update: _Update | None) -> TransferPlan:
        self._check_layout(offer)
        self._receiver.check_version(offer.version)
        specs = {s.name: (dtype_name(s.dtype), s.shape) for s in offer.tensors}
        if update is None:
            if offer.bucket != 0:
                raise InvalidArgument(
                    f"bucket {offer.bucket} offered without an update_id (bucket 0 opens "
                    "a bucketed update and its plan names it)",
                    field="update_id",
                )
            self._engine.check_weights(specs, complete=offer.final)
        else:
            self._check_bucket(update, offer, specs)
        transport = self._choose(offer)
        # Bucket 0 may be refused (the sender then streams the whole update over
        # gRPC); a later bucket must stay on the bulk plane.
        if update is not None and transport not in BULK:
            raise InvalidArgument(
                f"bucket {offer.bucket} of update {update.id}: no bulk transport among "
                f"{offer.transports}",
                field="transports",
                value=offer.transports,
            )
        if transport not in BULK:  # the sender streams instead: nothing is kept for it
            return TransferPlan(uuid.uuid4().hex, transport)
        with self._lock:  # counted and reserved at once: concurrent offers cannot overshoot
            open_now = (
                sum(1 for x in self._transfers.values() if x.transport in BULK)
                + self._committing
                + self._reserved
            )
            if open_now >= MAX_OPEN_TRANSFERS:  # each holds a staging buffer and a thread
                raise ResourceExhausted(
                    f"{open_now} bulk weight transfers are open here, the most a replica "
                    "keeps: commit or abort them, or wait for them to expire "
                    f"({self._timeout_s:g}s)",
                    field="transfer",
                    value=open_now,
                    code="TOO_MANY_TRANSFERS",
                )
            self._reserved += 1
        try:
            return self._open_bulk(offer, update, transport, specs)
        finally:
            with self._lock:
                self._reserved -= 1

    def _open_bulk(
        self,
        offer: TransferOffer,
        update: _Update | None,
        transport: str,
        specs: Mapping[str, tuple[str, tuple[int, ...]]],
    ) -> TransferPlan:
        now = time.monotonic()
        t = _Transfer(uuid.uuid4().hex, offer, transport, now)
        if not offer.whole and update is None:
            update = _Update(uuid.uuid4().hex, offer.version, now, now)
            self._make_room_for_an_update()
        t.update = update
        if transport == "tcp":
            self._open_tcp(t)
        elif transport == "shm":
            self._open_shm(t)
        with self._lock:
            self._transfers[t.id] = t
            if update is not None:
                self._updates[update.id] = update
                update.open = t
                update.specs.update(specs)
                update.touched = now
        endpoint = ""
        if t.listener is not None:
            endpoint = tcp_transport.endpoint_of(t.listener)
        elif t.shm is not None:
            endpoint = t.shm.name
        logger.info(
            "weight transfer %s: version %d, %d bytes over %s%s",
            t.id,
            offer.version,
            offer.total_bytes,
            transport,
            "" if update is None else f", bucket {offer.bucket} of update {update.id}",
        )
        return TransferPlan(t.id, transport, endpoint, t.token, update.id if update else "")

    def _check_bucket(
        self, u: _Update, offer: TransferOffer, specs: Mapping[str, tuple[str, tuple[int, ...]]]
    ) -> None:
        """A later bucket against the update's earlier ones; the final one for coverage."""
        where = f"update {u.id} (version {u.version})"
        if offer.version != u.version:
            raise InvalidArgument(
                f"bucket {offer.bucket} says version {offer.version}, {where} began with "
                f"{u.version}",
                field="version",
                value=offer.version,
            )
        if u.open is not None or offer.bucket != len(u.staged):
            raise InvalidArgument(
                f"bucket {offer.bucket} offered to {where}, which has {len(u.staged)} staged "
                f"buckets{' and one still open' if u.open is not None else ''}: buckets go "
                "one at a time, in order",
                field="bucket",
                value=offer.bucket,
            )
        dup = sorted(set(specs) & set(u.specs))
        if dup:
            raise InvalidArgument(
                f"bucket {offer.bucket} of {where} repeats tensors of earlier buckets: {dup[:3]}",
                field="tensors",
                value=dup[:3],
            )
        self._engine.check_weights(specs, complete=False)
        if offer.final:  # the union must cover the model, checked before the last bytes move
            self._engine.check_weights({**u.specs, **specs}, complete=True)

    def _make_room_for_an_update(self) -> None:
        """At most :data:`MAX_STAGED_UPDATES` bucketed updates stage at once (each holds
        up to a model's bytes): a new one drops the one touched longest ago (a sender
        that stopped; a live one's next offer then fails and it starts again)."""
        with self._lock:
            stale = sorted(self._updates.values(), key=lambda u: u.touched)
            stale = stale[: max(0, len(stale) - MAX_STAGED_UPDATES + 1)]
        for u in stale:
            self._drop_update(u, "a newer update started (at most "
                              f"{MAX_STAGED_UPDATES} stage at once)")  # fmt: skip

    def commit(
        self,
        transfer_id: str,
        crc32c: Sequence[int],
        *,
        timeout_s: float | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> UpdateResult:
        """Verify the transfer against the sender's per-tensor CRC-32Cs and apply it; a
        bucket of a bucketed update is staged, and its final bucket applies the union.

        Waiting for the bytes ends at the transfer's time-out, at ``timeout_s`` (the
        caller's deadline: a caller that gave up holds no thread here), when
        ``cancelled()`` says the caller went away, or when the receiver closes,
        whichever comes first; the transfer is then dropped. A transfer being committed
        still counts toward :data:`MAX_OPEN_TRANSFERS`."""
        with self._lock:
            t = self._transfers.pop(transfer_id, None)
            if t is not None:
                self._committing += 1
        if t is None:
            raise NotFound(
                f"no open weight transfer {transfer_id!r} (unknown, committed or expired)",
                field="transfer_id",
                value=transfer_id,
            )
        try:
            return self._commit(t, crc32c, timeout_s, cancelled)
        finally:
            with self._lock:
                self._committing -= 1

    def _commit(
        self,
        t: _Transfer,
        crc32c: Sequence[int],
        timeout_s: float | None,
        cancelled: Callable[[], bool] | None,
    ) -> UpdateResult:
        if timeout_s is not None:
            t.commit_deadline = time.monotonic() + max(0.0, timeout_s)
        t.cancelled = cancelled
        u = t.update
        if u is None:
            try:
                return self._verify_and_apply(t, crc32c)
            finally:
                # The sender committed, so it no longer writes: the buffer can be reused
                # once its receive / checksum thread has ended (and, if the engine
                # adopted the tensors, once it released them: then this is a no-op).
                self._recycle([t])
        try:
            return self._commit_bucket(t, u, crc32c)
        except BaseException:
            self._drop_update(u, f"bucket {t.offer.bucket} failed at commit", committed=t)
            raise

    def abort(self, update_id: str, reason: str = "") -> AbortResult:
        """Drop a bucketed update its sender gave up: every staged bucket and the one
        in flight, at once (not at the time-out). The staged buffers become the
        spares, as a finished update's do; the one in flight is released (its sender
        may still be writing). ``update_id`` may also name a whole-update transfer
        (its ``transfer_id``: a sender that cancels a transfer it could not use).
        An unknown, applied, failed or expired id is no error: ``aborted`` is False
        and nothing changes."""
        why = f"aborted by the sender: {reason or 'no reason'}"
        with self._lock:
            u = self._updates.get(update_id)
            whole = self._transfers.get(update_id) if u is None else None
            if whole is not None and whole.update is None:
                del self._transfers[update_id]
            else:
                whole = None
        if whole is not None:
            freed = _held(whole)
            logger.warning("weight transfer %s dropped: %s", whole.id, why)
            self._free(whole, reuse=False)
            return AbortResult(aborted=True, freed_bytes=freed)
        if u is None:
            logger.info("abort of weight update %r: not in progress (nothing to do)", update_id)
            return AbortResult(aborted=False)
        buckets, freed = self._drop_update(u, why)
        return AbortResult(aborted=True, staged_buckets=buckets, freed_bytes=freed)

    def staged_updates(self) -> dict[str, int]:
        """Bucketed updates being staged: id -> buckets committed so far."""
        with self._lock:
            return {k: len(u.staged) for k, u in self._updates.items()}

    def staged_bytes(self) -> int:
        """Bytes of staging buffers held by updates not applied yet: open transfers
        (whole updates and buckets in flight) and the committed buckets of bucketed
        updates."""
        with self._lock:
            held = sum(_held(t) for t in self._transfers.values())
            return held + sum(_held(t) for u in self._updates.values() for t in u.staged)

    def spare_bytes(self) -> int:
        """Bytes of the spare staging buffers kept for the next update."""
        with self._lock:
            arrays = sum(a.nbytes for a in self._spare_arrays)
            return arrays + sum(s.size for s in self._spare_shms)

    def _verify_and_apply(self, t: _Transfer, crc32c: Sequence[int]) -> UpdateResult:
        # A function of its own so that the tensor views into the buffer are gone
        # before the caller releases it (a shared-memory segment cannot close while
        # views of it exist).
        tensors, values = self._verify(t, crc32c)
        return self._apply([t], tensors, values, t.offer.version, t.created)

    def _apply(
        self,
        transfers: list[_Transfer],
        tensors: dict[str, Any],
        values: ValueScan,
        version: int,
        start: float,
    ) -> UpdateResult:
        """Apply an update's verified tensors. Tensors in private staging arrays (TCP,
        and shared memory copied out with ``private_shm``) are handed over: an engine
        that adopts them as its weights keeps the arrays (taken from the transfers
        here, so they are not recycled) until it releases them, and they become
        spares then. Shared-memory segments are never adopted: the sender maps them,
        and live weights must not be writable from outside."""
        transport = transfers[-1].transport
        if not all(t.storage is not None and t.done.is_set() for t in transfers):
            return self._receiver.apply(
                tensors, version, start=start, transport=transport, values=values
            )
        freed = [b for t in transfers for b in self._free(t, reuse=True)]
        arrays = [b for b in freed if isinstance(b, np.ndarray)]  # the tensors keep them alive
        self._pool([b for b in freed if not isinstance(b, np.ndarray)])  # segments: at once
        result: UpdateResult | None = None
        try:
            result = self._receiver.apply(
                tensors,
                version,
                start=start,
                transport=transport,
                on_release=lambda: self._pool(arrays),
                values=values,
            )
            return result
        finally:
            if result is None or not result.adopted:
                del tensors
                self._pool(arrays)

    def _commit_bucket(self, t: _Transfer, u: _Update, crc32c: Sequence[int]) -> UpdateResult:
        tensors, values = self._verify(t, crc32c)
        if not t.offer.final:
            with self._lock:
                if self._updates.get(u.id) is not u:
                    raise NotFound(f"update {u.id} was dropped (expired)", field="update_id")
                u.tensors.update(tensors)
                u.values = u.values | values
                u.staged.append(t)
                u.open = None
                u.touched = time.monotonic()
            logger.info(
                "weight update %s: bucket %d staged (%d bytes)",
                u.id,
                t.offer.bucket,
                t.offer.total_bytes,
            )
            return UpdateResult(
                version=self._receiver.version,
                bytes=t.offer.total_bytes,
                tensors=len(tensors),
                seconds=time.perf_counter() - t.created,
                transport=t.transport,
                staged=True,
            )
        with self._lock:
            if self._updates.pop(u.id, None) is not u:
                raise NotFound(f"update {u.id} was dropped (expired)", field="update_id")
            u.staged.append(t)
            u.open = None
            tensors = {**u.tensors, **tensors}
            values = u.values | values
            u.tensors.clear()
            u.values = ValueScan()
        staged, u.staged = u.staged, []
        try:
            return self._apply(staged, tensors, values, u.version, u.created)
        finally:
            del tensors
            self._recycle(staged)  # a no-op for the buffers an engine adopted

    def _verify(self, t: _Transfer, crc32c: Sequence[int]) -> tuple[dict[str, Any], ValueScan]:
        """Wait for the bytes and their verifier, compare the CRC-32Cs; the verified
        tensors viewing the transfer's buffer (no copy), and their value scans."""
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
        if t.transport == "tcp" and not self._wait_done(t):
            if self._closed.is_set():
                raise Unavailable(f"transfer {t.id}: the receiver is shutting down")
            raise DeadlineExceeded(
                f"transfer {t.id}: {t.progress.value} of {total} bytes arrived within "
                f"{self._timeout_s}s or the caller's deadline",
                field="transfer_id",
            )
        # Shared memory: the sender has finished writing (it committed); TCP: the
        # receive thread ended. Either way the verifier catches up and ends.
        t.stop.set()
        verifier = t.verifier
        assert verifier is not None
        remaining = max(0.0, self._timeout_s - (time.monotonic() - t.created))
        if not verifier.finish(remaining):
            raise DeadlineExceeded(f"transfer {t.id}: checksum thread still running")
        if verifier.error is not None:
            raise DataLoss(
                f"transfer {t.id}: verifying the bytes failed: {verifier.error!r}",
                code="TRANSFER_FAILED",
            )
        if verifier.fed < total and not t.error:
            t.error = f"sender committed after writing {verifier.fed} of {total} bytes"
        if t.transport == "shm" and t.storage is not None:
            t.done.set()  # copied out: the private bytes are all the receiver uses
        if t.error:
            raise DataLoss(f"transfer {t.id}: {t.error}", code="TRANSFER_FAILED")
        got = verifier.crcs
        bad = [i for i, (a, b) in enumerate(zip(got, crc32c, strict=True)) if a != b]
        if bad and t.transport == "shm":
            # The verifier read behind the sender's published count; where memory
            # order is weaker than x86's it may have read a block early. Re-read
            # those tensors now that the sender is done (the commit orders it)
            # before calling them corrupt.
            assert t.segment is not None
            copy_to = t.buffer if t.storage is not None else None
            verifier.rescan(np.frombuffer(t.segment, dtype=np.uint8), bad, copy_to)
            bad = [i for i in bad if got[i] != crc32c[i]]
        if bad:
            names = ", ".join(repr(specs[i].name) for i in bad[:3])
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            i = bad[0]
            bucket = "" if t.update is None else f", bucket {t.offer.bucket}"
            raise DataLoss(
                f"transfer {t.id} ({t.transport}{bucket}): CRC-32C mismatch in {len(bad)} of "
                f"{len(specs)} tensors ({names}{more}; first: received {got[i]:#010x}, "
                f"sender sent {crc32c[i]:#010x}); nothing applied",
                code="CHECKSUM_MISMATCH",
            )
        tensors: dict[str, Any] = unpack(t.buffer, specs, to="torch", copy=False)
        return tensors, verifier.values()

    def _wait_done(self, t: _Transfer) -> bool:
        """Wait for ``t``'s bytes (its ``done``) until the transfer's time-out, the
        committing caller's deadline, or this receiver's close; whether they came."""
        end = min(t.created + self._timeout_s, t.commit_deadline)
        while not t.done.is_set():
            left = end - time.monotonic()
            if left <= 0 or self._closed.is_set():
                return False
            if t.cancelled is not None and t.cancelled():
                return False
            t.done.wait(min(left, 0.25))
        return True

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            transfers, self._transfers = list(self._transfers.values()), {}
            updates, self._updates = list(self._updates.values()), {}
        for u in updates:
            u.tensors.clear()
            transfers.extend(u.staged)
        for t in transfers:
            self._free(t, reuse=False)
        with self._lock:
            spare_shms, self._spare_shms, self._spare_arrays = self._spare_shms, [], []
        for shm in spare_shms:
            shm_transport.destroy_segment(shm)

    # ------------------------------------------------------------------ internals

    def _check_layout(self, offer: TransferOffer) -> None:
        offset = 0
        seen: set[str] = set()
        for i, s in enumerate(offer.tensors):
            if s.name in seen:
                raise InvalidArgument(
                    f"tensor {s.name!r} is offered twice (tensors[{i}] repeats it)",
                    field=f"tensors[{i}].name",
                    value=s.name,
                    code="DUPLICATE_TENSOR",
                )
            seen.add(s.name)
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
            if name == "shm" and not (self._host_id and offer.sender_host == self._host_id):
                continue
            if name in SERVED:
                return name
        raise InvalidArgument(
            f"none of the offered transports {offer.transports} is served here "
            f"(served: {list(SERVED)}; shm only from a sender with this host's identity "
            f"{self._host_id!r}, the offer says {offer.sender_host!r})",
            field="transports",
            value=offer.transports,
        )

    def _free(self, t: _Transfer, *, reuse: bool) -> list[np.ndarray | shared_memory.SharedMemory]:
        """Free ``t``'s listener and views; with ``reuse``, return its buffers (array,
        segment) that no thread can still write into or checksum, destroying the rest."""
        if t.listener is not None:
            with contextlib.suppress(OSError):
                t.listener.close()
        t.stop.set()
        t.progress.close()  # a TCP verifier stops following
        views_gone = True
        for view in (t.buffer, t.segment):
            if isinstance(view, memoryview):
                try:
                    view.release()
                except BufferError:  # tensors still view it (an exception's traceback holds them)
                    views_gone = False
        t.buffer = t.segment = None
        # Stopped above, the verifier ends within a poll; its views of the buffers
        # must be gone before a segment can close (else it is closed at garbage
        # collection, with a BufferError warning) or a buffer be reused.
        verifier_done = t.verifier is None or t.verifier.finish(1.0)
        out: list[np.ndarray | shared_memory.SharedMemory] = []
        storage, t.storage = t.storage, None
        if storage is not None and reuse and t.done.is_set() and verifier_done:
            out.append(storage)
        shm, t.shm = t.shm, None
        if shm is not None:
            if reuse and verifier_done and views_gone:
                out.append(shm)
            else:
                shm_transport.destroy_segment(shm)
        return out

    def _recycle(self, transfers: Sequence[_Transfer]) -> None:
        """Free the transfers of one finished update (committed: nothing writes any
        more); their reusable buffers become the spares of their transport, replacing
        the spares left over (so the spares never outgrow one update's staging)."""
        self._pool([b for t in transfers for b in self._free(t, reuse=True)])

    def _pool(self, buffers: Sequence[np.ndarray | shared_memory.SharedMemory]) -> None:
        """Make ``buffers`` the spares of their transport (module docstring)."""
        arrays: list[np.ndarray] = []
        shms: list[shared_memory.SharedMemory] = []
        for buf in buffers:
            if isinstance(buf, np.ndarray):
                arrays.append(buf)
            else:
                shms.append(buf)
        old_shms: list[shared_memory.SharedMemory] = []
        with self._lock:
            if arrays:
                self._spare_arrays = arrays
            if shms:
                old_shms, self._spare_shms = self._spare_shms, shms
        for shm in old_shms:
            shm_transport.destroy_segment(shm)

    def _drop_update(
        self, u: _Update, reason: str, *, committed: _Transfer | None = None
    ) -> tuple[int, int]:
        """Drop a bucketed update and every bucket it staged; nothing was applied.
        Returns the buckets dropped and the staging bytes they (and the bucket in
        flight) held."""
        with self._lock:
            if self._updates.get(u.id) is u:
                del self._updates[u.id]
            open_t, u.open = u.open, None
            if open_t is not None and open_t is not committed:
                self._transfers.pop(open_t.id, None)
            staged, u.staged = u.staged, []
            u.tensors.clear()
            held = sum(_held(t) for t in staged) + (0 if open_t is None else _held(open_t))
        logger.warning(
            "weight update %s (version %d) dropped with %d staged buckets: %s",
            u.id,
            u.version,
            len(staged),
            reason,
        )
        buckets = len(staged)
        if committed is not None:
            staged.append(committed)
        self._recycle(staged)
        if open_t is not None and open_t is not committed:
            self._free(open_t, reuse=False)  # a sender may still be writing into it
        return buckets, held

    def _take_array(self, nbytes: int) -> np.ndarray:
        with self._lock:
            spare = _take_smallest(self._spare_arrays, nbytes, lambda a: a.nbytes)
        if spare is not None:
            return spare
        # None fits (or a concurrent transfer holds them): a fresh one; a spare too
        # small was dropped first, so its memory goes before the new one is touched.
        return np.empty(nbytes, dtype=np.uint8)

    def _take_shm(self, nbytes: int) -> shared_memory.SharedMemory:
        with self._lock:
            spare = _take_smallest(self._spare_shms, nbytes, lambda s: s.size)
            too_small = None
            if spare is None and self._spare_shms:
                too_small = self._spare_shms.pop()
        if spare is not None:
            return spare
        if too_small is not None:
            shm_transport.destroy_segment(too_small)
        return shm_transport.create_segment(nbytes)

    def _open_shm(self, t: _Transfer) -> None:
        total = t.offer.total_bytes
        t.token = secrets.token_hex(16)  # the nonce the sender must find in the header
        t.shm = self._take_shm(shm_transport.HEADER + total)
        shm_transport.prepare_segment(t.shm, t.token)
        buf = t.shm.buf
        assert buf is not None
        t.segment = buf[shm_transport.HEADER : shm_transport.HEADER + total]
        count = shm_transport.segment_count(t.shm)
        copy_to = None
        if self._private_shm:
            t.storage = self._take_array(total)
            t.buffer = copy_to = t.storage[:total]
        else:
            t.buffer = t.segment
        t.verifier = StreamVerifier(
            t.offer.tensors,
            [dtype_name(s.dtype) for s in t.offer.tensors],
            np.frombuffer(t.segment, dtype=np.uint8),
            PolledCount(lambda: int(count[0]), t.stop.is_set),
            copy_to=copy_to,
        )

    def _open_tcp(self, t: _Transfer) -> None:
        t.token = secrets.token_hex(16)
        t.storage = self._take_array(t.offer.total_bytes)
        t.buffer = t.storage[: t.offer.total_bytes]
        t.listener = tcp_transport.open_listener(self._host, self._timeout_s)
        t.verifier = StreamVerifier(
            t.offer.tensors,
            [dtype_name(s.dtype) for s in t.offer.tensors],
            t.buffer,
            t.progress,
        )
        threading.Thread(
            target=self._serve_tcp, args=(t,), name=f"rlfleet-weights-{t.id[:8]}", daemon=True
        ).start()

    def _serve_tcp(self, t: _Transfer) -> None:
        assert t.listener is not None
        deadline = t.created + self._timeout_s
        try:
            conn = tcp_transport.accept_sender(
                t.listener,
                t.token,
                deadline=deadline,
                token_timeout_s=self._token_timeout_s,
                stop=t.stop,
                label=t.id,
                tls=self._tls,
            )
            if conn is None:
                t.error = f"no connection presented the token within {self._timeout_s}s"
                return
            # The sender is known: no one else may connect any more.
            with contextlib.suppress(OSError):
                t.listener.close()
            with conn:
                t.error = tcp_transport.receive(
                    conn, t.buffer, deadline=deadline, on_bytes=t.progress.advance, stop=t.stop
                )
        except (OSError, ValueError) as e:  # ValueError: the listener closed (dropped)
            t.error = f"{type(e).__name__}: {e} after {t.progress.value} bytes"
        finally:
            with contextlib.suppress(OSError):
                t.listener.close()
            t.progress.close()
            t.done.set()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [k for k, t in self._transfers.items() if now - t.created > self._timeout_s]
            dropped = [self._transfers.pop(k) for k in old]
            idle = [u for u in self._updates.values() if now - u.touched > self._timeout_s]
        for t in dropped:
            logger.warning("weight transfer %s expired uncommitted", t.id)
            if t.update is not None:
                self._drop_update(t.update, f"bucket {t.offer.bucket} expired uncommitted")
            self._free(t, reuse=False)
        for u in idle:
            self._drop_update(u, f"no bucket offered or committed for {self._timeout_s}s")

    def _reap(self) -> None:
        interval = min(30.0, max(0.05, self._timeout_s / 4))
        while not self._closed.wait(interval):
            try:
                self._expire()
            except Exception:  # a reaper that dies would leak every later dead update
                logger.exception("weight transfer expiry failed")


def _held(t: _Transfer) -> int:
    """Bytes of the staging buffer ``t`` holds (0 once freed)."""
    storage, shm = t.storage, t.shm
    return (int(storage.nbytes) if storage is not None else 0) + (
        int(shm.size) if shm is not None else 0
    )


def _take_smallest(pool: list[Any], nbytes: int, size: Callable[[Any], int]) -> Any:
    """Remove and return the smallest item of ``pool`` of at least ``nbytes``; if none
    fits, drop the largest (its memory goes before a fresh one is touched) and return
    None."""
    # By index: ``list.remove`` compares with ``==``, elementwise for numpy arrays.
    fits = [i for i, x in enumerate(pool) if size(x) >= nbytes]
    if fits:
        return pool.pop(min(fits, key=lambda i: size(pool[i])))
    if pool:
        pool.pop(max(range(len(pool)), key=lambda i: size(pool[i])))
    return None
