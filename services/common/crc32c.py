"""CRC-32C (Castagnoli) over uint8 arrays without holding the GIL, and the copy that
checksums what it just wrote while it is in cache.

The codec's chunks and the bulk plane's transfers both use them, so that a thread
checksumming bytes lets the others (a sender, a receiver, gRPC's) go on.

Two implementations, the first that loads is used (:data:`IMPLEMENTATION`):

* ``"awscrt"`` -- the AWS Common Runtime's ``checksums.crc32c``: carry-less
  multiplication folding (AVX-512 ``vpclmulqdq`` where the CPU has it, else SSE4.2
  and ``pclmulqdq``), about 84 GB/s a core on bytes in cache on the development VM,
  and it releases the GIL for all but small buffers;
* ``"google-crc32c"`` -- google-crc32c's C ``crc32c_extend`` called through
  ``ctypes``, which releases the GIL (the extension's own ``extend`` keeps it for
  anything but ``bytes``); about 29 GB/s on the same bytes. Its pure
  Python fallback keeps the GIL (:data:`CRC_RELEASES_GIL` is then False).

Both give the same values (checked at import against a known one); which one runs
is a matter of speed only, never of what goes on the wire.

The copies (:func:`copy_crc`, :func:`copy_crc_views`) run in one pass where the
package's C extension ``rlfleet.common._copycrc`` was built and the CPU has SSE4.2
(:data:`COPY_IMPLEMENTATION` ``"native"``): each byte is checksummed from a register
as it is stored, three lanes side by side, and the GIL is released for the copy.
Elsewhere (``"blocks"``) they copy a :data:`BLOCK` at a time in Python and checksum
each block right after writing it, while it is in cache. The extension is checked
at import against the functions above; it too changes speed only.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable

import google_crc32c
import numpy as np

__all__ = [
    "BLOCK",
    "COPY_IMPLEMENTATION",
    "CRC_RELEASES_GIL",
    "IMPLEMENTATION",
    "copy_crc",
    "copy_crc_from",
    "copy_crc_views",
    "crc32c_extend",
]

# CRC-32C of b"123456789", the standard check value.
_CHECK = 0xE3069283
_PROBE = b"123456789"


def _load_awscrt() -> Callable[[memoryview, int], int] | None:
    """awscrt's ``checksums.crc32c(data, previous)``, or None where it is absent or
    does not give CRC-32C's check value. The extension's function itself where it is
    there (the public one is a Python function that only calls it: a frame saved
    per 256 KiB block), checked against the check value like the public one."""
    try:
        from awscrt import checksums
    except ImportError:
        return None
    fn: Callable[[memoryview, int], int] = checksums.crc32c
    try:
        import _awscrt

        direct = _awscrt.checksums_crc32c
        if direct(memoryview(_PROBE), 0) == _CHECK:
            fn = direct
    except Exception:  # any surprise from a private module: keep the public function
        pass
    if (
        fn(memoryview(_PROBE), 0) != _CHECK
        or fn(memoryview(_PROBE[4:]), fn(memoryview(_PROBE[:4]), 0)) != _CHECK
    ):
        return None
    return fn


def _load_crc32c_raw() -> Callable[[int, int, int], int] | None:
    """google-crc32c's C ``crc32c_extend(crc, address, length)``, called through
    ``ctypes`` so that it runs without the GIL, or None where it cannot be loaded.

    The extension's own ``extend`` holds the GIL for anything but a ``bytes`` object
    (it guards against a buffer changing under it), so a checksum thread would stall
    the thread moving bytes. A changing buffer is harmless here: any difference
    between what the two ends checksummed is a mismatch that rejects the data.
    Checked against the extension on a known value."""
    try:
        from google_crc32c import _crc32c

        fn = ctypes.CDLL(_crc32c.__file__).crc32c_extend
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    address = ctypes.cast(ctypes.c_char_p(_PROBE), ctypes.c_void_p).value
    if fn(0, address, len(_PROBE)) != _CHECK or fn(0, address, 9) != google_crc32c.value(_PROBE):
        return None
    return fn


_crc_fast = _load_awscrt()
_crc_raw = None if _crc_fast is not None else _load_crc32c_raw()

#: Which implementation computes the checksums: ``"awscrt"``, ``"google-crc32c"``
#: (C, through ``ctypes``) or ``"google-crc32c-python"``.
IMPLEMENTATION = (
    "awscrt"
    if _crc_fast is not None
    else "google-crc32c"
    if _crc_raw is not None
    else "google-crc32c-python"
)

#: Whether :func:`crc32c_extend` runs without the GIL (so that a thread can
#: checksum while another moves bytes).
CRC_RELEASES_GIL = IMPLEMENTATION != "google-crc32c-python"


def crc32c_extend(crc: int, data: np.ndarray) -> int:
    """``crc`` extended with the bytes of ``data``, a C-contiguous uint8 array."""
    if _crc_fast is not None:
        return int(_crc_fast(data.data, crc))
    if _crc_raw is None:
        return int(google_crc32c.extend(crc, data))
    return int(_crc_raw(crc, data.ctypes.data, data.nbytes))


#: Bytes copied and then checksummed at a time: a block is still in the core's cache
#: when its CRC-32C is computed, so each byte is read from memory once (checksumming
#: a whole 4 MB piece after copying it reads it twice, about 1.8x the time).
BLOCK = 1 << 18


def _load_native() -> Callable[[object, object, int], int] | None:
    """The extension's ``copy_crc32c(dst, src, crc)``, or None where it was not built,
    the CPU lacks SSE4.2, or it disagrees with :func:`crc32c_extend` on a probe long
    enough for its three-lane path (checked once, at import)."""
    try:
        from rlfleet.common import _copycrc
    except ImportError:
        return None
    if not getattr(_copycrc, "AVAILABLE", 0):
        return None
    fn: Callable[[object, object, int], int] = _copycrc.copy_crc32c
    probe = (np.arange(3 * int(_copycrc.LANE) + 13, dtype=np.uint32) * 2654435761 >> 24).astype(
        np.uint8
    )
    out = np.zeros_like(probe)
    try:
        ok = (
            fn(bytearray(len(_PROBE)), _PROBE, 0) == _CHECK
            and fn(out, probe, 12345) == crc32c_extend(12345, probe)
            and np.array_equal(out, probe)
        )
    except Exception:  # any surprise from the extension: copy in Python instead
        return None
    return fn if ok else None


_copy_native = _load_native()

#: How :func:`copy_crc` and :func:`copy_crc_views` run: ``"native"`` (one pass in the
#: C extension, GIL released from 64 KiB) or ``"blocks"`` (Python, a :data:`BLOCK`
#: at a time).
COPY_IMPLEMENTATION = "native" if _copy_native is not None else "blocks"


def copy_crc(src: np.ndarray, dst: np.ndarray, crc: int) -> int:
    """Copy ``src`` into ``dst`` (C-contiguous uint8, same length), extending ``crc``
    (a 32-bit value) with the bytes copied.

    Without the GIL, so that other threads (gRPC's, a receiver's) run meanwhile: in one
    pass where the extension is there (:data:`COPY_IMPLEMENTATION`; copies under 64
    KiB keep the GIL, being short), else a :data:`BLOCK` at a time, each block's two
    C calls (``memmove`` through ``ctypes`` on raw addresses, then the checksum)
    releasing it."""
    for name, a in (("src", src), ("dst", dst)):
        if a.dtype != np.uint8 or a.ndim != 1 or not a.flags.c_contiguous:
            raise ValueError(f"copy_crc: {name} must be a contiguous 1-D uint8 array")
    if len(src) != len(dst):
        raise ValueError(f"copy_crc: src has {len(src)} bytes, dst {len(dst)}")
    crc = _crc_arg("copy_crc", crc)
    if _copy_native is not None and len(dst):
        if not dst.flags.writeable:
            raise ValueError("copy_crc: dst is read-only")
        return int(_copy_native(dst, src, crc))
    return copy_crc_from(src.ctypes.data, dst.data, crc)


def copy_crc_from(src: int, dst: memoryview, crc: int) -> int:
    """:func:`copy_crc` from a raw address, for callers that hold one already (a
    tensor's or a chunk's base address plus an offset, found once): the
    ``len(dst)`` bytes at address ``src`` into ``dst``, a writable, C-contiguous,
    one-dimensional view of bytes. The caller vouches that those source bytes are
    live; the destination's bounds and writability are the view's own. Saves finding
    the source's address per call (a microsecond through numpy), which adds up over
    the few hundred pieces of a large weight stream."""
    if dst.ndim != 1 or dst.itemsize != 1 or not dst.c_contiguous:
        raise ValueError("copy_crc_from: dst must be a contiguous 1-D view of bytes")
    n = dst.nbytes
    if n == 0:
        return crc
    if dst.readonly:
        raise ValueError("copy_crc_from: dst is read-only")
    # The ctypes object goes at once, and with it its hold on the buffer.
    d = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    fast = _crc_fast
    if fast is not None:
        # The loop runs once per 256 KiB: names bound locally, whole blocks first.
        memmove = ctypes.memmove
        block = BLOCK
        whole = n - n % block
        for start in range(0, whole, block):
            memmove(d + start, src + start, block)
            crc = fast(dst[start : start + block], crc)
        if whole < n:
            memmove(d + whole, src + whole, n - whole)
            crc = fast(dst[whole:], crc)
        return int(crc)
    if _crc_raw is None:
        block_view = np.frombuffer(dst, np.uint8)
        for start in range(0, n, BLOCK):
            ctypes.memmove(d + start, src + start, min(BLOCK, n - start))
            crc = int(google_crc32c.extend(crc, block_view[start : start + BLOCK]))
        return crc
    for start in range(0, n, BLOCK):
        size = min(BLOCK, n - start)
        ctypes.memmove(d + start, src + start, size)
        crc = _crc_raw(crc, d + start, size)
    return int(crc)


def copy_crc_views(src: memoryview, dst: memoryview, crc: int) -> int:
    """:func:`copy_crc` between two views of bytes (C-contiguous, one-dimensional, the
    same length and format; ``dst`` writable); ``ValueError`` for views that do not
    fit, before anything is written. Bounds are kept by the views themselves: no raw
    addresses.

    With the extension (:data:`COPY_IMPLEMENTATION` ``"native"``), one call copies and
    checksums in one pass, without the GIL from 64 KiB. Without it, a :data:`BLOCK`
    at a time: each block copied by slice assignment (a ``memcpy`` under the GIL) and
    then checksummed. That is cheaper per block than :func:`copy_crc_from`, whose
    ``ctypes`` call releasing the GIL costs about a microsecond. The GIL is then held
    for one block's copy at a time (about 25 us) and released for its checksum, so
    other threads still get their turn each block; where a thread must run *during*
    the copies (a receiver filling the buffer being checksummed), use
    :func:`copy_crc`."""
    n = dst.nbytes
    if src.nbytes != n:
        raise ValueError(f"copy_crc_views: src has {src.nbytes} bytes, dst {n}")
    # Everything checked before the first block is written (a block assignment would
    # refuse a strided or read-only view only when it gets there).
    for name, v in (("src", src), ("dst", dst)):
        if v.itemsize != 1 or v.ndim != 1 or not v.c_contiguous:
            raise ValueError(f"copy_crc_views: {name} must be a contiguous 1-D view of bytes")
    if src.format != dst.format:  # as slice assignment refuses them
        raise ValueError(f"copy_crc_views: src has format {src.format!r}, dst {dst.format!r}")
    crc = _crc_arg("copy_crc_views", crc)
    if dst.readonly and n:
        raise ValueError("copy_crc_views: dst is read-only")
    if _copy_native is not None and n:
        return int(_copy_native(dst, src, crc))
    extend = _crc_fast if _crc_fast is not None else _extend_view
    block = BLOCK
    for start in range(0, n, block):
        d = dst[start : start + block]
        d[:] = src[start : start + block]  # refuses a read-only or differently shaped dst
        crc = extend(d, crc)
    return int(crc)


def _crc_arg(where: str, crc: int) -> int:
    """``crc`` as an int (numpy integers too), or ``ValueError`` unless it is a 32-bit
    value: the same on both copy paths, before anything is written."""
    value = operator.index(crc)
    if not 0 <= value <= 0xFFFFFFFF:
        raise ValueError(f"{where}: crc {value} is not a 32-bit value")
    return value


def _extend_view(data: memoryview, crc: int) -> int:
    return crc32c_extend(crc, np.frombuffer(data, np.uint8))
