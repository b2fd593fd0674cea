"""The scheduler's gRPC servicer: validates, converts (:mod:`rlfleet.scheduler.serde`)
and calls :class:`SchedulerCore`; errors the core raises (``InvalidArgument``,
``PlacementError`` ...) become status codes through
:func:`rlfleet.common.rpc.create_server`'s interceptor. Clients are in
:mod:`rlfleet.scheduler.client`.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from collections.abc import Sequence

import grpc

from rlfleet.common.auth import ADMIN, caller_role
from rlfleet.common.errors import InvalidArgument, PermissionDenied
from rlfleet.common.roles import ROLES
from rlfleet.scheduler.registry import (
    SchedulerCore,
    ServiceSpec,
)
from rlfleet.scheduler.serde import (
    entry_to_proto,
    load_from_proto,
    placement_to_proto,
    role_from_proto,
    role_to_proto,
    spec_from_proto,
    status_from_proto,
    status_to_proto,
)
from rlfleet.v1 import scheduler_pb2, scheduler_pb2_grpc


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``), or ""."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    host = rest.rpartition(":")[0]
    return host.strip("[]")


def _host_ips(host: str) -> set[str]:
    """The IP addresses of ``host`` (itself when it is one; resolved names otherwise)."""
    host = host.strip("[]")
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return set()
    return {str(info[4][0]) for info in infos}


def _openai_address(url: str) -> str:
    """``host:port`` of an ``openai_url`` capability (InvalidArgument if it is no
    http(s) URL with a host and a port)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        port = None
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port:
        raise InvalidArgument(
            "expected http(s)://host:port/...",
            field="info.capabilities[openai_url]",
            value=url,
        )
    host = parts.hostname
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_own_address(spec: ServiceSpec, peer: str, allowed_hosts: Sequence[str] = ()) -> str:
    """A service may only register addresses on its own host (the connection's peer).

    ``address``, ``metrics_address`` and an ``openai_url`` capability (where agents
    send their key) must name the peer's IP (or a name resolving to it); hosts in
    ``allowed_hosts`` are accepted as they are (NAT, proxies).

    Returns:
        ``address`` as the scheduler resolved it (``peer ip:port``), which the
        registry compares entries by; "" where no peer IP is known or the host is
        an allowed one.

    Raises:
        PermissionDenied: naming the field and the address.
    """
    caller_ip = peer_host(peer)
    if not caller_ip:
        return ""  # unix socket or in-process: the host is this one
    openai = spec.capabilities.get("openai_url")
    for field_name, address in (
        ("info.address", spec.address),
        ("info.metrics_address", spec.metrics_address),
        ("info.capabilities[openai_url]", _openai_address(openai) if openai else ""),
    ):
        if not address:
            continue
        host = address.rpartition(":")[0].strip("[]")
        if host in allowed_hosts:
            continue
        ips = _host_ips(host)
        if caller_ip in ips:
            continue
        raise PermissionDenied(
            f"{address} is not on the registering host ({caller_ip}); a service registers "
            "its own addresses (or the scheduler allows the host: --allow-register-host)",
            field=field_name,
            value=address,
        )
    host, _, port = spec.address.rpartition(":")
    if host.strip("[]") in allowed_hosts:
        return ""
    return f"[{caller_ip}]:{port}" if ":" in caller_ip else f"{caller_ip}:{port}"


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    """SchedulerService over a :class:`SchedulerCore`.

    Args:
        core: the registry, placement and status.
        allowed_hosts: hosts a service may register addresses on besides its own
            (:func:`check_own_address`; the driver and admin are not checked).
    """

    def __init__(self, core: SchedulerCore, *, allowed_hosts: Sequence[str] = ()) -> None:
        self.core = core
        self.allowed_hosts = tuple(allowed_hosts)

    def Register(
        self, request: scheduler_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.RegisterResponse:
        spec = spec_from_proto(request.info)
        if "openai_url" in spec.capabilities:  # agents are sent there: a URL, from anyone
            _openai_address(spec.capabilities["openai_url"])
        caller = caller_role()
        endpoint = ""
        if caller not in (None, "driver", ADMIN):
            endpoint = check_own_address(spec, context.peer(), self.allowed_hosts)
        entry = self.core.register(spec, caller=caller, lease=request.lease, endpoint=endpoint)
        return scheduler_pb2.RegisterResponse(
            service_id=entry.service_id,
            heartbeat_interval_s=self.core.heartbeat_interval_s,
            weight_version=self.core.weight_version,
            lease=entry.lease,
        )

    def Heartbeat(
        self, request: scheduler_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.HeartbeatResponse:
        if not request.service_id:
            raise InvalidArgument("service_id is required", field="service_id")
        load = load_from_proto(request.load) if request.HasField("load") else None
        known = self.core.heartbeat(
            request.service_id, load, lease=request.lease, caller=caller_role()
        )
        return scheduler_pb2.HeartbeatResponse(known=known)

    def Deregister(
        self, request: scheduler_pb2.DeregisterRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.DeregisterResponse:
        # idempotent: unknown ids are fine
        self.core.deregister(request.service_id, lease=request.lease, caller=caller_role())
        return scheduler_pb2.DeregisterResponse()

    def ListServices(
        self, request: scheduler_pb2.ListServicesRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.ListServicesResponse:
        role = role_from_proto(request.role)
        return scheduler_pb2.ListServicesResponse(
            services=[entry_to_proto(e) for e in self.core.list_services(role)]
        )

    def Plan(
        self, request: scheduler_pb2.PlanRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.Placement:
        if not request.resource_pools:
            raise InvalidArgument("resource_pools is empty", field="resource_pools")
        # Proto maps have no order: plan pools by name, so the same request gives the
        # same plan.
        pools = {
            name: list(request.resource_pools[name].gpus_per_node)
            for name in sorted(request.resource_pools)
        }
        for name, entries in pools.items():  # as the config's resource_pools are checked
            if not name or not name.isprintable() or len(name) > 256:
                raise InvalidArgument(
                    "a pool name must be 1-256 printable characters",
                    field="resource_pools",
                    value=name[:64],
                )
            if not entries:
                raise InvalidArgument(
                    f"pool {name!r} lists no node (one device count per node)",
                    field=f"resource_pools[{name}].gpus_per_node",
                    value=entries[:16],
                )
        for role, pool in request.mapping.items():
            if role not in ROLES:
                raise InvalidArgument(
                    f"no role {role[:64]!r} (roles: {', '.join(ROLES)})",
                    field=f"mapping[{role[:64]}]",
                    value=role[:64],
                )
            if pool and pool not in pools:
                raise InvalidArgument(
                    f"mapping.{role}: no pool {pool[:64]!r} (pools: {sorted(pools)})",
                    field=f"mapping[{role}]",
                    value=pool[:64],
                )
        mapping: dict[str, str | None] = {r: (p or None) for r, p in request.mapping.items()}
        return placement_to_proto(self.core.plan(pools, mapping))

    def GetPlacement(
        self, request: scheduler_pb2.GetPlacementRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.Placement:
        return placement_to_proto(self.core.placement())

    def GetTrainingStatus(
        self, request: scheduler_pb2.GetTrainingStatusRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.TrainingStatus:
        return status_to_proto(self.core.training_status())

    def SetTrainingStatus(
        self, request: scheduler_pb2.TrainingStatus, context: grpc.ServicerContext
    ) -> scheduler_pb2.TrainingStatus:
        s = status_from_proto(request)
        if request.state and request.state != s.state:
            raise InvalidArgument(
                f"unknown training state {request.state!r}", field="state", value=request.state
            )
        return status_to_proto(
            self.core.set_training_status(
                global_step=s.global_step,
                total_steps=s.total_steps,
                weight_version=s.weight_version,
                metrics=s.metrics,
                state=s.state,
            )
        )

    def SetScale(
        self, request: scheduler_pb2.SetScaleRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.Scale:
        role = role_from_proto(request.role) or "rollout"
        replicas, generation = self.core.set_scale(role, request.replicas)
        return scheduler_pb2.Scale(
            role=role_to_proto(role), replicas=replicas, generation=generation
        )

    def GetScale(
        self, request: scheduler_pb2.GetScaleRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.Scale:
        role = role_from_proto(request.role) or "rollout"
        replicas, generation = self.core.scale(role)
        return scheduler_pb2.Scale(
            role=role_to_proto(role), replicas=replicas, generation=generation
        )
