"""read_ahead: order, bounds, errors and early stops of the thread that runs ahead."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from rlfleet.common.codec import wire
from rlfleet.common.readahead import read_ahead


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_items_arrive_in_order_and_the_thread_ends() -> None:
    assert list(read_ahead(range(100), 3, name="ra-order")) == list(range(100))
    assert _threads("ra-order") == []


def test_the_producer_runs_at_most_depth_plus_one_ahead() -> None:
    made: list[int] = []

    def source() -> Iterator[int]:
        for i in range(50):
            made.append(i)
            yield i

    it = read_ahead(source(), 2, name="ra-bound")
    assert next(it) == 0
    # Item 0 taken, items 1 and 2 waiting in the queue, item 3 made and blocked.
    deadline = time.monotonic() + 10
    while len(made) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # time for an unbounded producer to run on
    assert len(made) == 4
    it.close()


def test_an_error_reaches_the_consumer_after_the_items_before_it() -> None:
    def source() -> Iterator[int]:
        yield 1
        yield 2
        raise KeyError("boom")

    got = []
    with pytest.raises(KeyError, match="boom"):
        for x in read_ahead(source(), 1, name="ra-error"):
            got.append(x)
    assert got == [1, 2]
    assert _threads("ra-error") == []


def test_closing_early_stops_the_producer_and_closes_the_source() -> None:
    closed = threading.Event()

    def source() -> Iterator[int]:
        try:
            yield from range(1_000_000)
        finally:
            closed.set()

    it = read_ahead(source(), 1, name="ra-close")
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.close()
    assert closed.is_set()
    assert _threads("ra-close") == []


def test_an_iterator_never_started_starts_no_thread() -> None:
    it = read_ahead(range(10), 1, name="ra-lazy")
    assert _threads("ra-lazy") == []
    del it


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
        read_ahead(range(3), 0)


def test_chunks_built_ahead_are_the_chunks_built_in_line() -> None:
    batch = {
        "w": torch.randn(300_000),
        "h": torch.randn(70_000).to(torch.bfloat16),
        "ids": torch.arange(5_000),
    }
    inline = list(wire.iter_chunk_bytes(batch, {"m": "1"}, max_chunk_bytes=200_000, stream_id="s"))
    ahead = list(
        wire.iter_chunk_bytes(batch, {"m": "1"}, max_chunk_bytes=200_000, stream_id="s", ahead=True)
    )
    assert len(ahead) > 5
    assert ahead == inline
    values, meta = wire.assemble_chunks(ahead)
    assert meta == {"m": "1"}
    assert all(torch.equal(values[k], v) for k, v in batch.items())
    assert _threads("codec-encode") == []
