"""copy_crc: the copy that checksums what it writes, in one pass (the C extension)
or a block at a time (Python), and the checksum implementations behind it."""

from __future__ import annotations

from types import ModuleType

import google_crc32c
import numpy as np
import pytest

from rlfleet.common import crc32c as crc32c_module
from rlfleet.common.crc32c import BLOCK, copy_crc, copy_crc_from, copy_crc_views

# The one-pass copy as loaded at import (None where the extension was not built or
# the CPU lacks SSE4.2).
_NATIVE = crc32c_module._copy_native


@pytest.fixture(params=["native", "blocks"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each way the copies can run, made the one in use: the C extension's one pass,
    and Python's blocks (what runs where the extension is absent)."""
    if request.param == "native" and _NATIVE is None:
        pytest.skip("the C extension rlfleet.common._copycrc is not built here (or no SSE4.2)")
    monkeypatch.setattr(
        crc32c_module, "_copy_native", _NATIVE if request.param == "native" else None
    )
    return str(request.param)


def test_copy_crc_copies_checksums_and_refuses_layouts_it_cannot_address(
    copy_path: str,
) -> None:
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
    with pytest.raises(ValueError, match="dst is read-only"):  # bytes stay immutable
        copy_crc(src[:8], np.frombuffer(bytes(8), dtype=np.uint8), 0)


def test_copy_crc_from_writes_exactly_the_view_it_is_given() -> None:
    """The raw-address copy the codec uses: as many bytes as the destination view
    holds, nothing before or after it, the same value as copy_crc; a read-only or
    non-byte destination is refused."""
    src = np.random.default_rng(2).integers(0, 256, 2 * BLOCK + 5, dtype=np.uint8)
    dst = np.full(len(src) + 64, 0xAB, dtype=np.uint8)
    n = len(src) - 3
    crc = copy_crc_from(src.ctypes.data + 3, dst.data[32 : 32 + n], 0)
    assert crc == google_crc32c.value(src[3:].tobytes())
    assert np.array_equal(dst[32 : 32 + n], src[3:])
    assert (dst[:32] == 0xAB).all() and (dst[32 + n :] == 0xAB).all()
    assert copy_crc_from(src.ctypes.data, dst.data[:0], 5) == 5
    assert copy_crc_from(src.ctypes.data, memoryview(b""), 5) == 5  # nothing to write
    with pytest.raises(ValueError, match="read-only"):
        copy_crc_from(src.ctypes.data, memoryview(bytes(8)), 0)
    with pytest.raises(ValueError, match="1-D view of bytes"):
        copy_crc_from(src.ctypes.data, memoryview(np.zeros(2, dtype=np.float32)), 0)


def test_copy_crc_views_copies_view_to_view_and_refuses_what_the_views_refuse(
    copy_path: str,
) -> None:
    """The codec's copy: exactly the destination view is written, the value is
    google-crc32c's (extended from the one given), and a destination that is
    read-only, shorter or not of bytes is refused before anything is written."""
    src = np.random.default_rng(3).integers(0, 256, 2 * BLOCK + 9, dtype=np.uint8)
    dst = np.full(len(src) + 64, 0xAB, dtype=np.uint8)
    n = len(src) - 5
    crc = copy_crc_views(src.data[5:], dst.data[32 : 32 + n], 0)
    assert crc == google_crc32c.value(src[5:].tobytes())
    assert np.array_equal(dst[32 : 32 + n], src[5:])
    assert (dst[:32] == 0xAB).all() and (dst[32 + n :] == 0xAB).all()
    head = google_crc32c.value(b"abc")
    assert copy_crc_views(src.data, dst.data[: len(src)], head) == google_crc32c.value(
        b"abc" + src.tobytes()
    )
    assert copy_crc_views(memoryview(b""), dst.data[:0], 5) == 5
    assert copy_crc_views(memoryview(b""), memoryview(b""), 5) == 5  # nothing to write
    before = dst.copy()
    with pytest.raises(ValueError, match="dst is read-only"):
        copy_crc_views(src.data[:8], memoryview(bytes(8)), 0)
    strided = np.zeros(4 * BLOCK, dtype=np.uint8)
    with pytest.raises(ValueError, match="dst must be a contiguous 1-D view"):
        copy_crc_views(src.data[: 2 * BLOCK], strided.data[::2], 0)
    assert not strided.any()
    with pytest.raises(ValueError, match="src has 9 bytes, dst 8"):
        copy_crc_views(src.data[:9], dst.data[:8], 0)
    with pytest.raises(ValueError, match="src must be a contiguous 1-D view"):
        copy_crc_views(memoryview(np.zeros(2, dtype=np.float32)), dst.data[:8], 0)
    assert np.array_equal(dst, before)


def test_both_copy_paths_take_the_same_arguments(copy_path: str) -> None:
    """On either path: a crc is any integer of 32 bits (numpy's too), views of bytes
    in different formats are refused as slice assignment refuses them, and a refusal
    comes before anything is written."""
    src = np.random.default_rng(4).integers(0, 256, BLOCK + 3, dtype=np.uint8)
    dst = np.zeros_like(src)
    expected = google_crc32c.extend(5, src.tobytes())
    assert copy_crc(src, dst, np.uint32(5)) == expected  # type: ignore[arg-type]
    assert copy_crc_views(src.data, dst.data, np.int64(5)) == expected  # type: ignore[arg-type]
    dst[:] = 0
    for bad, error in [(2**32, ValueError), (-1, ValueError), (1.0, TypeError)]:
        with pytest.raises(error):
            copy_crc(src, dst, bad)  # type: ignore[arg-type]
        with pytest.raises(error):
            copy_crc_views(src.data, dst.data, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="src has format 'b', dst 'B'"):
        copy_crc_views(src.data.cast("b"), dst.data, 0)
    assert not dst.any()


@pytest.fixture(params=["awscrt", "google-crc32c", "google-crc32c-python"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each implementation the module can fall back to, made the one in use."""
    name = request.param
    fast = crc32c_module._load_awscrt()
    raw = crc32c_module._load_crc32c_raw()
    if name == "awscrt" and fast is None:
        pytest.skip("awscrt is not importable here")
    if name == "google-crc32c" and raw is None:
        pytest.skip("google-crc32c has no C extension here")
    monkeypatch.setattr(crc32c_module, "_crc_fast", fast if name == "awscrt" else None)
    monkeypatch.setattr(crc32c_module, "_crc_raw", raw if name == "google-crc32c" else None)
    return str(name)


def test_every_implementation_gives_google_crc32c_values(
    implementation: str, copy_path: str
) -> None:
    """Which implementation runs changes speed only: each one's values, whole and
    extended piece by piece (pieces of any length, empty ones too), and copy_crc's
    copy and value are google-crc32c's."""
    data = np.random.default_rng(1).integers(0, 256, 2 * BLOCK + 12_345, dtype=np.uint8)
    expected = google_crc32c.value(data.tobytes())
    assert crc32c_module.crc32c_extend(0, data) == expected
    assert crc32c_module.crc32c_extend(7, data[:0]) == 7
    crc = 0
    for start, end in [(0, 1), (1, 1), (1, 5_000), (5_000, BLOCK + 3), (BLOCK + 3, len(data))]:
        crc = crc32c_module.crc32c_extend(crc, data[start:end])
    assert crc == expected
    dst = np.zeros_like(data)
    assert crc32c_module.copy_crc(data, dst, 0) == expected
    assert np.array_equal(dst, data)
    resumed = crc32c_module.copy_crc(
        data[BLOCK + 1 :], dst[BLOCK + 1 :], google_crc32c.value(data[: BLOCK + 1].tobytes())
    )
    assert resumed == expected
    dst[:] = 0
    assert crc32c_module.copy_crc_from(data.ctypes.data, dst.data, 0) == expected
    assert np.array_equal(dst, data)
    dst[:] = 0
    assert crc32c_module.copy_crc_views(data.data, dst.data, 0) == expected
    assert np.array_equal(dst, data)


def test_the_fastest_importable_implementation_is_the_one_in_use() -> None:
    """awscrt (a base dependency) is chosen where it imports, and then checksums run
    without the GIL."""
    if crc32c_module._load_awscrt() is None:
        pytest.skip("awscrt is not importable here")
    assert crc32c_module.IMPLEMENTATION == "awscrt"
    assert crc32c_module.CRC_RELEASES_GIL


# ------------------------------------------------------------------ the C extension


def _native_module() -> ModuleType:
    if _NATIVE is None:
        pytest.skip("the C extension rlfleet.common._copycrc is not built here (or no SSE4.2)")
    from rlfleet.common import _copycrc

    return _copycrc


def test_the_one_pass_copy_is_in_use_where_it_was_built() -> None:
    """Where the extension imports and the CPU has SSE4.2, the copies use it."""
    try:
        from rlfleet.common import _copycrc
    except ImportError:
        pytest.skip("the C extension rlfleet.common._copycrc is not built here")
    in_use = crc32c_module.COPY_IMPLEMENTATION
    assert in_use == ("native" if _copycrc.AVAILABLE else "blocks")


def test_one_pass_copy_matches_google_crc32c_at_every_lane_boundary() -> None:
    """Runs of three lanes and the tails after them (eight bytes, then single ones),
    at offsets that leave both sides unaligned, continuing a given crc: the bytes
    copied and the value are google-crc32c's, and nothing outside dst is written."""
    ext = _native_module()
    run = 3 * ext.LANE
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 3 * run + 64, dtype=np.uint8)
    for n in [0, 1, 7, 8, 9, 15, run - 1, run, run + 1, run + 8, 2 * run + 13, 3 * run]:
        for src_off, dst_off in [(0, 0), (3, 0), (0, 5), (7, 1)]:
            src = data[src_off : src_off + n]
            out = np.full(n + 16, 0xCD, dtype=np.uint8)
            dst = out[dst_off : dst_off + n]
            crc = int(rng.integers(0, 2**32))
            assert ext.copy_crc32c(dst, src, crc) == google_crc32c.extend(crc, src.tobytes())
            assert np.array_equal(dst, src)
            assert (out[:dst_off] == 0xCD).all() and (out[dst_off + n :] == 0xCD).all()


def test_one_pass_copy_moves_overlapping_views_like_memmove() -> None:
    """Two views of one buffer that overlap, either way round: the result is what
    memmove leaves, and the value is the CRC-32C of the bytes moved."""
    ext = _native_module()
    n = 3 * ext.LANE + 100
    for src_at, dst_at in [(50, 0), (0, 50)]:
        buf = (np.arange(n + 50) % 251).astype(np.uint8)
        moved = buf[src_at : src_at + n].tobytes()
        crc = ext.copy_crc32c(buf.data[dst_at : dst_at + n], buf.data[src_at : src_at + n], 0)
        assert buf[dst_at : dst_at + n].tobytes() == moved
        assert crc == google_crc32c.value(moved)


def test_one_pass_copy_refuses_what_it_cannot_do() -> None:
    """A read-only or shorter destination, a crc that is not a 32-bit value, or a
    source that is not a buffer: an error, and the destination untouched."""
    ext = _native_module()
    dst = bytearray(4)
    with pytest.raises(BufferError):
        ext.copy_crc32c(b"abcd", b"wxyz", 0)
    with pytest.raises(ValueError, match="src has 4 bytes, dst 3"):
        ext.copy_crc32c(memoryview(dst)[:3], b"wxyz", 0)
    with pytest.raises(ValueError, match="not a 32-bit value"):
        ext.copy_crc32c(dst, b"wxyz", 2**32)
    with pytest.raises(OverflowError):
        ext.copy_crc32c(dst, b"wxyz", -1)
    with pytest.raises(TypeError):
        ext.copy_crc32c(dst, "wxyz", 0)
    with pytest.raises(TypeError):
        ext.copy_crc32c(dst, b"wxyz", 1.0)
    assert dst == bytearray(4)
