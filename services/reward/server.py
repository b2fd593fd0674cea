"""`rlfleet serve reward`: the reward service as a process.

    rlfleet serve reward [--config FILE] [--host H] [--port N] [--metrics-port N]
                         [--processes N] [--auth-token-env VAR]
                         [--tls-cert F --tls-key F [--tls-ca F]] [-o reward.num_workers=8 ...]

On start it prints one JSON line to stdout,
``{"event": "serving", "service": "reward", "address": "127.0.0.1:50053",
"metrics_address": "127.0.0.1:9100" | null, "pid": ...}``, then serves until
SIGTERM / SIGINT (graceful: health NOT_SERVING, in-flight calls finish).

``--processes N`` (or ``reward.num_processes``; 0: one per CPU core) runs N server
processes on the one port, a parent supervising them (:mod:`rlfleet.reward.processes`);
its serving line adds ``"processes"`` and ``"process_pids"``.

Everything here is torch-free unless the config enables a reward model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

from rlfleet.common import cli_args, tracing
from rlfleet.common.allocator import use_one_arena
from rlfleet.common.auth import SHARED_TOKEN_ENV, CredentialError
from rlfleet.common.config import ConfigError, RewardConfig, load_config
from rlfleet.common.rpc import (
    Server,
    TLSConfig,
    add_security_arguments,
    create_server,
    init_service_security,
    taken_ports,
)
from rlfleet.reward.core import DEFAULT_MAX_BATCH_SIZE, RewardManager
from rlfleet.reward.metrics import RewardMetrics, start_metrics_server
from rlfleet.reward.processes import MAX_AUTO_PROCESSES, resolve_processes, serve_processes
from rlfleet.reward.servicer import RewardServicer
from rlfleet.reward.types import DEFAULT_MAX_NAME_CHARS, DEFAULT_MAX_TEXT_CHARS, SampleLimits
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
    reuse_port: bool = False,
    processes: int = 1,
    limits: SampleLimits | None = None,
) -> RewardService:
    """Build the core, start the gRPC server (and ``/metrics`` when ``metrics_port`` is set).

    ``port=0`` / ``metrics_port=0`` pick free ports (read ``address`` / ``metrics_port``).
    ``reuse_port``: share the port with other processes (``SO_REUSEPORT``);
    ``processes``: how many do, as ``GetInfo`` reports it.
    ``max_batch_size`` and ``limits`` (default :class:`SampleLimits`) bound each request.
    """
    metrics = manager.metrics if manager is not None else RewardMetrics()
    if manager is None:
        manager = RewardManager(config, max_batch_size=max_batch_size, metrics=metrics)
    try:
        server = create_server(
            [
                (
                    reward_pb2_grpc.add_RewardServiceServicer_to_server,
                    RewardServicer(manager, processes=processes, limits=limits),
                )
            ],
            host=host,
            port=port,
            max_workers=max_grpc_workers,
            tls=tls,
            auth_token=auth_token,
            reuse_port=reuse_port,
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
    cli_args.add_override_argument(parser, "reward.num_workers=8")
    parser.add_argument("--host", default="127.0.0.1", help="interface (0.0.0.0 to expose)")
    parser.add_argument(
        "--port", type=cli_args.port, default=DEFAULT_PORT, help="0 picks a free port"
    )
    parser.add_argument(
        "--metrics-port",
        type=cli_args.port,
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
    parser.add_argument(
        "--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE, help="samples per request"
    )
    parser.add_argument(
        "--max-text-chars",
        type=_positive,
        default=DEFAULT_MAX_TEXT_CHARS,
        metavar="N",
        help="most characters per text field of a sample (response, prompt, prompt_messages, "
        "ground_truth) and bytes of extra_info / a structured ground_truth",
    )
    parser.add_argument(
        "--max-name-chars",
        type=_positive,
        default=DEFAULT_MAX_NAME_CHARS,
        metavar="N",
        help="most characters of a sample's data_source and id",
    )
    parser.add_argument("--grpc-workers", type=int, default=32, help="gRPC handler threads")
    parser.add_argument(
        "--processes",
        type=_processes,
        default=None,
        metavar="N",
        help="server processes sharing --port (SO_REUSEPORT), each with its own GIL and "
        f"reward.num_workers workers; 0: one per CPU core, at most {MAX_AUTO_PROCESSES}; "
        "default: reward.num_processes (1)",
    )
    # Set by the parent of --processes N on each child it starts.
    parser.add_argument("--process-index", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--process-count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--log-level", type=cli_args.log_level, default="INFO")
    add_security_arguments(parser)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _processes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 0 (0: one per CPU core, at most {MAX_AUTO_PROCESSES}), "
            f"got {text!r}"
        )
    return value


def _stop_when_stdin_closes() -> None:
    """A child of ``--processes N``: stop (as on SIGTERM) once the parent is gone.

    Its stdin is a pipe from the parent, which closes it only after the child has
    exited; an end of file sooner means the parent died.
    """

    def watch() -> None:
        # os.read, not sys.stdin: a daemon thread blocked inside a buffered reader's
        # lock makes the interpreter abort at exit.
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        logger.warning("parent process gone (stdin closed): stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="rlfleet-parent-watch", daemon=True).start()


def serve_main(args: argparse.Namespace) -> int:
    """Run the reward service until SIGTERM / SIGINT. Returns the exit code."""
    use_one_arena()  # before any thread starts (rlfleet.common.allocator)
    child = args.process_index is not None
    where = f" [process {args.process_index}]" if child else ""
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s{where} %(name)s: %(message)s",
    )
    overrides = list(args.override)
    if args.processes is not None:
        overrides.append(f"reward.num_processes={args.processes}")
    try:
        run_config = load_config(args.config, overrides)
        config = run_config.reward
        if args.config is not None:
            tracing.configure(run_config, "reward")
    except ConfigError as e:
        print(e.lines("error: "), file=sys.stderr)
        return 2
    processes = resolve_processes(config.num_processes)
    if args.auth_token_env:
        token = os.environ.get(args.auth_token_env)
        if not token:
            print(
                f"error: --auth-token-env {args.auth_token_env}: variable is empty or unset",
                file=sys.stderr,
            )
            return 2
        os.environ[SHARED_TOKEN_ENV] = token  # a shared token: its holders are admin
    try:
        security = init_service_security(args, what="rlfleet serve reward", host=args.host)
    except CredentialError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not child:  # children share the port their parent reserved
        taken = taken_ports(args.host, {"--port": args.port, "--metrics-port": args.metrics_port})
        if taken:
            print("\n".join(f"error: {t}" for t in taken), file=sys.stderr)
            return 2
    tls = security.server_tls()
    if processes > 1 and not child:
        return serve_processes(args, processes, tls=tls)
    service = start_reward_service(
        config,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        tls=tls,
        max_batch_size=args.max_batch_size,
        limits=SampleLimits(args.max_text_chars, args.max_name_chars),
        max_grpc_workers=args.grpc_workers,
        reuse_port=child,
        processes=args.process_count if child else 1,
    )
    service.server.install_signal_handlers()
    if child:
        _stop_when_stdin_closes()
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
