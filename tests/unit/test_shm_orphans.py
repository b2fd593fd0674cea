"""Shared-memory segments whose replica died with its resource tracker (its process
group SIGKILLed) are removed when a bulk plane starts; those of live owners stay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.weightsync import shm

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm here")

_OWNER = """
import sys, time
from rlfleet.weightsync import shm
s = shm.create_segment(1 << 16)
print(s.name, flush=True)
time.sleep(120)
"""


def _orphan() -> str:
    """A segment whose owner and its resource tracker were SIGKILLed together."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().decode().strip()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    return name


def test_a_dead_owners_segment_is_removed_and_a_live_ones_kept() -> None:
    name = _orphan()
    assert name.startswith("rlfleet_")
    assert (Path("/dev/shm") / name).exists()  # the tracker died too: nothing removed it
    mine = shm.create_segment(1 << 16)
    try:
        removed = shm.remove_orphans()
        assert name in removed and not (Path("/dev/shm") / name).exists()
        assert mine.name not in removed and (Path("/dev/shm") / mine.name).exists()
    finally:
        shm.destroy_segment(mine)


def test_segments_without_an_owner_record_are_left_alone() -> None:
    """A segment of that name that this module did not record (another tool's, or
    one of an older release) is not ours to remove."""
    from multiprocessing import shared_memory

    other = shared_memory.SharedMemory(name="rlfleet_" + "0f" * 8, create=True, size=4096)
    try:
        assert other.name not in shm.remove_orphans()
        assert (Path("/dev/shm") / other.name).exists()
    finally:
        shm.destroy_segment(other)
