"""`rlfleet status`, `rlfleet up`, `rlfleet down`: see and run a local cluster.

::

    rlfleet up --config examples/arithmetic_ppo.yaml [key.path=value ...] [--state-dir .rlfleet]
    rlfleet status [--scheduler HOST:PORT] [--json]
    rlfleet down [--state-dir .rlfleet]

``up`` starts a :class:`~rlfleet.launch.cluster.LocalCluster` whose processes
outlive the command, and records their PIDs (with their start times) and addresses
in ``<state-dir>/cluster.json``; ``down`` stops exactly those processes; ``status``
asks the scheduler of that file (or ``--scheduler``) for its services and the
training status. ``up --foreground`` instead keeps the cluster, and its launcher,
until Ctrl-C: only then are dead services restarted and ``rlfleet scale`` followed (a
detached cluster's processes run on their own).

The module serves all three subcommands: ``add_arguments`` reads which one from the
parser's ``prog`` (``rlfleet status``); under any other name it adds the three as
sub-subcommands.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rlfleet.common import cli_args

__all__ = [
    "RAY_ACTOR_CAPABILITY",
    "STATE_FILE",
    "add_arguments",
    "format_services",
    "read_state",
    "run",
    "service_json",
]

STATE_FILE = "cluster.json"
DEFAULT_STATE_DIR = ".rlfleet"
_COMMANDS = ("status", "up", "down")


def _state_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / STATE_FILE


class StateFileError(ValueError):
    """The state file of ``rlfleet up`` exists but is not one (the CLI: one line, exit 2)."""


def read_state(state_dir: str | Path) -> dict[str, Any] | None:
    """The state file of ``rlfleet up`` in ``state_dir``, or None if there is none.

    Raises:
        StateFileError: the file is there but unreadable or not a state file.
    """
    path = _state_path(state_dir)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # ValueError: JSON, UTF-8
        raise StateFileError(f"the cluster state file {path} is unreadable ({e}); remove it "
                             "(and stop what it recorded by hand)") from None  # fmt: skip
    processes = data.get("processes", []) if isinstance(data, dict) else None
    fields = {"name", "pid", "start_time", "log"}
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("handle", {}), dict)
        or not isinstance(processes, list)
        or not all(isinstance(p, dict) and set(p) == fields for p in processes)
    ):
        raise StateFileError(f"{path} is not a cluster state file written by `rlfleet up`; "
                             "remove it (and stop what it recorded by hand)")  # fmt: skip
    return data


def _write_state(state_dir: str | Path, state: dict[str, Any]) -> Path:
    path = _state_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(path)
    return path


# --------------------------------------------------------------------------- arguments


def _add_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        default=DEFAULT_STATE_DIR,
        help=f"where `rlfleet up` records the cluster (default: ./{DEFAULT_STATE_DIR})",
    )


def _add(command: str, p: argparse.ArgumentParser) -> None:
    p.set_defaults(_cluster_command=command)
    _add_state_dir(p)
    if command == "status":
        p.add_argument(
            "--scheduler",
            default=None,
            type=cli_args.address,
            help="scheduler host:port (default: from the state file)",
        )
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.add_argument("--timeout-s", type=cli_args.positive_float, default=10.0)
    elif command == "up":
        p.add_argument("--config", required=True, help="run config (YAML)")
        p.add_argument("overrides", nargs="*", help="dotted config overrides key.path=value")
        p.add_argument("--run-dir", default=None, help="logs and config (default: the run dir)")
        p.add_argument(
            "--timeout-s", type=cli_args.positive_float, default=300.0, help="start-up limit"
        )
        p.add_argument(
            "--foreground", action="store_true", help="keep the cluster until Ctrl-C / SIGTERM"
        )
    else:
        p.add_argument(
            "--grace-s",
            type=cli_args.nonnegative_float,
            default=10.0,
            help="SIGTERM-to-SIGKILL wait",
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``rlfleet status|up|down`` (picked from ``parser.prog``)."""
    command = parser.prog.split()[-1] if parser.prog else ""
    if command in _COMMANDS:
        _add(command, parser)
        return
    sub = parser.add_subparsers(dest="cluster_command_name", metavar="COMMAND", required=True)
    helps = {
        "status": "services and training status",
        "up": "start a local cluster",
        "down": "stop it",
    }
    for name in _COMMANDS:
        _add(name, sub.add_parser(name, help=helps[name]))


def run(args: argparse.Namespace) -> int:
    command = args._cluster_command
    if command == "status":
        return _status(args)
    if command == "up":
        return _up(args)
    return _down(args)


# --------------------------------------------------------------------------- status


def _devices(devices: Any) -> str:
    by_kind: dict[str, list[int]] = {}
    for d in devices:
        by_kind.setdefault(d.kind, []).append(d.index)
    return " ".join(f"{k}:{_ranges(sorted(v))}" for k, v in by_kind.items()) or "-"


def _ranges(values: list[int]) -> str:
    out: list[str] = []
    start = prev = None
    for v in [*values, None]:
        if v is not None and prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    return ",".join(out)


RAY_ACTOR_CAPABILITY = "ray_actor_id"
"""The registry capability naming a service's Ray actor (``launcher: ray``)."""


def _ray_actor_id(entry: Any) -> str:
    return str(entry.spec.capabilities.get(RAY_ACTOR_CAPABILITY, ""))


def format_services(entries: Any, now: float | None = None) -> str:
    """The table ``rlfleet status`` prints: one row per service, with its node and,
    when any service runs in a Ray actor, a ``RAY ACTOR`` column (its actor id)."""
    now = time.time() if now is None else now
    entries = list(entries)
    ray = any(_ray_actor_id(e) for e in entries)
    header: tuple[str, ...] = ("ID", "ROLE", "ADDRESS", "NODE", "STATE", "DEVICES", "QUEUE")
    header += ("TOK/S", "WEIGHTS", "SEEN", *(("RAY ACTOR",) if ray else ()))
    rows = [header]
    for e in entries:
        row: tuple[str, ...] = (
            e.service_id,
            e.spec.role,
            e.spec.address,
            e.spec.node or "-",
            e.state.value.upper(),
            _devices(e.spec.devices),
            str(e.load.queue_depth),
            f"{e.load.tokens_per_second:.1f}",
            f"v{e.load.weight_version}",
            f"{max(0.0, now - e.last_heartbeat_unix):.0f}s ago",
        )
        rows.append((*row, _ray_actor_id(e) or "-") if ray else row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def service_json(entry: Any) -> dict[str, Any]:
    """One service of ``rlfleet status --json``."""
    e = entry
    return {
        "service_id": e.service_id,
        "role": e.spec.role,
        "address": e.spec.address,
        "node": e.spec.node,
        "ray_actor_id": _ray_actor_id(e) or None,
        "state": e.state.value,
        "devices": [[d.kind, d.index] for d in e.spec.devices],
        "metrics_address": e.spec.metrics_address,
        "pid": e.spec.pid,
        "queue_depth": e.load.queue_depth,
        "tokens_per_second": e.load.tokens_per_second,
        "weight_version": e.load.weight_version,
        "last_heartbeat_unix": e.last_heartbeat_unix,
    }


def _client_security(state: dict[str, Any] | None) -> Any:
    """This command's credentials: the environment's, else the cluster's observer's."""
    from rlfleet.common.auth import Credentials, load_credentials
    from rlfleet.common.rpc import Security, tls_from_env

    env_creds = load_credentials()
    tls_env = {**(state or {}).get("tls_env", {}), **os.environ}
    tls = tls_from_env(tls_env)
    if env_creds is not None:
        return Security(credentials=env_creds, tls=tls)
    creds_dir = (state or {}).get("handle", {}).get("credentials_dir")
    if creds_dir:
        path = Path(creds_dir) / "observer.json"
        data = json.loads(path.read_text())
        return Security(credentials=Credentials.from_json(data, str(path)), tls=tls)
    return Security(credentials=None, tls=tls, insecure=True)


def _status(args: argparse.Namespace) -> int:
    from rlfleet.common.auth import CredentialError
    from rlfleet.common.errors import RlfleetError
    from rlfleet.common.rpc import using_security
    from rlfleet.scheduler.client import RemoteSchedulerClient

    address = args.scheduler
    state = read_state(args.state_dir)
    if address is None:
        address = state["handle"].get("scheduler") if state else None
        if not address:
            print(
                f"rlfleet status: no --scheduler and no scheduler in {_state_path(args.state_dir)}"
                " (start one with `rlfleet up`)",
                file=sys.stderr,
            )
            return 2
    try:
        security = _client_security(state)
    except CredentialError as e:
        print(f"rlfleet status: {e}", file=sys.stderr)
        return 2
    try:
        with (
            using_security(security),
            RemoteSchedulerClient(address, timeout_s=args.timeout_s) as client,
        ):
            entries = client.list_services()
            status = client.training_status()
    except RlfleetError as e:
        print(f"rlfleet status: scheduler {address}: {e}", file=sys.stderr)
        return 1
    if args.json:
        out = {
            "scheduler": address,
            "services": [service_json(e) for e in entries],
            "training": {
                "state": status.state,
                "global_step": status.global_step,
                "total_steps": status.total_steps,
                "weight_version": status.weight_version,
                "metrics": dict(status.metrics),
            },
        }
        print(json.dumps(out, indent=2))
        return 0
    print(f"scheduler {address}: {len(entries)} service(s)")
    print(format_services(entries))
    if status.state != "idle" or status.global_step > 0:
        line = (
            f"training: {status.state}, step {status.global_step}/{status.total_steps or '?'}, "
            f"weights v{status.weight_version}"
        )
        shown = sorted(status.metrics.items())[:12]
        if shown:
            line += "\n  " + "  ".join(f"{k}={v:.4g}" for k, v in shown)
        print(line)
    return 0


# --------------------------------------------------------------------------- up / down


def _live(state: dict[str, Any]) -> list[str]:
    from rlfleet.launch.cluster import ProcessInfo, process_start_time

    out = []
    for p in state.get("processes", []):
        info = ProcessInfo(**p)
        try:
            os.kill(info.pid, 0)
        except (ProcessLookupError, PermissionError):
            continue
        if info.start_time is None or process_start_time(info.pid) == info.start_time:
            out.append(f"{info.name} (pid {info.pid})")
    return out


def _up(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from rlfleet.common.config import ConfigError, load_config
    from rlfleet.common.errors import RlfleetError
    from rlfleet.launch.cluster import LocalCluster

    state = read_state(args.state_dir)
    if state is not None and _live(state):
        print(
            f"rlfleet up: a cluster is already up ({', '.join(_live(state))}; "
            f"state {_state_path(args.state_dir)}): run `rlfleet down` first",
            file=sys.stderr,
        )
        return 1
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e.lines("rlfleet up: "), file=sys.stderr)
        return 2
    from rlfleet.launch.preflight import preflight

    problems = preflight(config, driver=False)
    if problems:  # one line each, before anything starts
        print("\n".join(f"rlfleet up: {p}" for p in problems), file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir) if args.run_dir else config.run_dir()
    cluster = LocalCluster(config, run_dir, detach=not args.foreground)
    try:
        handle = cluster.start(timeout_s=args.timeout_s)
    except RlfleetError as e:
        print(f"rlfleet up: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        cluster.stop()
        return 130
    path = _write_state(
        args.state_dir,
        {
            "version": 1,
            "created_unix": time.time(),
            "config": str(Path(args.config).resolve()),
            "handle": handle.to_dict(),
            "tls_env": cluster.security.tls_env() if cluster.security is not None else {},
            "processes": [asdict(p) for p in cluster.processes()],
            # Detached (the default), nothing restarts dead services or follows
            # `rlfleet scale`: only `up --foreground` keeps the launcher running.
            "supervised": bool(args.foreground),
        },
    )
    print(json.dumps({"event": "up", "state": str(path), **handle.to_dict()}), flush=True)
    if not args.foreground:
        return 0
    try:
        while True:  # until Ctrl-C, or SIGTERM (the cluster's handler stops it and exits)
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
        _state_path(args.state_dir).unlink(missing_ok=True)
    return 0


def _down(args: argparse.Namespace) -> int:
    from rlfleet.launch.cluster import ProcessInfo, stop_processes

    state = read_state(args.state_dir)
    if state is None:
        print(
            f"rlfleet down: no cluster recorded in {_state_path(args.state_dir)}", file=sys.stderr
        )
        return 1
    infos = [ProcessInfo(**p) for p in state.get("processes", [])]
    services = [i for i in infos if i.name != "scheduler"]
    schedulers = [i for i in infos if i.name == "scheduler"]
    killed = stop_processes(services, grace_s=args.grace_s)
    killed += stop_processes(schedulers, grace_s=args.grace_s)
    _state_path(args.state_dir).unlink(missing_ok=True)
    note = f" ({', '.join(killed)} needed SIGKILL)" if killed else ""
    print(f"stopped {len(infos)} process(es){note}")
    return 0
