"""copy_crc: the copy that checksums what it writes, on raw addresses."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest

from rlfleet.common.crc32c import BLOCK, copy_crc


def test_copy_crc_copies_checksums_and_refuses_layouts_it_cannot_address() -> None:
    src = np.random.default_rng(0).integers(0, 256, 3 * BLOCK + 17, dtype=np.uint8)
    dst = np.zeros_like(src)
    assert copy_crc(src, dst, 0) == google_crc32c.value(src.tobytes())
    assert np.array_equal(src, dst)
    with pytest.raises(ValueError, match="src must be a contiguous 1-D uint8"):
        copy_crc(src[::2], dst[: len(src[::2])], 0)
    with pytest.raises(ValueError, match="dst must be a contiguous 1-D uint8"):
        copy_crc(src[:8], np.zeros(2, dtype=np.float32).view(np.uint8).reshape(2, 4), 0)
    with pytest.raises(ValueError, match="src has 8 bytes, dst 7"):
        copy_crc(src[:8], dst[:7], 0)
