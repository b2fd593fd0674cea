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
