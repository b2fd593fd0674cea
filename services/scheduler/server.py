"""`rlfleet serve scheduler`: the SchedulerService as a process (or a server in-process).

    rlfleet serve scheduler [--host H] [--port N] [--metrics-port N] [--config FILE [-o k=v]]
                            [--plan-local] [--heartbeat-interval-s S] [--missed-heartbeats K]

On start it prints one JSON line to stdout, ``{"event": "serving", "service":
"scheduler", "address": "127.0.0.1:50050", "metrics_address": "127.0.0.1:9200" | null,
"pid": ...}``, then serves until SIGTERM / SIGINT (graceful: health NOT_SERVING,
in-flight calls finish).

With a metrics port, one small HTTP server answers:

* ``/metrics``: Prometheus text (``rlfleet_scheduler_registered_services{role,state}``,
  plus whatever the in-process driver put on the registry it passed in);
* ``/sd``: Prometheus HTTP service discovery, ``[{"targets": ["host:port"], "labels":
  {"role": ..., "service_id": ..., "node": ...}}, ...]`` with the metrics address of
  every alive service that has one, the scheduler included.

A :class:`HealthProber` thread marks silent services DEAD on time and keeps the
services registered with ``liveness=probe`` alive while their gRPC health check
answers SERVING.

In-process (the driver, tests)::

    core = SchedulerCore()
    with start_scheduler_server(core, metrics_port=0) as server:
        print(server.address, server.metrics_address)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from rlfleet.common import cli_args
from rlfleet.common.allocator import use_one_arena
from rlfleet.common.auth import CredentialError
from rlfleet.common.http import HttpEndpoint, serve_http
from rlfleet.common.rpc import (
    Server,
    add_security_arguments,
    check_health,
    create_channel,
    create_server,
    init_service_security,
    taken_ports,
)
from rlfleet.scheduler.autoscale import Autoscaler, autoscale_collector
from rlfleet.scheduler.placement import PlacementError
from rlfleet.scheduler.registry import Registry, SchedulerCore, ServiceEntry
from rlfleet.scheduler.servicer import SchedulerServicer
from rlfleet.v1 import scheduler_pb2_grpc

__all__ = [
    "DEFAULT_PORT",
    "HealthProber",
    "SchedulerServer",
    "add_serve_arguments",
    "main",
    "serve_main",
    "service_discovery",
    "start_scheduler_server",
]

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50050


def service_discovery(
    services: list[ServiceEntry], *, scheduler_metrics: str | None = None
) -> list[dict[str, Any]]:
    """Prometheus HTTP SD targets: one group per alive service with a metrics address."""
    groups: list[dict[str, Any]] = []
    if scheduler_metrics:
        groups.append(
            {"targets": [scheduler_metrics], "labels": {"role": "scheduler", "service_id": ""}}
        )
    for e in services:
        if not e.alive or not e.spec.metrics_address:
            continue
        groups.append(
            {
                "targets": [e.spec.metrics_address],
                "labels": {"role": e.spec.role, "service_id": e.service_id, "node": e.spec.node},
            }
        )
    return groups


class HealthProber:
    """Every ``interval_s``: expire silent services, health-check the probed ones.

    A service registered with ``liveness=probe`` counts as heartbeating while its
    gRPC health check answers SERVING.
    """

    def __init__(
        self, core: SchedulerCore, *, interval_s: float | None = None, timeout_s: float = 2.0
    ) -> None:
        self.core = core
        self.interval_s = interval_s or core.heartbeat_interval_s
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.Channel] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlfleet-prober", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def probe_once(self) -> None:
        """One round (also what the thread does each interval)."""
        self.core.registry.expire()
        probed = [e for e in self.core.list_services() if e.spec.probed]
        addresses = {e.spec.address for e in probed}
        for address in list(self._channels):
            if address not in addresses:
                self._channels.pop(address).close()
        for entry in probed:
            channel = self._channels.get(entry.spec.address)
            if channel is None:
                channel = create_channel(entry.spec.address, retry_unavailable=False)
                self._channels[entry.spec.address] = channel
            if check_health(channel, timeout_s=self.timeout_s):
                self.core.heartbeat(entry.service_id)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.probe_once()
            except Exception:  # keep probing: one bad round must not end liveness tracking
                logger.exception("health probe round failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + self.timeout_s + 1.0)
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


def _metrics_text(core: SchedulerCore, registry: Any) -> bytes | None:
    try:
        from prometheus_client import generate_latest
    except ImportError:
        return None
    return bytes(generate_latest(registry))


def _services_collector(core: SchedulerCore) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    class Collector:
        def collect(self) -> Iterator[Any]:
            services = GaugeMetricFamily(
                "rlfleet_scheduler_registered_services",
                "registered services by role and state",
                labels=["role", "state"],
            )
            counts: dict[tuple[str, str], int] = {}
            for e in core.list_services():
                key = (e.spec.role, e.state.value)
                counts[key] = counts.get(key, 0) + 1
            for (role, state), n in sorted(counts.items()):
                services.add_metric([role, state], n)
            yield services

    return Collector()


class SchedulerServer:
    """A running scheduler: gRPC server, optional HTTP metrics/SD server, prober."""

    def __init__(
        self,
        core: SchedulerCore,
        grpc_server: Server,
        prober: HealthProber,
        *,
        advertise_host: str,
        metrics_registry: Any = None,
    ) -> None:
        self.core = core
        self.grpc_server = grpc_server
        self.prober = prober
        self.metrics_registry = metrics_registry
        self.address = f"{advertise_host}:{grpc_server.port}"
        self.metrics_address: str | None = None
        self._http: HttpEndpoint | None = None
        self.autoscaler: Autoscaler | None = None

    def _sd_page(self) -> tuple[int, str, bytes]:
        body = json.dumps(
            service_discovery(self.core.list_services(), scheduler_metrics=self.metrics_address)
        ).encode()
        return 200, "application/json", body

    def _metrics_page(self) -> tuple[int, str, bytes]:
        text = _metrics_text(self.core, self.metrics_registry)
        if text is None:
            return 501, "text/plain", b"prometheus-client is not installed\n"
        return 200, "text/plain; version=0.0.4; charset=utf-8", text

    def _start_http(self, host: str, port: int, advertise_host: str) -> None:
        self._http = serve_http(host, port, {"/sd": self._sd_page, "/metrics": self._metrics_page})
        self.metrics_address = f"{advertise_host}:{self._http.port}"

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop autoscaling, probing, the HTTP server and gRPC (draining within ``grace_s``)."""
        if self.autoscaler is not None:
            self.autoscaler.stop()
        self.prober.stop()
        if self._http is not None:
            self._http.stop()
            self._http = None
        self.grpc_server.stop(grace_s)

    def wait(self) -> None:
        self.grpc_server.wait()

    def __enter__(self) -> SchedulerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(0.0)


def start_scheduler_server(
    core: SchedulerCore,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
    metrics_port: int | None = None,
    metrics_host: str | None = None,
    metrics_registry: Any = None,
    auth_token: str | None = None,
    probe_interval_s: float | None = None,
    allowed_hosts: Sequence[str] = (),
    autoscale: Any = None,
) -> SchedulerServer:
    """Serve ``core`` over gRPC (health, reflection), start the prober and, with a
    ``metrics_port`` (0: a free one), ``/metrics`` and ``/sd`` over HTTP.

    Args:
        metrics_registry: a ``prometheus_client.CollectorRegistry`` to serve (the
            driver's metrics live there); None: a fresh one. The scheduler's own
            collector is added to it.
        autoscale: ``scheduler.autoscale`` of the run config; with ``enable``, an
            :class:`~rlfleet.scheduler.autoscale.Autoscaler` runs against ``core``.
    """
    advertise = advertise_host or (socket.gethostname() if host in ("0.0.0.0", "::") else host)
    grpc_server = create_server(
        [
            (
                scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
                SchedulerServicer(core, allowed_hosts=allowed_hosts),
            )
        ],
        host=host,
        port=port,
        auth_token=auth_token,
    )
    prober = HealthProber(core, interval_s=probe_interval_s)
    registry = metrics_registry
    if metrics_port is not None and registry is None:
        with contextlib.suppress(ImportError):
            from prometheus_client import CollectorRegistry

            registry = CollectorRegistry()
    server = SchedulerServer(
        core, grpc_server, prober, advertise_host=advertise, metrics_registry=registry
    )
    if autoscale is not None and autoscale.enable:
        server.autoscaler = Autoscaler(core, autoscale)
    try:
        if metrics_port is not None:
            if registry is not None:
                registry.register(_services_collector(core))
                if server.autoscaler is not None:
                    registry.register(autoscale_collector(server.autoscaler))
            mhost = metrics_host or host
            server._start_http(mhost, metrics_port, advertise if mhost == host else mhost)
        prober.start()
        if server.autoscaler is not None:
            server.autoscaler.start()
    except BaseException:
        server.stop(0.0)
        raise
    return server


# --------------------------------------------------------------------------- CLI


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``rlfleet serve scheduler``."""
    parser.add_argument("--host", default="127.0.0.1", help="interface (0.0.0.0 to expose)")
    parser.add_argument(
        "--port", type=cli_args.port, default=DEFAULT_PORT, help="0 picks a free port"
    )
    parser.add_argument("--advertise-host", default=None, help="host others dial (default: --host)")
    parser.add_argument(
        "--metrics-port",
        type=cli_args.port,
        default=None,
        help="serve /metrics and /sd (Prometheus service discovery) here; 0: a free port; "
        "default: off",
    )
    parser.add_argument("--metrics-host", default=None, help="default: --host")
    parser.add_argument("--config", default=None, help="run config: device kind and pools")
    cli_args.add_override_argument(parser)
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="default: trainer.device, else cpu"
    )
    parser.add_argument(
        "--plan-local",
        action="store_true",
        help="plan the config's pools on this machine at start (what `rlfleet up` does)",
    )
    parser.add_argument(
        "--heartbeat-interval-s",
        type=float,
        default=2.0,
        help="what services are told to beat at (with --missed-heartbeats 3: dead after 6 s)",
    )
    parser.add_argument(
        "--missed-heartbeats", type=int, default=3, help="beats missed before a service is DEAD"
    )
    parser.add_argument(
        "--forget-dead-after-s", type=float, default=600.0, help="drop DEAD entries after this"
    )
    parser.add_argument("--grace-s", type=float, default=5.0, help="drain time on SIGTERM")
    parser.add_argument(
        "--allow-register-host",
        action="append",
        default=[],
        metavar="HOST",
        help="a host services may register addresses on besides their own (repeatable)",
    )
    parser.add_argument("--log-level", type=cli_args.log_level, default="INFO")
    add_security_arguments(parser)


def serve_main(args: argparse.Namespace) -> int:
    """Run the scheduler until SIGTERM / SIGINT. Returns the exit code."""
    use_one_arena()  # before any thread starts (rlfleet.common.allocator)
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        init_service_security(args, what="rlfleet serve scheduler", host=args.host)
    except CredentialError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    taken = taken_ports(
        args.metrics_host or args.host, {"--metrics-port": args.metrics_port}
    ) + taken_ports(args.host, {"--port": args.port})
    if taken:
        print("\n".join(f"error: {t}" for t in taken), file=sys.stderr)
        return 2
    config = None
    if args.config is not None or args.override:
        from rlfleet.common.config import ConfigError, load_config

        try:
            config = load_config(args.config, args.override)
        except ConfigError as e:
            print(e.lines("error: "), file=sys.stderr)
            return 2
    device = args.device or (config.trainer.device if config is not None else "cpu")
    core = SchedulerCore(
        Registry(
            heartbeat_interval_s=args.heartbeat_interval_s,
            missed_heartbeats=args.missed_heartbeats,
            forget_dead_after_s=args.forget_dead_after_s,
        ),
        device=device,
    )
    if config is not None and args.plan_local:
        try:
            placement = core.plan(
                config.resource_pools,
                config.mapping.model_dump(),
                roles=config.enabled_roles(),
                fold_nodes=True,
            )
        except PlacementError as e:
            print(f"error: --plan-local: {e}", file=sys.stderr)
            return 2
        logger.info("placement (%s):\n%s", placement.plan.mode, placement.plan.describe())
    server = start_scheduler_server(
        core,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        allowed_hosts=args.allow_register_host,
        autoscale=config.scheduler.autoscale if config is not None else None,
    )
    server.grpc_server.install_signal_handlers(grace_s=args.grace_s)
    print(
        json.dumps(
            {
                "event": "serving",
                "service": "scheduler",
                "address": server.address,
                "metrics_address": server.metrics_address,
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    try:
        server.wait()
    finally:
        server.stop(0.0)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet serve scheduler", description=__doc__)
    add_serve_arguments(parser)
    return serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
