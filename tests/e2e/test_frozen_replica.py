"""A rollout replica that freezes mid-run (SIGSTOP: alive, silent) costs the run its
share of one step, not the run: the driver's liveness probe gives it up, its prompts
are re-queued on the other replica, the registry marks it dead (no heartbeats) so it
gets no work while frozen, and once it answers again (SIGCONT) it is adopted back with
the current weights. Every step trains its full batch."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from runlib import arithmetic, grpo_config

from rlfleet.common.config import config_from_dict
from rlfleet.driver.clients import remote_workers
from rlfleet.driver.loop import PPOTrainer, StepRecord
from rlfleet.launch.cluster import LocalCluster
from rlfleet.scheduler.client import RemoteSchedulerClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 6
BATCH = 4
N = 2


def test_a_frozen_replica_is_fenced_its_work_requeued_and_it_rejoins(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = arithmetic(tmp_path / "data")
    run_dir = tmp_path / "run"
    config = config_from_dict(
        grpo_config(
            tiny_model_dir,
            data,
            run_dir,
            rollout={"n": N, "replicas": 2},
            trainer={"total_training_steps": STEPS},
        )
    )
    with LocalCluster(config, run_dir, heartbeat_interval_s=0.5, grace_s=10) as cluster:
        h = cluster.start(timeout_s=180)
        assert h.scheduler is not None and len(h.rollout) == 2
        frozen = cluster.pids["rollout-1"]
        frozen_address = h.rollout[1]
        events: dict[str, float] = {}

        def alive() -> set[str]:
            with RemoteSchedulerClient(h.scheduler) as c:  # type: ignore[arg-type]
                return {e.spec.address for e in c.list_services("rollout", alive_only=True)}

        def on_step(record: StepRecord) -> None:
            if record.step == 1:
                os.kill(frozen, signal.SIGSTOP)
                events["stopped"] = time.monotonic()
            elif record.step == 3:
                # Fenced: the registry no longer lists it while it is frozen.
                events["alive_while_frozen"] = float(frozen_address in alive())
                os.kill(frozen, signal.SIGCONT)
                deadline = time.monotonic() + 60
                while frozen_address not in alive() and time.monotonic() < deadline:
                    time.sleep(0.2)
                events["alive_again"] = float(frozen_address in alive())

        mapping = remote_workers(h.trainer, h.rollout, h.reward)
        try:
            with PPOTrainer(
                config=config, role_worker_mapping=mapping, scheduler=h.scheduler, on_step=on_step
            ) as trainer:
                records = trainer.fit()
        finally:
            os.kill(frozen, signal.SIGCONT)  # never leave it stopped
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert all(len(r.indices) == BATCH for r in records)
    m = {r.step: r.metrics for r in records}
    # Step 2 lost the frozen replica mid-generation and re-queued its share.
    assert m[2]["rollout/requeued_samples"] > 0
    assert m[2]["rollout/replicas"] == 1.0
    assert events["alive_while_frozen"] == 0.0 and events["alive_again"] == 1.0
    # Back in the fleet after it answered again, with the current weights.
    assert m[STEPS]["rollout/replicas"] == 2.0
    assert m[STEPS]["staleness/max"] == 0.0


def test_a_frozen_reward_service_costs_a_wait_not_the_run(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The reward service freezes for 25 s mid-run: its client's liveness probe gives
    the call up, the driver retries (reward.retry_s) until it answers again."""
    import threading

    data = arithmetic(tmp_path / "data")
    run_dir = tmp_path / "run"
    config = config_from_dict(grpo_config(tiny_model_dir, data, run_dir, reward={"retry_s": 120}))
    with LocalCluster(config, run_dir, scheduler=False, grace_s=10) as cluster:
        h = cluster.start(timeout_s=180)
        reward = cluster.pids["reward"]
        thaw = threading.Timer(25.0, os.kill, (reward, signal.SIGCONT))

        def on_step(record: StepRecord) -> None:
            if record.step == 1:
                os.kill(reward, signal.SIGSTOP)
                thaw.start()

        mapping = remote_workers(h.trainer, h.rollout, h.reward)
        try:
            with PPOTrainer(config=config, role_worker_mapping=mapping, on_step=on_step) as t:
                records = t.fit()
        finally:
            thaw.cancel()
            os.kill(reward, signal.SIGCONT)
        assert cluster.pids["reward"] == reward  # the same process: frozen, not dead
    assert [r.step for r in records] == [1, 2, 3]
    assert [r.metrics["rollout/samples"] for r in records] == [BATCH * N] * 3
    assert any("reward:" in m and "retrying" in m for m in caplog.messages)
