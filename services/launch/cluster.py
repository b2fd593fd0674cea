"""A local cluster: every service as its own process on 127.0.0.1, pinned per pool.

::

    with LocalCluster(config, run_dir) as cluster:
        handle = cluster.start(timeout_s=120)
        handle.scheduler, handle.reward, handle.trainer, handle.rollout  # addresses
        ...                                                               # train
    # every process stopped (SIGTERM, then SIGKILL after the grace period)

What :meth:`LocalCluster.start` does:

1. Writes the resolved config to ``run_dir/config.yaml`` (the trainer and reward
   read it) and plans the pools on this machine (:func:`plan_placement`, every
   pool entry on this one node, disjoint devices per pool).
2. Starts the scheduler (``scheduler=True``) and the tools service (when a
   multi-turn tool source of kind ``service`` asks for it and ``services.tools`` is
   unset; the rollout replicas get its address), then reward, trainer and one rollout
   replica per ``config.rollout_replicas()``, each as ``python -m rlfleet.<service>.server``
   with ``--port 0``, in its own session, output in ``run_dir/logs/<name>.log``.
   A service's address comes from its one-line JSON ``serving`` message (or the
   trainer's ``--address-file``); then its gRPC health must answer SERVING.
3. On ``cpu``, each process is pinned to its pool's cores (``sched_setaffinity`` in a
   tiny launcher that then ``exec``s the server, so the PID is the server's) and
   gets ``OMP_NUM_THREADS`` = its cores; rollout replicas split the rollout pool,
   one pool entry each. On ``cuda`` each process gets ``CUDA_VISIBLE_DEVICES`` of
   its pool. Roles sharing a pool share its devices (colocation).
4. Registers reward and trainer with the scheduler as ``liveness=probe`` (they do
   not heartbeat; the scheduler health-checks them); rollout replicas register
   themselves (``--scheduler``).

A service that exits during start-up fails :meth:`start` with the tail of its log;
so does one that is not healthy within ``timeout_s``. Everything started so far is
stopped first.

:meth:`LocalCluster.stop` (also on ``with`` exit, at interpreter exit, and on
SIGTERM to this process when started from the main thread) sends SIGTERM to each
process group it started (rollouts, trainer and reward first, the scheduler last),
waits ``grace_s``, then SIGKILLs what is left. Children also get SIGTERM if this
process dies without stopping them (Linux ``PR_SET_PDEATHSIG``), unless the
cluster is ``detach``-ed (``rlfleet up``), in which case :func:`stop_processes` on
the recorded PIDs stops them later (``rlfleet down``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rlfleet.common.auth import (
    CREDENTIALS_ENV,
    INSECURE_ENV,
    CredentialError,
    credential_set,
    read_credential_set,
    write_credential_set,
)
from rlfleet.common.config import Config, save_resolved
from rlfleet.common.errors import RlfleetError, Unavailable
from rlfleet.common.roles import PRINCIPALS, Service
from rlfleet.common.rpc import (
    Security,
    TLSConfig,
    current_security,
    is_loopback,
    set_security,
    wait_for_ready,
)
from rlfleet.scheduler.placement import (
    Device,
    PlacementPlan,
    cuda_visible_devices,
    local_node,
    plan_placement,
    split_devices,
)
from rlfleet.scheduler.registry import LIVENESS_CAPABILITY, LIVENESS_PROBE, ServiceSpec

__all__ = [
    "ClusterHandle",
    "LocalCluster",
    "ProcessInfo",
    "ServiceStartError",
    "process_start_time",
    "stop_processes",
]

logger = logging.getLogger(__name__)

# Runs in the child before the server: pin to cores, ask for SIGTERM when the parent
# dies (PR_SET_PDEATHSIG = 1), then exec the server so its PID is the one we hold.
_LAUNCHER = """\
import os, sys
cores, parent, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
if cores:
    os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
if parent:
    import ctypes, signal
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != parent:
        sys.exit(1)
os.execv(sys.executable, [sys.executable, *argv])
"""

_LOG_TAIL_LINES = 40


class ServiceStartError(Unavailable):
    """A service died or stayed unhealthy during start-up; the message has its log tail,
    or the one line it said why. ``bad_input``: it refused its input that way (exit
    code 2 and an ``error:`` line: a model that does not load, say), which
    ``rlfleet train`` reports with exit code 2 as its own start-up errors."""

    default_recoverable = False
    bad_input = False


@dataclass(frozen=True)
class ProcessInfo:
    """One process the cluster started: enough to stop it from another process.

    ``start_time`` is the kernel's start time of the PID (clock ticks since boot,
    ``/proc/<pid>/stat``), so a recycled PID is never taken for ours.
    """

    name: str
    pid: int
    start_time: int | None
    log: str


@dataclass(frozen=True)
class ClusterHandle:
    """Addresses of a started cluster.

    Attributes:
        scheduler: the scheduler's ``host:port`` (None: no scheduler).
        reward: the reward service.
        trainer: the trainer service (rank 0).
        rollout: one address per rollout replica.
        metrics: service name -> its Prometheus ``host:port`` (the scheduler's also
            serves ``/sd``).
        pids: service name (``scheduler``, ``reward``, ``trainer``, ``rollout-0`` ...) -> PID
            (absent for services given by address in ``config.services``).
        cores: service name -> CPU cores it is pinned to (empty: not pinned).
        gpus: service name -> its ``CUDA_VISIBLE_DEVICES`` (cuda only).
        run_dir: where the config and logs are.
        config_path: the resolved config the services read.
        mode: ``colocated`` or ``disaggregated``.
        credentials_dir: the cluster's credential set ("" when auth is off): clients
            use ``driver.json`` (``observer.json`` to only read).
        tools: the tools service of multi-turn rollouts (None: none).
    """

    scheduler: str | None
    reward: str
    trainer: str
    rollout: list[str]
    metrics: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    cores: dict[str, list[int]] = field(default_factory=dict)
    gpus: dict[str, str] = field(default_factory=dict)
    run_dir: str = ""
    config_path: str = ""
    mode: str = "disaggregated"
    credentials_dir: str = ""
    tools: str | None = None

    def log_path(self, name: str) -> Path:
        return Path(self.run_dir) / "logs" / f"{name}.log"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterHandle:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass
class _Proc:
    name: str
    kind: str  # scheduler | tools | reward | trainer | rollout
    argv: list[str]
    env: dict[str, str]
    cores: tuple[int, ...]
    gpus: str | None
    log_path: Path
    address_file: Path | None = None
    popen: subprocess.Popen[bytes] | None = None
    start_time: int | None = None
    address: str | None = None
    metrics_address: str | None = None
    _read: int = 0

    @property
    def pid(self) -> int:
        return 0 if self.popen is None else self.popen.pid


def _argv_address(argv: Sequence[str]) -> str | None:
    """``host:port`` of a service's ``--host`` / ``--port`` arguments (a restart keeps
    its port there), or None when the port is not fixed."""

    def value(flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv[:-1] else None

    host, port = value("--host"), value("--port")
    return f"{host}:{port}" if host and port and port != "0" else None


def process_start_time(pid: int) -> int | None:
    """The PID's start time in clock ticks since boot (Linux), or None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


def cluster_tls(config: Config) -> TLSConfig | None:
    """The TLS material ``security.tls`` names (None: none): what every launcher hands
    its services and uses for itself."""
    t = config.security.tls
    if t.cert is None and t.ca is None:
        return None
    return TLSConfig(
        cert=t.cert,
        key=t.key,
        ca=t.ca,
        require_client_cert=t.require_client_cert,
        server_name_override=t.server_name,
    )


def fleet_metrics(events: Mapping[str, int], rollout_replicas: int) -> dict[str, float]:
    """A launcher's step metrics: its event counts (``fleet/restarted``, ...) and
    ``fleet/rollout_replicas``, the replicas it runs (starting ones included; the
    driver's working set is ``rollout/replicas``)."""
    out = {f"fleet/{k}": float(v) for k, v in sorted(events.items())}
    out["fleet/rollout_replicas"] = float(rollout_replicas)
    return out


def deregister_address(scheduler: str, address: str, role: Service = "rollout") -> None:
    """Drop the ``role`` registry entries at ``address`` (as the driver): a dead or
    removed replica leaves the fleet at once, and its restart may take the address.
    Best effort: an entry left goes DEAD after missed heartbeats anyway."""
    from rlfleet.scheduler.client import RemoteSchedulerClient

    try:
        with RemoteSchedulerClient(scheduler, timeout_s=5.0) as client:
            for e in client.list_services(role):
                if e.spec.address == address:
                    client.deregister(e.service_id)
    except Exception as e:
        logger.info("could not drop the registry entry of %s: %s", address, e)


def scheduler_argv(
    host: str, config_path: Path, heartbeat_interval_s: float, *, plan_local: bool
) -> list[str]:
    """``python`` arguments of a scheduler service launched for a cluster."""
    argv = ["-m", "rlfleet.scheduler.server", "--host", host, "--port", "0"]
    argv += ["--metrics-port", "0", "--config", str(config_path)]
    argv += ["--heartbeat-interval-s", str(heartbeat_interval_s), "--grace-s", "1"]
    return [*argv, "--plan-local"] if plan_local else argv


def reward_argv(host: str, config_path: Path) -> list[str]:
    """``python`` arguments of the reward service launched for a cluster."""
    return ["-m", "rlfleet.reward.server", "--config", str(config_path), "--host", host,
            "--port", "0", "--metrics-port", "0"]  # fmt: skip


def trainer_argv(host: str, config_path: Path, address_file: Path) -> list[str]:
    """Module and arguments of a trainer rank (``-m`` goes before, by the caller)."""
    return ["rlfleet.trainer.server", "--config", str(config_path), "--host", host,
            "--port", "0", "--address-file", str(address_file)]  # fmt: skip


def tools_argv(host: str, config_path: Path) -> list[str]:
    """``python`` arguments of the tools service launched for a cluster."""
    return ["-m", "rlfleet.tools.server", "--config", str(config_path), "--host", host,
            "--port", "0", "--grace-s", "2"]  # fmt: skip


def needs_tools_service(config: Config) -> bool:
    """A multi-turn tool source names the run's tools service and none is given."""
    m = config.rollout.multi_turn
    return m.enable and config.services.tools is None and any(t.kind == "service" for t in m.tools)


def rollout_argv(
    host: str, config_path: Path, replica_id: str, *, drain_s: float = 2.0
) -> list[str]:
    """A rollout replica: the run config gives it model, engine, dtype and device;
    ``drain_s``: how long it finishes its calls in flight on SIGTERM (an idle replica
    exits at once)."""
    return ["rlfleet.rollout.server", "--config", str(config_path), "--host", host,
            "--port", "0", "--metrics-port", "0", "--replica-id", replica_id,
            "--grace-s", f"{drain_s:g}"]  # fmt: skip


def replica_number(name: str) -> int:
    """K of a replica named ``rollout-K``: the order replicas were first started in,
    which a restart (the same name, a new process) does not change."""
    return int(name.rpartition("-")[2])


def drain_time(grace_s: float) -> float:
    """A replica's drain time within a launcher's SIGTERM-to-SIGKILL ``grace_s``: what
    is left after a second for its exit, at least one second."""
    return max(1.0, grace_s - 1.0)


class LocalCluster:
    """Start and stop the services of a run as local processes.

    Args:
        config: the validated run config.
        run_dir: gets ``config.yaml``, ``logs/<service>.log`` and address files.
        scheduler: start a scheduler process (rollout replicas register with it, and
            reward/trainer are registered for probing). False: use
            ``scheduler_address`` or ``config.services.scheduler`` if given, else none.
        scheduler_address: an already running scheduler (e.g. the driver's in-process
            one); implies no scheduler process.
        host: interface every service binds and advertises.
        extra_args: service kind (``scheduler``, ``reward``, ``trainer``, ``rollout``) ->
            more command-line arguments for it.
        env: extra environment variables for every service.
        detach: leave the services running when this object or process goes away
            (no atexit / parent-death stop); stop them with :func:`stop_processes`.
        grace_s: SIGTERM-to-SIGKILL wait of :meth:`stop`.
        python: interpreter to run the services with.
    """

    def __init__(
        self,
        config: Config,
        run_dir: str | Path,
        *,
        scheduler: bool = True,
        scheduler_address: str | None = None,
        host: str = "127.0.0.1",
        extra_args: Mapping[str, Sequence[str]] | None = None,
        env: Mapping[str, str] | None = None,
        detach: bool = False,
        grace_s: float = 10.0,
        heartbeat_interval_s: float = 2.0,
        python: str = sys.executable,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        given = scheduler_address or config.services.scheduler
        self.launch_scheduler = scheduler and given is None
        self.scheduler_address: str | None = given
        self.tools_address: str | None = config.services.tools
        self.host = host
        self.extra_args = {k: list(v) for k, v in (extra_args or {}).items()}
        self.env = dict(env or {})
        self.detach = detach
        self.grace_s = grace_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.python = python
        self.placement: PlacementPlan | None = None
        self.handle: ClusterHandle | None = None
        self._procs: list[_Proc] = []
        self._registered: list[str] = []
        self._lock = threading.RLock()
        self._stopped = False
        self._atexit: Callable[[], None] | None = None
        self._old_sigterm: Any = None
        self._pdeathsig = False
        self.security: Security | None = None
        self.credentials_dir: Path | None = None
        self._role_env: dict[str, dict[str, str]] = {}
        self._previous_security: Security | None = None
        self.restarts: dict[str, int] = {}
        self._supervisor: threading.Thread | None = None
        self._scaler: threading.Thread | None = None
        self._starting: set[str] = set()  # replicas a scale-up is bringing up
        self._restarting: set[str] = set()  # out of _procs between a restart's two steps
        self.given_up: set[str] = set()
        self._rollout_shares: list[Sequence[Device]] = []
        self._next_rollout = 0
        self._scale_generation = 0
        # Replicas started in place of given-up ones (bounded by services.max_restarts),
        # and when a failed scale-up may be tried again.
        self._replacements = 0
        self._scale_retry_at = 0.0
        self._config_path: Path | None = None
        self.events: dict[str, int] = {"restarted": 0, "scaled_up": 0, "scaled_down": 0}

    # ------------------------------------------------------------------ planning

    def plan(self) -> PlacementPlan:
        """Place the config's pools on this machine (raises PlacementError if they don't fit)."""
        cfg = self.config
        return plan_placement(
            cfg.resource_pools,
            cfg.mapping.model_dump(),
            device=cfg.trainer.device,
            nodes=[local_node(cfg.trainer.device)],
            roles=cfg.enabled_roles(),
            fold_nodes=True,
        )

    def _prepare_security(self) -> None:
        """A credential set for this cluster; each service gets its role's, this process
        the driver's (made the process's security until :meth:`stop`)."""
        sec = self.config.security
        tls = cluster_tls(self.config)
        if not sec.auth:
            if not is_loopback(self.host):
                raise CredentialError(
                    f"security.auth=false is refused with host {self.host}: services listen "
                    "beyond loopback only with authentication on"
                )
            logger.warning("security.auth=false: the cluster's services run WITHOUT authentication")
            self.security = Security(credentials=None, tls=tls, insecure=True)
            env = {INSECURE_ENV: "1", **self.security.tls_env()}
            self._role_env = {role: dict(env) for role in PRINCIPALS}
        else:
            if sec.credentials_dir is not None:
                root = Path(sec.credentials_dir)
                tokens = read_credential_set(root)
            else:
                root = write_credential_set(self.run_dir / "secrets")
                tokens = read_credential_set(root)
            self.credentials_dir = root
            creds = credential_set(tokens)
            self.security = Security(credentials=creds["driver"], tls=tls)
            tls_env = self.security.tls_env()
            self._role_env = {
                role: {
                    CREDENTIALS_ENV: str(root / f"{role}.json"),
                    INSECURE_ENV: "",
                    **tls_env,
                }
                for role in PRINCIPALS
            }
        self._previous_security = current_security()
        set_security(self.security)

    def _devices_env(self, devices: Sequence[Device], procs: int = 1) -> dict[str, str]:
        if self.config.trainer.device == "cpu":
            threads = str(max(1, len(devices) // max(1, procs)) if devices else 1)
            return {
                "CUDA_VISIBLE_DEVICES": "",
                "OMP_NUM_THREADS": threads,
                "MKL_NUM_THREADS": threads,
                "OPENBLAS_NUM_THREADS": threads,
            }
        return {"CUDA_VISIBLE_DEVICES": cuda_visible_devices(devices)} if devices else {}

    def _proc(
        self,
        name: str,
        kind: str,
        module_argv: list[str],
        devices: Sequence[Device],
        *,
        procs: int = 1,
        address_file: Path | None = None,
    ) -> _Proc:
        cpu = self.config.trainer.device == "cpu"
        cores = tuple(sorted({d.index for d in devices})) if cpu else ()
        gpus = None if cpu else cuda_visible_devices(devices)
        env = {
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **self._devices_env(devices, procs),
            **self.env,
            **self._role_env.get(kind, {}),
        }
        return _Proc(
            name=name,
            kind=kind,
            argv=[*module_argv, *self.extra_args.get(kind, [])],
            env=env,
            cores=cores,
            gpus=gpus,
            log_path=self.run_dir / "logs" / f"{name}.log",
            address_file=address_file,
        )

    def _build(self, plan: PlacementPlan, config_path: Path) -> tuple[list[_Proc], list[_Proc]]:
        """The processes to start first (scheduler, tools service), then the others."""
        cfg, host = self.config, self.host
        first: list[_Proc] = []
        if self.launch_scheduler:
            first.append(
                self._proc(
                    "scheduler",
                    "scheduler",
                    scheduler_argv(host, config_path, self.heartbeat_interval_s, plan_local=True),
                    (),
                )
            )
        if needs_tools_service(cfg):
            # Unpinned: its sandboxed programs are short and bounded by their own limits.
            first.append(self._proc("tools", "tools", tools_argv(host, config_path), ()))
        others: list[_Proc] = []
        if cfg.services.reward is None:
            devices = plan.devices_of("reward_model") if "reward_model" in plan.role_pool else ()
            others.append(self._proc("reward", "reward", reward_argv(host, config_path), devices))
        if cfg.services.trainer is None:
            pools = {plan.role_pool[r] for r in ("actor", "critic", "ref") if r in plan.role_pool}
            devices = tuple(sorted({d for p in pools for d in plan.pools[p].devices}))
            world = cfg.world_size("actor")
            address_file = self.run_dir / "trainer.address"
            server = trainer_argv(host, config_path, address_file)
            if world > 1:
                launcher = ["-m", "torch.distributed.run", "--standalone"]
                argv = [*launcher, "--nproc-per-node", str(world), "-m", *server]
            else:
                argv = ["-m", *server]
            others.append(
                self._proc(
                    "trainer", "trainer", argv, devices, procs=world, address_file=address_file
                )
            )
        if not cfg.services.rollout:
            pool = plan.pools[plan.role_pool["rollout"]]
            replicas = cfg.rollout_replicas()
            if cfg.trainer.device == "cpu" and replicas == len(pool.nodes):
                shares = [devs for _, _, devs in pool.nodes]
            elif cfg.trainer.device == "cuda":
                tp = cfg.rollout.tensor_parallel_size
                devs = pool.devices
                shares = (
                    [devs[i * tp : (i + 1) * tp] for i in range(replicas)]
                    if len(devs) >= replicas * tp
                    else split_devices(devs, replicas)
                )
            else:
                shares = split_devices(pool.devices, replicas)
            self._rollout_shares = list(shares)
            self._next_rollout = len(shares)
            for i, share in enumerate(shares):
                others.append(self._rollout_proc(i, config_path, share))
        return first, others

    def _rollout_proc(self, index: int, config_path: Path, devices: Sequence[Device]) -> _Proc:
        name = f"rollout-{index}"
        argv = ["-m", *rollout_argv(self.host, config_path, name, drain_s=drain_time(self.grace_s))]
        return self._proc(name, "rollout", argv, devices)

    def _join_args(self, proc: _Proc) -> None:
        """What a rollout or trainer started after the scheduler needs to find it."""
        if proc.kind in ("rollout", "trainer") and self.scheduler_address:
            proc.argv += ["--scheduler", self.scheduler_address]
        if proc.kind == "rollout" and self.tools_address:
            proc.argv += ["--override", f"services.tools={self.tools_address}"]

    # ------------------------------------------------------------------ start

    def start(self, timeout_s: float = 180.0) -> ClusterHandle:
        """Start every service, wait until each is healthy, return their addresses.

        Raises:
            PlacementError: the pools do not fit this machine.
            ServiceStartError: a service died or was not healthy within ``timeout_s``
                (with its log tail); everything started is stopped first.
        """
        with self._lock:
            if self._procs or self.handle is not None:
                raise RuntimeError("LocalCluster.start called twice")
            self._stopped = False
        deadline = time.monotonic() + timeout_s
        plan = self.plan()
        self.placement = plan
        nodes = max((len(p) for p in self.config.resource_pools.values()), default=1)
        if nodes > 1:  # said once: a config written for a cluster runs here folded
            logger.warning(
                "resource_pools name %d nodes; the local launcher runs them all on this "
                "machine, each pool entry on devices of its own (launcher: ray places "
                "them on separate nodes: docs/ray.md)", nodes,
            )  # fmt: skip
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        config_path = save_resolved(self.config, self.run_dir)
        self._config_path = config_path
        self._prepare_security()
        first, others = self._build(plan, config_path)
        self._install_stop_hooks()
        try:
            for proc in first:
                self._launch(proc)
            self._await(first, deadline)
            for proc in first:
                if proc.kind == "scheduler":
                    self.scheduler_address = proc.address
                elif proc.kind == "tools":
                    self.tools_address = proc.address
            for proc in others:
                self._join_args(proc)
                self._launch(proc)
            self._await(others, deadline)
            self._check_external(deadline)
            if self.scheduler_address:
                self._register_probed(others, deadline)
        except BaseException:
            self.stop()
            raise
        self.handle = self._make_handle(plan, config_path)
        follow = self.config.scheduler.autoscale.enable or self.config.services.max_restarts > 0
        if follow and not self.detach:
            self._supervisor = threading.Thread(
                target=self._supervise, name="rlfleet-supervisor", daemon=True
            )
            self._supervisor.start()
            # Its own thread: a scale-up (seconds to minutes) or a drain (up to
            # grace_s) must not hold back the restart of a service that dies meanwhile.
            self._scaler = threading.Thread(
                target=self._follow_scale_loop, name="rlfleet-scaler", daemon=True
            )
            self._scaler.start()
        logger.info(
            "local cluster up (%s): %s",
            plan.mode,
            ", ".join(f"{p.name}={p.address}" for p in self._procs),
        )
        return self.handle

    # ------------------------------------------------------------------ self-healing

    def _supervise(self) -> None:
        """Restart rollout replicas, the reward service, the tools service and the
        scheduler that die during the run, and follow the scheduler's desired rollout
        count.

        Each is restarted at most ``services.max_restarts`` times, on its old port
        (so every client's address stays valid), after ``restart_backoff_s`` doubling
        with each restart. The trainer is restarted only with ``trainer.recovery``
        (the driver then restores the last checkpoint into it); otherwise its state
        is lost with it (resume the run from its last checkpoint). Everything is logged.
        """
        while not self._stopped:
            time.sleep(0.5)
            try:
                self._restart_dead()
            except Exception:  # keep supervising: one bad round must not end it
                if not self._stopped:
                    logger.exception("supervising the services failed in this round")

    def _follow_scale_loop(self) -> None:
        while not self._stopped:
            time.sleep(0.5)
            try:
                self._follow_scale()
            except Exception:  # keep following: one bad round must not end it
                if not self._stopped:
                    logger.exception("following the desired rollout scale failed")

    def _restart_dead(self) -> None:
        """One round of :meth:`_supervise`'s restarts."""
        with self._lock:
            if self._stopped:
                return
            dead = [
                p
                for p in self._procs
                if p.popen is not None
                and p.popen.poll() is not None
                and p.name not in self.given_up
                and p.name not in self._starting  # the scale-up's to retire
            ]
        for proc in dead:
            code = proc.popen.returncode if proc.popen is not None else None
            kill_leftovers(proc.pid, proc.name)
            # The scheduler too: on its address, its registry rebuilt from the replicas'
            # re-registrations and the launcher's own (reward, trainer).
            restartable = {"rollout", "reward", "tools", "scheduler"}
            if self.config.trainer.recovery.enable:
                restartable.add("trainer")  # the driver restores its checkpoint
            if proc.kind not in restartable:
                logger.error(
                    "%s (%s, pid %d) died with code %s: it is not restarted (its state is "
                    "in memory); resume the run from its last checkpoint "
                    "(trainer.resume_mode=auto)",
                    proc.name, proc.address, proc.pid, code,
                )  # fmt: skip
                self.given_up.add(proc.name)
                continue
            done = self.restarts.get(proc.name, 0)
            if done >= self.config.services.max_restarts:
                logger.error(
                    "%s (%s) died with code %s after %d restart(s): giving up on it",
                    proc.name, proc.address, code, done,
                )  # fmt: skip
                self.given_up.add(proc.name)
                address = proc.address or _argv_address(proc.argv)  # died starting: argv's
                if proc.kind == "rollout" and self.scheduler_address and address:
                    # Out of the registry (not listed dead for good); a desired count
                    # set at the scheduler brings a new replica in its place.
                    deregister_address(self.scheduler_address, address)
                continue
            self._restart(proc, code, done)

    def _restart(self, proc: _Proc, code: int | None, done: int) -> None:
        backoff = self.config.services.restart_backoff_s * 2.0**done
        logger.warning(
            "%s (%s, pid %d) died with code %s: restarting it in %.1fs (restart %d of %d); "
            "log %s",
            proc.name, proc.address, proc.pid, code, backoff, done + 1,
            self.config.services.max_restarts, proc.log_path,
        )  # fmt: skip
        time.sleep(backoff)
        with self._lock:
            if self._stopped:
                return
            if proc not in self._procs:  # scaled away (retired) during the backoff
                logger.info("%s was removed while it waited for its restart: not restarted",
                            proc.name)  # fmt: skip
                return
        self.restarts[proc.name] = done + 1
        self.events["restarted"] += 1
        argv = list(proc.argv)
        if "--port" in argv and proc.address:  # else: a failed restart kept it in argv
            argv[argv.index("--port") + 1] = proc.address.rpartition(":")[2]
        if proc.kind == "rollout" and self.scheduler_address and proc.address:
            deregister_address(self.scheduler_address, proc.address)
        fresh = dataclasses.replace(
            proc, argv=argv, popen=None, start_time=None, address=None, metrics_address=None
        )
        with self._lock:
            if self._stopped or proc not in self._procs:
                return
            self._procs.remove(proc)
            self._restarting.add(proc.name)
        try:
            self._launch(fresh)
            self._await([fresh], time.monotonic() + 120.0)
        except Exception as e:
            logger.error("restarting %s failed: %s", proc.name, e)
            return
        finally:
            with self._lock:
                self._restarting.discard(proc.name)
        logger.warning("%s restarted at %s (pid %d)", fresh.name, fresh.address, fresh.pid)
        if fresh.kind in ("reward", "trainer") and self.scheduler_address:
            try:  # its entry names the new process (pid), not the dead one
                self._register_probed([fresh], time.monotonic() + 30.0)
            except Exception as e:  # the registry keeps the old entry; it still answers
                logger.warning("registering the restarted %s failed: %s", fresh.name, e)
        if fresh.kind == "scheduler" and self.scheduler_address:
            self._scale_generation = 0  # a new scheduler numbers its requests from 1 again
            with self._lock:
                probed = [p for p in self._procs if p.kind in ("reward", "trainer")]
            self._registered.clear()
            try:
                self._register_probed(probed, time.monotonic() + 30.0)
            except Exception as e:  # the next restart of it, or the run, will tell
                logger.error("registering %s with the restarted scheduler failed: %s",
                             [p.name for p in probed], e)  # fmt: skip

    # ------------------------------------------------------------------ scale

    def rollout_replicas(self) -> list[str]:
        """Names of the rollout replicas this cluster runs now (given-up ones excluded)."""
        with self._lock:
            return [
                p.name for p in self._procs if p.kind == "rollout" and p.name not in self.given_up
            ]

    def _follow_scale(self) -> None:
        """Reconcile with the scheduler's desired rollout count (``rlfleet scale
        rollout N`` or the autoscaler set it) when it changed."""
        from rlfleet.scheduler.client import RemoteSchedulerClient

        if not self.scheduler_address or not self._rollout_shares:
            return
        try:
            with RemoteSchedulerClient(self.scheduler_address, timeout_s=5.0) as client:
                desired, generation = client.scale("rollout")
        except RlfleetError as e:  # one line per round: the scheduler may come back
            logger.warning("desired scale unknown: scheduler %s: %s", self.scheduler_address, e)
            return
        if not desired:
            return
        if generation == self._scale_generation:
            # The count is the one followed; a replica given up since then leaves the
            # fleet short of it: one in its place (at most services.max_restarts times).
            with self._lock:  # a replica between its restart's two steps is still ours
                running = sum(
                    1 for p in self._procs if p.kind == "rollout" and p.name not in self.given_up
                )
                owned = running + sum(1 for n in self._restarting if n.startswith("rollout-"))
                lost = sum(1 for n in self.given_up if n.startswith("rollout-"))
            more = replacements_due(
                owned, desired, lost=lost, started=self._replacements, config=self.config,
                retry_at=self._scale_retry_at,
            )  # fmt: skip
            if not more:
                return
            self._replacements += more
            target = running + more  # exactly those: restarting ones come back by themselves
        else:
            target = desired
        try:
            self.scale_rollout(target)
        except ServiceStartError:
            self._scale_retry_at = scale_retry_at(self.config)  # not every 0.5 s
            self._scale_generation = generation
            raise
        self._scale_generation = generation

    def scale_rollout(self, replicas: int, timeout_s: float = 120.0) -> None:
        """Start or stop rollout replicas until ``replicas`` run.

        A new replica takes the next free name (``rollout-K``) and the CPU cores (or
        GPUs) of the pool's shares round robin, registers with the scheduler, and gets
        the current weights from the driver before it takes work. A removed one (the
        newest first) is deregistered first, so the driver sends it nothing new, then
        drained: SIGTERM lets it finish the calls in flight within ``grace_s``; what
        it could not finish the driver re-queues on the others.
        """
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if not self._rollout_shares or self._config_path is None:
            raise RuntimeError("this cluster launched no rollout replicas: nothing to scale")
        with self._lock:
            current = [
                p for p in self._procs if p.kind == "rollout" and p.name not in self.given_up
            ]
        current.sort(key=lambda p: replica_number(p.name))
        if len(current) == replicas:
            return
        logger.warning("scaling rollout replicas %d -> %d", len(current), replicas)
        if len(current) < replicas:
            added: list[_Proc] = []
            try:
                for _ in range(replicas - len(current)):
                    k = self._next_rollout
                    self._next_rollout += 1
                    share = self._rollout_shares[k % len(self._rollout_shares)]
                    proc = self._rollout_proc(k, self._config_path, share)
                    self._join_args(proc)
                    with self._lock:
                        self._starting.add(proc.name)
                    added.append(proc)
                    self._launch(proc)
                self._await(added, time.monotonic() + timeout_s)
            except ServiceStartError as e:
                logger.error("scaling up failed: %s", e)
                self._retire(added)
                raise
            finally:
                with self._lock:
                    self._starting.difference_update(p.name for p in added)
            self.events["scaled_up"] += len(added)
            logger.warning("rollout replicas added: %s",
                           ", ".join(f"{p.name}={p.address}" for p in added))  # fmt: skip
            return
        leaving = current[replicas:][::-1]
        self._retire(leaving)
        self.events["scaled_down"] += len(leaving)

    def _retire(self, procs: Sequence[_Proc]) -> None:
        """Take replicas out: off the supervisor's list, deregistered, then drained."""
        with self._lock:
            for proc in procs:
                if proc in self._procs:
                    self._procs.remove(proc)
        for proc in procs:
            if self.scheduler_address and proc.address:
                deregister_address(self.scheduler_address, proc.address)
        infos = [ProcessInfo(p.name, p.pid, p.start_time, str(p.log_path)) for p in procs]
        popens = {p.pid: p.popen for p in procs if p.popen is not None}
        stop_processes(infos, grace_s=self.grace_s, popens=popens)
        for proc in procs:
            logger.warning("%s (%s) drained and stopped", proc.name, proc.address)

    def fleet_metrics(self) -> dict[str, float]:
        """What the launcher did, for the run's step metrics (``fleet/...``)."""
        return fleet_metrics(self.events, len(self.rollout_replicas()))

    def kill_trainer(self) -> None:
        """SIGKILL the trainer's process group (all its ranks): the driver's last resort
        for one that stopped answering without dying; the supervisor then restarts it
        (``trainer.recovery``). Nothing when this cluster did not start a trainer."""
        with self._lock:
            procs = [p for p in self._procs if p.kind == "trainer" and p.popen is not None]
        for proc in procs:
            logger.warning("killing the unresponsive trainer %s (pid %d)", proc.address, proc.pid)
            self.events["killed"] = self.events.get("killed", 0) + 1
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: pgid == pid

    def _launch(self, proc: _Proc) -> None:
        if proc.address_file is not None:
            proc.address_file.unlink(missing_ok=True)
        parent = os.getpid() if self._pdeathsig else 0
        pin = hasattr(os, "sched_setaffinity")
        if pin or parent:
            cores = ",".join(str(c) for c in proc.cores) if pin else ""
            argv = [self.python, "-c", _LAUNCHER, cores, str(parent), *proc.argv]
        else:  # pragma: no cover - not Linux
            argv = [self.python, *proc.argv]
        env = {**os.environ, **proc.env}
        proc.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(proc.log_path, "ab") as log:
            log.write(f"# {' '.join(proc.argv)}\n".encode())
            log.flush()
            proc._read = log.tell()
            with self._lock:
                if self._stopped:  # a restart racing stop(): start nothing it would miss
                    raise ServiceStartError(f"{proc.name}: the cluster is stopping")
                proc.popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=os.getcwd(),
                    start_new_session=True,
                )
                self._procs.append(proc)
        proc.start_time = process_start_time(proc.pid)
        logger.info(
            "started %s (pid %d, cores %s%s)",
            proc.name,
            proc.pid,
            ",".join(map(str, proc.cores)) or "any",
            f", CUDA_VISIBLE_DEVICES={proc.gpus}" if proc.gpus is not None else "",
        )

    def _scan(self, proc: _Proc) -> None:
        """Pick up the address from the serving line or the address file."""
        if proc.address is None and proc.address_file is not None and proc.address_file.exists():
            text = proc.address_file.read_text().strip()
            if text:
                proc.address = text
        if proc.address is not None and proc.metrics_address is not None:
            return
        try:
            with open(proc.log_path, "rb") as f:
                f.seek(proc._read)
                chunk = f.read()
        except OSError:
            return
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        proc._read += end + 1
        for line in chunk[: end + 1].splitlines():
            line = line.strip()
            if not line.startswith(b"{"):
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("event") == "serving" and msg.get("address"):
                proc.address = str(msg["address"])
                metrics = msg.get("metrics_address") or msg.get("metrics")
                proc.metrics_address = str(metrics) if metrics else None
                if msg.get("openai_url"):  # rollout.openai.port: where agents connect
                    logger.info("%s: OpenAI endpoint at %s", proc.name, msg["openai_url"])

    def _failure(self, proc: _Proc, what: str) -> ServiceStartError:
        tail = log_tail(proc.log_path)
        said = [line[len("error: ") :] for line in tail.splitlines() if line.startswith("error: ")]
        if said:  # the service said why in one line: that line, not its log's tail
            error = ServiceStartError(
                f"{what}: {said[-1]} (log: {proc.log_path})",
                field=proc.name,
                value=str(proc.log_path),
            )
            error.bad_input = proc.popen is not None and proc.popen.returncode == 2
            return error
        return ServiceStartError(
            f"{proc.name} {what}; last lines of {proc.log_path}:\n{tail}",
            field=proc.name,
            value=str(proc.log_path),
        )

    def _await(self, procs: Sequence[_Proc], deadline: float) -> None:
        pending = list(procs)
        while pending:
            for proc in list(pending):
                self._scan(proc)
                code = proc.popen.poll() if proc.popen is not None else None
                if code is not None:
                    raise self._failure(proc, f"exited with code {code} during start-up")
                if proc.address is not None:
                    pending.remove(proc)
            if not pending:
                break
            if time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise self._failure(pending[0], f"did not report its address in time ({names})")
            time.sleep(0.05)
        for proc in procs:
            assert proc.address is not None
            while True:
                left = deadline - time.monotonic()
                try:
                    wait_for_ready(proc.address, timeout_s=max(0.1, min(left, 2.0)))
                    break
                except Unavailable as e:
                    code = proc.popen.poll() if proc.popen is not None else None
                    if code is not None:
                        raise self._failure(proc, f"exited with code {code} during start-up") from e
                    if time.monotonic() >= deadline:
                        raise self._failure(proc, f"was not healthy in time: {e}") from e
            # A rollout's metrics address arrives on the same line; the trainer may
            # also print one: read it if it is there.
            self._scan(proc)

    def _check_external(self, deadline: float) -> None:
        s = self.config.services
        external = [a for a in (s.reward, s.trainer, *s.rollout) if a]
        if s.tools and self.config.rollout.multi_turn.enable:
            external.append(s.tools)
        if not self.launch_scheduler and self.scheduler_address:
            external.append(self.scheduler_address)
        for address in external:
            wait_for_ready(address, timeout_s=max(0.1, deadline - time.monotonic()))

    def _register_probed(self, procs: Sequence[_Proc], deadline: float) -> None:
        """Register reward and trainer with the scheduler; it health-checks them."""
        from rlfleet.scheduler.client import RemoteSchedulerClient

        assert self.scheduler_address is not None
        roles = ",".join(r for r in self.config.enabled_roles() if r in ("actor", "critic", "ref"))
        node = socket.gethostname()
        kind = self.config.trainer.device
        with RemoteSchedulerClient(
            self.scheduler_address, timeout_s=max(1.0, deadline - time.monotonic())
        ) as client:
            for proc in procs:
                if proc.kind not in ("reward", "trainer") or proc.address is None:
                    continue
                caps = {LIVENESS_CAPABILITY: LIVENESS_PROBE, "launched_by": "local-cluster"}
                if proc.kind == "trainer":
                    caps["roles"] = roles
                if kind == "cpu":
                    devices = tuple(Device("cpu", c, "cpu") for c in proc.cores)
                else:
                    devices = tuple(
                        Device("cuda", int(g), g) if g.isdigit() else Device("cuda", i, g)
                        for i, g in enumerate((proc.gpus or "").split(","))
                        if g
                    )
                spec = ServiceSpec(
                    role="reward" if proc.kind == "reward" else "trainer",
                    address=proc.address,
                    service_id=proc.name,  # the launcher's name: one name everywhere
                    node=node,
                    devices=devices,
                    capabilities=caps,
                    metrics_address=proc.metrics_address or "",
                    pid=proc.pid,
                )
                service_id = client.register(spec).service_id
                if service_id not in self._registered:  # (re-registered after a restart)
                    self._registered.append(service_id)

    def _make_handle(self, plan: PlacementPlan, config_path: Path) -> ClusterHandle:
        s = self.config.services
        by_kind: dict[str, list[_Proc]] = {}
        for p in self._procs:
            by_kind.setdefault(p.kind, []).append(p)

        def address(kind: str, given: str | None) -> str:
            if given:
                return given
            procs = by_kind.get(kind, [])
            return procs[0].address or "" if procs else ""

        rollout = list(s.rollout) or [p.address or "" for p in by_kind.get("rollout", [])]
        return ClusterHandle(
            scheduler=self.scheduler_address,
            reward=address("reward", s.reward),
            trainer=address("trainer", s.trainer),
            rollout=rollout,
            metrics={p.name: p.metrics_address for p in self._procs if p.metrics_address},
            pids={p.name: p.pid for p in self._procs},
            cores={p.name: list(p.cores) for p in self._procs},
            gpus={p.name: p.gpus for p in self._procs if p.gpus is not None},
            run_dir=str(self.run_dir),
            config_path=str(config_path),
            mode=plan.mode,
            tools=self.tools_address,
            credentials_dir=str(self.credentials_dir or ""),
        )

    # ------------------------------------------------------------------ stop

    def processes(self) -> list[ProcessInfo]:
        """The processes started (for a state file, or checks)."""
        with self._lock:
            return [
                ProcessInfo(p.name, p.pid, p.start_time, str(p.log_path))
                for p in self._procs
                if p.popen is not None
            ]

    @property
    def pids(self) -> dict[str, int]:
        with self._lock:
            return {p.name: p.pid for p in self._procs if p.popen is not None}

    def stop(self, grace_s: float | None = None) -> None:
        """Stop every process started: SIGTERM to each group, wait, SIGKILL the rest.

        Services first, the scheduler last (rollout replicas deregister on the way
        out). Idempotent; safe from atexit and signal handlers.
        """
        grace = self.grace_s if grace_s is None else grace_s
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            procs = list(self._procs)
        self._remove_stop_hooks()
        self._deregister_probed()
        services = [p for p in procs if p.kind != "scheduler"]
        schedulers = [p for p in procs if p.kind == "scheduler"]
        for group in (services, schedulers):
            infos = [ProcessInfo(p.name, p.pid, p.start_time, str(p.log_path)) for p in group]
            popens = {p.pid: p.popen for p in group if p.popen is not None}
            stop_processes(infos, grace_s=grace, popens=popens)
        if self.security is not None and current_security() is self.security:
            set_security(self._previous_security)
        logger.info("local cluster stopped (%d processes)", len(procs))

    def _deregister_probed(self) -> None:
        if not self._registered or not self.scheduler_address:
            return
        from rlfleet.scheduler.client import RemoteSchedulerClient

        try:
            with RemoteSchedulerClient(self.scheduler_address, timeout_s=2.0) as client:
                for sid in self._registered:
                    client.deregister(sid)
        except Exception as e:  # the scheduler may be gone already: nothing to undo
            logger.info("could not deregister %s: %s", self._registered, e)
        self._registered.clear()

    def _install_stop_hooks(self) -> None:
        if self.detach:
            return
        self._atexit = self.stop
        atexit.register(self._atexit)
        if threading.current_thread() is threading.main_thread():
            self._pdeathsig = sys.platform.startswith("linux")
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _remove_stop_hooks(self) -> None:
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        previous = self._old_sigterm
        self.stop()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            raise SystemExit(128 + signum)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- stopping by PID


def _is_ours(info: ProcessInfo) -> bool:
    """True while the PID is alive and still the process we started."""
    with contextlib.suppress(ChildProcessError):  # our own child (same process): reap it
        if os.waitpid(info.pid, os.WNOHANG)[0] == info.pid:
            return False
    if _zombie(info.pid):
        return False  # exited; its parent has yet to reap it
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # someone else's process now
    if info.start_time is not None:
        now = process_start_time(info.pid)
        if now is not None and now != info.start_time:
            return False
        if now is None and Path("/proc").is_dir():
            return False  # gone between the two checks
    return True


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].startswith("Z")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def replacements_due(
    owned: int, desired: int, *, lost: int, started: int, config: Config, retry_at: float
) -> int:
    """How many rollout replicas a launcher starts now in place of ``lost`` ones (given
    up, or whose replacement failed) to keep the desired count: the shortfall, at most
    the lost ones not yet replaced and ``services.max_restarts`` replacements in all
    (``started`` so far); 0 while a failed start's wait (``retry_at``,
    ``time.monotonic()``) runs. A shortfall with nothing lost (a scale-up refused) is
    not retried here."""
    more = min(desired - owned, lost - started, config.services.max_restarts - started)
    if more <= 0 or time.monotonic() < retry_at:
        return 0
    logger.warning("rollout replicas given up: %d of the desired %d run; starting %d "
                   "in their place", owned, desired, more)  # fmt: skip
    return more


def scale_retry_at(config: Config) -> float:
    """When a scale-up whose start failed is tried again: after the restart backoff's
    longest wait (at least 5 s)."""
    wait = config.services.restart_backoff_s * 2.0**config.services.max_restarts
    return time.monotonic() + max(5.0, wait)


def kill_leftovers(pid: int, name: str) -> bool:
    """SIGKILL what a dead service left in its process group (services start in a
    session of their own, so the group's id is the service's pid, and Linux hands a
    pid out again only once no group uses it). A child that outlives its service --
    vLLM's engine-core and worker processes, which do not follow their parent --
    would keep the device memory and ports a restart needs. Returns whether anything
    was left."""
    if not _group_alive(pid):
        return False
    logger.warning("%s (pid %d) died and left processes in its group: killing them", name, pid)
    members = _group_members(pid)
    segments = _shm_mapped_by(members)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    if segments:
        _remove_orphaned_segments(segments, members)
    return True


def _group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _shm_mapped_by(pids: Sequence[int]) -> set[str]:
    """The ``/dev/shm`` files the processes ``pids`` map (their ``/proc/<pid>/maps``)."""
    found: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            _, sep, path = line.partition(" /dev/shm/")
            if sep and "/" not in path and not path.endswith(" (deleted)"):
                found.add(path)
    return found


def _remove_orphaned_segments(names: set[str], killed: Sequence[int]) -> None:
    """Unlink the shared-memory files that only the SIGKILLed processes ``killed`` used
    (vLLM's message queues, each hundreds of MB: the resource tracker that would have
    unlinked them died in the same group, so they stayed until the next boot). Files
    another live process maps, or of another user, stay."""
    deadline = time.monotonic() + 5.0
    while any(Path(f"/proc/{p}").exists() and not _zombie(p) for p in killed):
        if time.monotonic() > deadline:
            return  # not all gone yet: leave the files rather than guess
        time.sleep(0.02)
    still = _shm_mapped_by([int(p.name) for p in Path("/proc").glob("[0-9]*")])
    removed = []
    for name in sorted(names - still):
        path = Path("/dev/shm") / name
        try:
            ours = not path.is_symlink() and path.is_file() and path.stat().st_uid == os.geteuid()
        except OSError:
            continue
        if ours:
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(name)
    if removed:
        logger.warning("removed %d shared-memory files the killed processes left: %s",
                       len(removed), ", ".join(removed))  # fmt: skip


def _signal(info: ProcessInfo, sig: signal.Signals, *, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(info.pid, sig)  # started with start_new_session: pgid == pid
        else:
            os.kill(info.pid, sig)


def stop_processes(
    infos: Sequence[ProcessInfo],
    *,
    grace_s: float = 10.0,
    popens: Mapping[int, subprocess.Popen[bytes] | None] | None = None,
) -> list[str]:
    """SIGTERM each process (and its process group), wait ``grace_s``, SIGKILL the rest.

    Only PIDs that are still the processes recorded (same start time) are signalled.
    Children of this process are reaped through ``popens``.

    Returns:
        Names of the processes that had to be killed.
    """
    popens = popens or {}

    def alive(info: ProcessInfo) -> bool:
        popen = popens.get(info.pid)
        if popen is not None:
            return popen.poll() is None
        return _is_ours(info)

    live = [i for i in infos if alive(i)]
    for info in live:
        _signal(info, signal.SIGTERM, group=True)
    deadline = time.monotonic() + grace_s
    killed: list[str] = []
    for info in live:
        popen = popens.get(info.pid)
        if popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        else:
            while alive(info) and time.monotonic() < deadline:
                time.sleep(0.05)
        if alive(info):
            logger.warning(
                "%s (pid %d) ignored SIGTERM for %.1fs: SIGKILL", info.name, info.pid, grace_s
            )
            _signal(info, signal.SIGKILL, group=True)
            killed.append(info.name)
            if popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=10.0)
            else:
                end = time.monotonic() + 10.0
                while alive(info) and time.monotonic() < end:
                    time.sleep(0.05)
        # Stragglers of the group (torchrun's workers) once the leader is gone.
        if _group_alive(info.pid):
            end = time.monotonic() + grace_s
            while _group_alive(info.pid) and time.monotonic() < end:
                time.sleep(0.05)
            if _group_alive(info.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(info.pid, signal.SIGKILL)
    return killed
