"""CRC-32C (Castagnoli) over uint8 arrays without holding the GIL, and the copy that
checksums what it just wrote while it is in cache.

The codec's chunks and the bulk plane's transfers both use them, so that a thread
checksumming bytes lets the others (a sender, a receiver, gRPC's) go on.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import google_crc32c
import numpy as np

__all__ = ["BLOCK", "CRC_RELEASES_GIL", "copy_crc", "crc32c_extend"]


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
    probe = b"123456789"
    address = ctypes.cast(ctypes.c_char_p(probe), ctypes.c_void_p).value
    if fn(0, address, len(probe)) != 0xE3069283 or fn(0, address, 9) != google_crc32c.value(probe):
        return None
    return fn


_crc_raw = _load_crc32c_raw()

#: Whether :func:`crc32c_extend` runs without the GIL (so that a thread can
#: checksum while another moves bytes).
CRC_RELEASES_GIL = _crc_raw is not None


def crc32c_extend(crc: int, data: np.ndarray) -> int:
    """``crc`` extended with the bytes of ``data``, a C-contiguous uint8 array."""
    if _crc_raw is None:
        return int(google_crc32c.extend(crc, data))
    return int(_crc_raw(crc, data.ctypes.data, data.nbytes))


#: Bytes copied and then checksummed at a time: a block is still in the core's cache
#: when its CRC-32C is computed, so each byte is read from memory once (checksumming
#: a whole 4 MB piece after copying it reads it twice, about 1.8x the time).
BLOCK = 1 << 18


def copy_crc(src: np.ndarray, dst: np.ndarray, crc: int) -> int:
    """Copy ``src`` into ``dst`` (C-contiguous uint8, same length) a :data:`BLOCK`
    at a time, extending ``crc`` with each block right after writing it.

    Both steps are C calls on raw addresses that release the GIL (``ctypes``), with
    no array view made per block: other threads (gRPC's, a receiver's) run
    meanwhile, and a 256 KiB block costs two calls."""
    for name, a in (("src", src), ("dst", dst)):
        if a.dtype != np.uint8 or a.ndim != 1 or not a.flags.c_contiguous:
            raise ValueError(f"copy_crc: {name} must be a contiguous 1-D uint8 array")
    if len(src) != len(dst):
        raise ValueError(f"copy_crc: src has {len(src)} bytes, dst {len(dst)}")
    if _crc_raw is None:
        for start in range(0, len(src), BLOCK):
            block = dst[start : start + BLOCK]
            np.copyto(block, src[start : start + BLOCK])
            crc = int(google_crc32c.extend(crc, block))
        return crc
    s, d, n = src.ctypes.data, dst.ctypes.data, len(src)
    for start in range(0, n, BLOCK):
        size = min(BLOCK, n - start)
        ctypes.memmove(d + start, s + start, size)
        crc = _crc_raw(crc, d + start, size)
    return int(crc)
