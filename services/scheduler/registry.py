"""The scheduler's core state: the service registry, the placement, the training status.

No sockets here: :class:`Registry` and :class:`SchedulerCore` are plain, thread-safe
classes with an injectable clock; :mod:`rlfleet.scheduler.servicer` puts them on gRPC (:mod:`rlfleet.scheduler.serde` converts).

Registry semantics:

* ``register`` assigns an id (``rollout-1``, ``trainer-1``, ...), or keeps the id the
  service asks for when it is free (a service re-registering after a scheduler
  restart), and a random *lease*: the entry belongs to whoever holds it. A service
  registering again at an address already registered replaces the old entry and
  keeps its id (a restarted replica on the same port), but only if the old entry
  is DEAD, the caller holds its lease, or the caller is the driver: nobody takes
  over a live replica's entry. Heartbeat and deregister need the lease too.
* Entries are bounded (:data:`MAX_SERVICES`, field lengths, devices,
  capabilities: :func:`check_spec`), and so is the whole (:data:`MAX_REGISTRY_BYTES`,
  so that it always lists in one answer; for a service role's credential
  :data:`MAX_PER_HOST` entries and :data:`MAX_HOST_BYTES` per host, and never the
  driver's reserve, :data:`PRIVILEGED_RESERVE_BYTES`); a service role may register
  only its own kind, and no one registers a scheduler.
* ``heartbeat`` refreshes liveness and records the load (queue depth, tokens/s,
  weight version). A service whose last sign of life is older than
  ``missed_heartbeats x heartbeat_interval_s`` is DEAD; a heartbeat revives it. An
  unknown id gets ``False``: the service should register again.
* DEAD entries are forgotten ``forget_dead_after_s`` after they died.
* Services that cannot heartbeat themselves (reward, trainer: they do not know the
  scheduler) are registered by whoever launched them with the capability
  ``liveness=probe``; the scheduler server health-checks those instead
  (:class:`rlfleet.scheduler.server.HealthProber`).

The driver publishes its progress with :meth:`SchedulerCore.set_training_status`;
``rlfleet status`` reads it back through ``GetTrainingStatus``.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Literal

from rlfleet.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
)
from rlfleet.common.roles import SERVICES, Service
from rlfleet.scheduler.placement import (
    SERVICE_OF_ROLE,
    Device,
    DeviceKind,
    NodeInventory,
    PlacementPlan,
    inventory_from_services,
    local_node,
    plan_placement,
)

__all__ = [
    "LIVENESS_CAPABILITY",
    "LIVENESS_PROBE",
    "SERVICES",
    "Assignment",
    "Placement",
    "Registry",
    "SchedulerCore",
    "Service",
    "ServiceEntry",
    "ServiceLoad",
    "ServiceSpec",
    "ServiceState",
    "TrainingState",
    "TrainingStatus",
    "bind_services",
    "check_spec",
]

logger = logging.getLogger(__name__)

"""A registered service's kind (:data:`rlfleet.common.roles.Service`)."""

LIVENESS_CAPABILITY = "liveness"
"""Capability key; value :data:`LIVENESS_PROBE` asks the scheduler to health-check."""
LIVENESS_PROBE = "probe"


class ServiceState(Enum):
    ALIVE = "alive"
    DEAD = "dead"


@dataclass(frozen=True)
class ServiceSpec:
    """What a service says about itself when it registers.

    Attributes:
        role: the kind of service.
        address: ``host:port`` other services dial.
        node: host name, for same-host transports and placement.
        devices: the devices it runs on.
        capabilities: free-form (engine, model, roles, transports, liveness ...).
        capacity: concurrent samples it can take (0: unknown).
        metrics_address: ``host:port`` of its Prometheus endpoint ("" if none).
        pid: its process id (0 if unknown).
        service_id: "" to get one assigned.
    """

    role: Service
    address: str
    node: str = ""
    devices: tuple[Device, ...] = ()
    capabilities: Mapping[str, str] = field(default_factory=dict)
    capacity: int = 0
    metrics_address: str = ""
    pid: int = 0
    service_id: str = ""

    @property
    def probed(self) -> bool:
        return self.capabilities.get(LIVENESS_CAPABILITY) == LIVENESS_PROBE


@dataclass(frozen=True)
class ServiceLoad:
    """What a heartbeat carries."""

    queue_depth: int = 0
    tokens_per_second: float = 0.0
    weight_version: int = 0


@dataclass(frozen=True)
class ServiceEntry:
    """One registered service, as the registry sees it now.

    ``lease`` is the owner's secret (heartbeat and deregister with it); it never
    leaves the scheduler except in the answer to the registration that made it.
    """

    spec: ServiceSpec
    state: ServiceState
    registered_unix: float
    last_heartbeat_unix: float
    load: ServiceLoad = ServiceLoad()
    lease: str = field(default="", repr=False)

    @property
    def service_id(self) -> str:
        return self.spec.service_id

    @property
    def alive(self) -> bool:
        return self.state is ServiceState.ALIVE


@dataclass
class _Record:
    spec: ServiceSpec
    registered: float
    last_seen: float
    load: ServiceLoad = ServiceLoad()
    dead_since: float | None = None
    lease: str = ""
    keys: frozenset[str] = frozenset()  # its address as written and as resolved


# Callers that may act on any entry: in-process (None: auth off or no server), the
# driver (it launches and registers the services that cannot), a shared-token admin.
_PRIVILEGED: frozenset[str | None] = frozenset({None, "driver", "admin"})

MAX_SERVICES = 4096
"""Registry entries at most (DEAD ones count until forgotten)."""
MAX_DEVICES = 1024
MAX_CAPABILITIES = 64
MAX_TEXT_CHARS = 256
"""Longest address, node, service id, capability key."""
MAX_CAPABILITY_CHARS = 1024
MAX_REGISTRY_BYTES = 16 << 20
"""What every entry says about itself, in all (:func:`spec_bytes`): a full registry
still lists in one ``ListServices`` answer, far below the 64 MiB message limit."""
MAX_PER_HOST = 256
"""Entries a service role may hold on one host (the host of their addresses)."""
MAX_HOST_BYTES = 1 << 20
"""What the entries on one host may take in all (:func:`spec_bytes`) when a service
role registers there: one stolen credential fills at most this much."""
#: The training status' metrics: names at most, and characters of a name.
MAX_STATUS_METRICS = 4096
MAX_METRIC_NAME_CHARS = MAX_TEXT_CHARS
PRIVILEGED_RESERVE_BYTES = MAX_REGISTRY_BYTES // 8
"""The part of :data:`MAX_REGISTRY_BYTES` only privileged callers may fill, so the
driver can still register a restarted trainer or reward whatever services did."""


def spec_bytes(spec: ServiceSpec) -> int:
    """About the bytes ``spec`` takes in a ``ListServices`` answer (an upper bound of
    its text plus a fixed allowance per field)."""
    return (
        128
        + len(spec.address)
        + len(spec.metrics_address)
        + len(spec.node)
        + len(spec.service_id)
        + sum(len(d.name) + 32 for d in spec.devices)
        + sum(len(k) + len(v) + 8 for k, v in spec.capabilities.items())
    )


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def _check_text(value: str, field_name: str, limit: int = MAX_TEXT_CHARS) -> None:
    if len(value) > limit:
        raise InvalidArgument(
            f"{len(value)} characters, at most {limit}", field=field_name, value=value[:64]
        )
    if value and not value.isprintable():
        raise InvalidArgument("must be printable text", field=field_name, value=value[:64])


def _check_host_port(value: str, field_name: str) -> None:
    """``host:port`` written one way only: a port without leading zeros, an IP
    address as Python writes it (not ``127.1``), so one endpoint has one spelling."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument("expected host:port", field=field_name, value=value)
    if port != str(int(port)):
        raise InvalidArgument("the port has leading zeros", field=field_name, value=value)
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    looks_ip = ":" in bare or all(c.isdigit() or c == "." for c in bare)
    if looks_ip:
        try:
            canonical = str(ipaddress.ip_address(bare))
        except ValueError:
            canonical = ""
        if canonical != bare or (":" in bare) != (bare != host):
            raise InvalidArgument(
                f"not an IP address as written canonically ({canonical or 'invalid'})",
                field=field_name,
                value=value,
            )


def endpoint_key(address: str) -> str:
    """How an address is compared in the registry: lowercase (host names are)."""
    return address.lower()


def check_spec(spec: ServiceSpec) -> None:
    """Bounds and shapes of what a service says about itself (InvalidArgument naming the field)."""
    if spec.role not in SERVICES or spec.role == "scheduler":
        raise InvalidArgument(
            f"role {spec.role!r} cannot register (roles: rollout, reward, trainer)",
            field="info.role",
            value=spec.role,
        )
    if not spec.address:
        raise InvalidArgument("a service must register an address", field="info.address")
    _check_text(spec.address, "info.address")
    _check_host_port(spec.address, "info.address")
    if spec.metrics_address:
        _check_text(spec.metrics_address, "info.metrics_address")
        _check_host_port(spec.metrics_address, "info.metrics_address")
    _check_text(spec.node, "info.node")
    _check_text(spec.service_id, "info.service_id")
    if len(spec.devices) > MAX_DEVICES:
        raise InvalidArgument(
            f"{len(spec.devices)} devices, at most {MAX_DEVICES}",
            field="info.devices",
            value=len(spec.devices),
        )
    if len(spec.capabilities) > MAX_CAPABILITIES:
        raise InvalidArgument(
            f"{len(spec.capabilities)} capabilities, at most {MAX_CAPABILITIES}",
            field="info.capabilities",
            value=len(spec.capabilities),
        )
    for key, value in spec.capabilities.items():
        _check_text(key, "info.capabilities")
        _check_text(value, f"info.capabilities[{key}]", MAX_CAPABILITY_CHARS)
    for i, d in enumerate(spec.devices):
        _check_text(d.name, f"info.devices[{i}].name")
        if d.index < 0 or d.memory_bytes < 0:
            raise InvalidArgument(
                "index and memory_bytes must be >= 0", field=f"info.devices[{i}]", value=d.index
            )
    if spec.capacity < 0 or spec.pid < 0:
        raise InvalidArgument("capacity and pid must be >= 0", field="info", value=spec.capacity)


class Registry:
    """Registered services and their liveness. Thread-safe.

    Args:
        heartbeat_interval_s: what services are told to beat at.
        missed_heartbeats: beats missed before a service is DEAD.
        forget_dead_after_s: drop DEAD entries this long after they died (None: never).
        clock: wall-clock seconds (``time.time``); tests pass a fake.
        max_services: entries at most (:data:`MAX_SERVICES`).
    """

    def __init__(
        self,
        *,
        heartbeat_interval_s: float = 5.0,
        missed_heartbeats: int = 3,
        forget_dead_after_s: float | None = 600.0,
        clock: Callable[[], float] = time.time,
        max_services: int = MAX_SERVICES,
    ) -> None:
        if heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {heartbeat_interval_s}")
        if missed_heartbeats < 1:
            raise ValueError(f"missed_heartbeats must be >= 1, got {missed_heartbeats}")
        self.heartbeat_interval_s = heartbeat_interval_s
        self.missed_heartbeats = missed_heartbeats
        self.forget_dead_after_s = forget_dead_after_s
        self.max_services = max_services
        self._clock = clock
        self._lock = threading.Lock()
        self._records: dict[str, _Record] = {}
        self._counters: dict[str, int] = {}

    @property
    def dead_after_s(self) -> float:
        """Silence after which a service is DEAD."""
        return self.heartbeat_interval_s * self.missed_heartbeats

    # ---------------------------------------------------------------- mutations

    def register(
        self,
        spec: ServiceSpec,
        *,
        caller: str | None = None,
        lease: str = "",
        endpoint: str = "",
    ) -> ServiceEntry:
        """Add (or replace) a service; returns its entry with the assigned id and lease.

        Args:
            spec: what the service says about itself (:func:`check_spec`).
            caller: the authenticated role registering it (None: auth is off). A
                service role may only register an entry of its own kind.
            lease: re-registering: the lease its entry was given.
            endpoint: the address as the scheduler resolved it (``ip:port``), which
                entries are compared by: ``localhost:P`` and ``127.0.0.1:P`` are one
                endpoint; "": :func:`endpoint_key` of ``spec.address``.

        An entry at the same address (or with the asked-for id) is replaced only
        when it is DEAD, the caller holds its lease, or the caller is the driver;
        otherwise PermissionDenied. A full registry is ResourceExhausted.
        """
        check_spec(spec)
        if caller not in _PRIVILEGED and caller != spec.role:
            raise PermissionDenied(
                f"a {caller} may only register itself, not a {spec.role} service",
                field="info.role",
                value=spec.role,
            )
        now = self._clock()
        with self._lock:
            self._expire(now)
            keys = frozenset({endpoint or endpoint_key(spec.address), endpoint_key(spec.address)})
            same_address = [i for i, r in self._records.items() if keys & r.keys]
            service_id = spec.service_id
            if not service_id and same_address:
                service_id = same_address[0]
            taken = [*same_address, *([service_id] if service_id in self._records else [])]
            for old_id in taken:
                old = self._records[old_id]
                owned = bool(lease) and hmac.compare_digest(lease.encode(), old.lease.encode())
                if old.dead_since is None and caller not in _PRIVILEGED and not owned:
                    raise PermissionDenied(
                        f"{old_id} ({old.spec.role} at {old.spec.address}) is registered by "
                        "another owner; it can be replaced once it is dead, or by its owner",
                        field="info.address" if old_id in same_address else "info.service_id",
                        value=spec.address if old_id in same_address else service_id,
                    )
            if service_id in self._records and self._records[service_id].spec.role != spec.role:
                raise InvalidArgument(
                    f"service id {service_id!r} belongs to a "
                    f"{self._records[service_id].spec.role} service",
                    field="info.service_id",
                    value=service_id,
                )
            if not taken and len(self._records) >= self.max_services:
                raise ResourceExhausted(
                    f"the registry holds {len(self._records)} services, at most "
                    f"{self.max_services}",
                    field="info",
                    value=spec.address,
                )
            self._check_room(spec, caller, replaced=set(taken))
            for old_id in same_address:
                if old_id != service_id:
                    logger.info("%s at %s replaced by a new registration", old_id, spec.address)
                self._records.pop(old_id, None)
            if not service_id:
                service_id = self._new_id(spec.role)
            spec = replace(spec, service_id=service_id)
            record = _Record(
                spec,
                registered=now,
                last_seen=now,
                lease=secrets.token_urlsafe(24),
                keys=keys,
            )
            self._records[service_id] = record
            logger.info("registered %s (%s at %s)", service_id, spec.role, spec.address)
            return self._entry(record, now)

    def _check_room(self, spec: ServiceSpec, caller: str | None, replaced: set[str]) -> None:
        """ResourceExhausted when ``spec`` would take the registry past
        :data:`MAX_REGISTRY_BYTES`, or a service role past :data:`MAX_PER_HOST`
        entries on its host (``replaced``: the entries this registration replaces)."""
        others = [r.spec for i, r in self._records.items() if i not in replaced]
        size = spec_bytes(spec)
        total = sum(spec_bytes(o) for o in others) + size
        privileged = caller in _PRIVILEGED
        limit = MAX_REGISTRY_BYTES if privileged else MAX_REGISTRY_BYTES - PRIVILEGED_RESERVE_BYTES
        if total > limit:
            raise ResourceExhausted(
                f"the registry's entries would take {total} bytes, at most {limit}"
                f"{'' if privileged else f' for a {caller} credential'} (this one: {size})",
                field="info",
                value=spec.address,
            )
        if privileged:
            return
        host = _host(spec.address)
        on_host = [o for o in others if _host(o.address) == host]
        if len(on_host) >= MAX_PER_HOST:
            raise ResourceExhausted(
                f"{len(on_host)} services are registered on {host}, at most {MAX_PER_HOST} "
                f"for a {caller} credential",
                field="info.address",
                value=spec.address,
            )
        host_bytes = sum(spec_bytes(o) for o in on_host) + size
        if host_bytes > MAX_HOST_BYTES:
            raise ResourceExhausted(
                f"the entries on {host} would take {host_bytes} bytes, at most "
                f"{MAX_HOST_BYTES} for a {caller} credential (this one: {size})",
                field="info.address",
                value=spec.address,
            )

    def _check_owner(self, record: _Record, lease: str, caller: str | None, what: str) -> None:
        if caller in _PRIVILEGED:
            return
        if not lease or not hmac.compare_digest(lease.encode(), record.lease.encode()):
            raise PermissionDenied(
                f"{what} {record.spec.service_id}: not its owner (the lease given at "
                "registration is required)",
                field="lease",
                value=record.spec.service_id,
            )

    def _new_id(self, role: str) -> str:
        while True:
            n = self._counters.get(role, 0) + 1
            self._counters[role] = n
            candidate = f"{role}-{n}"
            if candidate not in self._records:
                return candidate

    def heartbeat(
        self,
        service_id: str,
        load: ServiceLoad | None = None,
        *,
        lease: str = "",
        caller: str | None = None,
    ) -> bool:
        """Record a sign of life (and the load); False if the id is unknown.

        A service role must present the entry's lease (PermissionDenied otherwise).
        """
        if load is not None and not (
            math.isfinite(load.tokens_per_second) and load.tokens_per_second >= 0
        ):  # it feeds the autoscaler and the status table
            raise InvalidArgument(
                "must be a finite number >= 0",
                field="load.tokens_per_second",
                value=load.tokens_per_second,
            )
        now = self._clock()
        with self._lock:
            self._expire(now)
            record = self._records.get(service_id)
            if record is None:
                return False
            self._check_owner(record, lease, caller, "heartbeat for")
            if record.dead_since is not None:
                logger.info("%s is alive again after %.1fs", service_id, now - record.last_seen)
                record.dead_since = None
            record.last_seen = now
            if load is not None:
                record.load = load
            return True

    def deregister(self, service_id: str, *, lease: str = "", caller: str | None = None) -> bool:
        """Remove a service; False if it was not registered.

        A service role must present the entry's lease (PermissionDenied otherwise).
        """
        with self._lock:
            record = self._records.get(service_id)
            if record is not None:
                self._check_owner(record, lease, caller, "deregister")
            gone = self._records.pop(service_id, None)
        if gone is not None:
            logger.info("deregistered %s (%s)", service_id, gone.spec.address)
        return gone is not None

    # ---------------------------------------------------------------- queries

    def get(self, service_id: str) -> ServiceEntry | None:
        now = self._clock()
        with self._lock:
            self._expire(now)
            record = self._records.get(service_id)
            return None if record is None else self._entry(record, now)

    def list_services(
        self, role: Service | None = None, *, alive_only: bool = False
    ) -> list[ServiceEntry]:
        """Entries (of ``role``, or all) in registration order."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            out = [
                self._entry(r, now)
                for r in self._records.values()
                if role is None or r.spec.role == role
            ]
        return [e for e in out if e.alive] if alive_only else out

    def expire(self) -> list[str]:
        """Mark silent services DEAD and forget old dead ones; returns the newly dead ids."""
        now = self._clock()
        with self._lock:
            return self._expire(now)

    def _expire(self, now: float) -> list[str]:
        newly_dead = []
        for sid, record in list(self._records.items()):
            if record.dead_since is None and now - record.last_seen > self.dead_after_s:
                record.dead_since = now
                newly_dead.append(sid)
                logger.warning(
                    "%s (%s at %s) is DEAD: no heartbeat for %.1fs (limit %.1fs)",
                    sid,
                    record.spec.role,
                    record.spec.address,
                    now - record.last_seen,
                    self.dead_after_s,
                )
            if (
                record.dead_since is not None
                and self.forget_dead_after_s is not None
                and now - record.dead_since > self.forget_dead_after_s
            ):
                del self._records[sid]
        return newly_dead

    def _entry(self, record: _Record, now: float) -> ServiceEntry:
        dead = record.dead_since is not None or now - record.last_seen > self.dead_after_s
        return ServiceEntry(
            spec=record.spec,
            state=ServiceState.DEAD if dead else ServiceState.ALIVE,
            registered_unix=record.registered,
            last_heartbeat_unix=record.last_seen,
            load=record.load,
            lease=record.lease,
        )


# --------------------------------------------------------------------------- core


TrainingState = Literal["idle", "running", "done", "failed"]


@dataclass(frozen=True)
class TrainingStatus:
    """The driver's progress, as ``GetTrainingStatus`` reports it."""

    global_step: int = 0
    total_steps: int = 0
    weight_version: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)
    state: TrainingState = "idle"


@dataclass(frozen=True)
class Assignment:
    """A role on a pool, bound to a registered service (``service_id`` "" if none yet)."""

    role: str
    pool: str
    service_id: str
    devices: tuple[Device, ...]


@dataclass(frozen=True)
class Placement:
    """A plan bound to the registered services."""

    plan: PlacementPlan
    assignments: tuple[Assignment, ...]

    @property
    def colocated(self) -> bool:
        return self.plan.colocated


def _serves(entry: ServiceEntry, role: str) -> bool:
    if entry.spec.role != SERVICE_OF_ROLE[role]:
        return False
    roles = entry.spec.capabilities.get("roles")
    return roles is None or role in {r.strip() for r in roles.split(",")}


def bind_services(plan: PlacementPlan, services: Sequence[ServiceEntry]) -> tuple[Assignment, ...]:
    """One assignment per (placed role, alive service serving it); a role no service
    serves yet gets one unbound assignment with all its pool's devices."""
    out: list[Assignment] = []
    for role, pool_name in plan.role_pool.items():
        pool = plan.pools[pool_name]
        bound = False
        for entry in services:
            if not entry.alive or not _serves(entry, role):
                continue
            on_node = pool.devices_on(entry.spec.node)
            own = {d.key for d in entry.spec.devices}
            devices = tuple(d for d in on_node if d.key in own) or on_node
            out.append(Assignment(role, pool_name, entry.service_id, devices))
            bound = True
        if not bound:
            out.append(Assignment(role, pool_name, "", pool.devices))
    return tuple(out)


class SchedulerCore:
    """Registry + placement + training status: everything the SchedulerService serves.

    Args:
        registry: the service registry (default: a fresh :class:`Registry`).
        device: what pool entries count when planning (``cpu`` cores or ``cuda`` GPUs).
        nodes: the devices to plan against when no registered service reports any
            of ``device``'s kind (None: this machine, :func:`local_node`).
    """

    def __init__(
        self,
        registry: Registry | None = None,
        *,
        device: DeviceKind = "cpu",
        nodes: Sequence[NodeInventory] | None = None,
    ) -> None:
        self.registry = registry or Registry()
        self.device: DeviceKind = device
        self._fallback_nodes = list(nodes) if nodes is not None else None
        self._lock = threading.Lock()
        self._status = TrainingStatus()
        self._placement: Placement | None = None
        self._desired: dict[str, int] = {}
        self._scale_generation = 0
        self._scale_step: dict[str, int] = {}  # the global step published at each set

    # ---- registry

    def register(
        self, spec: ServiceSpec, *, caller: str | None = None, lease: str = "", endpoint: str = ""
    ) -> ServiceEntry:
        return self.registry.register(spec, caller=caller, lease=lease, endpoint=endpoint)

    def heartbeat(
        self,
        service_id: str,
        load: ServiceLoad | None = None,
        *,
        lease: str = "",
        caller: str | None = None,
    ) -> bool:
        return self.registry.heartbeat(service_id, load, lease=lease, caller=caller)

    def deregister(self, service_id: str, *, lease: str = "", caller: str | None = None) -> bool:
        return self.registry.deregister(service_id, lease=lease, caller=caller)

    def list_services(
        self, role: Service | None = None, *, alive_only: bool = False
    ) -> list[ServiceEntry]:
        return self.registry.list_services(role, alive_only=alive_only)

    @property
    def heartbeat_interval_s(self) -> float:
        return self.registry.heartbeat_interval_s

    # ---- placement

    def inventory(self) -> list[NodeInventory]:
        """Nodes to plan against: the registered services' devices of this kind, else
        the fallback nodes (this machine)."""
        reported = [
            (e.spec.node, [d for d in e.spec.devices if d.kind == self.device])
            for e in self.registry.list_services(alive_only=True)
        ]
        nodes = [n for n in inventory_from_services(reported) if n.devices]
        if nodes:
            return nodes
        if self._fallback_nodes is None:
            self._fallback_nodes = [local_node(self.device)]
        return list(self._fallback_nodes)

    def plan(
        self,
        resource_pools: Mapping[str, Sequence[int]],
        mapping: Mapping[str, str | None],
        *,
        roles: Iterable[str] | None = None,
        fold_nodes: bool = False,
    ) -> Placement:
        """Validate the pools against :meth:`inventory`, bind roles to registered
        services, keep the result as the current placement and return it.

        A pool gets the devices its roles' registered services run on first, so the
        plan matches what is running when it can.

        Raises:
            InvalidArgument: a role maps to an unknown pool.
            PlacementError: the pools do not fit (every shortfall named).
        """
        alive = self.registry.list_services(alive_only=True)
        prefer: dict[str, list[tuple[str, Device]]] = {}
        for role, pool in mapping.items():
            if pool is None or role not in SERVICE_OF_ROLE:
                continue
            for entry in alive:
                if _serves(entry, role):
                    prefer.setdefault(pool, []).extend(
                        (entry.spec.node, d) for d in entry.spec.devices
                    )
        plan = plan_placement(
            resource_pools,
            mapping,
            device=self.device,
            nodes=self.inventory(),
            roles=roles,
            fold_nodes=fold_nodes,
            prefer=prefer,
        )
        placement = Placement(plan, bind_services(plan, alive))
        with self._lock:
            self._placement = placement
        return placement

    def set_placement(self, plan: PlacementPlan) -> Placement:
        """Adopt a plan computed elsewhere (e.g. by the local cluster that launched us)."""
        placement = Placement(
            plan, bind_services(plan, self.registry.list_services(alive_only=True))
        )
        with self._lock:
            self._placement = placement
        return placement

    def placement(self) -> Placement:
        """The current placement, re-bound to the services alive now.

        Raises:
            FailedPrecondition: nothing has been planned yet.
        """
        with self._lock:
            current = self._placement
        if current is None:
            raise FailedPrecondition("no placement yet: call Plan first")
        return Placement(
            current.plan, bind_services(current.plan, self.registry.list_services(alive_only=True))
        )

    # ---- training status

    def training_status(self) -> TrainingStatus:
        with self._lock:
            return self._status

    def set_training_status(
        self,
        *,
        global_step: int | None = None,
        total_steps: int | None = None,
        weight_version: int | None = None,
        metrics: Mapping[str, float] | None = None,
        state: TrainingState | None = None,
    ) -> TrainingStatus:
        """Update the fields given (the driver calls this after each step)."""
        if state is not None and state not in ("idle", "running", "done", "failed"):
            raise InvalidArgument(f"unknown training state {state!r}", field="state", value=state)
        if metrics is not None:  # kept, and sent to every GetTrainingStatus: bounded
            if len(metrics) > MAX_STATUS_METRICS:
                raise InvalidArgument(
                    f"{len(metrics)} metrics, over the limit of {MAX_STATUS_METRICS}",
                    field="metrics",
                    value=len(metrics),
                    code="TOO_LARGE",
                )
            for name in metrics:
                if not name or len(name) > MAX_METRIC_NAME_CHARS or not name.isprintable():
                    raise InvalidArgument(
                        f"a metric name must be 1-{MAX_METRIC_NAME_CHARS} printable characters "
                        f"(got {len(name)})",
                        field=f"metrics[{name[:64]!r}]",
                        value=name[:64],
                        code="TOO_LARGE" if len(name) > MAX_METRIC_NAME_CHARS else None,
                    )
        with self._lock:
            s = self._status
            self._status = TrainingStatus(
                global_step=s.global_step if global_step is None else global_step,
                total_steps=s.total_steps if total_steps is None else total_steps,
                weight_version=s.weight_version if weight_version is None else weight_version,
                metrics=dict(s.metrics if metrics is None else metrics),
                state=s.state if state is None else state,
            )
            return self._status

    @property
    def weight_version(self) -> int:
        """The version a newly registered rollout replica must fetch before serving."""
        return self.training_status().weight_version

    # ---- desired scale

    MAX_REPLICAS = 1024

    def set_scale(self, role: Service, replicas: int) -> tuple[int, int]:
        """Ask for ``replicas`` services of ``role`` (rollout); the launcher reconciles.

        Returns ``(replicas, generation)``.
        """
        if role != "rollout":
            raise InvalidArgument(
                f"only rollout replicas are scaled, not {role}", field="role", value=role
            )
        if not 1 <= replicas <= self.MAX_REPLICAS:
            raise InvalidArgument(
                f"replicas must be in [1, {self.MAX_REPLICAS}]", field="replicas", value=replicas
            )
        with self._lock:
            self._scale_generation += 1
            self._desired[role] = replicas
            self._scale_step[role] = self._status.global_step
            logger.info("desired %s replicas: %d (request %d)", role, replicas,
                        self._scale_generation)  # fmt: skip
            return replicas, self._scale_generation

    def scale(self, role: Service) -> tuple[int, int]:
        """``(desired replicas or 0 when never set, generation)``."""
        with self._lock:
            return self._desired.get(role, 0), self._scale_generation

    def scale_set_at_step(self, role: Service) -> int:
        """The global step the driver had published when ``role``'s count was last set
        (-1 if never): a step after it ran with the fleet asked for."""
        with self._lock:
            return self._scale_step.get(role, -1)
