"""Run an iterator a few items ahead of its consumer, in a thread of its own.

A chunked sender builds chunk ``k + 1`` (copying tensor bytes, checksumming them)
while the consumer still works on chunk ``k``: gRPC sending it, or a receiver in the
same process copying it into place. Both halves copy with the GIL released
(``np.copyto``, CRC-32C through ``ctypes``), so on two cores they overlap instead of
taking turns.

The producer is bounded (at most ``depth`` finished items wait, plus the one being
made), an error it raises reaches the consumer at the item where it happened, and a
consumer that stops early (``close()``, garbage collection, an exception) stops the
producer and closes the source iterator before the generator returns.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar, cast

__all__ = ["read_ahead"]

T = TypeVar("T")

#: How often a blocked producer looks whether the consumer has gone, in seconds.
_POLL_S = 0.05


class _End:
    """The producer's last item: the source ended, or raised ``error``."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


def read_ahead(items: Iterable[T], depth: int = 1, *, name: str = "read-ahead") -> Iterator[T]:
    """Yield the items of ``items`` in order, produced by a daemon thread named
    ``name`` that runs at most ``depth`` items ahead (``depth >= 1``). The thread
    starts at the first ``next()``: an iterator never started holds none."""
    if depth < 1:
        raise ValueError(f"read_ahead depth must be >= 1, got {depth}")
    return _run(iter(items), depth, name)


def _run(source: Iterator[T], depth: int, name: str) -> Iterator[T]:
    ready: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in source:
                if not put(item):
                    return
            put(_End(None))
        except BaseException as e:  # handed to the consumer, raised there
            put(_End(e))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    worker = threading.Thread(target=produce, name=name, daemon=True)
    worker.start()
    try:
        while True:
            item = ready.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield cast(T, item)
    finally:
        stop.set()
        worker.join()
