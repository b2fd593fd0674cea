"""The C allocator of a service process: one glibc malloc arena.

A service does its heavy work (a training step, a generation) in a gRPC handler
thread, not the main thread. glibc gives such threads malloc arenas of their own,
made of 64 MiB heaps that it shrinks (``MADV_DONTNEED``) when their top is free and
grows again on the next large allocation: every regrown page faults in anew. Measured
on the trainer service (tiny model, GRPO 64 x 4, `bench/ppo_step.py
--service-overhead`): one step in five to nine took 1.6 to 2.0 s instead of 1.1 s,
the extra time all CPU in the forward pass, which the same step run in a main thread
never showed; with one arena, none of 36 steps did. Python threads take turns at the
GIL anyway, so one arena costs them no parallelism worth having.

:func:`use_one_arena` is called first thing by every service's ``serve_main``, before
the process starts threads (an arena is a thread's from its first allocation on). A
``MALLOC_ARENA_MAX`` in the environment is the operator's choice and is left alone,
as is any C library other than glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os

__all__ = ["use_one_arena"]

logger = logging.getLogger(__name__)

#: glibc's ``mallopt`` parameter for the most arenas (``M_ARENA_MAX`` in malloc.h).
_M_ARENA_MAX = -8


def use_one_arena() -> bool:
    """Limit glibc malloc to one arena for the threads started from now on. True if
    set; False where ``MALLOC_ARENA_MAX`` is set or the C library is not glibc."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: AttributeError elsewhere
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_ARENA_MAX, 1) == 1
    if not ok:  # pragma: no cover - glibc refuses only a bad parameter
        logger.warning("mallopt(M_ARENA_MAX, 1) failed: each thread keeps its own arena")
    return ok
