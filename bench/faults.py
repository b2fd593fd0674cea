"""How fast the fleet notices a fault and is whole again, on the local launcher
(docs/fault-tolerance.md). Prints one JSON object.

    .venv/bin/python bench/faults.py [--rounds 2]

Real processes on loopback with auth on (the tiny model, CPU): a scheduler, two
rollout replicas, the reward service, and a health-only stand-in for the trainer
(not involved in these faults). Per round it measures, in seconds:

* ``replica_killed_to_serving``: SIGKILL a replica -> the launcher has restarted it on
  its address and it answers health checks (``services.restart_backoff_s`` included);
* ``replica_frozen_call_failed``: SIGSTOP a replica during a ``Generate`` -> the
  client's liveness probe fails the call (``Unavailable`` naming the replica);
* ``replica_frozen_registry_dead``: SIGSTOP -> the scheduler lists it dead (missed
  heartbeats), so the driver's next membership refresh leaves it out;
* ``replica_resumed_registry_alive``: SIGCONT -> listed alive again (it is adopted back
  with the current weights at the next step);
* ``scale_up_to_serving``: the desired count raised by one -> the new replica is
  registered and alive;
* ``reward_killed_to_serving``: SIGKILL the reward service -> restarted on its
  address and answering health checks;
* ``reward_frozen_call_failed``: a ``Score`` call to a reward service stopped with
  SIGSTOP -> the client's liveness probe fails the call (its health checks every
  ``connect_timeout_s``, 5 s by default).

The trainer's death inside a training run is measured by
``tests/e2e/test_trainer_recovery.py`` (its ``fault/trainer_recovery_s`` metric).
There is no baseline to divide by: these are latencies of the mechanisms, reported
with the settings that bound them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HEARTBEAT_S = 0.5
LIVENESS_S = 1.0


def _until(what: str, ok: Callable[[], bool], timeout_s: float = 120.0) -> float:
    t0 = time.monotonic()
    while not ok():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


def _round(
    cluster: Any,
    address: str,
    sched: Any,
    alive: Callable[[], set[str]],
    healthy: Callable[[str], bool],
    note: Callable[[str, float], None],
) -> None:
    from rlfleet.common.errors import Unavailable
    from rlfleet.rollout.client import RemoteRolloutClient
    from rlfleet.rollout.engine import SamplingParams

    name = "rollout-1"
    # A killed replica, restarted on its address by the launcher.
    pid = cluster.pids[name]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    _until("restart", lambda: cluster.pids.get(name, pid) != pid and healthy(address))
    note("replica_killed_to_serving", time.monotonic() - t0)
    _until("re-registered", lambda: address in alive())

    # A frozen replica, during a generation and in the registry.
    pid = cluster.pids[name]
    client = RemoteRolloutClient(address, liveness_s=LIVENESS_S)
    failed: dict[str, float] = {}
    started = threading.Event()

    def generate() -> None:
        params = SamplingParams(n=8, max_tokens=256, ignore_eos=True)
        try:
            for _ in client.generate([[1, 2, 3]] * 32, params):
                started.set()
        except Unavailable:
            failed["t"] = time.monotonic()

    worker = threading.Thread(target=generate, daemon=True)
    worker.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        worker.join(60)
        if "t" in failed:
            note("replica_frozen_call_failed", failed["t"] - t0)
        _until("listed dead", lambda: address not in alive())
        note("replica_frozen_registry_dead", time.monotonic() - t0)
    finally:
        os.kill(pid, signal.SIGCONT)
    t0 = time.monotonic()
    _until("listed alive", lambda: address in alive())
    note("replica_resumed_registry_alive", time.monotonic() - t0)
    client.close()

    # Scale up by one: the launcher starts it, it registers; then back.
    before = len(alive())
    t0 = time.monotonic()
    sched.set_scale("rollout", before + 1)
    _until("scaled up", lambda: len(alive()) == before + 1)
    note("scale_up_to_serving", time.monotonic() - t0)
    sched.set_scale("rollout", before)
    _until("scaled down", lambda: len(alive()) == before)


def _reward_round(
    cluster: Any, address: str, healthy: Callable[[str], bool], note: Callable[[str, float], None]
) -> None:
    from rlfleet.common.errors import RlfleetError
    from rlfleet.reward.client import RemoteRewardClient

    pid = cluster.pids["reward"]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    _until("reward restarted", lambda: cluster.pids.get("reward", pid) != pid and healthy(address))
    note("reward_killed_to_serving", time.monotonic() - t0)

    pid = cluster.pids["reward"]
    sample = {"data_source": "openai/gsm8k", "response": "#### 4", "ground_truth": "4"}
    with RemoteRewardClient(address) as client:
        assert client.score([sample])[0].score == 1.0  # connected and answering
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            client.score([sample], timeout_s=120.0)
            raise AssertionError("a frozen reward service answered")
        except RlfleetError:
            note("reward_frozen_call_failed", time.monotonic() - t0)
        finally:
            os.kill(pid, signal.SIGCONT)
    _until("reward answers again", lambda: healthy(address))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)

    from rlfleet.common.config import config_from_dict
    from rlfleet.common.rpc import check_health, create_channel, create_server
    from rlfleet.common.tiny_model import build_tiny_model
    from rlfleet.launch.cluster import LocalCluster
    from rlfleet.scheduler.client import RemoteSchedulerClient

    results: dict[str, list[float]] = {}

    def note(key: str, value: float) -> None:
        results.setdefault(key, []).append(value)

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-faults-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model", preset="tiny", seed=0)
        stand_in = create_server([])
        config = config_from_dict(
            {
                "actor": {"model_path": str(model)},
                "trainer": {"device": "cpu", "default_local_dir": str(root / "run")},
                "rollout": {"replicas": 2},
                "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
                "services": {
                    "trainer": stand_in.address,
                    "max_restarts": 2 * args.rounds + 2,
                    "restart_backoff_s": 0.2,
                },
            }
        )
        try:
            with LocalCluster(config, root / "run", heartbeat_interval_s=HEARTBEAT_S) as cluster:
                h = cluster.start(timeout_s=180)
                assert h.scheduler is not None
                sched = RemoteSchedulerClient(h.scheduler)

                def alive() -> set[str]:
                    return {e.spec.address for e in sched.list_services("rollout", alive_only=True)}

                def healthy(address: str) -> bool:
                    channel = create_channel(address, retry_unavailable=False)
                    try:
                        return check_health(channel, timeout_s=0.5)
                    finally:
                        channel.close()

                _until("both replicas registered", lambda: alive() == set(h.rollout))
                for _ in range(args.rounds):
                    _round(cluster, h.rollout[1], sched, alive, healthy, note)
                    assert h.reward is not None
                    _reward_round(cluster, h.reward, healthy, note)
                sched.close()
        finally:
            stand_in.stop(0)
    out: dict[str, Any] = {
        "bench": "faults",
        "rounds": args.rounds,
        "settings": {
            "heartbeat_interval_s": HEARTBEAT_S,
            "missed_heartbeats": 3,
            "client_liveness_s": LIVENESS_S,
            "restart_backoff_s": 0.2,
        },
    }
    for key, values in results.items():
        out[key] = {"median_s": round(statistics.median(values), 3), "max_s": round(max(values), 3)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
