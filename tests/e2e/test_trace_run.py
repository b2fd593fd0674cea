"""Traces of a real run: the driver's step spans and the services' spans (a rollout
replica, the reward service, the trainer, each its own process) join one trace per
step through the gRPC metadata; `rlfleet trace` prints the step's tree and critical
path and writes its timeline."""

from __future__ import annotations

from pathlib import Path

import pytest
from runlib import arithmetic, grpo_config

from rlfleet.cli import main
from rlfleet.common.config import config_from_dict
from rlfleet.driver.clients import remote_workers
from rlfleet.driver.loop import PPOTrainer
from rlfleet.launch.cluster import LocalCluster
from rlfleet.launch.trace_cli import load_spans, step_trace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_steps_spans_cross_every_service_and_rlfleet_trace_shows_them(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = arithmetic(tmp_path / "data", n=32)
    run_dir = tmp_path / "run"
    config = config_from_dict(
        grpo_config(tiny_model_dir, data, run_dir, trainer={"total_training_steps": 2})
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
        ("weight_push", "driver"),  # one per replica: which one a slow push waited on
    ]:
        assert (name, service) in seen, (name, service, sorted(seen))
    assert main(["trace", "--run", str(run_dir), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 2: ") and "critical path:" in out
    assert "rollout.generate" in out and "trainer.train_step" in out
    page = (run_dir / "traces" / "step-2.html").read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page and "trainer.update_actor" in page
    assert main(["trace", "--run", str(run_dir), "--step", "9"]) == 2
    capsys.readouterr()
    # One prompt's path: the replica and weights that generated it, its scoring, the
    # step that trained it.
    prompt = records[1].indices[0]
    assert main(["trace", "--run", str(run_dir), "--prompt", str(prompt)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"prompt {prompt}: step(s) [2], generated 1 time(s)")
    assert "generate.shard replica=rollout-0" in out and "weights v1" in out
    assert "reward samples=" in out and "train rows=8" in out
    assert main(["trace", "--run", str(run_dir), "--prompt", "100000"]) == 2
