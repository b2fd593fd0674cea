"""Integrity of the bulk plane: per-tensor CRC-32C and the value scan, as bytes move.

Both ends of a bulk transfer checksum every tensor (CRC-32C, Castagnoli); the
commit carries the sender's values and the replica applies nothing unless every
one matches its own. Neither end makes a pass over the bytes before or after the
move:

* the **sender** checksums each bucket once, whatever the number of replicas it
  goes to (:class:`SourceCrcs`): the first transfer computes the values as it moves
  the bytes, each block right after moving it while it is in cache, and the others
  wait for them only at commit;
* the **receiver** follows the bytes as they land (:class:`StreamVerifier`, a
  thread behind the count of bytes received or written), extending each tensor's
  CRC-32C and scanning its values (:func:`scan_values`: finite? non-zero?) while
  the block is still in cache, so that the commit only compares.

:data:`crc32c_extend` (:mod:`rlfleet.common.crc32c`) releases the GIL: a checksum
thread runs while another thread moves bytes.
"""

from __future__ import annotations

import bisect
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlfleet.common.codec.batch import TensorSpec
from rlfleet.common.crc32c import CRC_RELEASES_GIL, copy_crc, crc32c_extend

__all__ = [
    "CRC_RELEASES_GIL",
    "CrcThread",
    "PolledCount",
    "Progress",
    "SourceCrcs",
    "StreamVerifier",
    "ValueScan",
    "as_u8",
    "crc32c_extend",
    "scan_values",
    "tensor_bytes",
    "tensor_crcs",
]

# Receiver: bytes checksummed and scanned per step of the follower thread (small
# enough to stay in cache between the CRC and the scan).
_FOLLOW_BLOCK = 4 << 20
# Receiver: a count another process writes (shared memory) is polled, from this
# wait between looks, doubling while nothing comes, up to the longest.
_POLL_S = 0.0001
_POLL_MAX_S = 0.002
# Receiver: a follower's longest wait before it looks again anyway.
_WAIT_S = 1.0
# Elements per pass of the exact value scan (a scratch block of 4-32 MiB).
_VALUE_BLOCK = 1 << 22


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


def as_u8(data: memoryview) -> np.ndarray:
    """A uint8 array over ``data`` (what :data:`crc32c_extend` takes)."""
    return np.frombuffer(data, dtype=np.uint8)


def tensor_crcs(named_tensors: Mapping[str, Any], specs: Sequence[TensorSpec]) -> list[int]:
    """CRC-32C of each tensor's bytes, in ``specs`` order (what a sender commits)."""
    return [crc32c_extend(0, as_u8(tensor_bytes(named_tensors[s.name]))) for s in specs]


class SourceCrcs:
    """The sender's per-tensor CRC-32Cs of one bucket, computed once however many
    replicas the bucket goes to; every replica's commit carries the same values.

    The first transfer to :meth:`claim` them computes them as it moves the bytes,
    each block right after moving it, while it is still in cache (shared memory:
    inline after each copy; TCP: a :class:`CrcThread` fed after each ``sendmsg``),
    and publishes them (:meth:`publish`); the others only wait (:meth:`result`). Unclaimed
    (or abandoned by a claimant that failed), they are computed by a thread of
    their own once someone waits.

    Args:
        arrays: each tensor's bytes (uint8, C-contiguous), in offer order; they
            must not change until :meth:`result` returned.
    """

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        self.arrays = list(arrays)
        self._lock = threading.Lock()
        self._state = "idle"  # idle -> claimed -> done, or idle -> thread -> done
        self._values: list[int] = []
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._stop = False
        self._closed = False
        self._claimant = 0  # the claiming thread's ident
        self._thread: threading.Thread | None = None

    @classmethod
    def of(cls, named_tensors: Mapping[str, Any], specs: Sequence[TensorSpec]) -> SourceCrcs:
        return cls([as_u8(tensor_bytes(named_tensors[s.name])) for s in specs])

    def claim(self) -> bool:
        """True for the one caller that is to compute and :meth:`publish` the values."""
        with self._lock:
            if self._state != "idle":
                return False
            self._state = "claimed"
            self._claimant = threading.get_ident()
            return True

    def release(self, claimant: int) -> None:
        """:meth:`abandon` on behalf of the thread ``claimant`` (its transfer was given
        up from another thread), if that thread holds the claim; else nothing."""
        with self._lock:
            if self._state != "claimed" or self._claimant != claimant:
                return
            self._state = "idle"
        self._start()

    def publish(self, values: Sequence[int]) -> None:
        with self._lock:
            self._values = list(values)
            self._state = "done"
        self._done.set()

    def abandon(self) -> None:
        """The claimant failed: whoever waits gets the values from a thread instead."""
        with self._lock:
            if self._state == "claimed":
                self._state = "idle"
        self._start()

    def _start(self) -> None:
        with self._lock:
            if self._state != "idle" or self._closed:
                return
            self._state = "thread"
            self._thread = threading.Thread(target=self._run, name="rlfleet-send-crc", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        values = []
        try:
            for a in self.arrays:
                crc = 0
                # Blocks, so that a stop is seen within one block of a large tensor.
                for i in range(0, a.nbytes, _FOLLOW_BLOCK):
                    if self._stop:
                        return
                    crc = crc32c_extend(crc, a[i : i + _FOLLOW_BLOCK])
                values.append(crc)
            self._values = values
        except BaseException as e:  # re-raised in the caller's thread
            self._error = e
        finally:
            self._done.set()

    def result(self, timeout_s: float | None = None) -> list[int]:
        """The per-tensor CRC-32Cs, once computed (``TimeoutError`` after ``timeout_s``)."""
        self._start()  # nobody claimed them: compute them here
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"the sender's checksums took more than {timeout_s}s")
        if self._error is not None:
            raise self._error
        if len(self._values) != len(self.arrays):
            raise RuntimeError("the sender's checksums were stopped")
        return list(self._values)

    def close(self) -> None:
        """Stop (the bucket was given up) and drop the references to its bytes. A
        later :meth:`abandon` (a replica given up from another thread) starts nothing."""
        self._stop = True
        with self._lock:  # a thread assigned is a thread started (see _start)
            thread = self._thread
            self._closed = True
        if thread is not None:
            thread.join()
        self.arrays = []


class CrcThread:
    """Per-tensor CRC-32C computed in a thread of its own, block by block, behind
    the caller that moves the blocks (``put`` right after a block is sent, while it
    is still in cache): with the GIL-free :data:`crc32c_extend` the checksum of
    block i runs while block i+1 moves."""

    def __init__(self, n_tensors: int) -> None:
        self.values = [0] * n_tensors
        self._queue: queue.SimpleQueue[list[tuple[int, np.ndarray]] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rlfleet-send-crc", daemon=True)
        self._thread.start()

    def put(self, blocks: list[tuple[int, np.ndarray]]) -> None:
        """``(tensor index, block)`` pairs, in byte order."""
        self._queue.put(blocks)

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
            try:
                for index, block in item:
                    self.values[index] = crc32c_extend(self.values[index], block)
            except BaseException as e:  # re-raised in the caller's thread
                self._error = e


# ------------------------------------------------------------------- value scan

# Floating dtype -> (same-width int dtype, magnitude mask, all-ones exponent).
_BITS: dict[str, tuple[str, int, int]] = {
    "float32": ("int32", 0x7FFF_FFFF, 0x7F80_0000),
    "bfloat16": ("int16", 0x7FFF, 0x7F80),
    "float16": ("int16", 0x7FFF, 0x7C00),
    "float64": ("int64", 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
}


def scan_values(t: Any) -> tuple[bool, bool]:
    """``(every value finite, some value non-zero)`` of a floating torch tensor.

    Fast path: one ``sum`` in the tensor's dtype (vectorized, ~2.5x the speed of a
    pass over the bits): a NaN or an infinity anywhere makes the sum non-finite,
    so a finite sum proves every value finite, and a non-zero sum proves a non-zero
    value. Only when the sum cannot tell (non-finite, which may be an overflow of
    finite values, or exactly zero) does the exact pass over the bits decide: with
    the sign bit masked off, a value is non-finite iff its bits reach the all-ones
    exponent, and zero iff they are 0."""
    import torch

    if t.numel() == 0:
        return True, False
    flat = t.detach().reshape(-1)
    with torch.no_grad():
        total = float(flat.sum())
    if total == total and abs(total) != float("inf") and total != 0.0:
        return True, True
    return _scan_bits(flat)


def _scan_bits(flat: Any) -> tuple[bool, bool]:
    import torch

    bits = _BITS.get(str(flat.dtype).removeprefix("torch."))
    if bits is None:  # e.g. float8: rare, the plain way
        wide = flat.float()
        return bool(torch.isfinite(wide).all()), bool(wide.any())
    int_name, magnitude, exponent = bits
    ints = flat.contiguous().view(getattr(torch, int_name))
    block = torch.empty(min(_VALUE_BLOCK, ints.numel()), dtype=ints.dtype, device=ints.device)
    top = 0
    for i in range(0, ints.numel(), _VALUE_BLOCK):
        part = ints[i : i + _VALUE_BLOCK]
        out = block[: part.numel()]
        torch.bitwise_and(part, magnitude, out=out)
        top = max(top, int(out.max()))
        if top >= exponent:
            return False, True
    return True, top > 0


class Progress:
    """Bytes made available so far, in order, by a thread of this process (TCP's
    receive thread), for a thread that follows them: it is woken when the count
    grows, no polling."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.value = 0
        self.closed = False

    def advance(self, value: int) -> None:
        with self._cond:
            self.value = value
            self._cond.notify_all()

    def close(self) -> None:
        """No more bytes will come."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def wait(self, beyond: int, timeout_s: float) -> tuple[int, bool]:
        """``(count, closed)`` once the count passed ``beyond`` or no more will come
        (or ``timeout_s`` passed)."""
        with self._cond:
            self._cond.wait_for(lambda: self.value > beyond or self.closed, timeout_s)
            return self.value, self.closed


class PolledCount:
    """Bytes written so far by another process (a shared-memory segment's count),
    looked at every :data:`_POLL_S`, the wait doubling while nothing comes."""

    def __init__(self, read: Callable[[], int], stopped: Callable[[], bool]) -> None:
        self._read = read
        self._stopped = stopped

    def wait(self, beyond: int, timeout_s: float) -> tuple[int, bool]:
        deadline = time.monotonic() + timeout_s
        pause = _POLL_S
        while True:
            closed = self._stopped()  # read before the count: see the last write
            value = self._read()
            if value > beyond or closed or time.monotonic() >= deadline:
                return value, closed
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)

    def release(self) -> None:
        """Drop the references to the segment (it cannot close while one exists)."""
        self._read, self._stopped = _nothing, _stopped


def _nothing() -> int:
    return 0


def _stopped() -> bool:
    return True


Source = Progress | PolledCount


_FLOATING = frozenset({"float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})


@dataclass(frozen=True)
class ValueScan:
    """What the value scan of some floating tensors found (the input of
    :func:`rlfleet.weightsync.receiver.check_weight_values`): which were scanned,
    which hold a NaN or an infinity (in order), and whether any value is non-zero."""

    names: frozenset[str] = frozenset()
    nonfinite: tuple[str, ...] = ()
    nonzero: bool = False

    def __or__(self, other: ValueScan) -> ValueScan:
        """Both scans (the buckets of one update)."""
        return ValueScan(
            self.names | other.names,
            self.nonfinite + other.nonfinite,
            self.nonzero or other.nonzero,
        )


class StreamVerifier:
    """The receiver's checks of one bulk transfer, computed as the bytes land.

    A thread follows ``source`` (bytes of ``buffer`` received or written so far, in
    order) and, for each new range, extends the CRC-32C of the tensors it
    covers and scans the floating values (:func:`scan_values`: one call per run of
    consecutive tensors of one dtype, cut at element boundaries, so that many small
    tensors cost one scan, not one each; a run that is not finite is scanned again
    tensor by tensor to name the culprits). :meth:`finish` waits for it to reach
    the end.

    With ``copy_to``, the same thread first copies each range there from ``buffer``
    as it lands (:func:`~rlfleet.common.crc32c.copy_crc`), checksumming the bytes as
    it copies them (in one pass, or each block right after copying it, from this
    core's cache), and scans the copy: the
    receiver then verifies, and uses, bytes that no one else can write (``buffer``
    being memory a sender maps), copied while the sender is still writing. (A copy
    thread of its own, with the checks reading behind it from another core,
    measured 25% slower for the whole push on two cores, where the sender needs
    the other core.)

    Args:
        specs: the offered tensors, packed back to back in ``buffer``.
        dtypes: each spec's torch dtype name (``bfloat16``, ...).
        buffer: a uint8 numpy array over the staging bytes.
        source: how many bytes of ``buffer`` are there so far, and whether more
            will come (:class:`Progress`, :class:`PolledCount`).
        copy_to: a private uint8 array of ``buffer``'s size, or None.
    """

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        dtypes: Sequence[str],
        buffer: np.ndarray,
        source: Source,
        copy_to: np.ndarray | None = None,
    ) -> None:
        self.specs = list(specs)
        self.crcs = [0] * len(self.specs)
        self._dtypes = list(dtypes)
        self._floating = [d in _FLOATING for d in dtypes]
        self._itemsize = [_itemsize(d) for d in dtypes]
        self._ends = [s.offset + s.nbytes for s in self.specs]
        self._total = self._ends[-1] if self._ends else 0
        self._nonfinite: set[int] = set()
        self._nonzero = False
        self._buffer = buffer if copy_to is None else copy_to
        self._copy_from = None if copy_to is None else buffer
        self._source: Source = source
        self.fed = 0  # bytes checksummed so far
        self._scanned = 0  # bytes scanned so far (an element boundary)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rlfleet-verify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while self.fed < self._total:
                count, closed = self._source.wait(self.fed, _WAIT_S)
                available = min(count, self._total)
                if available > self.fed:
                    self.feed(min(available, self.fed + _FOLLOW_BLOCK))
                elif closed:
                    return
        except BaseException as e:  # reported at finish()
            self.error = e
        finally:
            # No view of the staging memory may outlive the thread: a shared-memory
            # segment cannot close while one exists (the count reads the segment too).
            self._buffer = np.empty(0, dtype=np.uint8)
            self._copy_from = None
            if isinstance(self._source, PolledCount):
                self._source.release()

    def feed(self, end: int) -> None:
        """Checksum and scan ``buffer[self.fed:end]`` (with ``copy_to``: copy it there
        first, and checksum and scan the copy), split at tensor boundaries."""
        buf, src = self._buffer, self._copy_from
        pos = self.fed
        i = bisect.bisect_right(self._ends, pos)  # first tensor ending after pos
        while pos < end:
            stop = min(end, self._ends[i])
            if src is None:
                self.crcs[i] = crc32c_extend(self.crcs[i], buf[pos:stop])
            else:
                self.crcs[i] = copy_crc(src[pos:stop], buf[pos:stop], self.crcs[i])
            pos = stop
            i += 1
        self.fed = max(self.fed, end)
        self._scan_to(buf, end)

    def _scan_to(self, buf: np.ndarray, end: int) -> None:
        """Scan the floating values of ``buf[self._scanned:end]``, whole elements only
        (the rest of a cut element is scanned with the next range)."""
        if end < self._total:
            j = bisect.bisect_right(self._ends, end)  # the tensor ``end`` falls in
            end -= (end - self.specs[j].offset) % self._itemsize[j]
        pos = self._scanned
        i = bisect.bisect_right(self._ends, pos)
        while pos < end:
            # One run: consecutive tensors of tensor i's dtype (packed back to back,
            # so one view covers them).
            first, dtype = i, self._dtypes[i]
            while i + 1 < len(self.specs) and self._ends[i] < end and self._dtypes[i + 1] == dtype:
                i += 1
            stop = min(end, self._ends[i])
            if self._floating[first] and stop > pos:
                self._scan_run(buf, pos, stop, first, i)
            pos = stop
            i += 1
        self._scanned = max(self._scanned, end)

    def _scan_run(self, buf: np.ndarray, start: int, stop: int, first: int, last: int) -> None:
        finite, nonzero = scan_values(_as_torch(buf[start:stop], self._dtypes[first]))
        self._nonzero = self._nonzero or nonzero
        if finite:
            return
        for i in range(first, last + 1):  # name the culprits
            a, b = max(start, self.specs[i].offset), min(stop, self._ends[i])
            if b > a and not scan_values(_as_torch(buf[a:b], self._dtypes[i]))[0]:
                self._nonfinite.add(i)

    def finish(self, timeout_s: float) -> bool:
        """Wait for the thread (at most ``timeout_s``); False if it still runs. An
        error it met is in :attr:`error`."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def rescan(self, buffer: np.ndarray, indices: Sequence[int], copy_to: Any = None) -> None:
        """Checksum and scan tensors ``indices`` again from ``buffer`` (copied into
        ``copy_to`` first, when given) (a commit that found a mismatch re-reads them
        once, for hosts whose memory order is weaker than x86's: the follower may
        have read a block before it was written)."""
        for i in indices:
            s = self.specs[i]
            data = buffer[s.offset : s.offset + s.nbytes]
            if copy_to is not None:
                copy_to[s.offset : s.offset + s.nbytes] = data
                data = copy_to[s.offset : s.offset + s.nbytes]
            self.crcs[i] = crc32c_extend(0, data)
            if self._floating[i] and s.nbytes:
                finite, nonzero = scan_values(_as_torch(data, self._dtypes[i]))
                self._nonzero = self._nonzero or nonzero
                if finite:
                    self._nonfinite.discard(i)
                else:
                    self._nonfinite.add(i)

    def values(self) -> ValueScan:
        """The scan of the floating tensors (complete once :meth:`finish` returned)."""
        return ValueScan(
            frozenset(s.name for i, s in enumerate(self.specs) if self._floating[i]),
            tuple(self.specs[i].name for i in sorted(self._nonfinite)),
            self._nonzero,
        )


def _itemsize(dtype: str) -> int:
    import torch

    return int(getattr(torch, dtype).itemsize)


def _as_torch(data: np.ndarray, dtype: str) -> Any:
    import torch

    return torch.from_numpy(data).view(getattr(torch, dtype))
