"""The trainer dies mid-run and the run goes on (``trainer.recovery``).

Two runs on fresh local clusters (every service a real process over gRPC), the same
config and seeds, synchronous and on-policy: one fault-free; in the other the trainer
process is SIGKILLed right after step 3. The launcher restarts it on its address, the
driver restores the step-2 checkpoint into it, pushes its weights to the rollout
replica (which kept running) and redoes step 3. Both runs train the same prompts in
the same order, and their step-4 checkpoints hold the same weights.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from runlib import arithmetic, checkpoint_weights, grpo_config

from rlfleet.common.config import config_from_dict
from rlfleet.driver.clients import remote_workers
from rlfleet.driver.loop import PPOTrainer, StepRecord
from rlfleet.launch.cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 4


def _raw(model: Path, data: Path, run_dir: Path) -> dict[str, Any]:
    return grpo_config(
        model,
        data,
        run_dir,
        trainer={
            "total_training_steps": STEPS,
            "save_freq": 2,
            "recovery": {"enable": True, "wait_s": 180},
        },
        services={"max_restarts": 2, "restart_backoff_s": 0.2},
    )


def _run(
    model: Path,
    data: Path,
    run_dir: Path,
    *,
    kill_after: int | None,
    wait_back: bool = False,
    overrides: tuple[str, ...] = (),
    freeze: bool = False,
) -> tuple[list[StepRecord], dict[str, torch.Tensor], LocalCluster, int]:
    config = config_from_dict(_raw(model, data, run_dir), list(overrides))
    with LocalCluster(config, run_dir, scheduler=False, grace_s=10) as cluster:
        h = cluster.start(timeout_s=180)
        first_pid = cluster.pids["trainer"]

        def on_step(record: StepRecord) -> None:
            if record.step == kill_after and cluster.pids["trainer"] == first_pid:
                os.kill(first_pid, signal.SIGSTOP if freeze else signal.SIGKILL)
                if wait_back:  # the next step's call reaches the fresh trainer
                    deadline = time.monotonic() + 120
                    while cluster.pids["trainer"] == first_pid or not _serving(h.trainer):
                        assert time.monotonic() < deadline, "the trainer was not restarted"
                        time.sleep(0.1)

        mapping = remote_workers(h.trainer, h.rollout, h.reward)
        with PPOTrainer(
            config=config,
            role_worker_mapping=mapping,
            on_step=on_step,
            kill_trainer=cluster.kill_trainer,
        ) as t:
            records = t.fit()
        pid = cluster.pids["trainer"]
    weights = checkpoint_weights(run_dir / "checkpoints" / f"global_step_{STEPS}")
    return records, weights, cluster, pid - first_pid


def _serving(address: str) -> bool:
    from rlfleet.common.rpc import check_health, create_channel

    channel = create_channel(address, retry_unavailable=False)
    try:
        return check_health(channel, timeout_s=1.0)
    finally:
        channel.close()


@pytest.fixture(scope="module")
def clean_run(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[StepRecord], dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("recovery")
    data = arithmetic(root / "data")
    clean, weights, _, _ = _run(tiny_model_dir, data, root / "clean", kill_after=None)
    return data, clean, weights


# wait_back: the driver's next call finds the trainer already restarted (fresh: step 0)
# rather than gone; it must notice from the step counter, not from an error.
@pytest.mark.parametrize("wait_back", [False, True], ids=["gone", "already-back"])
def test_a_killed_trainer_is_restarted_and_the_run_finishes_as_without_the_fault(
    tiny_model_dir: Path,
    tmp_path: Path,
    clean_run: tuple[Path, list[StepRecord], dict[str, torch.Tensor]],
    wait_back: bool,
) -> None:
    data, clean, clean_weights = clean_run
    records, weights, cluster, pid_moved = _run(
        tiny_model_dir, data, tmp_path / "fault", kill_after=3, wait_back=wait_back
    )
    assert pid_moved != 0 and cluster.restarts == {"trainer": 1}
    # Every step once, in order, each with its full batch; the same prompts as the
    # fault-free run (step 3 was redone from the step-2 checkpoint).
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert [r.indices for r in records] == [r.indices for r in clean]
    last = records[-1].metrics
    assert last["fault/trainer_recoveries"] == 1.0
    assert last["fault/redone_steps"] == 1.0
    assert last["fault/trainer_recovery_s"] > 0
    assert "fault/trainer_recoveries" not in clean[-1].metrics
    # The same weights as without the fault.
    assert weights.keys() == clean_weights.keys()
    for name, tensor in clean_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)
    log = (tmp_path / "fault" / "metrics.jsonl").read_text().splitlines()
    # Each step once, as on a resume: the record of step 3 before the fault, whose
    # update the restored trainer lost, went when the step was redone.
    assert [json.loads(line)["step"] for line in log] == list(range(1, STEPS + 1))


def test_a_pipelined_run_recovers_from_the_trainers_death(
    tiny_model_dir: Path,
    tmp_path: Path,
    clean_run: tuple[Path, list[StepRecord], dict[str, torch.Tensor]],
) -> None:
    """Pipelined (max_staleness 1): the pipeline starts again at the restored step
    (2), same data order. Step 4's batch, generated with step 2's weights while step 3
    trained, is kept and trained at step 4 after step 3 is redone; its staleness is the
    same 1 it would have had without the fault."""
    data, clean, _ = clean_run
    records, _, cluster, pid_moved = _run(
        tiny_model_dir,
        data,
        tmp_path / "fault",
        kill_after=3,
        overrides=("trainer.pipeline.enable=true",),
    )
    assert pid_moved != 0 and cluster.restarts == {"trainer": 1}
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert [r.indices for r in records] == [r.indices for r in clean]
    last = records[-1].metrics
    assert last["fault/trainer_recoveries"] == 1.0
    assert last["fault/kept_batches"] == 1.0 and last["fault/dropped_batches"] == 0.0
    assert last["staleness/max"] == 1.0


def test_a_frozen_trainer_is_killed_restarted_and_the_run_finishes_as_without_the_fault(
    tiny_model_dir: Path,
    tmp_path: Path,
    clean_run: tuple[Path, list[StepRecord], dict[str, torch.Tensor]],
) -> None:
    """SIGSTOP, not SIGKILL: the trainer is alive and answers nothing. The driver's
    call gives up on it (liveness probes), and once it has not answered for
    ``trainer.recovery.kill_after_s`` the driver has the launcher kill it; it is
    restarted and the run ends with the fault-free run's weights."""
    data, clean, clean_weights = clean_run
    records, weights, cluster, pid_moved = _run(
        tiny_model_dir,
        data,
        tmp_path / "fault",
        kill_after=3,
        freeze=True,
        overrides=("trainer.recovery.kill_after_s=2",),
    )
    assert pid_moved != 0 and cluster.restarts == {"trainer": 1}
    assert cluster.events["killed"] == 1
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert [r.indices for r in records] == [r.indices for r in clean]
    assert records[-1].metrics["fault/trainer_recoveries"] == 1.0
    for name, tensor in clean_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)
