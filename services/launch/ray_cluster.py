"""A cluster on Ray: every service as a Ray actor on the node its pool places it.

::

    with RayCluster(config, run_dir) as cluster:       # config.launcher == "ray"
        handle = cluster.start(timeout_s=300)          # the same ClusterHandle as LocalCluster
        ...                                            # train against handle's addresses
    # every actor, its service process and every placement group gone

What :meth:`RayCluster.start` does:

1. Connects to Ray (``ray.address``: ``auto`` joins the running cluster, else starts a
   local one for the run and shuts it down at :meth:`stop`; or ``host:port``).
2. Turns ``resource_pools`` into placement groups: one per pool, a bundle per node
   entry (``{"CPU": n}`` on cpu, ``{"GPU": n}`` on cuda), ``ray.pool_strategy``
   across the entries (``STRICT_SPREAD`` by default: each entry is a node) and
   ``STRICT_PACK`` for a one-node pool. A pool that
   cannot be placed fails the start with what Ray has.
3. Starts each service as a :class:`ServiceActor` (named ``rlfleet/<service>`` in the
   ``ray.namespace``) in its pool's bundle; the actor runs the service's real process
   (``python -m rlfleet.<service>.server``) bound to its node's IP address, with its
   role's credentials in the environment (never argv), and reports the address the
   service printed. The scheduler comes first; rollout replicas register with it and
   reward / trainer are registered for probing, as with :class:`LocalCluster`.
   Roles sharing a pool share its bundles (colocation).
4. The trainer's ranks (``world_size("actor")``) are actors in the train pool's
   bundles: rank 0's node address and a free port there are the torch.distributed
   master (gloo on cpu, NCCL on cuda); rank 0 serves gRPC.

Every node must see the model, the data and the run directory at the same paths (a
shared file system, or the same copies): the config and logs are written on each
node by its actors. Each actor requests no CPU of its own (``num_cpus=0``): the bundle
holds the pool's resources and the service process uses them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.common.auth import (
    INSECURE_ENV,
    CredentialError,
    credential_set,
    credentials_env,
    read_credential_set,
    write_credential_set,
)
from rlfleet.common.config import Config, save_resolved
from rlfleet.common.errors import RlfleetError
from rlfleet.common.roles import PRINCIPALS
from rlfleet.common.rpc import Security, current_security, set_security
from rlfleet.launch.cluster import (
    ClusterHandle,
    ProcessInfo,
    ServiceStartError,
    cluster_tls,
    deregister_address,
    drain_time,
    fleet_metrics,
    kill_leftovers,
    log_tail,
    needs_tools_service,
    replacements_due,
    replica_number,
    reward_argv,
    rollout_argv,
    scale_retry_at,
    scheduler_argv,
    tools_argv,
    trainer_argv,
)
from rlfleet.scheduler.placement import Device
from rlfleet.scheduler.registry import (
    LIVENESS_CAPABILITY,
    LIVENESS_PROBE,
    MAX_DEVICES,
    ServiceSpec,
)

__all__ = ["GpuPlan", "RayCluster", "ServiceActor", "pool_bundles"]

logger = logging.getLogger(__name__)

_HOST = "{node_ip}"  # replaced by the actor with its node's IP address


def _pool(cfg: Config, role: str) -> str | None:
    pool: str | None = getattr(cfg.mapping, role)
    return pool


def pool_bundles(
    nodes: Sequence[int], device: str, across: str = "STRICT_SPREAD"
) -> tuple[list[dict[str, float]], str]:
    """A pool's placement-group bundles (one per node entry) and strategy: ``across``
    (``ray.pool_strategy``) for several entries, ``STRICT_PACK`` for one."""
    key = "GPU" if device == "cuda" else "CPU"
    bundles = [{key: float(n)} for n in nodes]
    return bundles, ("STRICT_PACK" if len(bundles) == 1 else across)


class GpuPlan:
    """Who holds which GPUs of a pool's bundles on cuda (Ray counts GPUs per actor).

    A pool's GPUs belong to one service kind, its *owner*: the trainer where the actor
    role is (one GPU per rank), else rollout (``rollout.tensor_parallel_size`` per
    replica), else the reward model (one). The owner's actors ask Ray for them, so
    Ray never puts more in a bundle than it holds. A kind colocated in another's pool
    asks for none and is handed GPUs its owner holds on the same node (a rollout
    replica in slot ``j`` of its bundle: the owner's GPUs ``j*tp .. j*tp+tp-1``, in
    rank order; the reward model: the first), as verl's colocated workers share theirs.
    Rollout replicas fit ``GPUs // tensor_parallel_size`` to a bundle; one more is
    refused rather than left pending. On cpu nothing is counted: bundles hold CPUs.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.cuda = config.trainer.device == "cuda"
        self.tp = config.rollout.tensor_parallel_size

    def owner(self, pool: str) -> str:
        cfg = self.config
        if _pool(cfg, "actor") == pool:
            return "trainer"
        return "rollout" if _pool(cfg, "rollout") == pool else "reward"

    def request(self, kind: str, pool: str | None) -> float:
        """GPUs the actor of a ``kind`` service in ``pool`` asks Ray for."""
        if not self.cuda or pool is None or kind != self.owner(pool):
            return 0.0
        return float(self.tp) if kind == "rollout" else 1.0

    def rank_bundles(self, pool: str, world: int) -> list[int]:
        """The bundle of each trainer rank: consecutive ranks fill a node entry (one
        rank per GPU on cuda, per node on cpu); beyond that, round robin."""
        room = [n if self.cuda else 1 for n in self.config.resource_pools[pool]]
        out = [b for b, n in enumerate(room) for _ in range(n)][:world]
        return out + [r % len(room) for r in range(len(out), world)]

    def rollout_room(self, pool: str) -> list[int] | None:
        """Replicas each bundle of the rollout pool holds (None: not counted, cpu)."""
        if not self.cuda:
            return None
        return [n // self.tp for n in self.config.resource_pools[pool]]

    def place_rollout(
        self,
        pool: str,
        taken: Sequence[tuple[int, int]],
        allowed: Collection[int] | None = None,
    ) -> tuple[int, int]:
        """``(bundle, slot)`` for one more rollout replica, given those of the running
        ones: the bundle with the most room left (the fewest replicas on cpu), its
        lowest free slot; only among ``allowed`` bundles when given (those on live
        nodes, for a replacement).

        Raises:
            ServiceStartError: on cuda, every (allowed) bundle is full.
        """
        entries = len(self.config.resource_pools[pool])
        room = self.rollout_room(pool)
        used: dict[int, set[int]] = {b: set() for b in range(entries)}
        for b, slot in taken:
            used.setdefault(b, set()).add(slot)
        candidates = [b for b in range(entries) if allowed is None or b in allowed]
        if not candidates:
            raise ServiceStartError(
                f"no bundle of pool {pool} is on a live node", field="rollout.replicas"
            )
        if room is None:
            bundle = min(candidates, key=lambda b: (len(used[b]), b))
            return bundle, min(set(range(len(used[bundle]) + 1)) - used[bundle])
        free = [(room[b] - len(used[b]), -b) for b in candidates]
        left, neg = max(free)
        if left <= 0:
            raise ServiceStartError(
                f"no room for another rollout replica in pool {pool}: "
                f"{self.config.resource_pools[pool]} GPUs per node hold {sum(room)} replicas "
                f"of tensor_parallel_size {self.tp}",
                field="rollout.replicas",
                value=len(taken) + 1,
            )
        bundle = -neg
        return bundle, min(set(range(room[bundle])) - used[bundle])

    def shared_devices(
        self, kind: str, slot: int, owner_gpus: Sequence[str], where: str
    ) -> list[str]:
        """The owner's GPUs (on the same node, in rank order) a colocated ``kind``
        service in ``slot`` uses."""
        want = self.tp if kind == "rollout" else 1
        first = slot * want if kind == "rollout" else 0
        picked = list(owner_gpus[first : first + want])
        if len(picked) < want:
            raise ServiceStartError(
                f"{where}: a colocated {kind} service needs {want} GPU(s) of its pool's "
                f"owner from #{first}, which holds {list(owner_gpus)} on that node",
                field="rollout.tensor_parallel_size",
                value=self.tp,
            )
        return picked


class ServiceActor:
    """Runs one service process on its node (made a Ray actor by :class:`RayCluster`).

    The process is the same one :class:`LocalCluster` starts (so signals, logs,
    health and graceful stop behave the same); the actor starts it, reports its
    address, and stops it (SIGTERM, then SIGKILL) when asked or when the actor dies
    (the child gets SIGTERM when its parent goes, ``PR_SET_PDEATHSIG``).
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._label = "service"  # its log's name (rollout-3, trainer-rank1, ...)

    def node(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "actor_id": ctx.get_actor_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
        }

    def free_port(self) -> int:
        import ray

        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return int(s.getsockname()[1])

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        files: dict[str, str],
        log_path: str,
        address_file: str | None,
        wait_address: bool,
        timeout_s: float,
    ) -> dict[str, Any]:
        """Write ``files`` (path -> text: the config), start ``python argv``, wait for
        the address it reports (its serving line, or ``address_file``)."""
        import ray

        ip = ray.util.get_node_ip_address()
        for path, text in files.items():
            # Atomically: on one machine (or a shared file system) several actors write
            # the same config while a service started before may be reading it.
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, target)
        argv = [a.replace(_HOST, ip) for a in argv]
        if address_file:
            Path(address_file).unlink(missing_ok=True)
        log = Path(log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
        self._label = log.stem
        launcher = (
            "import ctypes, os, signal, sys\n"
            "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
            "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
        )
        with open(log, "ab") as f:
            f.write(f"# {' '.join(argv)}\n".encode())
            f.flush()
            start = f.tell()
            self._proc = subprocess.Popen(
                [sys.executable, "-c", launcher, *argv],
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
            )
        out = {"pid": self._proc.pid, "ip": ip, "address": None, "metrics_address": None}
        if not wait_address:
            return out
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"exited with code {self._proc.returncode} during start-up; "
                    f"last lines of {log}:\n{log_tail(log)}"
                )
            if address_file and Path(address_file).exists():
                text = Path(address_file).read_text().strip()
                if text:
                    out["address"] = text
                    return out
            serving = _serving_line(log, start)
            if serving is not None:
                out["address"] = serving.get("address")
                metrics = serving.get("metrics_address") or serving.get("metrics")
                out["metrics_address"] = metrics or None
                return out
            time.sleep(0.05)
        raise RuntimeError(f"did not report its address within {timeout_s}s; log {log}")

    def poll(self) -> int | None:
        """The service's exit code, None while it runs; once it has exited, what it
        left in its process group is killed here, on its node (see kill_leftovers)."""
        if self._proc is None:
            return None
        code = self._proc.poll()
        if code is not None:
            kill_leftovers(self._proc.pid, self._label)
        return code

    def stop(self, grace_s: float) -> int | None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(timeout=10)


def driver_ip(address: str) -> str:
    """This machine's address towards the Ray head at ``address`` (host:port): the
    driver joins the cluster as the node with that IP. ``127.0.0.1`` for a head on
    loopback; else the source address the kernel routes to the head from (a UDP
    ``connect`` sends no packet), which on a machine with several interfaces is the
    one on the cluster's network, not whichever one reaches the internet."""
    host, _, port = address.rpartition(":")
    infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)
    # IPv4 first: Ray's nodes name themselves by IPv4 address unless told otherwise.
    family, kind, _, _, sockaddr = min(infos, key=lambda info: info[0] != socket.AF_INET)
    if ipaddress.ip_address(sockaddr[0]).is_loopback:
        return "127.0.0.1" if family == socket.AF_INET else "::1"
    with socket.socket(family, kind) as probe:
        probe.connect(sockaddr)
        return str(probe.getsockname()[0])


def _actor_gone(ray: Any, error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) says an actor is dead."""
    while error is not None:
        if isinstance(error, ray.exceptions.RayActorError):
            return True
        error = error.__cause__  # type: ignore[assignment]
    return False


def _where(svc: _Service) -> str:
    """``svc``'s node, for log lines."""
    return f"node {svc.info.get('ip')} ({str(svc.info.get('node_id', ''))[:12]})"


def _keep_port(svc: _Service) -> None:
    """Make ``svc``'s next start listen on the port it has now (every client's address
    of it stays valid)."""
    argv = list(svc.launch["argv"])
    if svc.address and "--port" in argv:
        argv[argv.index("--port") + 1] = svc.address.rpartition(":")[2]
    svc.launch["argv"] = argv


def _serving_line(log: Path, start: int) -> dict[str, Any] | None:
    try:
        with open(log, "rb") as f:
            f.seek(start)
            data = f.read()
    except OSError:
        return None
    for line in data.splitlines():
        line = line.strip()
        if not line.startswith(b"{"):
            continue
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and msg.get("event") == "serving" and msg.get("address"):
            return msg
    return None


_SAME = object()  # _launch_again: the service's own actor


@dataclass
class _Service:
    name: str
    kind: str  # scheduler | reward | trainer | rollout
    actor: Any
    pool: str | None
    bundle: int | None
    info: dict[str, Any] = field(default_factory=dict)  # node ip / id, actor id
    slot: int = 0  # a rollout replica's place in its bundle (GpuPlan)
    pid: int = 0
    address: str | None = None
    metrics_address: str | None = None
    launch: dict[str, Any] = field(default_factory=dict)  # what _launch got: to do it again


class RayCluster:
    """Start and stop the services of a run as Ray actors (same interface as LocalCluster).

    Args:
        config: the validated run config (its ``ray`` section says where).
        run_dir: ``config.yaml``, ``logs/<service>.log`` (on each service's node).
        scheduler: start a scheduler actor (False: use ``config.services.scheduler``).
        heartbeat_interval_s: the scheduler's heartbeat interval.
        grace_s: SIGTERM-to-SIGKILL wait of :meth:`stop`.
    """

    def __init__(
        self,
        config: Config,
        run_dir: str | Path,
        *,
        scheduler: bool = True,
        heartbeat_interval_s: float = 2.0,
        grace_s: float = 10.0,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir).resolve()
        self.launch_scheduler = scheduler and config.services.scheduler is None
        self.scheduler_address: str | None = config.services.scheduler
        self.tools_address: str | None = config.services.tools
        self.heartbeat_interval_s = heartbeat_interval_s
        self.grace_s = grace_s
        self.security: Security | None = None
        self.credentials_dir: Path | None = None
        self.handle: ClusterHandle | None = None
        self.placement_groups: dict[str, Any] = {}
        self.restarts: dict[str, int] = {}
        self._services: list[_Service] = []
        self._role_env: dict[str, dict[str, str]] = {}
        self._previous_security: Security | None = None
        self._own_ray = False
        self._stopped = False
        self._stop_event = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._scaler: threading.Thread | None = None
        self._lock = threading.RLock()
        self.supervise_interval_s = 1.0
        self.events: collections.Counter[str] = collections.Counter()
        self.given_up: set[str] = set()
        self._scale_generation = 0
        # Rollout replicas out of ``_services`` for a moment, still the fleet's: those
        # between a restart's stop and start, and lost ones whose replacement is placed.
        self._restarting: set[str] = set()
        self._replacing_names: set[str] = set()  # the lost replicas being replaced
        # The (bundle, slot) of rollout replicas out of ``_services`` for a moment, so
        # that no other replica is placed on them: a restart's own place, and places
        # chosen for a scale-up or a replacement until their replicas are started.
        self._held: dict[object, list[tuple[int, int]]] = {}
        # Replicas started in place of given-up ones (at most services.max_restarts),
        # and when a failed start of them may be tried again.
        self._replacements = 0
        self._scale_retry_at = 0.0
        self._next_rollout = config.rollout_replicas()
        self.gpus = GpuPlan(config)

    # ------------------------------------------------------------------ start

    def start(self, timeout_s: float | None = None) -> ClusterHandle:
        """Place the pools, start every service, wait until each answers; the addresses.

        Raises:
            ServiceStartError: a pool cannot be placed, or a service failed to start
                (with its log tail); everything started is stopped first.
        """
        import ray

        if not self.config.security.auth:  # before Ray is joined or started
            raise CredentialError(
                "security.auth=false is refused with launcher=ray: services listen on their "
                "nodes' addresses, beyond loopback, only with authentication on"
            )
        timeout = timeout_s if timeout_s is not None else self.config.ray.start_timeout_s
        deadline = time.monotonic() + timeout
        self._connect(ray)
        config_path = save_resolved(self.config, self.run_dir)
        config_text = config_path.read_text()
        self._prepare_security()
        try:
            self._place(ray, deadline)
            if self.launch_scheduler:
                sched = self._launch(
                    ray,
                    "scheduler",
                    "scheduler",
                    None,
                    None,
                    scheduler_argv(_HOST, config_path, self.heartbeat_interval_s, plan_local=False),
                    {},
                    config_path,
                    config_text,
                    deadline,
                )
                self._finish(ray, sched, deadline)
                self.scheduler_address = sched.address
            if needs_tools_service(self.config):  # pool-less, on the driver's node
                tools = self._launch(
                    ray, "tools", "tools", None, None, tools_argv(_HOST, config_path), {},
                    config_path, config_text, deadline,
                )  # fmt: skip
                self._finish(ray, tools, deadline)
                self.tools_address = tools.address
            self._start_services(ray, config_path, config_text, deadline)
            self._register_probed(deadline)
        except BaseException:
            self.stop()
            raise
        self.handle = self._make_handle(config_path)
        self._supervisor = threading.Thread(
            target=self._supervise, name="rlfleet-ray-supervisor", daemon=True
        )
        self._supervisor.start()
        # Its own thread: a scale-up (placing actors, loading the model) or a drain
        # must not hold back the restart of a service that dies meanwhile.
        self._scaler = threading.Thread(
            target=self._follow_scale_loop, name="rlfleet-ray-scaler", daemon=True
        )
        self._scaler.start()
        logger.info(
            "ray cluster up: %s",
            ", ".join(f"{s.name}={s.address} on {_where(s)}" for s in self._services),
        )
        return self.handle

    def _connect(self, ray: Any) -> None:
        if ray.is_initialized():
            return
        address = self.config.ray.address
        kwargs: dict[str, Any] = {"namespace": self.config.ray.namespace, "log_to_driver": False}
        if address == "auto":
            try:
                ray.init(address="auto", **kwargs)
                return
            except (ConnectionError, RuntimeError) as e:
                logger.info("no running Ray cluster (%s): starting a local one", e)
            # A Ray of this run only: on loopback (its workers read this variable at
            # start and then take 127.0.0.1 as their node's address), no dashboard.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, **kwargs)
            self._own_ray = True
        else:
            ray.init(address=address, _node_ip_address=driver_ip(address), **kwargs)

    def _prepare_security(self) -> None:
        sec = self.config.security
        tls = cluster_tls(self.config)
        root = Path(sec.credentials_dir) if sec.credentials_dir else None
        if root is None:
            root = write_credential_set(self.run_dir / "secrets")
        tokens = read_credential_set(root)
        self.credentials_dir = root
        creds = credential_set(tokens)
        self.security = Security(credentials=creds["driver"], tls=tls)
        tls_env = self.security.tls_env()
        # Inline: another node need not see this machine's files.
        self._role_env = {
            role: {**credentials_env(creds[role]), INSECURE_ENV: "", **tls_env}
            for role in PRINCIPALS
            if role in creds  # a set written before a principal existed lacks it
        }
        self._previous_security = current_security()
        set_security(self.security)

    def _place(self, ray: Any, deadline: float) -> None:
        from ray.util.placement_group import placement_group

        cfg = self.config
        used = {p for r in cfg.enabled_roles() if (p := _pool(cfg, r)) is not None}
        for pool in sorted(used):
            bundles, strategy = pool_bundles(
                cfg.resource_pools[pool], cfg.trainer.device, cfg.ray.pool_strategy
            )
            pg = placement_group(bundles, strategy=strategy, name=f"rlfleet/{pool}")
            self.placement_groups[pool] = pg
            left = max(1.0, deadline - time.monotonic())
            ready, _ = ray.wait([pg.ready()], timeout=left)
            if not ready:
                raise ServiceStartError(
                    f"pool {pool} ({bundles}, {strategy}) cannot be placed on the Ray "
                    f"cluster within {left:.0f}s; it has {ray.available_resources()} "
                    f"available on {len(ray.nodes())} node(s)",
                    field=f"resource_pools.{pool}",
                    value=cfg.resource_pools[pool],
                )

    def _actor(self, ray: Any, name: str, pool: str | None, bundle: int | None, gpus: float) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options: dict[str, Any] = {
            "name": f"rlfleet/{name}",
            "namespace": self.config.ray.namespace,
            "num_cpus": 0,
            "num_gpus": gpus,
            "max_concurrency": 4,
        }
        if pool is not None and bundle is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.placement_groups[pool], placement_group_bundle_index=bundle
            )
        else:
            # Pool-less services (the scheduler; reward without a reward model) are pinned to
            # the driver's node, where they live as long as the run: never onto a
            # worker node whose loss would take the registry with it.
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False
            )
        return ray.remote(ServiceActor).options(**options).remote()

    def _launch(
        self,
        ray: Any,
        name: str,
        kind: str,
        pool: str | None,
        bundle: int | None,
        argv: list[str],
        env: dict[str, str],
        config_path: Path,
        config_text: str,
        deadline: float,
        *,
        address_file: Path | None = None,
        wait_address: bool = True,
        actor: Any = None,
        slot: int = 0,
    ) -> _Service:
        if actor is None:
            actor = self._actor(ray, name, pool, bundle, self.gpus.request(kind, pool))
        svc = _Service(name, kind, actor, pool, bundle, slot=slot)
        svc.launch = {
            "argv": argv,
            "env": env,
            "config_path": config_path,
            "config_text": config_text,
            "address_file": address_file,
            "wait_address": wait_address,
        }
        with self._lock:
            if self._stopped:  # a replacement started while the cluster stops
                with contextlib.suppress(Exception):
                    ray.kill(actor)
                raise ServiceStartError(f"{name}: the cluster is stopping", field=name)
            self._services.append(svc)
        try:
            svc.info = ray.get(actor.node.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            with self._lock:
                self._services.remove(svc)
            raise
        threads = self._threads(pool)
        full_env = {
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "CUDA_VISIBLE_DEVICES": ",".join(self._devices(svc)),
            **self._role_env.get(kind, {}),
            "RLFLEET_RAY_ACTOR_ID": str(svc.info.get("actor_id", "")),
            "RLFLEET_NODE": str(svc.info.get("ip", "")),
            **env,
        }
        svc.info["_pending"] = actor.start.remote(
            argv,
            full_env,
            {str(config_path): config_text},
            str(self.run_dir / "logs" / f"{name}.log"),
            str(address_file) if address_file else None,
            wait_address,
            max(1.0, deadline - time.monotonic()),
        )
        return svc

    def _finish(self, ray: Any, svc: _Service, deadline: float) -> None:
        from rlfleet.common.rpc import wait_for_ready

        pending = svc.info["_pending"]  # kept until the start returns: see supervise_once
        try:
            out = ray.get(pending, timeout=max(1.0, deadline - time.monotonic()) + 5)
        except Exception as e:
            raise ServiceStartError(
                f"{svc.name} on node {svc.info.get('ip')} failed to start: {e}",
                field=svc.name,
                value=str(self.run_dir / "logs" / f"{svc.name}.log"),
            ) from e
        finally:
            svc.info.pop("_pending", None)
        svc.pid = int(out["pid"])
        svc.address = out["address"]
        svc.metrics_address = out["metrics_address"]
        if svc.address:
            wait_for_ready(svc.address, timeout_s=max(1.0, deadline - time.monotonic()))

    def _devices(self, svc: _Service) -> list[str]:
        """The GPUs ``svc``'s process sees: those Ray gave its actor, or for a service
        colocated in another kind's pool, the owner's on its node (:class:`GpuPlan`)."""
        if not self.gpus.cuda:
            return []
        if svc.pool is None or svc.kind == self.gpus.owner(svc.pool):
            return [str(g) for g in svc.info["gpu_ids"]]
        owner = self.gpus.owner(svc.pool)
        with self._lock:
            holders = [
                s
                for s in self._services
                if s.kind == owner and s.pool == svc.pool and s.bundle == svc.bundle and s.info
            ]
        holders.sort(key=lambda s: (int(s.launch.get("env", {}).get("RANK", "0")), s.slot))
        owned = [str(g) for s in holders for g in s.info.get("gpu_ids", [])]
        return self.gpus.shared_devices(svc.kind, svc.slot, owned, svc.name)

    def _device_list(self, svc: _Service) -> list[Device]:
        """What ``svc`` runs on, for the registry (``rlfleet status``): its GPUs on cuda,
        else the cores its process may use."""
        if self.gpus.cuda:
            return [Device("cuda", int(g), "cuda") for g in self._devices(svc) if g.isdigit()]
        return [Device("cpu", int(c), "cpu") for c in svc.info.get("cores", [])][:MAX_DEVICES]

    def _taken_places(self) -> list[tuple[int, int]]:
        """``(bundle, slot)`` of every rollout replica the fleet has: running, restarting,
        or placed and starting (call with the lock held)."""
        taken = [(s.bundle or 0, s.slot) for s in self._services if s.kind == "rollout"]
        return taken + [place for held in self._held.values() for place in held]

    def _rollout_places(
        self,
        pool: str,
        count: int,
        key: object | None = None,
        allowed: Collection[int] | None = None,
    ) -> list[tuple[int, int]]:
        """``(bundle, slot)`` for ``count`` more replicas (ServiceStartError: no room),
        held under ``key`` (when given) until :meth:`_unhold`: when they run, or failed
        to start."""
        with self._lock:
            taken = self._taken_places()
            places = []
            for _ in range(count):
                places.append(self.gpus.place_rollout(pool, taken, allowed))
                taken.append(places[-1])
            if key is not None:
                self._held[key] = places
        return places

    def _unhold(self, key: object) -> None:
        with self._lock:
            self._held.pop(key, None)

    def _sharing(self, pool: str) -> int:
        """Services that share each bundle of ``pool`` (colocated roles)."""
        cfg = self.config
        kinds = {_pool(cfg, r) == pool and r for r in cfg.enabled_roles()} - {False}
        services = {
            "rollout" if r == "rollout" else "reward" if r == "reward_model" else "trainer"
            for r in kinds
        }
        return max(1, len(services))

    def _threads(self, pool: str | None) -> int:
        if pool is None or self.config.trainer.device != "cpu":
            return 1
        nodes = self.config.resource_pools[pool]
        return max(1, min(nodes) // self._sharing(pool))

    def _start_services(
        self, ray: Any, config_path: Path, config_text: str, deadline: float
    ) -> None:
        cfg = self.config
        started: list[_Service] = []
        # The trainer first: services colocated in its pool use the GPUs its ranks hold.
        if cfg.services.trainer is None:
            started += self._launch_trainer(ray, config_path, config_text, deadline)
        if cfg.services.reward is None:
            pool = _pool(cfg, "reward_model") if cfg.reward.reward_model.enable else None
            started.append(
                self._launch(
                    ray,
                    "reward",
                    "reward",
                    pool,
                    0 if pool else None,
                    reward_argv(_HOST, config_path),
                    {},
                    config_path,
                    config_text,
                    deadline,
                )
            )
        if not cfg.services.rollout:
            pool = _pool(cfg, "rollout")
            assert pool is not None
            key = object()  # the places, held until their replicas are in the fleet
            try:
                places = self._rollout_places(pool, cfg.rollout_replicas(), key)
                for i, (bundle, slot) in enumerate(places):
                    argv = self._rollout_argv(config_path, f"rollout-{i}")
                    started.append(
                        self._launch(
                            ray,
                            f"rollout-{i}",
                            "rollout",
                            pool,
                            bundle,
                            argv,
                            {},
                            config_path,
                            config_text,
                            deadline,
                            slot=slot,
                        )
                    )
            finally:
                self._unhold(key)
        for svc in started:
            self._finish(ray, svc, deadline)

    def _rollout_argv(self, config_path: Path, name: str) -> list[str]:
        """A replica's arguments: its scheduler and the run's tools service, when any."""
        argv = ["-m", *rollout_argv(_HOST, config_path, name, drain_s=drain_time(self.grace_s))]
        if self.scheduler_address:
            argv += ["--scheduler", self.scheduler_address]
        if self.tools_address:
            argv += ["--override", f"services.tools={self.tools_address}"]
        return argv

    def _launch_trainer(
        self, ray: Any, config_path: Path, config_text: str, deadline: float
    ) -> list[_Service]:
        cfg = self.config
        pool = _pool(cfg, "actor")
        assert pool is not None
        world = cfg.world_size("actor")
        bundles = self.gpus.rank_bundles(pool, world)
        address_file = self.run_dir / "trainer.address"
        argv = ["-m", *trainer_argv(_HOST, config_path, address_file)]
        if self.scheduler_address:
            argv += ["--scheduler", self.scheduler_address]
        if world == 1:
            return [
                self._launch(
                    ray,
                    "trainer",
                    "trainer",
                    pool,
                    0,
                    argv,
                    {},
                    config_path,
                    config_text,
                    deadline,
                    address_file=address_file,
                )
            ]
        # One actor per rank, consecutive ranks on a node (GpuPlan.rank_bundles); rank
        # 0's node address and a free port there are the rendezvous.
        gpus = self.gpus.request("trainer", pool)
        actors = [
            self._actor(ray, "trainer" if rank == 0 else f"trainer-{rank}", pool, bundle, gpus)
            for rank, bundle in enumerate(bundles)
        ]
        master = ray.get(actors[0].node.remote())["ip"]
        port = ray.get(actors[0].free_port.remote())
        out = []
        for rank, actor in enumerate(actors):
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
            }
            name = "trainer" if rank == 0 else f"trainer-{rank}"
            out.append(
                self._launch(
                    ray,
                    name,
                    "trainer",
                    pool,
                    bundles[rank],
                    argv,
                    env,
                    config_path,
                    config_text,
                    deadline,
                    address_file=address_file if rank == 0 else None,
                    wait_address=rank == 0,
                    actor=actor,
                )
            )
        return out

    def _register_probed(self, deadline: float, only: str | None = None) -> None:
        """Register reward and trainer (rank 0) with the scheduler (``only``: that one);
        it health-checks them."""
        from rlfleet.scheduler.client import RemoteSchedulerClient

        if not self.scheduler_address:
            return
        roles = ",".join(r for r in self.config.enabled_roles() if r in ("actor", "critic", "ref"))
        with RemoteSchedulerClient(
            self.scheduler_address, timeout_s=max(1.0, deadline - time.monotonic())
        ) as client:
            for svc in self._services:
                if svc.name not in ("reward", "trainer") or svc.address is None:
                    continue
                if only is not None and svc.name != only:
                    continue
                caps = {
                    LIVENESS_CAPABILITY: LIVENESS_PROBE,
                    "launched_by": "ray",
                    "ray_actor_id": str(svc.info.get("actor_id", "")),
                }
                group = [svc]
                if svc.name == "trainer":
                    caps["roles"] = roles
                    group = self._trainer_ranks()
                    caps["nodes"] = ",".join(
                        dict.fromkeys(str(s.info.get("ip", "")) for s in group)
                    )
                spec = ServiceSpec(
                    role="reward" if svc.name == "reward" else "trainer",
                    address=svc.address,
                    service_id=svc.name,  # the actor's name: one name everywhere
                    node=str(svc.info.get("ip", "")),
                    devices=tuple(d for s in group for d in self._device_list(s)),
                    capabilities=caps,
                    metrics_address=svc.metrics_address or "",
                    pid=svc.pid,
                )
                client.register(spec)

    def _make_handle(self, config_path: Path) -> ClusterHandle:
        s = self.config.services

        def first(kind: str, given: str | None) -> str:
            if given:
                return given
            for svc in self._services:
                if svc.kind == kind and svc.address:
                    return svc.address
            return ""

        rollout = list(s.rollout) or [
            svc.address or "" for svc in self._services if svc.kind == "rollout"
        ]
        return ClusterHandle(
            scheduler=self.scheduler_address,
            reward=first("reward", s.reward),
            trainer=first("trainer", s.trainer),
            rollout=rollout,
            metrics={
                svc.name: svc.metrics_address for svc in self._services if svc.metrics_address
            },
            pids={svc.name: svc.pid for svc in self._services},
            run_dir=str(self.run_dir),
            config_path=str(config_path),
            mode=self.config.placement().mode,
            credentials_dir=str(self.credentials_dir or ""),
            tools=self.tools_address,
        )

    # ------------------------------------------------------------------ supervision

    def _supervise(self) -> None:
        """Keep the fleet as asked: restart dead service processes, replace replicas
        whose actor (node) is gone. (:meth:`_follow_scale_loop` follows the
        scheduler's desired rollout count.)"""
        while not self._stop_event.wait(self.supervise_interval_s):
            try:
                self.supervise_once(scale=False)
            except Exception:  # keep supervising: one bad round must not end it
                if not self._stopped:
                    logger.exception("ray cluster supervision round failed")

    def _follow_scale_loop(self) -> None:
        import ray

        while not self._stop_event.wait(self.supervise_interval_s):
            try:
                self._follow_scale(ray)
            except Exception:  # keep following: one bad round must not end it
                if not self._stopped:
                    logger.exception("following the desired rollout scale failed")

    def supervise_once(self, *, scale: bool = True) -> None:
        """One round of :meth:`_supervise`, and with ``scale`` of following the desired
        rollout count (tests call it directly)."""
        import ray

        with self._lock:
            services = [s for s in self._services if s.name not in self.given_up]
        for svc in services:
            if self._stopped:
                return
            with self._lock:
                if svc not in self._services:
                    continue  # replaced this round (a trainer rank restarted with rank 0)
            try:
                if "_pending" in svc.info or svc.address is None:
                    # Still starting (a scale-up's, a replacement's): its actor answers
                    # after, and a start that fails is its starter's to handle.
                    continue
                code = ray.get(svc.actor.poll.remote(), timeout=15)
            except ray.exceptions.GetTimeoutError:
                continue  # slow to answer is not gone: ask again next round
            except ray.exceptions.RayError as e:  # the actor is gone: its node died, or killed
                self._lost(ray, svc, e)
                continue
            if code is not None:
                self._restart(ray, svc, code)
        if scale:
            self._follow_scale(ray)

    def _deregister(self, address: str | None) -> None:
        if address and self.scheduler_address:
            deregister_address(self.scheduler_address, address)

    def _lost(self, ray: Any, svc: _Service, error: BaseException) -> None:
        where = _where(svc)
        self.events["lost"] += 1
        with self._lock:
            if svc in self._services:
                self._services.remove(svc)
        if svc.kind == "trainer" and self.config.trainer.recovery.enable:
            self._replace_trainer(ray, [svc, *self._trainer_ranks()], where, error)
            return
        if svc.kind != "rollout":
            self.given_up.add(svc.name)
            logger.error(
                "%s at %s on %s is gone (%s): it is not replaced (%s)",
                svc.name,
                svc.address,
                where,
                type(error).__name__,
                "resume the run from its last checkpoint"
                if svc.kind == "trainer"
                else "the run cannot reach it at a new address",
            )
            return
        logger.warning(
            "rollout replica %s at %s on %s is gone (%s): its prompts are re-queued by the "
            "driver; placing a replacement in its pool",
            svc.name,
            svc.address,
            where,
            type(error).__name__,
        )
        self._deregister(svc.address)
        with contextlib.suppress(Exception):
            ray.kill(svc.actor)
        with self._lock:
            self._replacing_names.add(svc.name)
        # In a thread: placing and starting it may take long (a bundle waiting for a
        # node), and the supervisor must go on restarting and scaling meanwhile.
        threading.Thread(
            target=self._replace_rollout,
            args=(ray, svc),
            name=f"rlfleet-replace-{svc.name}",
            daemon=True,
        ).start()

    #: Tries at placing a lost replica's replacement, and the pause between them: Ray
    #: may still count a node that just died as alive (its bundles on it) for seconds.
    REPLACE_TRIES = 4
    REPLACE_PAUSE_S = 5.0

    def _replace_rollout(self, ray: Any, svc: _Service) -> None:
        """A lost replica's replacement: in a bundle of its pool on a live node with
        room (the most room first) other than the one the replica was lost on, else
        in its own bundle (Ray moves that one to a live node when one has room); tried
        again while the node it lands on turns out dead."""
        try:
            self._place_replacement(ray, svc)
        finally:
            with self._lock:
                self._replacing_names.discard(svc.name)

    def _place_replacement(self, ray: Any, svc: _Service) -> None:
        assert svc.pool is not None
        lost_node = svc.info.get("node_id")
        for attempt in range(1, self.REPLACE_TRIES + 1):
            live = self._live_bundles(ray, svc.pool, avoid=lost_node)
            key = object()  # the place chosen, held while the replacement starts
            bundle: int | None
            try:
                [(bundle, slot)] = self._rollout_places(svc.pool, 1, key, allowed=live)
            except ServiceStartError:
                bundle, slot = svc.bundle, svc.slot
                with self._lock:
                    self._held[key] = [(bundle or 0, slot)]
            moved = dataclasses.replace(svc, bundle=bundle, slot=slot)
            try:
                new = self._relaunch(ray, moved, timeout_s=self.config.ray.start_timeout_s)
            except Exception as e:
                if self._stopped or attempt == self.REPLACE_TRIES:
                    self.events["replacement_failed"] += 1
                    logger.error("no replacement for %s: %s", svc.name, e)
                    return
                logger.warning("replacement %d of %s failed (%s): trying again in %gs",
                               attempt, svc.name, e, self.REPLACE_PAUSE_S)  # fmt: skip
                time.sleep(self.REPLACE_PAUSE_S)
                continue
            finally:
                # Started (its own entry holds the place now) or failed: let it go.
                self._unhold(key)
            break
        self.events["replaced"] += 1
        logger.warning(
            "%s replaced at %s on node %s (bundle %s of %s)",
            new.name, new.address, new.info.get("ip"), bundle, svc.pool,
        )  # fmt: skip

    def _live_bundles(self, ray: Any, pool: str, avoid: Any = None) -> set[int] | None:
        """Bundles of ``pool``'s placement group placed on a node that is alive now and
        is not ``avoid`` (None: Ray would not say)."""
        try:
            table = ray.util.placement_group_table(self.placement_groups[pool])
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")} - {avoid}
            placed = table.get("bundles_to_node_id", {})
            return {int(b) for b, node in placed.items() if node in alive}
        except Exception as e:  # a Ray without this table: its own bundle, as before
            logger.warning("bundles of pool %s not known (%s): replacing in place", pool, e)
            return None

    def _replace_trainer(
        self, ray: Any, ranks: list[_Service], where: str, error: BaseException
    ) -> None:
        """A trainer rank's actor is gone (its node died; ``ranks[0]``): every rank
        starts again in new actors of the train pool's bundles (Ray moves a lost node's
        bundles to a live node with room), on a new address that replaces the old one in
        the registry; the driver finds it there and restores the last checkpoint into it."""
        lost = ranks[0]
        old_address = next((s.address for s in ranks if s.name == "trainer"), None)
        done = self.restarts.get("trainer", 0)
        if done >= self.config.services.max_restarts:
            self.given_up.update(s.name for s in ranks)
            logger.error("trainer rank %s on %s is gone (%s) after %d restart(s): giving up",
                         lost.name, where, type(error).__name__, done)  # fmt: skip
            return
        logger.warning(
            "trainer rank %s on %s is gone (%s): placing every rank again in the train pool",
            lost.name,
            where,
            type(error).__name__,
        )
        with self._lock:
            for s in ranks:
                if s in self._services:
                    self._services.remove(s)
        for s in ranks:
            with contextlib.suppress(Exception):
                ray.get(s.actor.stop.remote(2.0), timeout=20)
            with contextlib.suppress(Exception):
                ray.kill(s.actor)
        # The actor names are free again once the actors are gone.
        self._await_names_released(ray, [f"rlfleet/{s.name}" for s in ranks], 30.0)
        self.restarts["trainer"] = done + 1
        first = next(s for s in ranks if s.name == "trainer")
        config_path = first.launch["config_path"]
        deadline = time.monotonic() + self.config.ray.start_timeout_s
        try:
            fresh = self._launch_trainer(ray, config_path, first.launch["config_text"], deadline)
            for new in fresh:
                self._finish(ray, new, deadline)
        except Exception as e:
            self.events["replacement_failed"] += 1
            logger.error("no replacement for the trainer: %s", e)
            return
        self.events["replaced"] += 1
        new_address = fresh[0].address
        if self.handle is not None and new_address:
            self.handle = dataclasses.replace(self.handle, trainer=new_address)
        if self.scheduler_address:
            try:
                deregister_address(self.scheduler_address, old_address or "", role="trainer")
                self._register_probed(time.monotonic() + 30.0, only="trainer")
            except Exception as e:
                logger.error("registering the replaced trainer failed: %s", e)
        logger.warning("trainer replaced: %s -> %s on node %s", old_address, new_address,
                       fresh[0].info.get("ip"))  # fmt: skip

    def _relaunch(self, ray: Any, svc: _Service, *, timeout_s: float) -> _Service:
        """Start ``svc`` again in a new actor of its bundle (its old one is gone)."""
        deadline = time.monotonic() + timeout_s
        new = self._launch_again(ray, svc, deadline, actor=None)
        try:
            self._finish(ray, new, deadline)
        except BaseException:
            with self._lock:
                if new in self._services:
                    self._services.remove(new)
            with contextlib.suppress(Exception):
                ray.kill(new.actor)
            raise
        return new

    def _restart(self, ray: Any, svc: _Service, code: int) -> None:
        """A service process exited: start it again in its actor, on its port.

        Rollout replicas, the reward and tools services and the scheduler always (its registry is
        rebuilt: replicas register again at their next heartbeat, the reward service and
        the trainer are registered again here); the trainer with ``trainer.recovery``,
        every rank of it (the driver restores the last checkpoint into it)."""
        restartable = {"rollout", "reward", "scheduler", "tools"}
        if self.config.trainer.recovery.enable:
            restartable.add("trainer")
        if svc.kind not in restartable:
            self.given_up.add(svc.name)
            logger.error(
                "%s (%s) exited with code %s: not restarted (its state is in "
                "memory; resume from the last checkpoint, or set trainer.recovery.enable)",
                svc.name,
                svc.address,
                code,
            )
            return
        # The trainer's ranks are one group: they stop, count and start together.
        group = self._trainer_ranks() if svc.kind == "trainer" else [svc]
        key = "trainer" if svc.kind == "trainer" else svc.name
        done = self.restarts.get(key, 0)
        if done >= self.config.services.max_restarts:
            self.given_up.update(s.name for s in group)
            logger.error(
                "%s (%s) exited with code %s after %d restart(s): giving up",
                svc.name,
                svc.address,
                code,
                done,
            )
            if svc.kind == "rollout":
                self._retire(ray, svc)
            return
        backoff = self.config.services.restart_backoff_s * 2.0**done
        logger.warning(
            "%s (%s) exited with code %s: restarting %s in %.1fs (%d of %d)",
            svc.name,
            svc.address,
            code,
            "every trainer rank" if len(group) > 1 else "it",
            backoff,
            done + 1,
            self.config.services.max_restarts,
        )
        for other in group:
            if other is not svc:  # a group with a rank gone cannot go on
                with contextlib.suppress(Exception):
                    ray.get(other.actor.stop.remote(2.0), timeout=20)
        time.sleep(backoff)
        with self._lock:
            if self._stopped:
                return
            if any(member not in self._services for member in group):
                logger.info("%s was removed while it waited for its restart: not restarted",
                            svc.name)  # fmt: skip
                return
        self.restarts[key] = done + 1
        self.events["restarted"] += 1
        if svc.kind == "rollout":
            self._deregister(svc.address)
        with self._lock:
            for member in group:
                if member in self._services:
                    self._services.remove(member)
            if svc.kind == "rollout":
                self._restarting.add(svc.name)
                self._held[svc.name] = [(svc.bundle or 0, svc.slot)]  # its place stays its
        try:
            self._start_again(ray, svc, group)
        finally:
            with self._lock:
                self._restarting.discard(svc.name)
                self._held.pop(svc.name, None)

    def _retire(self, ray: Any, svc: _Service) -> None:
        """A given-up replica leaves the fleet: out of the registry (not listed dead for
        good) and its actor ended (its bundle's room free again); a desired count set
        at the scheduler brings a new replica in its place (:meth:`_follow_scale`)."""
        with self._lock:
            if svc in self._services:
                self._services.remove(svc)
        self._deregister(svc.address)
        with contextlib.suppress(Exception):
            ray.kill(svc.actor)

    def _start_again(self, ray: Any, svc: _Service, group: list[_Service]) -> None:
        """The second half of :meth:`_restart`: ``group`` (out of the fleet) started
        again in its actors, on its ports."""
        if len(group) > 1:
            # A fresh rendezvous port: the old one may linger in TIME_WAIT.
            port = ray.get(group[0].actor.free_port.remote(), timeout=20)
            for member in group:
                member.launch["env"] = {**member.launch["env"], "MASTER_PORT": str(port)}
        for member in group:
            _keep_port(member)
        deadline = time.monotonic() + 120.0
        fresh: list[_Service] = []
        try:
            # Every rank starts before any is awaited: rank 0 serves only once the
            # group has formed.
            for member in group:
                fresh.append(self._launch_again(ray, member, deadline))
            for new in fresh:
                self._finish(ray, new, deadline)
        except Exception as e:
            with self._lock:  # out of the fleet: replaced below, or given up
                for new in fresh:
                    if new in self._services:
                        self._services.remove(new)
            if _actor_gone(ray, e):  # its node died under the restart: place it anew
                if svc.kind == "trainer" and self.config.trainer.recovery.enable:
                    self._replace_trainer(ray, group, _where(svc), e)
                else:
                    self._lost(ray, svc, e)
                return
            logger.error("restarting %s failed: %s", svc.name, e)
            if svc.kind == "rollout":  # given up: its actor ended, a replacement may come
                self.given_up.add(svc.name)
                self._retire(ray, svc)
            return
        logger.warning("%s restarted at %s", svc.name, fresh[0].address)
        if svc.kind in ("trainer", "reward"):
            try:  # its entry names the new process (pid, actor), not the dead one
                self._register_probed(time.monotonic() + 30.0, only=svc.kind)
            except Exception as e:  # the registry keeps the old entry; it still answers
                logger.warning("registering the restarted %s failed: %s", svc.name, e)
        if svc.kind == "scheduler":
            self._scale_generation = 0  # a new scheduler numbers its requests from 1 again
            try:
                self._register_probed(time.monotonic() + 30.0)
            except Exception as e:  # the next restart of it, or the run, will tell
                logger.error("registering reward and trainer with the restarted scheduler "
                             "failed: %s", e)  # fmt: skip

    def _trainer_ranks(self) -> list[_Service]:
        """The trainer's rank actors, rank 0 first."""
        with self._lock:
            ranks = [s for s in self._services if s.kind == "trainer"]
        return sorted(ranks, key=lambda s: int(s.launch["env"].get("RANK", "0")))

    def _launch_again(
        self, ray: Any, svc: _Service, deadline: float, *, actor: Any = _SAME
    ) -> _Service:
        """Start ``svc``'s process again as it was started: in its actor, or in
        ``actor`` (None: a new one in its bundle)."""
        launch = svc.launch
        return self._launch(
            ray,
            svc.name,
            svc.kind,
            svc.pool,
            svc.bundle,
            list(launch["argv"]),
            dict(launch["env"]),
            launch["config_path"],
            launch["config_text"],
            deadline,
            address_file=launch["address_file"],
            wait_address=launch["wait_address"],
            actor=svc.actor if actor is _SAME else actor,
            slot=svc.slot,
        )

    def rollout_replicas(self) -> list[str]:
        """Names of the rollout replicas running now."""
        with self._lock:
            return [s.name for s in self._services if s.kind == "rollout"]

    def _coming(self, running: Collection[str]) -> int:
        """Rollout replicas of the fleet out of the running list for a moment: those
        restarting and the lost ones whose replacement starts (call with the lock held,
        ``running`` read under it). One already back in the list (a restart or a
        replacement that is starting, not yet done) is not counted twice."""
        return len((self._restarting | self._replacing_names) - set(running))

    def _follow_scale(self, ray: Any) -> None:
        from rlfleet.scheduler.client import RemoteSchedulerClient

        if not self.scheduler_address:
            return
        try:
            with RemoteSchedulerClient(self.scheduler_address, timeout_s=5.0) as client:
                desired, generation = client.scale("rollout")
        except RlfleetError as e:  # no traceback per round: the scheduler may be back
            logger.warning("desired scale unknown: scheduler %s: %s", self.scheduler_address, e)
            return
        if not desired:
            return
        if generation == self._scale_generation:
            # The count is the one followed; a replica given up since then (or whose
            # restart or replacement failed) leaves the fleet short of it: one in its
            # place, at most services.max_restarts times.
            with self._lock:
                names = self.rollout_replicas()
                owned = len(names) + self._coming(names)
                lost = sum(1 for n in self.given_up if n.startswith("rollout-"))
            more = replacements_due(
                owned, desired, started=self._replacements, config=self.config,
                retry_at=self._scale_retry_at,
                lost=lost + self.events["replacement_failed"],
            )  # fmt: skip
            if not more:
                return
            self._replacements += more
            target = owned + more  # exactly those: restarting ones come back by themselves
        else:
            target = desired
        self._scale_generation = generation  # asked once: a refusal is not retried
        try:
            self.scale_rollout(target)
        except ServiceStartError as e:
            logger.error("scaling rollout to %d refused: %s", desired, e)
            self._scale_retry_at = scale_retry_at(self.config)  # not every round

    def scale_rollout(self, replicas: int) -> None:
        """Add or remove rollout replicas (actors in the rollout pool's bundles, the one
        with the most room first: :class:`GpuPlan`) until ``replicas`` run (those
        restarting or being replaced count: they come back by themselves); on cuda,
        more than the pool's GPUs hold is refused (ServiceStartError) before any starts. A new one registers with the scheduler and gets
        the current weights from the driver before it takes work; one removed is
        deregistered first, then stopped (SIGTERM: it finishes what it has in flight
        within its grace period)."""
        import ray

        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        cfg = self.config
        pool = _pool(cfg, "rollout")
        assert pool is not None
        with self._lock:  # one look at those running and those coming back
            current = self.rollout_replicas()
            coming = self._coming(current)
        if len(current) + coming == replicas:
            return
        logger.warning(
            "scaling rollout replicas %d -> %d (%d more restarting or being replaced)",
            len(current) + coming, replicas, coming,
        )  # fmt: skip
        if len(current) + coming < replicas:
            template = next((s for s in self._services if s.kind == "rollout"), None)
            config_path = self.run_dir / "config.yaml"
            config_text = template.launch["config_text"] if template else config_path.read_text()
            deadline = time.monotonic() + cfg.ray.start_timeout_s
            added = []
            key = object()  # its places, held until their replicas are in the fleet
            try:
                places = self._rollout_places(pool, replicas - len(current) - coming, key)
                added = [self._launch_rollout(ray, pool, p, config_path, config_text, deadline)
                         for p in places]  # fmt: skip
            finally:
                self._unhold(key)
            for svc in added:
                self._finish(ray, svc, deadline)
                self.events["scaled_up"] += 1
            return
        with self._lock:
            rollouts = [s for s in self._services if s.kind == "rollout"]
        rollouts.sort(key=lambda s: replica_number(s.name))  # the newest leave first
        for svc in rollouts[max(0, replicas - coming) :][::-1]:  # those coming back stay
            with self._lock:  # out of the fleet at once; then drained and stopped
                self._services.remove(svc)
            self._deregister(svc.address)
            with contextlib.suppress(Exception):
                ray.get(svc.actor.stop.remote(self.grace_s), timeout=self.grace_s + 15)
            with contextlib.suppress(Exception):
                ray.kill(svc.actor)
            self.events["scaled_down"] += 1

    def _launch_rollout(
        self,
        ray: Any,
        pool: str,
        place: tuple[int, int],
        config_path: Path,
        config_text: str,
        deadline: float,
    ) -> _Service:
        """One more rollout replica, numbered next, at ``place`` (bundle, slot)."""
        k = self._next_rollout
        self._next_rollout += 1
        argv = self._rollout_argv(config_path, f"rollout-{k}")
        bundle, slot = place
        return self._launch(
            ray, f"rollout-{k}", "rollout", pool, bundle, argv, {}, config_path, config_text,
            deadline, slot=slot,
        )  # fmt: skip

    def kill_trainer(self) -> None:
        """End every trainer rank's process (SIGKILL): the driver's last resort for a
        trainer that stopped answering without dying; the supervisor then restarts the
        ranks (``trainer.recovery``)."""
        import ray

        for svc in self._trainer_ranks():
            logger.warning("killing the unresponsive trainer rank %s (%s)", svc.name, svc.address)
            self.events["killed"] += 1
            with contextlib.suppress(Exception):
                ray.get(svc.actor.stop.remote(0.0), timeout=20)

    def fleet_metrics(self) -> dict[str, float]:
        """What the launcher did, for the run's step metrics (``fleet/...``)."""
        return fleet_metrics(self.events, len(self.rollout_replicas()))

    # ------------------------------------------------------------------ inspect / stop

    @property
    def pids(self) -> dict[str, int]:
        with self._lock:
            return {s.name: s.pid for s in self._services if s.pid}

    def nodes(self) -> dict[str, dict[str, Any]]:
        """Service name -> its node IP, node id, Ray actor id and address."""
        with self._lock:
            return {
                s.name: {
                    **{k: s.info.get(k) for k in ("ip", "node_id", "actor_id")},
                    "address": s.address,
                }
                for s in self._services
            }

    def processes(self) -> list[ProcessInfo]:
        with self._lock:
            return [
                ProcessInfo(s.name, s.pid, None, str(self.run_dir / "logs" / f"{s.name}.log"))
                for s in self._services
                if s.pid
            ]

    def stop(self, grace_s: float | None = None) -> None:
        """Stop every service (rollouts, trainer and reward first, the scheduler last),
        kill the actors, remove the placement groups, and shut down a Ray started here."""
        import ray

        grace = self.grace_s if grace_s is None else grace_s
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._stop_event.set()
        for thread in (self._supervisor, self._scaler):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=60)
        with self._lock:
            services = list(self._services)
        if ray.is_initialized():
            ordered = [s for s in services if s.kind != "scheduler"] + [
                s for s in services if s.kind == "scheduler"
            ]
            for group in (ordered[:-1] if len(ordered) > 1 else [], ordered[-1:]):
                stops = [s.actor.stop.remote(grace) for s in group]
                with contextlib.suppress(Exception):
                    ray.get(stops, timeout=grace + 15)
            for s in services:
                with contextlib.suppress(Exception):
                    ray.kill(s.actor)
            self._await_names_released(ray, [f"rlfleet/{s.name}" for s in services])
            for pg in self.placement_groups.values():
                with contextlib.suppress(Exception):
                    ray.util.remove_placement_group(pg)
            if self._own_ray:
                ray.shutdown()
        if self.security is not None and current_security() is self.security:
            set_security(self._previous_security)
        logger.info("ray cluster stopped (%d services)", len(services))

    def _await_names_released(
        self, ray: Any, names: Sequence[str], timeout_s: float = 30.0
    ) -> None:
        """Wait until killed actors' names are free (a next run in the namespace takes them)."""
        deadline = time.monotonic() + timeout_s
        pending = list(names)
        while pending and time.monotonic() < deadline:
            still = []
            for name in pending:
                try:
                    ray.get_actor(name, namespace=self.config.ray.namespace)
                    still.append(name)
                except ValueError:
                    pass
            pending = still
            if pending:
                time.sleep(0.1)
        if pending:
            logger.warning("ray actors %s still named after %.0fs", pending, timeout_s)

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
