"""``kill_leftovers``: what a dead service left in its process group is killed before
the launchers restart it (vLLM's engine-core and worker processes outlive a killed
replica; here a plain child stands in for them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlfleet.launch.cluster import kill_leftovers

# A leader that starts a child which ignores its parent's death, then waits.
LEADER = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print('up', flush=True)\n"
    "time.sleep(120)\n"
)


def _live_members(pgid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            out.append(int(stat.parent.name))
    return out


def test_what_a_dead_leader_left_is_killed() -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert leader.stdout is not None and leader.stdout.readline().strip() == "up"
        os.kill(leader.pid, signal.SIGKILL)  # the leader alone
        leader.wait(timeout=10)
        assert _live_members(leader.pid), "the child should have outlived its leader"
        assert kill_leftovers(leader.pid, "service") is True
        deadline = time.monotonic() + 10
        while _live_members(leader.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _live_members(leader.pid) == []
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait(timeout=10)


def test_a_leader_that_left_nothing() -> None:
    leader = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    assert leader.wait(timeout=30) == 0
    assert kill_leftovers(leader.pid, "service") is False


# A leader whose child maps a shared-memory file (as vLLM's engine-core maps its
# message queues), with the resource tracker that would unlink it in the same group.
SHM_LEADER = (
    "import subprocess, sys, time\n"
    "child = (\n"
    "    'from multiprocessing import shared_memory; import time\\n'\n"
    "    's = shared_memory.SharedMemory(create=True, size=1 << 20)\\n'\n"
    "    'print(s.name, flush=True); time.sleep(120)\\n'\n"
    ")\n"
    "p = subprocess.Popen([sys.executable, '-c', child], stdout=subprocess.PIPE, text=True)\n"
    "print(p.stdout.readline().strip(), flush=True)\n"
    "time.sleep(120)\n"
)


def test_shared_memory_only_the_killed_processes_mapped_is_removed() -> None:
    """The resource tracker that would unlink a dead service's segments dies in the
    same SIGKILL: its files stayed in /dev/shm (vLLM's, hundreds of MB a replica,
    after each restart). Files another live process maps stay."""
    from multiprocessing import shared_memory

    mine = shared_memory.SharedMemory(create=True, size=4096)
    leader = subprocess.Popen(
        [sys.executable, "-c", SHM_LEADER],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert leader.stdout is not None
        name = leader.stdout.readline().strip()
        assert (Path("/dev/shm") / name).exists()
        os.kill(leader.pid, signal.SIGKILL)  # the leader alone
        leader.wait(timeout=10)
        assert kill_leftovers(leader.pid, "service") is True
        assert not (Path("/dev/shm") / name).exists()
        assert (Path("/dev/shm") / mine.name).exists()
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait(timeout=10)
        mine.close()
        mine.unlink()
