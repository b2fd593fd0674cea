"""`rlfleet scale rollout N`: ask a running cluster's scheduler for N rollout replicas.

::

    RLFLEET_CREDENTIALS=secrets/driver.json rlfleet scale rollout 4 --scheduler HOST:PORT

The scheduler records the desired count (``SetScale``, driver role only; the
autoscaler, ``scheduler.autoscale``, sets the same value); the launcher that started
the run (``rlfleet train``'s local processes or Ray actors) adds or removes replicas to
match within a few seconds, and a new replica gets the current weights before it takes
work. Without ``--scheduler``, the scheduler of the cluster `rlfleet up` recorded is
used, with that cluster's driver credentials when the environment names none.

A launcher rlfleet does not run (docker compose, a Kubernetes Deployment) follows the
desired count through a hook::

    rlfleet scale rollout --scheduler HOST:PORT \
        --watch-exec "docker compose up -d --no-recreate --scale rollout={replicas}"

polls the scheduler every ``--interval-s`` and, each time the desired count changes,
runs the command (split like a shell line, run without a shell) with ``{replicas}``
replaced; a replica the command starts registers with the scheduler as usual.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rlfleet.common import cli_args

__all__ = ["add_arguments", "run"]


#: What the scheduler takes (its registry's MAX_REPLICAS).
MAX_REPLICAS = 1024


def _replicas(text: str) -> int:
    value = cli_args.positive_int(text)
    if value > MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_REPLICAS} (got {value})")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rlfleet.launch.cli import DEFAULT_STATE_DIR

    parser.add_argument("role", choices=["rollout"], help="what to scale")
    parser.add_argument(
        "replicas",
        type=_replicas,
        nargs="?",
        help="replicas wanted (>= 1); omit with --watch-exec",
    )
    parser.add_argument(
        "--watch-exec",
        default=None,
        metavar="CMD",
        help="follow the desired count: run CMD ({replicas} replaced) each time it changes",
    )
    parser.add_argument(
        "--interval-s", type=cli_args.positive_float, default=2.0, help="--watch-exec poll period"
    )
    parser.add_argument(
        "--max-runs",
        type=cli_args.nonnegative_int,
        default=0,
        help="--watch-exec: stop after N runs (0: never)",
    )
    parser.add_argument(
        "--scheduler", default=None, type=cli_args.address, help="scheduler host:port"
    )
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=cli_args.positive_float, default=10.0)


def _security(state: dict[str, Any] | None) -> Any:
    from rlfleet.common.auth import Credentials
    from rlfleet.common.rpc import Security, current_security, tls_from_env

    current = current_security()
    if current is not None and current.credentials is not None:
        return current  # the environment's (rlfleet.cli sets it)
    creds_dir = (state or {}).get("handle", {}).get("credentials_dir")
    if not creds_dir:
        return current
    path = Path(creds_dir) / "driver.json"
    tls = tls_from_env((state or {}).get("tls_env", {}))
    return Security(credentials=Credentials.from_json(json.loads(path.read_text()), str(path)),
                    tls=tls)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from rlfleet.common.errors import RlfleetError
    from rlfleet.common.rpc import using_security
    from rlfleet.launch.cli import read_state
    from rlfleet.scheduler.client import RemoteSchedulerClient

    if (args.replicas is None) == (args.watch_exec is None):
        print("rlfleet scale: give either a replica count or --watch-exec CMD", file=sys.stderr)
        return 2
    state = read_state(args.state_dir)
    address = args.scheduler or ((state or {}).get("handle", {}).get("scheduler"))
    if not address:
        print("rlfleet scale: no --scheduler and no cluster recorded by `rlfleet up`",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.watch_exec is not None:
        return _watch(args, address, _security(state))
    try:
        with (
            using_security(_security(state)),
            RemoteSchedulerClient(address, timeout_s=args.timeout_s) as client,
        ):
            replicas, generation = client.set_scale(args.role, args.replicas)
    except RlfleetError as e:
        print(f"rlfleet scale: scheduler {address}: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"role": args.role, "replicas": replicas, "request": generation}))
    if not args.scheduler and state is not None and state.get("supervised") is False:
        print("rlfleet scale: warning: the cluster was started by `rlfleet up` without "
              "--foreground, so no launcher follows this count (start it with `rlfleet up "
              "--foreground`, or follow it with `rlfleet scale rollout --watch-exec CMD`)",
              file=sys.stderr)  # fmt: skip
    return 0


def _watch(args: argparse.Namespace, address: str, security: Any) -> int:
    """Run ``--watch-exec`` each time the scheduler's desired count changes."""
    import shlex
    import subprocess
    import time

    from rlfleet.common.errors import RlfleetError
    from rlfleet.common.rpc import using_security
    from rlfleet.scheduler.client import RemoteSchedulerClient

    if "{replicas}" not in args.watch_exec:
        print("rlfleet scale: --watch-exec needs {replicas} in its command", file=sys.stderr)
        return 2
    if not args.interval_s > 0:
        print(f"rlfleet scale: --interval-s must be > 0, got {args.interval_s}", file=sys.stderr)
        return 2
    seen = 0
    runs = 0
    with (
        using_security(security),
        RemoteSchedulerClient(address, timeout_s=args.timeout_s) as client,
    ):
        while True:
            try:
                replicas, generation = client.scale(args.role)
            except RlfleetError as e:  # the scheduler may be restarting: keep watching
                print(f"rlfleet scale: scheduler {address}: {e}", file=sys.stderr, flush=True)
                replicas, generation = 0, seen
            if replicas and generation != seen:
                seen = generation
                argv = [
                    part.replace("{replicas}", str(replicas))
                    for part in shlex.split(args.watch_exec)
                ]
                code = subprocess.call(argv)
                runs += 1
                print(json.dumps({"role": args.role, "replicas": replicas, "request": generation,
                                  "exit_code": code}), flush=True)  # fmt: skip
                if args.max_runs and runs >= args.max_runs:
                    return 0
            time.sleep(args.interval_s)
