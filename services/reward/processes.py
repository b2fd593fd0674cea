"""Several reward-service processes on one port: ``rlfleet serve reward --processes N``.

One Python process scores on one core at a time (the GIL). gRPC Python's way to use
more cores is several server processes, each creating its own server after it
starts (a gRPC server never crosses a fork), all listening on one port with
``SO_REUSEPORT``; the kernel hands each new connection to one of them. Balancing is
per connection, not per call: a client with one channel talks to one process, so
spreading load needs several clients or channels.

The parent started here serves nothing itself. It:

* picks the port once (``--port 0``: a free one) and keeps it reserved with a bound,
  never listening, ``SO_REUSEPORT`` socket, so every child gets the same port and
  no other program takes it meanwhile; a fixed port already in use is an error;
* starts N children, fresh interpreters (``python -m rlfleet.reward.server ...
  --port P --processes 1``), never forks; each is healthy when it prints its
  serving line, which a server prints only once it is started and SERVING;
* then prints one serving line of its own (the shared address) and waits;
* forwards SIGTERM / SIGINT to every child (graceful: health NOT_SERVING, in-flight
  calls finish; a second signal stops them at once) and exits 0 once all have
  exited 0;
* restarts nothing: a child that exits while no stop was asked is logged as an
  error, the others are stopped, and the parent exits 1, so whatever supervises it
  (systemd, Kubernetes, ``rlfleet up``) sees the service fail.

Children run in their own session, so a terminal's Ctrl-C reaches only the parent
(which forwards it once, instead of each child getting it twice); and each child
watches its stdin, a pipe from the parent, and stops when it closes, so a parent
killed outright does not leave children holding the port.

``/metrics``: each child serves its own registry on a loopback port of its own; the
parent's ``/metrics`` fetches them all on each scrape and serves them merged, every
series labelled ``process="i"`` (:func:`~rlfleet.reward.metrics.merge_expositions`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from rlfleet.common.errors import Unavailable
from rlfleet.common.rpc import DEFAULT_GRACE_S, TLSConfig, wait_for_ready

__all__ = [
    "MAX_AUTO_PROCESSES",
    "ProcessGroup",
    "reserve_port",
    "resolve_processes",
    "serve_processes",
]

logger = logging.getLogger(__name__)

MAX_AUTO_PROCESSES = 32
"""``--processes 0`` starts one process per CPU core, at most this many."""

START_TIMEOUT_S = 120.0
"""How long the children may take to print their serving lines."""

_STOP_SLACK_S = 20.0  # after a forwarded stop, beyond the children's grace
_POLL_S = 0.1
_SCRAPE_TIMEOUT_S = 5.0


def resolve_processes(requested: int) -> int:
    """``requested`` server processes, 0 meaning one per usable CPU core (capped)."""
    if requested < 0:
        raise ValueError(f"processes must be >= 0 (0: one per CPU core), got {requested}")
    if requested > 0:
        return requested
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_AUTO_PROCESSES))


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) to ``host:port`` with ``SO_REUSEPORT``.

    Servers that also set ``SO_REUSEPORT`` can bind the same port while it is held,
    anything else cannot. ``port=0`` picks a free one (read ``getsockname()[1]``). A
    fixed port is first checked to be free, so a second service started on it fails
    rather than sharing its connections.

    Raises:
        OSError: the address does not resolve, or the port is in use.
    """
    family, type_, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    if port != 0:
        with socket.socket(family, type_, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise OSError(e.errno, f"port {port} on {host} is already in use") from e
                raise
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass
class _Child:
    index: int
    proc: subprocess.Popen[str]
    serving: dict[str, Any] | None = None
    reader: threading.Thread | None = None

    def read_stdout(self) -> None:
        """Reader thread: the serving line, then anything else, to stderr, until EOF.

        Read to the end, or a scorer that prints (custom functions run in worker
        processes that share this pipe) would block once the pipe is full.
        """
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self.serving is None and line.startswith("{"):
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if isinstance(event, dict) and event.get("event") == "serving":
                        self.serving = event
                        continue
            sys.stderr.write(f"[process {self.index} stdout] {line}")


class ProcessGroup:
    """N child processes started from ``argv_for(i)``: start-up handshake, stop, wait.

    Args:
        argv_for: the command line of child ``i``; the child prints a JSON line with
            ``"event": "serving"`` on stdout once it serves, and stops when its stdin
            closes.
        processes: how many children.
        grace_s: how long the children take to stop gracefully on a signal.
    """

    def __init__(
        self,
        argv_for: Callable[[int], Sequence[str]],
        processes: int,
        *,
        grace_s: float = DEFAULT_GRACE_S,
    ) -> None:
        self.argv_for = argv_for
        self.processes = processes
        self.grace_s = grace_s
        self.children: list[_Child] = []
        self.stop_signal: int | None = None
        self._stop_deadline: float | None = None

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> list[dict[str, Any]]:
        """Start every child and wait for all their serving lines.

        Raises:
            RuntimeError: a child exited or stayed silent past ``timeout_s``, or a
                stop was asked meanwhile (the children are stopped first).
        """
        for index in range(self.processes):
            proc = subprocess.Popen(
                list(self.argv_for(index)),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            child = _Child(index, proc)
            child.reader = threading.Thread(
                target=child.read_stdout, name=f"rlfleet-child-{index}", daemon=True
            )
            self.children.append(child)
            child.reader.start()
        deadline = time.monotonic() + timeout_s
        while True:
            silent = [c for c in self.children if c.serving is None]
            if not silent:
                return [c.serving for c in self.children if c.serving is not None]
            problem = None
            if self.stop_signal is not None:
                problem = f"stopped by {signal.Signals(self.stop_signal).name} while starting"
            for c in silent:
                if c.proc.poll() is not None:
                    problem = (
                        f"server process {c.index} (pid {c.proc.pid}) exited during start-up "
                        f"with code {c.proc.wait()}"
                    )
            if problem is None and time.monotonic() > deadline:
                problem = (
                    f"server processes {[c.index for c in silent]} did not report serving "
                    f"within {timeout_s}s"
                )
            if problem is not None:
                self.stop(signal.SIGTERM)
                self.wait()
                raise RuntimeError(problem)
            time.sleep(_POLL_S)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Forward ``signum`` to every running child (a second call: they stop at once)."""
        if self.stop_signal is None:
            self.stop_signal = signum
            self._stop_deadline = time.monotonic() + self.grace_s + _STOP_SLACK_S
        for c in self.children:
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signum)

    def wait(self) -> int:
        """Block until every child has exited; 0 iff all stopped cleanly when asked.

        A child exiting while no stop was asked fails the group: logged as an error,
        the others are stopped, 1 is returned. Children still running past the grace
        after a stop are killed (also 1).
        """
        failed = False
        while True:
            running = [c for c in self.children if c.proc.poll() is None]
            for c in self.children:
                rc = c.proc.returncode
                if rc is not None and self.stop_signal is None:
                    logger.error(
                        "reward server process %d (pid %d) exited with code %d while serving; "
                        "stopping the other %d and exiting (nothing is restarted)",
                        c.index,
                        c.proc.pid,
                        rc,
                        len(running),
                    )
                    failed = True
                    self.stop(signal.SIGTERM)
            if not running:
                break
            if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                for c in running:
                    logger.error(
                        "reward server process %d (pid %d) still running %.0fs after the stop; "
                        "killing it",
                        c.index,
                        c.proc.pid,
                        self.grace_s + _STOP_SLACK_S,
                    )
                    c.proc.kill()
                    c.proc.wait()
                failed = True
                break
            time.sleep(_POLL_S)
        clean = (0, -signal.SIGTERM, -signal.SIGINT)  # killed by the signal before handling it
        for c in self.children:
            if c.proc.stdin is not None:
                c.proc.stdin.close()  # only now: a closed stdin tells a child to stop
            if c.reader is not None:
                c.reader.join(5.0)  # EOF once the child (and its workers) are gone
            if c.proc.returncode not in clean:
                failed = True
        return 1 if failed else 0


# ---------------------------------------------------------------- merged /metrics


def _scrape(address: str) -> str:
    from rlfleet.common.http import http_get

    return http_get(address, "/metrics", timeout_s=_SCRAPE_TIMEOUT_S).decode()


def start_merged_metrics_server(addresses: Sequence[str], host: str, port: int) -> tuple[Any, int]:
    """Serve ``/metrics`` on ``host:port``: the children's at ``addresses``, merged.

    A child that cannot be scraped fails the scrape (HTTP 503 naming it): a partial
    answer would look to Prometheus like counters going backwards.
    """
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

    from rlfleet.common.http import serve_http
    from rlfleet.reward.metrics import merge_expositions

    def page() -> tuple[int, str, bytes]:
        try:
            body = merge_expositions([_scrape(a) for a in addresses])
        except OSError as e:
            logger.error("cannot scrape a reward server process: %s", e)
            return 503, "text/plain", f"scrape of a server process failed: {e}\n".encode()
        return 200, CONTENT_TYPE_PLAIN_0_0_4, body

    endpoint = serve_http(host, port, {"/metrics": page})
    return endpoint, endpoint.port


# ------------------------------------------------------------------------ parent


def _child_argv(args: argparse.Namespace, port: int, index: int, count: int) -> list[str]:
    argv = [sys.executable, "-m", "rlfleet.reward.server", f"--host={args.host}", f"--port={port}"]
    if args.config:
        argv.append(f"--config={args.config}")
    for override in args.override:
        argv += ["-o", override]
    if args.metrics_port is not None:
        argv += ["--metrics-port=0", "--metrics-host=127.0.0.1"]
    if args.auth_token_env:
        argv.append(f"--auth-token-env={args.auth_token_env}")
    for flag, value in (
        ("--tls-cert", args.tls_cert),
        ("--tls-key", args.tls_key),
        ("--tls-ca", args.tls_ca),
        ("--tls-server-name", args.tls_server_name),
    ):
        if value:
            argv.append(f"{flag}={value}")
    if args.tls_require_client_cert:
        argv.append("--tls-require-client-cert")
    if args.insecure:
        argv.append("--insecure")
    argv += [
        f"--max-batch-size={args.max_batch_size}",
        f"--max-text-chars={args.max_text_chars}",
        f"--max-name-chars={args.max_name_chars}",
        f"--grpc-workers={args.grpc_workers}",
        f"--log-level={args.log_level}",
        "--processes=1",
        f"--process-index={index}",
        f"--process-count={count}",
    ]
    return argv


def serve_processes(args: argparse.Namespace, processes: int, *, tls: TLSConfig | None) -> int:
    """Run ``processes`` reward servers on one port until SIGTERM / SIGINT; the exit code.

    ``args`` are ``rlfleet serve reward``'s; the children get the same ones, the
    port resolved, and ``--processes 1``.
    """
    from rlfleet.reward.metrics import prometheus_available

    if args.metrics_port is not None and not prometheus_available():
        raise RuntimeError(
            "metrics need the prometheus-client package: pip install prometheus-client"
        )
    try:
        reserved = reserve_port(args.host, args.port)
    except OSError as e:
        print(f"error: --host {args.host} --port {args.port}: {e}", file=sys.stderr)
        return 1
    port = int(reserved.getsockname()[1])
    group = ProcessGroup(lambda i: _child_argv(args, port, i, processes), processes)

    def forward(signum: int, _frame: FrameType | None) -> None:
        # On a thread: no locks (logging's, Popen's) taken inside the signal handler.
        threading.Thread(
            target=_forward, args=(signum,), name="rlfleet-forward", daemon=True
        ).start()

    def _forward(signum: int) -> None:
        logger.info("got %s: stopping %d server processes", signal.Signals(signum).name, processes)
        group.stop(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    metrics_server = None
    try:
        try:
            events = group.start()
            address = events[0]["address"]
            if tls is None:
                wait_for_ready(address, timeout_s=30.0)  # the shared port answers SERVING
        except (RuntimeError, Unavailable) as e:
            logger.error("reward service did not start: %s", e)
            group.stop(signal.SIGTERM)
            group.wait()
            return 1
        metrics_address = None
        if args.metrics_port is not None:
            metrics_host = args.metrics_host or args.host
            metrics_server, metrics_port = start_merged_metrics_server(
                [e["metrics_address"] for e in events], metrics_host, args.metrics_port
            )
            metrics_address = f"{metrics_host}:{metrics_port}"
        print(
            json.dumps(
                {
                    "event": "serving",
                    "service": "reward",
                    "address": address,
                    "metrics_address": metrics_address,
                    "pid": os.getpid(),
                    "processes": processes,
                    "process_pids": group.pids,
                }
            ),
            flush=True,
        )
        return group.wait()
    except BaseException:
        group.stop(signal.SIGTERM)
        group.wait()
        raise
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        reserved.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
