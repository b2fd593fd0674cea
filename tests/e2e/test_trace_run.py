"""Traces of a real run: the driver's step spans and the services' spans (a rollout
replica, the reward service, the trainer, each its own process) join one trace per
step through the gRPC metadata; `rlfleet trace` prints the step's tree and critical
path and writes its timeline."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.cli import main
from rlfleet.common.config import config_from_dict
from rlfleet.driver.clients import remote_workers
from rlfleet.driver.data.preprocess import preprocess
from rlfleet.driver.loop import PPOTrainer
from rlfleet.launch.cluster import LocalCluster
from rlfleet.launch.trace_cli import load_spans, step_trace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_steps_spans_cross_every_service_and_rlfleet_trace_shows_them(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    preprocess("arithmetic", None, data, n=32, n_test=4, digits=1, ops="+-*", seed=0)
    run_dir = tmp_path / "run"
    config = config_from_dict(
        {
            "data": {
                "train_files": str(data / "train.parquet"),
                "val_files": str(data / "test.parquet"),
                "train_batch_size": 4,
                "max_prompt_length": 64,
                "max_response_length": 8,
            },
            "actor": {"model_path": str(tiny_model_dir), "ppo_mini_batch_size": 4},
            "rollout": {"n": 2},
            "algorithm": {"adv_estimator": "grpo"},
            "reward": {"num_workers": 1},
            "trainer": {
                "total_training_steps": 2,
                "test_freq": -1,
                "save_freq": -1,
                "default_local_dir": str(run_dir),
                "resume_mode": "disable",
                "logger": ["jsonl"],
                "val_before_train": False,
            },
            "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
            "mapping": {"actor": "train_pool", "rollout": "rollout_pool"},
        }
    )
    with LocalCluster(config, run_dir, scheduler=False) as cluster:
        h = cluster.start(timeout_s=180)
        mapping = remote_workers(h.trainer, h.rollout, h.reward)
        with PPOTrainer(config=config, role_worker_mapping=mapping) as trainer:
            records = trainer.fit()
    root = step_trace(load_spans(run_dir), 2)
    assert root is not None
    assert root.attributes["prompts"] == records[1].indices
    assert root.attributes["samples"] == 8

    def names(span: object) -> set[tuple[str, str]]:
        out = {(span.name, span.service)}  # type: ignore[attr-defined]
        for c in span.children:  # type: ignore[attr-defined]
            out |= names(c)
        return out

    seen = names(root)
    # The driver's phases, and inside them the services' own spans, in one tree.
    for name, service in [
        ("generate", "driver"),
        ("generate.shard", "driver"),
        ("rollout.generate", "rollout-0"),
        ("reward", "driver"),
        ("reward.score", "reward"),
        ("train", "driver"),
        ("trainer.train_step", "trainer"),
        ("trainer.update_actor", "trainer"),
        ("weight_sync", "driver"),
    ]:
        assert (name, service) in seen, (name, service, sorted(seen))
    assert main(["trace", "--run", str(run_dir), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 2: ") and "critical path:" in out
    assert "rollout.generate" in out and "trainer.train_step" in out
    page = (run_dir / "traces" / "step-2.html").read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page and "trainer.update_actor" in page
    assert main(["trace", "--run", str(run_dir), "--step", "9"]) == 2
