"""`rlfleet serve reward`: the reward service as a process.

    rlfleet serve reward [--config FILE] [--host H] [--port N] [--metrics-port N]
                         [--auth-token-env VAR] [--tls-cert F --tls-key F [--tls-ca F]]
                         [-o reward.num_workers=8 ...]

On start it prints one JSON line to stdout,
``{"event": "serving", "service": "reward", "address": "127.0.0.1:50053",
"metrics_address": "127.0.0.1:9100" | null, "pid": ...}``, then serves until
SIGTERM / SIGINT (graceful: health NOT_SERVING, in-flight calls finish).

Everything here is torch-free unless the config enables a reward model.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from rlfleet.common.config import RewardConfig, load_config
from rlfleet.common.rpc import Server, TLSConfig, create_server
from rlfleet.reward.manager import DEFAULT_MAX_BATCH_SIZE, RewardManager
from rlfleet.reward.metrics import RewardMetrics, start_metrics_server
from rlfleet.reward.servicer import RewardServicer
from rlfleet.v1 import reward_pb2, reward_pb2_grpc

__all__ = [
    "DEFAULT_PORT",
    "SERVICE_NAME",
    "RewardService",
    "add_serve_arguments",
    "main",
    "serve_main",
    "start_reward_service",
]

DEFAULT_PORT = 50053
SERVICE_NAME: str = reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name

logger = logging.getLogger(__name__)


@dataclass
class RewardService:
    """A running reward service: gRPC server, core and (optional) metrics endpoint."""

    server: Server
    manager: RewardManager
    metrics: RewardMetrics
    metrics_server: Any = None
    metrics_port: int | None = None

    @property
    def address(self) -> str:
        return self.server.address

    def stop(self, grace_s: float = 5.0) -> None:
        self.server.stop(grace_s)
        self.manager.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()

    def __enter__(self) -> RewardService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(grace_s=0.0)


def start_reward_service(
    config: RewardConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int | None = None,
    metrics_host: str | None = None,
    auth_token: str | None = None,
    tls: TLSConfig | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    max_grpc_workers: int = 32,
    manager: RewardManager | None = None,
) -> RewardService:
    """Build the core, start the gRPC server (and ``/metrics`` when ``metrics_port`` is set).

    ``port=0`` / ``metrics_port=0`` pick free ports (read ``address`` / ``metrics_port``).
    """
    metrics = manager.metrics if manager is not None else RewardMetrics()
    if manager is None:
        manager = RewardManager(config, max_batch_size=max_batch_size, metrics=metrics)
    try:
        server = create_server(
            [(reward_pb2_grpc.add_RewardServiceServicer_to_server, RewardServicer(manager))],
            host=host,
            port=port,
            max_workers=max_grpc_workers,
            tls=tls,
            auth_token=auth_token,
        )
    except Exception:
        manager.close()
        raise
    service = RewardService(server, manager, metrics)
    if metrics_port is not None:
        try:
            service.metrics_server, service.metrics_port = start_metrics_server(
                metrics, metrics_host or host, metrics_port
            )
        except Exception:
            service.stop(grace_s=0.0)
            raise
    return service


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``rlfleet serve reward``."""
    parser.add_argument("--config", help="YAML run config; its `reward` section is used")
    parser.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted config override, e.g. reward.num_workers=8 (repeatable)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface (0.0.0.0 to expose)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics on this port (0: a free one); default: off",
    )
    parser.add_argument("--metrics-host", default=None, help="default: --host")
    parser.add_argument(
        "--auth-token-env",
        metavar="VAR",
        default=None,
        help="require `authorization: Bearer $VAR` on every call (health exempt)",
    )
    parser.add_argument("--tls-cert", help="server certificate (PEM); with --tls-key: TLS")
    parser.add_argument("--tls-key", help="server private key (PEM)")
    parser.add_argument("--tls-ca", help="CA for client certificates: requires mTLS")
    parser.add_argument(
        "--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE, help="samples per request"
    )
    parser.add_argument("--grpc-workers", type=int, default=32, help="gRPC handler threads")
    parser.add_argument("--log-level", default="INFO")


def serve_main(args: argparse.Namespace) -> int:
    """Run the reward service until SIGTERM / SIGINT. Returns the exit code."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = load_config(args.config, args.override).reward
    token = None
    if args.auth_token_env:
        token = os.environ.get(args.auth_token_env)
        if not token:
            print(
                f"error: --auth-token-env {args.auth_token_env}: variable is empty or unset",
                file=sys.stderr,
            )
            return 2
    tls = None
    if args.tls_cert or args.tls_key:
        tls = TLSConfig(
            cert=args.tls_cert,
            key=args.tls_key,
            ca=args.tls_ca,
            require_client_cert=args.tls_ca is not None,
        )
    service = start_reward_service(
        config,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        auth_token=token,
        tls=tls,
        max_batch_size=args.max_batch_size,
        max_grpc_workers=args.grpc_workers,
    )
    service.server.install_signal_handlers()
    metrics_address = (
        None
        if service.metrics_port is None
        else f"{args.metrics_host or args.host}:{service.metrics_port}"
    )
    print(
        json.dumps(
            {
                "event": "serving",
                "service": "reward",
                "address": service.address,
                "metrics_address": metrics_address,
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    try:
        service.server.wait()
    finally:
        service.stop(grace_s=0.0)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet serve reward", description=__doc__)
    add_serve_arguments(parser)
    return serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
