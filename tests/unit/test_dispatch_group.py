"""Rank 0 of a trainer whose process group lost a rank (rlfleet.trainer.dispatch).

Two real processes in a gloo group on loopback; the follower leaves. An operation sent
to the group makes rank 0 exit with ``GROUP_BROKEN_EXIT`` (so its launcher restarts
the whole group and the driver sees the trainer gone), while a shutdown's release of
the followers just logs that one is already gone.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from rlfleet.trainer.dispatch import GROUP_BROKEN_EXIT

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    from rlfleet.trainer.dispatch import Dispatcher

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os._exit(0)  # the follower is gone
    time.sleep(1.0)
    dispatcher = Dispatcher(None)
    if sys.argv[1] == "stop":
        dispatcher.stop()
        print("released", flush=True)
    else:
        dispatcher.send("update_actor", None, {})
        print("sent", flush=True)
    # Leave without tearing down the broken group: gloo's threads may abort the
    # interpreter's own exit (std::terminate) under load, which is not under test.
    sys.stderr.flush()
    os._exit(0)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group(what: str) -> subprocess.CompletedProcess[str]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", SCRIPT, what],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out, err = procs[0].communicate(timeout=120)
    procs[1].wait(timeout=30)
    return subprocess.CompletedProcess(procs[0].args, procs[0].returncode, out, err)


@pytest.mark.timeout(180)
def test_an_operation_on_a_broken_group_ends_rank_0() -> None:
    done = _group("send")
    assert done.returncode == GROUP_BROKEN_EXIT, done.stderr[-2000:]
    assert "sent" not in done.stdout
    assert "a rank is gone" in done.stderr


@pytest.mark.timeout(180)
def test_releasing_followers_already_gone_is_no_error() -> None:
    done = _group("stop")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "released" in done.stdout and "already gone" in done.stderr
