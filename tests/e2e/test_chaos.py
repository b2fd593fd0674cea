"""Chaos on the local launcher: during one synchronous PPO run a scripted loop kills a
rollout replica, freezes another (and thaws it), kills the reward service and kills
the trainer, while the autoscaler moves the rollout count between 2 and 3. The run
finishes; every step trains its full batch on the prompts the data order gives it
(none lost, none trained twice); each fault shows in the run's metrics.

A fault-free run of the same config (two replicas, no autoscaler) gives the
reference: every prompt's samples are keyed by its place in the step's batch, not by
the replica or the shard that generates it, so a re-queued prompt is sampled as it
would have been; the trainer's restart redoes its steps bit for bit
(``test_trainer_recovery.py``). The two runs sample the same responses at every step
and end with the same weights, up to the float rounding of differently batched
forwards on the replicas (what is left: the log-probs the replicas report, which the
trainer uses only for the truncated importance weights, off here).
"""

from __future__ import annotations

import copy
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from runlib import Weights, arithmetic, checkpoint_weights, grpo_config, loader_order

from rlfleet.common.config import config_from_dict
from rlfleet.driver.clients import remote_workers
from rlfleet.driver.loop import PPOTrainer, StepRecord
from rlfleet.launch.cluster import LocalCluster
from rlfleet.launch.trace_cli import load_spans, prompt_path, step_trace
from rlfleet.scheduler.client import RemoteSchedulerClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# 10 steps in `make test`; `make test-chaos` runs 30 (RLFLEET_CHAOS_STEPS), the replica
# faults repeated every 10 steps.
STEPS = max(10, int(os.environ.get("RLFLEET_CHAOS_STEPS", "10")))
BATCH = 4


def _fault_free(chaos: dict[str, Any], run_dir: Path) -> tuple[list[StepRecord], Weights]:
    """The chaos run's config without the autoscaler, run without faults."""
    raw = copy.deepcopy(chaos)
    del raw["scheduler"]
    raw["trainer"]["default_local_dir"] = str(run_dir)
    config = config_from_dict(raw)
    with LocalCluster(config, run_dir, scheduler=False, grace_s=10) as cluster:
        h = cluster.start(timeout_s=180)
        mapping = remote_workers(h.trainer, h.rollout, h.reward)
        with PPOTrainer(config=config, role_worker_mapping=mapping) as trainer:
            records = trainer.fit()
    return records, checkpoint_weights(run_dir / "checkpoints" / f"global_step_{STEPS}")


def test_the_run_survives_replica_reward_and_trainer_faults_while_autoscaling(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # More prompts than the run trains: every step's are new ones.
    data = arithmetic(tmp_path / "data", n=4 * STEPS * BATCH, digits=2)
    run_dir = tmp_path / "run"
    raw = grpo_config(
        tiny_model_dir,
        data,
        run_dir,
        rollout={"replicas": 2},
        trainer={
            "total_training_steps": STEPS,
            "save_freq": 2,
            "recovery": {"enable": True, "wait_s": 180},
        },
        services={"max_restarts": 3, "restart_backoff_s": 0.2},
        scheduler={
            "autoscale": {
                "enable": True,
                "min_replicas": 2,
                "max_replicas": 3,
                # Generation is well above a tenth of a step here: one replica more
                # at the first measured step, then held at the maximum.
                "target_gen_share": 0.1,
                "cooldown_s": 0,
                "interval_s": 0.5,
            }
        },
    )
    config = config_from_dict(raw)
    with LocalCluster(config, run_dir, heartbeat_interval_s=0.5, grace_s=10) as cluster:
        h = cluster.start(timeout_s=180)
        frozen: list[int] = []
        done: list[str] = []

        def kill(name: str) -> None:
            os.kill(cluster.pids[name], signal.SIGKILL)

        def freeze() -> None:
            frozen.append(cluster.pids["rollout-1"])
            os.kill(frozen[-1], signal.SIGSTOP)

        # After step -> fault, each once (a step redone after the trainer's recovery
        # does not fire its fault again); the replica faults every 10 steps.
        script: dict[int, tuple[str, Callable[[], None]]] = {
            5: ("reward killed", lambda: kill("reward")),
            7: ("trainer killed", lambda: kill("trainer")),
        }
        for base in range(0, STEPS - 9, 10):
            script[base + 2] = ("rollout-0 killed", lambda: kill("rollout-0"))
            script[base + 4] = ("rollout-1 frozen", freeze)
            script[base + 6] = ("rollout-1 thawed", lambda: os.kill(frozen[-1], signal.SIGCONT))
        faults = len(script)

        def healed(replicas: int) -> None:
            """Wait (bounded) until ``replicas`` rollout replicas are registered alive: a
            fault on a fleet that has not yet replaced the last one may leave no replica
            at all, which no scheduling can survive."""
            deadline = time.monotonic() + 120
            with RemoteSchedulerClient(h.scheduler) as client:  # type: ignore[arg-type]
                while len(client.list_services("rollout", alive_only=True)) < replicas:
                    assert time.monotonic() < deadline, f"fewer than {replicas} replicas"
                    time.sleep(0.2)

        def chaos(record: StepRecord) -> None:
            if record.step in script:
                healed(2)
                what, act = script.pop(record.step)
                act()
                done.append(what)

        mapping = remote_workers(h.trainer, h.rollout, h.reward)
        try:
            with PPOTrainer(
                config=config,
                role_worker_mapping=mapping,
                scheduler=h.scheduler,
                on_step=chaos,
                fleet_metrics=cluster.fleet_metrics,
            ) as trainer:
                records = trainer.fit()
                expected = loader_order(trainer, STEPS)
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        restarts = dict(cluster.restarts)
    assert len(done) == faults, done
    # Every step once, in order, each with its full batch of the prompts the data
    # order gives it: nothing lost, nothing trained twice.
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert [r.indices for r in records] == expected
    m = {r.step: r.metrics for r in records}
    assert [m[s]["rollout/samples"] for s in m] == [BATCH * 2] * STEPS
    assert {"rollout-0", "reward", "trainer"} <= restarts.keys()
    assert m[STEPS]["fault/trainer_recoveries"] == 1.0
    assert m[STEPS]["fleet/scaled_up"] >= 1.0
    requeued = sum(m[s].get("rollout/requeued_samples", 0.0) for s in m)
    assert requeued > 0, "the killed or frozen replica's share was never re-queued"
    log = (run_dir / "logs" / "scheduler.log").read_text()
    assert "autoscale: rollout replicas 2 -> 3" in log
    # From the traces: each step's last attempt trained the data order's prompts, all
    # distinct within the epoch, and generated every sample of them.
    spans = load_spans(run_dir)
    trained = []
    for step in range(1, STEPS + 1):
        root = step_trace(spans, step)
        assert root is not None, f"no trace of step {step}"
        assert root.attributes["prompts"] == expected[step - 1]
        assert root.attributes["samples"] == BATCH * 2
        trained += root.attributes["prompts"]
    assert len(trained) == len(set(trained)) == STEPS * BATCH
    # Step 8, where the trainer was lost, has two attempts; the first ended in an error.
    attempts = [s for s in spans if s.name == "step" and s.attributes.get("step") == 8]
    assert len(attempts) == 2 and "error" in min(attempts, key=lambda s: s.start_ns).attributes

    # A prompt a failed replica held and the driver re-queued: its trace shows the
    # failed shard, the replica that generated it instead, its scoring and the step
    # that trained it.
    requeued_paths = []
    for shard in (s for s in spans if s.name == "generate.shard" and "error" in s.attributes):
        gen = next(s for s in spans if s.span_id == shard.parent_id)
        for place in shard.attributes["prompt_indices"]:
            attempts = prompt_path(spans, gen.attributes["prompts"][place])
            attempt = next(a for a in attempts if any(p is shard for p in a.parts))
            shards = [p for p in attempt.parts if p.name == "generate.shard"]
            if len(shards) >= 2:
                requeued_paths.append((shards, attempt, attempts))
    assert requeued_paths, "no re-queued prompt in the traces"
    for shards, attempt, attempts in requeued_paths:
        assert "error" in shards[0].attributes and "error" not in shards[-1].attributes
        assert shards[-1].attributes["replica"] != shards[0].attributes["replica"]
        assert any(p.name == "reward" for p in attempt.parts)
        assert any(p.name == "train" for p in attempts[-1].parts)

    # The fault-free reference: the same responses at every step (their lengths and
    # scores), the same weights at the end.
    clean, clean_weights = _fault_free(raw, tmp_path / "clean")
    assert [r.indices for r in clean] == expected
    for key in ("response_length/mean", "critic/score/mean"):
        assert [m[s][key] for s in m] == [r.metrics[key] for r in clean], key
    weights = checkpoint_weights(run_dir / "checkpoints" / f"global_step_{STEPS}")
    assert weights.keys() == clean_weights.keys()
    worst = max((weights[k] - clean_weights[k]).abs().max().item() for k in weights)
    print(f"chaos vs fault-free: largest weight difference {worst:.3g}")
    for name, tensor in clean_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5, msg=name)
