"""The docker compose cluster for real: images built offline, Debian's docker-compose,
host networking, a few PPO steps, rollout scaled from 1 to 2 during the run.

Opt-in (minutes of image building): ``make test-compose`` (``RLFLEET_TEST_COMPOSE=1``).
What it does:

1. A Docker engine: the running one (``docker info``), else ``dockerd --bridge=none
   --iptables=false --dns 127.0.0.1`` started for the test (stopped by PID at the end;
   its data root is cached in ``build/compose/docker`` so images survive between runs).
2. Images: a base image from ``debootstrap`` + ``docker import`` (containers cannot
   reach a registry), cached as ``build/compose/base.tar``; the wheelhouse from
   ``tools/build_images.sh --wheels-only`` on the host; then
   ``tools/build_images.sh --no-wheels --base rlfleet-base:bookworm``.
3. ``docker-compose -f deploy/docker-compose.yml -f deploy/docker-compose.host.yml up``
   (scheduler, reward, trainer, one rollout replica) on free 127.0.0.1 ports, the
   tiny model and arithmetic data mounted. Authentication and mTLS are on, as
   shipped: the compose file's ``secrets`` service writes the credential set and TLS
   material into a host folder (``RLFLEET_SECRETS``) before the services start.
4. The PPO driver in this process, against the services' addresses (rollout replicas
   from the scheduler's registry), with the driver's credentials and the TLS material
   read from that folder; after step 1, ``--scale rollout=2``.
5. Checks: every step ran, every step trained on train_batch_size x n samples (the
   driver raises when one is missing), the second replica registered, is healthy and
   serves the trainer's newest weights; a call without a token is UNAUTHENTICATED and
   ``/metrics`` without a token is 401.

Skips with the reason where no Docker engine can be started (no binary, not root,
dockerd exits) or a build input is missing (no debootstrap, no package index).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from rlfleet.common.rpc import Security, TLSConfig, create_channel, using_security

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CACHE = ROOT / "build" / "compose"
BASE_IMAGE = "rlfleet-base:bookworm"
COMPOSE_FILES = [
    "-f",
    str(DEPLOY / "docker-compose.yml"),
    "-f",
    str(DEPLOY / "docker-compose.host.yml"),
]
PROJECT = "rlfleet-test"
STEPS = 4

if os.environ.get("RLFLEET_TEST_COMPOSE") != "1":
    pytest.skip(
        "the compose test builds images (minutes): run `make test-compose` "
        "(RLFLEET_TEST_COMPOSE=1)",
        allow_module_level=True,
    )


def run(
    cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 600, **kw: Any
) -> str:
    """Run a command; fail the test with its output when it fails."""
    out = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False, **kw
    )
    if out.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
        )
    return out.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# --------------------------------------------------------------------------- the engine


@dataclass
class Engine:
    env: dict[str, str]  # DOCKER_HOST for docker / docker-compose
    pid: int | None  # the dockerd we started, if any


def _docker_ok(env: dict[str, str]) -> bool:
    try:
        out = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            env=env, capture_output=True, text=True, timeout=20, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    for tool in ("docker", "docker-compose"):
        if shutil.which(tool) is None:
            pytest.skip(
                f"no `{tool}` on PATH (Debian: apt-get install -y docker.io docker-compose)"
            )
    env = dict(os.environ)
    if _docker_ok(env):
        yield Engine(env, None)
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        pytest.skip(
            "no Docker engine running and no `dockerd` to start (apt-get install docker.io)"
        )
    if os.geteuid() != 0:
        pytest.skip("no Docker engine running, and starting dockerd needs root")
    state = CACHE / "docker"
    state.mkdir(parents=True, exist_ok=True)
    sock = Path(f"/tmp/rlfleet-dockerd-{os.getpid()}.sock")
    exec_root = Path(f"/tmp/rlfleet-dockerd-exec-{os.getpid()}")
    env["DOCKER_HOST"] = f"unix://{sock}"
    log = (CACHE / "dockerd.log").open("wb")
    proc = subprocess.Popen(
        [
            dockerd, "--bridge=none", "--iptables=false", "--ip6tables=false",
            "--dns", "127.0.0.1", "--data-root", str(state / "data"),
            "--exec-root", str(exec_root),
            "--pidfile", str(state / "dockerd.pid"), "-H", env["DOCKER_HOST"],
        ],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _docker_ok(env):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (CACHE / "dockerd.log").read_text()[-2000:]
                pytest.skip(f"dockerd could not be started here:\n{tail}")
            time.sleep(1)
        yield Engine(env, proc.pid)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.close()
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        shutil.rmtree(exec_root, ignore_errors=True)


# --------------------------------------------------------------------------- images


def _base_image(engine: Engine) -> None:
    if (
        subprocess.run(
            ["docker", "image", "inspect", BASE_IMAGE],
            env=engine.env,
            capture_output=True,
            check=False,
        ).returncode
        == 0
    ):
        return
    tar = CACHE / "base.tar"
    if not tar.exists():
        debootstrap = shutil.which("debootstrap")
        if debootstrap is None:
            pytest.skip(
                "no base image and no `debootstrap` to make one (apt-get install debootstrap)"
            )
        rootfs = CACHE / "rootfs"
        shutil.rmtree(rootfs, ignore_errors=True)
        mirror = os.environ.get("RLFLEET_DEBIAN_MIRROR", "http://deb.debian.org/debian")
        out = subprocess.run(
            [debootstrap, "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
             "bookworm", str(rootfs), mirror],
            capture_output=True, text=True, timeout=1800, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            pytest.skip(
                f"debootstrap failed (no Debian mirror?):\n{out.stdout[-1500:]}{out.stderr[-1500:]}"
            )
        run(["tar", "-C", str(rootfs), "-cf", str(tar), "."], timeout=600)
        shutil.rmtree(rootfs, ignore_errors=True)
    with tar.open("rb") as f:
        run(["docker", "import", "-", BASE_IMAGE], env=engine.env, stdin=f, timeout=600)


def _requirements_digest() -> str:
    """SHA-256 of rlfleet's declared dependencies (pyproject): a wheelhouse made for
    other ones is made again (a dependency added since would be missing from it)."""
    import hashlib
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {"": project.get("dependencies", []), **project.get("optional-dependencies", {})}
    return hashlib.sha256(json.dumps(deps, sort_keys=True).encode()).hexdigest()


@pytest.fixture(scope="module")
def images(engine: Engine) -> None:
    _base_image(engine)
    script = str(ROOT / "tools" / "build_images.sh")
    house = ROOT / "build" / "images" / "cpu"
    stamp = house / "requirements.sha256"  # rlfleet's dependencies the wheelhouse holds
    wanted = _requirements_digest()
    stale = not stamp.is_file() or stamp.read_text().strip() != wanted
    if (
        not any(house.glob("rlfleet-*.whl"))
        or stale
        or os.environ.get("RLFLEET_REBUILD_WHEELS") == "1"
    ):
        out = subprocess.run(
            [script, "--wheels-only"], capture_output=True, text=True, timeout=1800, check=False
        )
        if out.returncode != 0:
            pytest.skip(f"could not make the wheelhouse (no package index?):\n{out.stderr[-2000:]}")
        stamp.write_text(wanted + "\n")
    else:  # rlfleet itself changes with every edit: rebuild its wheel only
        for whl in house.glob("rlfleet-*.whl"):
            whl.unlink()
        run([str(ROOT / ".venv" / "bin" / "python"), "-m", "pip", "wheel", "--no-deps", "-q",
             "--wheel-dir", str(house), str(ROOT)], timeout=600)  # fmt: skip
        shutil.copy(DEPLOY / "healthcheck.py", house / "healthcheck.py")
    run([script, "--no-wheels", "--base", BASE_IMAGE], env=engine.env, timeout=3000)
    if engine.pid is not None:  # our own engine: drop the build stages' dangling layers
        run(["docker", "image", "prune", "-f"], env=engine.env, timeout=600)


# --------------------------------------------------------------------------- the cluster


@dataclass
class Cluster:
    env: dict[str, str]
    scheduler: str
    scheduler_metrics: str
    trainer: str
    reward: str
    raw: dict[str, Any]  # the run config, host paths
    data: Path
    secrets: Path  # the credential set and TLS material the `secrets` service wrote

    def driver_security(self) -> Security:
        """The driver's credentials and the cluster's TLS, as the driver service gets them."""
        tls = self.secrets / "tls"
        return Security.from_env(
            {
                "RLFLEET_CREDENTIALS": str(self.secrets / "driver.json"),
                "RLFLEET_TLS_CERT": str(tls / "cert.pem"),
                "RLFLEET_TLS_KEY": str(tls / "cert.key"),
                "RLFLEET_TLS_CA": str(tls / "ca.pem"),
                "RLFLEET_TLS_SERVER_NAME": "rlfleet",
            }
        )

    def compose(self, *args: str, timeout: float = 600) -> str:
        return run(
            ["docker-compose", "-p", PROJECT, *COMPOSE_FILES, *args], env=self.env, timeout=timeout
        )


def _raw(model: str, data: str, run_dir: str) -> dict[str, Any]:
    return {
        "data": {
            "train_files": f"{data}/train.parquet",
            "val_files": f"{data}/test.parquet",
            "train_batch_size": 4,
            "max_prompt_length": 64,
            "max_response_length": 8,
        },
        "actor": {"model_path": model, "lr": 1e-4, "ppo_mini_batch_size": 4},
        "rollout": {"n": 2},
        "algorithm": {"adv_estimator": "grpo"},
        "reward": {"num_workers": 1},
        "trainer": {
            "device": "cpu",
            "total_training_steps": STEPS,
            "test_freq": -1,
            "save_freq": -1,
            "default_local_dir": run_dir,
            "resume_mode": "disable",
            "logger": ["jsonl"],
            "val_before_train": False,
        },
        "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
        "mapping": {"actor": "train_pool", "rollout": "rollout_pool"},
    }


@pytest.fixture(scope="module")
def cluster(
    engine: Engine, images: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    from rlfleet.driver.data.preprocess import preprocess

    tmp = tmp_path_factory.mktemp("compose")
    models, data, ckpt = tmp / "models", tmp / "data", tmp / "checkpoints"
    secrets = tmp / "secrets"  # made by the compose file's `secrets` service (as root)
    models.mkdir()
    shutil.copytree(tiny_model_dir, models / "policy")
    preprocess("arithmetic", None, data, n=32, n_test=4, digits=1, ops="+-*", seed=0)
    ckpt.mkdir()
    for d in (models, data, ckpt):  # the containers run as uid 1000
        for p in [d, *d.rglob("*")]:
            p.chmod(0o777 if p.is_dir() else 0o666)
    # The containers read /data/run.yaml with container paths.
    (data / "run.yaml").write_text(
        yaml.safe_dump(_raw("/models/policy", "/data", "/checkpoints/run"))
    )
    ports = {
        k: str(free_port())
        for k in ("SCHEDULER", "REWARD", "TRAINER", "SCHEDULER_METRICS", "REWARD_METRICS")
    }
    env = dict(engine.env)
    env.update({f"RLFLEET_{k}_PORT": v for k, v in ports.items()})
    env.update(
        RLFLEET_MODELS=str(models), RLFLEET_DATA=str(data), RLFLEET_CHECKPOINTS=str(ckpt),
        RLFLEET_SECRETS=str(secrets), RLFLEET_VARIANT="cpu", RLFLEET_OMP_THREADS="1",
    )  # fmt: skip
    c = Cluster(
        env,
        scheduler=f"127.0.0.1:{ports['SCHEDULER']}",
        scheduler_metrics=f"127.0.0.1:{ports['SCHEDULER_METRICS']}",
        trainer=f"127.0.0.1:{ports['TRAINER']}",
        reward=f"127.0.0.1:{ports['REWARD']}",
        raw=_raw(str(tiny_model_dir), str(data), str(tmp / "run")),
        data=data,
        secrets=secrets,
    )
    try:
        # Compose 1.29 waits for service_healthy dependencies itself; --scale keeps one replica.
        c.compose(
            "up",
            "-d",
            "--scale",
            "rollout=1",
            "scheduler",
            "reward",
            "trainer",
            "rollout",
            timeout=900,
        )
        _wait_healthy(c, {"scheduler", "reward", "trainer", "rollout"}, timeout_s=600)
        yield c
    finally:
        logs = subprocess.run(
            ["docker-compose", "-p", PROJECT, *COMPOSE_FILES, "logs", "--no-color", "--tail", "200"],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        (CACHE / "compose.log").write_text(logs.stdout + logs.stderr)
        subprocess.run(
            ["docker-compose", "-p", PROJECT, *COMPOSE_FILES, "down", "-t", "30", "--remove-orphans"],
            env=env, capture_output=True, timeout=300, check=False,
        )  # fmt: skip


def _containers(c: Cluster) -> list[dict[str, Any]]:
    ids = run(
        ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"], env=c.env
    ).split()
    if not ids:
        return []
    info: list[dict[str, Any]] = json.loads(run(["docker", "inspect", *ids], env=c.env))
    return info


def _wait_healthy(c: Cluster, services: set[str], timeout_s: float, replicas: int = 1) -> None:
    deadline = time.monotonic() + timeout_s
    states: dict[str, list[str]] = {}
    while time.monotonic() < deadline:
        states = {}
        for info in _containers(c):
            name = info["Config"]["Labels"]["com.docker.compose.service"]
            states.setdefault(name, []).append(
                info["State"].get("Health", {}).get("Status", "none")
            )
        if all(
            states.get(s, []).count("healthy") >= (replicas if s == "rollout" else 1)
            for s in services
        ):
            return
        time.sleep(2)
    pytest.fail(f"services not healthy within {timeout_s:.0f}s: {states}")


def _rollout_addresses(c: Cluster) -> list[str]:
    from rlfleet.scheduler.client import RemoteSchedulerClient

    client = RemoteSchedulerClient(c.scheduler)
    try:
        return sorted(e.spec.address for e in client.list_services("rollout", alive_only=True))
    finally:
        client.close()


def test_ppo_steps_with_rollout_scaled_from_1_to_2(cluster: Cluster, tmp_path: Path) -> None:
    with using_security(cluster.driver_security()):
        _ppo_steps_with_rollout_scaled_from_1_to_2(cluster, tmp_path)


def _ppo_steps_with_rollout_scaled_from_1_to_2(cluster: Cluster, tmp_path: Path) -> None:
    from rlfleet.common.config import config_from_dict
    from rlfleet.driver.clients import remote_workers
    from rlfleet.driver.loop import PPOTrainer, StepRecord
    from rlfleet.rollout.client import RemoteRolloutClient

    (first,) = _rollout_addresses(cluster)
    config = config_from_dict(cluster.raw, [f"trainer.default_local_dir={tmp_path}"])
    mapping = remote_workers(cluster.trainer, [first], cluster.reward)
    scaled: list[str] = []

    def scale_after_first_step(record: StepRecord) -> None:
        if record.step == 1:
            cluster.compose("up", "-d", "--no-recreate", "--scale", "rollout=2", "rollout")
            _wait_healthy(cluster, {"rollout"}, timeout_s=300, replicas=2)
            scaled.extend(a for a in _rollout_addresses(cluster) if a != first)

    with PPOTrainer(
        config,
        role_worker_mapping=mapping,
        on_step=scale_after_first_step,
        scheduler=cluster.scheduler,  # replicas that register mid-run join the next step
    ) as t:
        records = t.fit()
        newest = t._policy_version

    assert [r.step for r in records] == list(range(1, STEPS + 1))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == list(range(1, STEPS + 1))
    for r in records:  # no sample lost: every prompt of every step trained on, n samples each
        assert len(r.indices) == config.data.train_batch_size, r
        # Containers share no /dev/shm: the bulk plane's TCP transport, under mTLS.
        assert r.metrics.get("weight_sync/transport/tcp", 0.0) >= 1.0, r.metrics
        assert r.metrics["training/global_step"] == r.step
        assert r.metrics["perf/total_gen_tokens"] > 0
    (second,) = scaled  # the second replica registered with the scheduler, healthy
    client = RemoteRolloutClient(second)
    try:
        status = client.status()
    finally:
        client.close()
    # It got the current weights before serving and took work from the next step.
    assert status.weight_version == newest, (status.weight_version, newest)
    assert status.generated_tokens_total > 0, status
    assert max(r.metrics["rollout/replicas"] for r in records) == 2


def test_a_call_without_a_token_is_unauthenticated(cluster: Cluster) -> None:
    from rlfleet.v1 import scheduler_pb2, scheduler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

    def trainer_status(channel: grpc.Channel) -> Any:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        return stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=30)

    def list_services(channel: grpc.Channel) -> Any:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        return stub.ListServices(scheduler_pb2.ListServicesRequest(), timeout=30)

    driver = cluster.driver_security()
    tls = driver.client_tls()  # a client certificate (mTLS) and the CA, but no token
    assert tls is not None
    for address, call in ((cluster.trainer, trainer_status), (cluster.scheduler, list_services)):
        anonymous = create_channel(
            address, tls=tls, retry_unavailable=False, security=Security(insecure=True)
        )
        with contextlib.closing(anonymous), pytest.raises(grpc.RpcError) as e:
            call(anonymous)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (address, e.value)
        # The same call with the driver's token is answered.
        with contextlib.closing(create_channel(address, security=driver)) as channel:
            call(channel)


def test_metrics_without_a_token_is_401(cluster: Cluster) -> None:
    tls = cluster.driver_security().client_tls()
    assert isinstance(tls, TLSConfig) and tls.ca is not None and tls.cert is not None
    context = ssl.create_default_context(cafile=str(tls.ca))
    context.load_cert_chain(str(tls.cert), str(tls.key))
    url = f"https://{cluster.scheduler_metrics}/metrics"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url, timeout=30, context=context)
    assert e.value.code == 401
    # Prometheus' credentials: the bare observer token.
    token = (cluster.secrets / "observer.token").read_text().strip()
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30, context=context) as r:
        assert r.status == 200
        assert b"# TYPE" in r.read()


def test_the_driver_service_trains_with_its_own_credentials(cluster: Cluster) -> None:
    """`docker-compose run driver`: `rlfleet train` with every service given launches
    nothing and speaks with /secrets/driver.json and the TLS files of its view."""
    ports = {k: cluster.env[f"RLFLEET_{k}_PORT"] for k in ("SCHEDULER", "TRAINER", "REWARD")}
    out = cluster.compose(
        "run", "--rm", "-T", "driver",
        "train", "--config", "/data/run.yaml",
        f"services.scheduler=127.0.0.1:{ports['SCHEDULER']}",
        f"services.trainer=127.0.0.1:{ports['TRAINER']}",
        f"services.reward=127.0.0.1:{ports['REWARD']}",
        "trainer.total_training_steps=1",
        "trainer.default_local_dir=/checkpoints/driver-service",
        timeout=900,
    )  # fmt: skip
    summary = json.loads([x for x in out.splitlines() if x.startswith("{")][-1])
    assert summary["global_steps"] == 1, summary
