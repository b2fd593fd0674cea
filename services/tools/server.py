"""`rlfleet serve tools`: the tools service as a process.

    rlfleet serve tools [--config FILE] [-o tools.builtin=[calculator]] [--host H] [--port N]

The config's ``tools`` section says which built-in tools it offers and their limits
(docs/tools.md). On start it logs the Python sandbox's isolation and prints one JSON
line to stdout, ``{"event": "serving", "service": "tools", "address": ..., "tools":
[...], "sandbox": "bwrap" | ... | null, "pid": ...}``, then serves until SIGTERM /
SIGINT (graceful: health NOT_SERVING, in-flight calls finish within ``--grace-s``).

Authenticated like every service: callers need the ``rollout``, ``driver`` or
``admin`` role to call a tool (``rlfleet.common.auth.METHOD_ROLES``). Torch-free.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from rlfleet.common import cli_args
from rlfleet.common.allocator import use_one_arena
from rlfleet.common.auth import CredentialError
from rlfleet.common.config import ConfigError, ToolsConfig, load_config
from rlfleet.common.rpc import (
    Server,
    add_security_arguments,
    create_server,
    init_service_security,
    taken_ports,
)
from rlfleet.common.sandbox import SandboxUnavailable
from rlfleet.tools.builtin import PythonTool, tool_core_from_config
from rlfleet.tools.core import ToolCore
from rlfleet.tools.servicer import ToolServicer
from rlfleet.v1 import tools_pb2_grpc

__all__ = ["add_serve_arguments", "main", "serve_main", "start_tool_server"]

logger = logging.getLogger(__name__)


def start_tool_server(
    core: ToolCore, *, host: str = "127.0.0.1", port: int = 0, max_workers: int = 32
) -> Server:
    """Serve ``core`` over gRPC (with health and reflection); returns the started server.

    Handler threads: the core's concurrent calls plus a few for listing, so queued
    calls wait in the core (against their time-out), not in gRPC."""
    return create_server(
        [(tools_pb2_grpc.add_ToolServiceServicer_to_server, ToolServicer(core))],
        host=host,
        port=port,
        max_workers=max(max_workers, core.limits.max_concurrent_calls + 4),
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="run config (YAML): its tools section")
    cli_args.add_override_argument(parser, "tools.builtin=[calculator]")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: all)")
    parser.add_argument(
        "--port", type=cli_args.port, default=0, help="gRPC port; 0 picks a free one"
    )
    parser.add_argument("--grace-s", type=float, default=5.0, help="drain time on SIGTERM")
    parser.add_argument("--log-level", type=cli_args.log_level, default="INFO")
    add_security_arguments(parser)


def serve_main(args: argparse.Namespace) -> int:
    use_one_arena()  # before any thread starts (rlfleet.common.allocator)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config: ToolsConfig = load_config(args.config, args.override).tools
    except ConfigError as e:
        print(e.lines("error: "), file=sys.stderr)
        return 2
    try:
        init_service_security(args, what="rlfleet serve tools", host=args.host)
    except CredentialError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    taken = taken_ports(args.host, {"--port": args.port})
    if taken:
        print("\n".join(f"error: {t}" for t in taken), file=sys.stderr)
        return 2
    try:
        core = tool_core_from_config(config)
    except SandboxUnavailable as e:
        print(f"rlfleet serve tools: {e} (or leave python out of tools.builtin)", file=sys.stderr)
        return 2
    server = start_tool_server(core, host=args.host, port=args.port)
    server.install_signal_handlers(grace_s=args.grace_s)
    isolation = next((t.isolation.mode for t in core.tools() if isinstance(t, PythonTool)), None)
    print(
        json.dumps(
            {
                "event": "serving",
                "service": "tools",
                "address": server.address,
                "tools": core.names,
                "sandbox": isolation,
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    try:
        server.wait()
    finally:
        core.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet serve tools", description=__doc__)
    add_serve_arguments(parser)
    return serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
