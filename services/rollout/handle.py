"""What a submitted generation gives back: its samples as they finish.

:class:`SampleStream` is the queue between the thread that generates and the one
that reads; :class:`~rlfleet.rollout.core.GenerationHandle` (one turn) and
:class:`~rlfleet.rollout.multiturn.ConversationHandle` (conversations) are both one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator, Iterator
from typing import TypeAlias

from rlfleet.rollout.engine import SampleOutput

__all__ = ["DONE", "SampleStream"]


class _Done:
    pass


#: Put after the last sample: the stream ends.
DONE = _Done()

_Item: TypeAlias = SampleOutput | BaseException | _Done


class SampleStream:
    """Samples in the order they finish, then the end (or an error).

    Iteration raises the error the generation failed with, if any. Stopping early
    (or :meth:`cancel`) asks the generation to stop; iteration then ends after the
    samples that finished before (no error: the caller is the one who gave up).
    """

    def __init__(self) -> None:
        self._out: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()

    def _put(self, item: _Item) -> None:
        self._out.put(item)

    def __iter__(self) -> Iterator[SampleOutput]:
        groups = self.batches(1)
        try:
            for [sample] in groups:
                yield sample
        finally:
            groups.close()  # cancels: the caller stopped or the stream ended

    def batches(self, max_samples: int) -> Generator[list[SampleOutput], None, None]:
        """The samples as iteration gives them, grouped: each list holds the next
        sample (waited for) and those already finished behind it, at most
        ``max_samples``; an error is raised once the samples before it went out."""
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        try:
            pending: _Item | None = None
            while True:
                item = self._out.get() if pending is None else pending
                pending = None
                if isinstance(item, _Done):
                    return
                if isinstance(item, BaseException):
                    raise item
                group = [item]
                while len(group) < max_samples:
                    try:
                        nxt = self._out.get_nowait()
                    except queue.Empty:
                        break
                    if not isinstance(nxt, SampleOutput):
                        pending = nxt  # the end or an error: after this group
                        break
                    group.append(nxt)
                yield group
        finally:
            self.cancel()

    def result(self) -> list[SampleOutput]:
        """All samples, ordered by (prompt_index, sample_index)."""
        return sorted(self, key=lambda s: (s.prompt_index, s.sample_index))
