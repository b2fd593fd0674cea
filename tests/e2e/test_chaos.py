"""Chaos on the local launcher: during one synchronous PPO run a scripted loop kills a
rollout replica, freezes another (and thaws it), kills the reward service and kills
the trainer, and an operator scales the fleet down to one replica, while the
autoscaler moves the rollout count between 1 and 3 (up from one at the start, and up
again after the operator's scale-down). The run
finishes; every step trains its full batch on the prompts the data order gives it
(none lost, none trained twice); each fault shows in the run's metrics.

A fault-free run of the same config (one replica, no autoscaler) gives the
reference: every prompt's samples are keyed by its place in the step's batch, not by
the replica or the shard that generates it, so a re-queued prompt is sampled as it
would have been; the trainer's restart redoes its steps bit for bit
(``test_trainer_recovery.py``). The two runs sample the same responses at every step
and end with the same weights, up to the float rounding of differently batched
forwards on the replicas (what is left: the log-probs the replicas report, which the
trainer uses only for the truncated importance weights, off here).
"""

from __future__ import annotations

import contextlib
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
# faults and the scale-down repeated every 10 steps.
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
        rollout={"replicas": 1},
        trainer={
            "total_training_steps": STEPS,
            "save_freq": 2,
            "recovery": {"enable": True, "wait_s": 180},
        },
        services={"max_restarts": 3, "restart_backoff_s": 0.2},
        scheduler={
            "autoscale": {
                "enable": True,
                "min_replicas": 1,
                "max_replicas": 3,
                # Generation is well above 5% of a step here: one replica more
                # at each measured step up to the maximum, and again after the
                # operator's scale-down.
                "target_gen_share": 0.05,
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
        fleet: list[int] = []  # rollout replicas alive after each step

        def kill(name: str) -> None:
            os.kill(cluster.pids[name], signal.SIGKILL)

        def freeze() -> None:
            """SIGSTOP rollout-0: the one replica the launcher surely has up (a newer one
            may still be in its start-up checks, which a freeze would fail)."""
            frozen.append(cluster.pids["rollout-0"])
            os.kill(frozen[-1], signal.SIGSTOP)

        def scale_to_one() -> None:
            """What `rlfleet scale rollout 1` does, then wait (bounded) for the drain."""
            deadline = time.monotonic() + 120
            with RemoteSchedulerClient(h.scheduler) as client:  # type: ignore[arg-type]
                client.set_scale("rollout", 1)
                # The newest leave first: rollout-0 (restarted after its kill, maybe
                # still starting) stays, and is the one replica listed alive.
                while (
                    cluster.rollout_replicas() != ["rollout-0"]
                    or len(client.list_services("rollout", alive_only=True)) != 1
                ):
                    assert time.monotonic() < deadline, (
                        f"the fleet did not drain to rollout-0: {cluster.rollout_replicas()}"
                    )
                    time.sleep(0.1)
            fleet.append(1)

        # After step -> (fault, replicas it needs alive first), each once (a step
        # redone after the trainer's recovery does not fire its fault again); the
        # replica faults and the scale-down every 10 steps.
        script: dict[int, tuple[str, Callable[[], None], int]] = {
            5: ("reward killed", lambda: kill("reward"), 1),
            7: ("trainer killed", lambda: kill("trainer"), 1),
        }
        for base in range(0, STEPS - 9, 10):
            script[base + 2] = ("rollout-0 killed", lambda: kill("rollout-0"), 2)
            script[base + 3] = ("scaled down to one replica", scale_to_one, 1)
            script[base + 4] = ("rollout-0 frozen", freeze, 2)
            thaw = lambda: os.kill(frozen[-1], signal.SIGCONT)  # noqa: E731
            script[base + 6] = ("rollout-0 thawed", thaw, 1)
            # Not a fault: the autoscaler's way back up to max_replicas, waited for.
            script[base + 8] = ("three replicas serving", lambda: None, 3)
        faults = len(script)

        def healed(replicas: int) -> None:
            """Wait (bounded) until ``replicas`` rollout replicas are registered alive: a
            replica fault on a fleet that has not yet replaced the last one may leave no
            replica at all, which no scheduling can survive. (The autoscaler adds the
            second after a step measured with one: it saw this step's status.)"""
            deadline = time.monotonic() + 120
            with RemoteSchedulerClient(h.scheduler) as client:  # type: ignore[arg-type]
                while len(client.list_services("rollout", alive_only=True)) < replicas:
                    assert time.monotonic() < deadline, (
                        f"fewer than {replicas} replicas: {client.training_status()}, "
                        f"scale {client.scale('rollout')}"
                    )
                    time.sleep(0.2)

        def chaos(record: StepRecord) -> None:
            with RemoteSchedulerClient(h.scheduler) as client:  # type: ignore[arg-type]
                fleet.append(len(client.list_services("rollout", alive_only=True)))
            if record.step in script:
                what, act, need = script.pop(record.step)
                healed(need)
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
                with contextlib.suppress(ProcessLookupError):  # ended meanwhile
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
    assert m[STEPS]["fleet/scaled_up"] >= 3.0  # 1 -> 2, and 1 -> 2 -> 3 after the drain
    assert m[STEPS]["fleet/scaled_down"] >= 1.0
    assert min(fleet) == 1 and max(fleet) == 3, fleet
    requeued = sum(m[s].get("rollout/requeued_samples", 0.0) for s in m)
    assert requeued > 0, "the killed or frozen replica's share was never re-queued"
    log = (run_dir / "logs" / "scheduler.log").read_text()
    for change in ("1 -> 2", "2 -> 3"):
        assert f"autoscale: rollout replicas {change}" in log, change
    assert "rollout replicas set to 1 from outside" in log
    assert log.count("autoscale: rollout replicas 1 -> 2") >= 2  # after the drain too
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
