"""One malloc arena for a service process (rlfleet.common.allocator): counted by
glibc's own ``malloc_stats`` in a fresh process whose threads allocate."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

# Four threads allocate, then glibc lists its arenas ("Arena N:" lines on stderr).
SCRIPT = """
import ctypes, sys, threading
from rlfleet.common.allocator import use_one_arena
if sys.argv[1] == "set":
    print("set", use_one_arena(), flush=True)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
ready, done = threading.Barrier(5), threading.Event()
def work():
    kept = [libc.malloc(1000) for _ in range(100)]
    ready.wait()
    done.wait()
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
ready.wait()
libc.malloc_stats()
done.set()
for t in threads:
    t.join()
"""


def _glibc() -> bool:
    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except AttributeError:
        return False
    return True


def _arenas(mode: str, env: dict[str, str]) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )
    arenas = sum(line.startswith("Arena ") for line in out.stderr.splitlines())
    return arenas, out.stdout.strip()


@pytest.mark.skipif(not _glibc(), reason="malloc arenas are glibc's")
def test_threads_share_one_arena() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    default, _ = _arenas("leave", env)
    assert default > 1  # glibc's default: threads get arenas of their own
    one, said = _arenas("set", env)
    assert said == "set True"
    assert one == 1


@pytest.mark.skipif(not _glibc(), reason="malloc arenas are glibc's")
def test_operator_setting_is_kept() -> None:
    env = {**os.environ, "MALLOC_ARENA_MAX": "3"}
    arenas, said = _arenas("set", env)
    assert said == "set False"
    assert arenas == 3
