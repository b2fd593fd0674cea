"""PPO end to end with every service a real process over gRPC (LocalCluster).

One cluster (reward, trainer, one rollout replica; CPU pools pinned to distinct
cores) serves several driver runs in turn, as ``rlfleet up`` would: synchronous
steps with validation, pipelined steps with bounded staleness, and a run stopped
after step 3 that resumes from its step-2 checkpoint with the same data order and
step count. A last test runs the ``rlfleet train`` entry point as a subprocess,
SIGKILLs it mid-run and resumes it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from runlib import loader_order

from rlfleet.common.config import Config, config_from_dict
from rlfleet.driver.clients import remote_workers
from rlfleet.driver.data.preprocess import preprocess
from rlfleet.driver.loop import PPOTrainer, StepRecord

pytestmark = pytest.mark.slow


def _raw(model: Path, data: Path, run_dir: Path) -> dict[str, object]:
    return {
        "data": {
            "train_files": str(data / "train.parquet"),
            "val_files": str(data / "test.parquet"),
            "train_batch_size": 4,
            "max_prompt_length": 64,
            "max_response_length": 8,
        },
        "actor": {"model_path": str(model), "lr": 1e-4, "ppo_mini_batch_size": 2},
        "rollout": {"n": 2},
        "algorithm": {"adv_estimator": "grpo"},
        "reward": {"num_workers": 1},
        "trainer": {
            "total_training_steps": 3,
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


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("arith")
    preprocess("arithmetic", None, out, n=64, n_test=8, digits=1, ops="+-*", seed=0)
    return out


@pytest.fixture(scope="module")
def cluster(
    tiny_model_dir: Path, data_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, object], object]]:
    from rlfleet.launch.cluster import LocalCluster

    run_dir = tmp_path_factory.mktemp("cluster")
    raw = _raw(tiny_model_dir, data_dir, run_dir)
    with LocalCluster(config_from_dict(raw), run_dir, scheduler=False) as c:
        handle = c.start(timeout_s=180)
        yield raw, handle


def _config(raw: dict[str, object], run_dir: Path, *overrides: str) -> Config:
    return config_from_dict(raw, [f"trainer.default_local_dir={run_dir}", *overrides])


def _mapping(handle: object) -> dict[object, object]:
    return remote_workers(handle.trainer, handle.rollout, handle.reward)  # type: ignore[attr-defined]


def test_sync_steps_over_grpc(cluster: tuple[dict[str, object], object], tmp_path: Path) -> None:
    raw, handle = cluster
    cfg = _config(raw, tmp_path, "trainer.total_training_steps=2", "trainer.test_freq=2")
    with PPOTrainer(config=cfg, role_worker_mapping=_mapping(handle)) as trainer:
        records = trainer.fit()
    assert [r.step for r in records] == [1, 2]
    m = records[-1].metrics
    assert m["staleness/max"] == 0.0
    assert 0.0 <= m["val/test_score/rlfleet/arithmetic"] <= 1.0
    for phase in ("gen", "old_log_prob", "update_actor", "weight_sync"):
        assert m[f"timing_s/{phase}"] > 0.0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2


def test_pipelined_steps_over_grpc(
    cluster: tuple[dict[str, object], object], tmp_path: Path
) -> None:
    raw, handle = cluster
    cfg = _config(raw, tmp_path, "trainer.pipeline.enable=true")
    with PPOTrainer(config=cfg, role_worker_mapping=_mapping(handle)) as trainer:
        records = trainer.fit()
    assert [r.metrics["staleness/max"] for r in records] == [0.0, 1.0, 1.0]


class _Killed(Exception):
    pass


def test_stopped_run_resumes_over_grpc(
    cluster: tuple[dict[str, object], object], tmp_path: Path
) -> None:
    raw, handle = cluster
    over = ("trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.resume_mode=auto")
    # Checkpoint paths must lie in the trainer's run dir: this run's dir is inside it.
    trainer_run_dir = Path(str(raw["trainer"]["default_local_dir"]))  # type: ignore[index]
    cfg = _config(raw, trainer_run_dir / tmp_path.name, *over)

    def die_after_3(record: StepRecord) -> None:
        if record.step == 3:
            raise _Killed

    with PPOTrainer(config=cfg, role_worker_mapping=_mapping(handle), on_step=die_after_3) as t:
        with pytest.raises(_Killed):
            t.fit()
        first = [r.indices for r in t.history]
    with PPOTrainer(config=cfg, role_worker_mapping=_mapping(handle)) as t:
        second = t.fit()
        expected = loader_order(t, 4)
    assert [r.step for r in second] == [3, 4]
    assert first == expected[:3]
    assert [r.indices for r in second] == expected[2:]


def test_rlfleet_train_killed_and_resumed(
    tiny_model_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    import yaml

    raw = _raw(tiny_model_dir, data_dir, tmp_path / "run")
    raw["trainer"].update(  # type: ignore[attr-defined]
        {"total_training_steps": 5, "save_freq": 1, "resume_mode": "auto"}
    )
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "rlfleet.launch.train", "--config", str(cfg_file)]
    cmd.append("--no-scheduler")
    metrics = tmp_path / "run" / "metrics.jsonl"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        os.kill(proc.pid, signal.SIGKILL)  # no clean-up: services die with their parent
    finally:
        proc.wait(timeout=60)
    done = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert done[:2] == [1, 2]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["global_steps"] == 5
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    # The second run starts after the last checkpoint, never before step 2.
    resumed = steps[len(done) :]
    assert resumed[-1] == 5 and resumed[0] <= done[-1] + 1 and resumed[0] >= 3


# ------------------------------------------------------------------ elastic rollout


def _start_rollout(
    model: Path, scheduler: str, replica_id: str, log: Path, credentials_dir: str
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "rlfleet.rollout.server", "--model", str(model)]
    cmd += ["--port", "0", "--metrics-port", "-1", "--scheduler", scheduler]
    cmd += ["--replica-id", replica_id, "--grace-s", "1"]
    # The cluster's rollout credential, as an operator hands it to a replica it adds.
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "RLFLEET_CREDENTIALS": str(Path(credentials_dir) / "rollout.json"),
    }
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def _alive_rollouts(scheduler: str) -> list[str]:
    from rlfleet.scheduler.client import RemoteSchedulerClient

    with RemoteSchedulerClient(scheduler) as client:
        return sorted(e.spec.address for e in client.list_services("rollout", alive_only=True))


def _await_rollouts(scheduler: str, count: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while len(_alive_rollouts(scheduler)) < count:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{count} rollouts not registered: {log.read_text()}"
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture()
def elastic(
    tiny_model_dir: Path, data_dir: Path, tmp_path: Path
) -> Iterator[tuple[dict[str, object], object]]:
    """Scheduler, reward, trainer and one rollout replica registered with the scheduler."""
    from rlfleet.launch.cluster import LocalCluster

    raw = _raw(tiny_model_dir, data_dir, tmp_path / "run")
    with LocalCluster(config_from_dict(raw), tmp_path / "cluster", scheduler=True) as c:
        yield raw, c.start(timeout_s=120)


def test_rollout_replica_joins_mid_run(
    elastic: tuple[dict[str, object], object], tiny_model_dir: Path, tmp_path: Path
) -> None:
    from rlfleet.rollout.client import RemoteRolloutClient

    raw, handle = elastic
    scheduler: str = handle.scheduler  # type: ignore[attr-defined]
    (first,) = _alive_rollouts(scheduler)
    log = tmp_path / "rollout-joined.log"
    started: list[subprocess.Popen[bytes]] = []

    def scale_after_first_step(record: StepRecord) -> None:
        if record.step == 1:
            started.append(
                _start_rollout(
                    tiny_model_dir, scheduler, "rollout-joined", log, handle.credentials_dir
                )
            )
            _await_rollouts(scheduler, 2, started[0], log)

    cfg = _config(raw, tmp_path / "run", "trainer.total_training_steps=3")
    mapping = remote_workers(handle.trainer, [first], handle.reward)  # type: ignore[attr-defined]
    try:
        with PPOTrainer(
            cfg, role_worker_mapping=mapping, scheduler=scheduler, on_step=scale_after_first_step
        ) as trainer:
            records = trainer.fit()
            newest = trainer._policy_version
        from rlfleet.scheduler.client import RemoteSchedulerClient

        with RemoteSchedulerClient(scheduler) as sched:
            published = sched.training_status()  # what `rlfleet status` shows
        (second,) = [a for a in _alive_rollouts(scheduler) if a != first]
        client = RemoteRolloutClient(second)
        try:
            status = client.status()
        finally:
            client.close()
    finally:
        for proc in started:
            _stop(proc)
    assert [r.step for r in records] == [1, 2, 3]
    assert [r.metrics["rollout/replicas"] for r in records] == [1.0, 2.0, 2.0]
    assert status.weight_version == newest
    assert status.generated_tokens_total > 0  # it took work from step 2 on
    assert (published.global_step, published.total_steps, published.state) == (3, 3, "done")
    assert published.weight_version == newest
    assert published.metrics["timing_s/step"] == pytest.approx(records[-1].metrics["timing_s/step"])
    for r in records:  # every sample of step 2 on was generated at the policy's version
        assert r.metrics["staleness/max"] == 0.0
        assert len(r.indices) == cfg.data.train_batch_size


def test_killed_rollout_replica_work_is_requeued(
    elastic: tuple[dict[str, object], object], tiny_model_dir: Path, tmp_path: Path
) -> None:
    from rlfleet.rollout.client import RemoteRolloutClient

    raw, handle = elastic
    scheduler: str = handle.scheduler  # type: ignore[attr-defined]
    log = tmp_path / "rollout-victim.log"
    victim = _start_rollout(
        tiny_model_dir, scheduler, "rollout-victim", log, handle.credentials_dir
    )
    killed: list[int] = []
    try:
        _await_rollouts(scheduler, 2, victim, log)
        (address,) = [a for a in _alive_rollouts(scheduler) if a not in handle.rollout]  # type: ignore[attr-defined]
        watcher = RemoteRolloutClient(address)
        stop = threading.Event()

        def kill_when_generating() -> None:
            while not stop.is_set():
                try:
                    busy = watcher.status().queue_depth > 0
                except Exception:
                    return
                if busy:
                    os.kill(victim.pid, signal.SIGKILL)
                    killed.append(victim.pid)
                    return
                time.sleep(0.005)

        thread = threading.Thread(target=kill_when_generating, daemon=True)
        thread.start()
        cfg = _config(
            raw, tmp_path / "run", "trainer.total_training_steps=2", "data.max_response_length=48"
        )
        try:
            with PPOTrainer(
                cfg, role_worker_mapping=_mapping(handle), scheduler=scheduler
            ) as trainer:
                records = trainer.fit()
        finally:
            stop.set()
            thread.join(timeout=5)
            watcher.close()
    finally:
        _stop(victim)
    assert killed == [victim.pid]
    assert [r.step for r in records] == [1, 2]
    assert records[0].metrics["rollout/requeued_samples"] > 0
    assert records[1].metrics["rollout/replicas"] == 1.0
    for r in records:  # the full batch (the driver checks n samples for every prompt)
        assert len(r.indices) == cfg.data.train_batch_size
        assert r.metrics["perf/total_gen_tokens"] > 0


# ------------------------------------------------------------------ TLS


def test_rlfleet_train_with_mtls_and_auth(
    tiny_model_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    """`rlfleet train`'s path with security.tls on (mTLS) besides the default auth:
    every service serves TLS and requires client certificates, the driver trains
    through them; plaintext and certificate-less clients are refused, and so is an
    HTTPS client with a certificate but no token on /sd and /metrics. Weights go
    over the bulk plane's TCP transport, which is TLS too."""
    import dataclasses
    import shutil
    import urllib.error
    import urllib.request

    from rlfleet.common.http import http_get
    from rlfleet.common.rpc import TLSConfig, check_health, create_channel
    from rlfleet.common.secrets_cli import make_tls
    from rlfleet.launch.train import train

    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not found: cannot make certificates")
    tls = make_tls(tmp_path / "tls", [])
    raw = _raw(tiny_model_dir, data_dir, tmp_path / "run")
    raw["trainer"]["total_training_steps"] = 2  # type: ignore[index]
    raw["security"] = {
        "tls": {
            "cert": str(tls["cert"]),
            "key": str(tls["key"]),
            "ca": str(tls["ca"]),
            "require_client_cert": True,
            "server_name": "rlfleet",  # clients verify this name, in every certificate
        }
    }
    raw.setdefault("rollout", {})["weight_transport"] = "tcp"  # type: ignore[index]
    seen: dict[str, object] = {}
    pushes: list[float] = []

    def probe(record: StepRecord) -> None:
        pushes.append(record.metrics.get("weight_sync/transport/tcp", 0.0))
        if seen:
            return
        from rlfleet.common.rpc import Security, current_security

        security = current_security()
        assert security is not None and security.role == "driver"
        assert security.tls is not None and security.tls.server_name_override == "rlfleet"
        # The scheduler's serving line: its gRPC and HTTP addresses.
        log = (tmp_path / "run" / "logs" / "scheduler.log").read_text().splitlines()
        serving = json.loads(next(line for line in log if line.startswith("{")))
        address = serving["address"]
        # Reach it as outsiders: plaintext, and TLS without a client certificate.
        plain = create_channel(address, retry_unavailable=False, security=Security(insecure=True))
        no_cert = create_channel(address, tls=TLSConfig(ca=tls["ca"]), retry_unavailable=False)
        mine = create_channel(address, retry_unavailable=False)
        seen["plain"] = check_health(plain, timeout_s=3)
        seen["no_cert"] = check_health(no_cert, timeout_s=3)
        seen["mine"] = check_health(mine, timeout_s=3)
        for channel in (plain, no_cert, mine):
            channel.close()
        seen["sd"] = json.loads(http_get(serving["metrics_address"], "/sd"))
        # HTTPS with this process's client certificate but no token: refused.
        no_token = dataclasses.replace(security, credentials=None, insecure=True)
        for path in ("/sd", "/metrics"):
            try:
                http_get(serving["metrics_address"], path, security=no_token)
                seen[f"no_token{path}"] = 200
            except urllib.error.HTTPError as e:
                seen[f"no_token{path}"] = e.code
        try:
            urllib.request.urlopen(f"http://{serving['metrics_address']}/sd", timeout=3)
            seen["http"] = "answered"
        except OSError as e:  # an HTTPS server does not speak plain HTTP
            seen["http"] = type(e).__name__

    summary = train(config_from_dict(raw), on_step=probe)
    assert summary["global_steps"] == 2
    assert pushes == [1.0, 1.0]  # one replica, pushed over (TLS) TCP after each step
    assert seen["mine"] is True and seen["plain"] is False and seen["no_cert"] is False
    assert {g["labels"]["role"] for g in seen["sd"]} >= {"rollout"}  # type: ignore[union-attr]
    assert seen["http"] != "answered"
    assert seen["no_token/sd"] == seen["no_token/metrics"] == 401
