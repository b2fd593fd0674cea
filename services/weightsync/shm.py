"""The shared-memory transport of the bulk plane, for a sender on the replica's host.

**Same host, decided robustly.** Each end computes :func:`host_identity`: the host
name, the kernel's boot id and the device and inode of ``/dev/shm``. Two processes
see the same POSIX shared memory exactly when they share the ``/dev/shm`` mount,
which the last part names; the boot id and host name keep two machines whose
mounts happen to carry equal numbers apart. The sender puts its identity in the
offer (``sender_host``) and the replica plans shared memory only when it equals
its own (an IP address says nothing of this: containers of one host have their
own ``/dev/shm``, and one machine has many addresses). The sender then *checks*:
the plan's ``token`` is a nonce the replica wrote into the segment's header, and
the sender writes nothing unless it reads the same nonce there
(:class:`ShmUnavailable` otherwise, on which the sender cancels the transfer and
offers again without shared memory).

**Segment layout.** The replica owns a POSIX segment named in the plan's
``endpoint``: a header of :data:`HEADER` bytes (the count of bytes written so far,
a little-endian uint64, then the nonce; at byte 64 the owner: its pid, its start
time and its pid namespace), then the tensor bytes packed in offer order.

**Orphans.** Python's resource tracker unlinks a segment whose owner died, unless it
died too: a service's process group SIGKILLed (a stop past its grace period, a
restart's leftovers killed) left every segment in ``/dev/shm`` until the next boot, a
model's bytes of memory each. A replica's bulk plane removes them when it starts
(:func:`remove_orphans`): segments of this user and pid namespace whose owner is gone. The sender maps ``/dev/shm/<name>`` and copies block by block, publishing
the count after each block; the replica's verifier thread checksums and scans
behind that count (:class:`rlfleet.weightsync.checksum.StreamVerifier`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import socket
import stat
import struct
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from rlfleet.common.codec.batch import TensorSpec
from rlfleet.weightsync.checksum import SourceCrcs, as_u8, crc32c_extend, tensor_bytes
from rlfleet.weightsync.wire import TransferPlan

__all__ = [
    "HEADER",
    "ShmUnavailable",
    "create_segment",
    "destroy_segment",
    "host_identity",
    "prepare_segment",
    "remove_orphans",
    "segment_count",
    "send_shm",
]

logger = logging.getLogger(__name__)

HEADER = 4096  # bytes before the tensor bytes in a segment (page-aligned data)
_NONCE_AT = 8  # the nonce follows the count in the header
# Sender: bytes copied (then checksummed, when it checksums) per step: small, so
# the block is still in this core's cache for its checksum.
_SHM_BLOCK = 1 << 20
_SHM_DIR = "/dev/shm"
_OWNER_AT = 64  # the owner record: magic, pid, start time, pid namespace
_OWNER_MAGIC = b"rlfleet-owner-v1"
_OWNER = struct.Struct("<16sQQQ")
_SEGMENT_NAME = re.compile(r"rlfleet_[0-9a-f]{16}")


class ShmUnavailable(OSError):
    """The planned segment is not this sender's to write: it does not exist here, or
    its header lacks the plan's nonce (the two ends do not share ``/dev/shm``)."""


def host_identity() -> str:
    """This host's identity for shared memory (module docstring): ``host/boot
    id/device:inode of /dev/shm``; "" where there is no ``/dev/shm`` (shared memory
    is then never planned to or from this process)."""
    try:
        st = os.stat(_SHM_DIR)
    except OSError:
        return ""
    if not stat.S_ISDIR(st.st_mode):
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}/{st.st_dev}:{st.st_ino}"


# --------------------------------------------------------------------- sender side


def send_shm(
    plan: TransferPlan,
    named_tensors: Mapping[str, Any],
    specs: Sequence[TensorSpec],
    *,
    crcs: SourceCrcs | None = None,
    moved: Callable[[int], None] | None = None,
) -> list[int]:
    """Copy the bytes into the replica's segment, block by block, publishing the
    count of bytes written after each block (and telling ``moved`` each tensor's).

    Args:
        crcs: the bucket's checksums, shared by every replica it goes to; None: this
            transfer's own. When this transfer claims them, it checksums each block
            right after copying it, in the same thread, while the block is still in
            this core's cache (a checksum thread of its own, reading the block from
            another core, measured 25% slower for the whole push on two cores: the
            receiver's thread needs the other one).

    Returns:
        The CRC-32C of each tensor, in ``specs`` order (for the commit).

    Raises:
        ShmUnavailable: the segment is not there or not the replica's (nothing written).
    """
    arrays = [as_u8(tensor_bytes(named_tensors[s.name])) for s in specs]
    checksums = SourceCrcs(arrays) if crcs is None else crcs
    values: list[int] | None = [0] * len(specs) if checksums.claim() else None
    try:
        _write_segment(plan, arrays, specs, values, moved)
        if values is not None:
            checksums.publish(values)
            values = None
        return checksums.result()
    finally:
        if values is not None:  # failed: others waiting for the values compute them
            checksums.abandon()
        if crcs is None:
            checksums.close()


class _Mappings:
    """The sender's mappings of replicas' segments, kept from one transfer to the
    next: mapping a segment populates its page tables (``MAP_POPULATE``, about a
    third of the time a copy of its bytes takes), and the replica reuses its
    segments update after update. A mapping whose segment is gone (unlinked by the
    replica, or replaced) is dropped at the next transfer, so it holds no memory
    the replica freed for longer than that."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[str, tuple[int, int, mmap.mmap]] = {}  # path -> inode, size, map

    def get(self, path: str, nbytes: int) -> mmap.mmap:
        """A mapping of the whole segment at ``path`` (at least ``nbytes`` long)."""
        with self._lock:
            self._prune()
            entry = self._maps.get(path)
        if entry is not None and entry[1] >= nbytes:
            return entry[2]
        # Mapped by path rather than through SharedMemory: attaching with
        # SharedMemory registers the segment with this process's resource tracker,
        # which would unlink it (and warn) when this process exits.
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError as e:
            raise ShmUnavailable(f"shared-memory segment {path} does not exist on this host") from e
        try:
            st = os.fstat(fd)
            # A plain file of /dev/shm itself: not a link, not something mounted there.
            if not stat.S_ISREG(st.st_mode) or st.st_dev != os.stat(_SHM_DIR).st_dev:
                raise ShmUnavailable(f"{path} is not a shared-memory segment")
            if st.st_size < nbytes:
                raise ShmUnavailable(f"segment {path} is smaller than {nbytes} bytes")
            # MAP_POPULATE: map every page in one call rather than fault them in one
            # by one during the copy (the segment's pages exist once it was used).
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, st.st_size, flags=flags)
        finally:
            os.close(fd)
        with self._lock:
            old = self._maps.get(path)
            self._maps[path] = (st.st_ino, st.st_size, mm)
        if old is not None:
            _close(old[2])
        return mm

    def _prune(self) -> None:
        for path, (ino, size, mm) in list(self._maps.items()):
            try:
                st = os.stat(path)
            except OSError:
                st = None
            if st is None or (st.st_ino, st.st_size) != (ino, size):
                del self._maps[path]
                _close(mm)

    def clear(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for _, _, mm in maps.values():
            _close(mm)


def _close(mm: mmap.mmap) -> None:
    # A transfer still writing through it (its segment was dropped under it) holds
    # views: the map then closes when they go.
    with contextlib.suppress(BufferError):
        mm.close()


_MAPPINGS = _Mappings()


def _write_segment(
    plan: TransferPlan,
    arrays: Sequence[np.ndarray],
    specs: Sequence[TensorSpec],
    crcs: list[int] | None,
    moved: Callable[[int], None] | None = None,
) -> None:
    name = plan.endpoint.lstrip("/")
    if not name or "/" in name or name in (".", ".."):  # a segment's name, not a path
        raise ShmUnavailable(f"{plan.endpoint[:80]!r} is not a shared-memory segment's name")
    path = os.path.join(_SHM_DIR, name)
    total = specs[-1].offset + specs[-1].nbytes if specs else 0
    nonce = plan.token.encode()
    mm = _MAPPINGS.get(path, HEADER + total)
    if not nonce or mm[_NONCE_AT : _NONCE_AT + len(nonce)] != nonce:
        raise ShmUnavailable(
            f"segment {path} lacks the plan's nonce: the replica's /dev/shm is not this process's"
        )
    written = np.frombuffer(mm, dtype="<u8", count=1)
    dst = np.frombuffer(mm, dtype=np.uint8, offset=HEADER, count=total)
    try:
        for index, (s, src) in enumerate(zip(specs, arrays, strict=True)):
            crc = _copy(s, src, dst, written, crcs is not None)
            if crcs is not None:
                crcs[index] = crc
            if moved is not None:
                moved(s.nbytes)
    finally:
        del written, dst  # the map cannot close while numpy views it


def _copy(
    spec: TensorSpec, src: np.ndarray, dst: np.ndarray, written: np.ndarray, checksum: bool
) -> int:
    """Copy one tensor's bytes to its place in the segment; its CRC-32C when
    ``checksum`` (of the sender's own bytes, each block read again right after its
    copy, from cache), else 0."""
    crc = 0
    for i in range(0, spec.nbytes, _SHM_BLOCK):
        block = src[i : i + _SHM_BLOCK]
        start = spec.offset + i
        dst[start : start + len(block)] = block
        # Published after the bytes (x86 keeps the order of stores; elsewhere the
        # replica re-reads a mismatching tensor at commit).
        written[0] = start + len(block)
        if checksum:
            crc = crc32c_extend(crc, block)
    return crc


# --------------------------------------------------------------------- receiver side


def create_segment(nbytes: int) -> shared_memory.SharedMemory:
    """A fresh segment of ``nbytes`` (header included), its owner recorded."""
    shm = shared_memory.SharedMemory(
        name=f"rlfleet_{uuid.uuid4().hex[:16]}", create=True, size=nbytes
    )
    assert shm.buf is not None
    pid = os.getpid()
    if _own_proc():  # else no record: never removed as an orphan
        _OWNER.pack_into(shm.buf, _OWNER_AT, _OWNER_MAGIC, pid, _start_time(pid), _pid_namespace())
    return shm


def _own_proc() -> bool:
    """Whether ``/proc`` shows this process's pid namespace (not, say, the host's
    ``/proc`` mounted into a container), so that pids read there are its own."""
    try:
        return int(os.readlink("/proc/self")) == os.getpid()
    except (OSError, ValueError):
        return False


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot; 0 when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return 0
    return int(text[text.rindex(b")") + 2 :].split()[19])


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def remove_orphans() -> list[str]:
    """Unlink the segments of ``/dev/shm`` this module created in a process that is gone
    (same user, same pid namespace, that pid no longer the process that recorded it);
    returns their names. Segments of live owners, of other users or namespaces, and
    anything without an owner record are left alone."""
    try:
        names = [n for n in os.listdir(_SHM_DIR) if _SEGMENT_NAME.fullmatch(n)]
    except OSError:
        return []
    if not _own_proc():
        return []
    namespace, uid, removed = _pid_namespace(), os.geteuid(), []
    for name in names:
        path = os.path.join(_SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            record = os.pread(fd, _OWNER.size, _OWNER_AT)
        except OSError:
            continue
        finally:
            os.close(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or len(record) < _OWNER.size:
            continue
        magic, pid, started, owner_namespace = _OWNER.unpack(record)
        if magic != _OWNER_MAGIC or owner_namespace != namespace or namespace == 0:
            continue
        if pid and _start_time(pid) == started:
            continue  # its owner lives
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(name)
    if removed:
        logger.warning(
            "removed %d shared-memory segments left by dead replicas: %s",
            len(removed),
            ", ".join(removed),
        )
    return removed


def prepare_segment(shm: shared_memory.SharedMemory, nonce: str) -> None:
    """Reset a segment for a new transfer: nothing written, the transfer's nonce."""
    buf = shm.buf
    assert buf is not None
    data = nonce.encode()
    struct.pack_into("<Q", buf, 0, 0)
    buf[_NONCE_AT : _NONCE_AT + len(data)] = data


def segment_count(shm: shared_memory.SharedMemory) -> np.ndarray:
    """A one-element view of the segment's count of bytes written."""
    assert shm.buf is not None
    return np.frombuffer(shm.buf, dtype="<u8", count=1)


def destroy_segment(shm: shared_memory.SharedMemory) -> None:
    with contextlib.suppress(OSError, BufferError):
        shm.close()
    with contextlib.suppress(OSError):
        shm.unlink()
