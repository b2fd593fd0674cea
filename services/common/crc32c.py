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


def _load_crc32c_extend() -> tuple[Callable[[int, np.ndarray], int], bool]:
    """``crc32c_extend(crc, uint8 array)`` and whether it releases the GIL.

    google-crc32c's ``extend`` holds the GIL for anything but a ``bytes`` object
    (it guards against a buffer changing under it), so a checksum thread would
    stall the thread moving bytes. The same C function, ``crc32c_extend`` of the
    library its extension links, called through ``ctypes`` runs without the GIL.
    A changing buffer is harmless here: any difference between what the two ends
    checksummed is a mismatch that rejects the update. Checked against the
    extension on a known value; if the library cannot be loaded, the extension's
    ``extend``."""
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


#: Bytes copied and then checksummed at a time: a block is still in the core's cache
#: when its CRC-32C is computed, so each byte is read from memory once (checksumming
#: a whole 4 MB piece after copying it reads it twice, about 1.8x the time).
BLOCK = 1 << 18


def copy_crc(src: np.ndarray, dst: np.ndarray, crc: int) -> int:
    """Copy ``src`` into ``dst`` (uint8, same length) a :data:`BLOCK` at a time,
    extending ``crc`` with each block right after writing it."""
    for start in range(0, len(src), BLOCK):
        block = dst[start : start + BLOCK]
        np.copyto(block, src[start : start + BLOCK])
        crc = crc32c_extend(crc, block)
    return crc
