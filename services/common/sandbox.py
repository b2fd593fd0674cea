"""Run untrusted code (a model's program) in a sandbox: one process per execution.

Shared by the reward service's ``code`` scorer and, later, the tools service's
Python tool; standard library only (no torch, no rlfleet imports), so either can
import it cheaply.

Every execution gets:

* **a process of its own** in its own session, killed as a whole (process group,
  and PID namespace) at the wall-clock time-out;
* **no network**: a fresh network namespace (no interfaces but loopback, nothing
  listening), and the host's ``/run`` and ``/tmp`` (unix sockets) hidden;
* **a read-only view of the file system** except a fresh, size-limited ``/tmp``,
  which is also its working directory and ``HOME``;
* **no inherited secrets**: a clean environment (``PATH``, ``HOME``, ``TMPDIR``,
  ``LANG`` only), no inherited file descriptors but stdin, stdout and stderr, and a
  user of its own (as root: a fresh unprivileged uid per execution, so nothing
  readable only by root, such as credential files, is readable); the service's
  credential folder, TLS key and, not as root, home covered (:func:`hidden_paths`);
* **limits**: CPU seconds, address space (memory), file size, open files, and a
  process count (``RLIMIT_NPROC``, counted per sandbox) against fork bombs;
  stdout and stderr are read up to ``max_output_bytes`` each, past which the run
  is killed and flagged ``output_truncated``.

Isolation, best first (:func:`probe` picks one at start-up and says why the better
ones were not usable):

``bwrap``
    Debian's ``bubblewrap`` (``apt-get install bubblewrap``): ``--unshare-all``
    (user, mount, PID, network, IPC, UTS, cgroup namespaces), ``--disable-userns``,
    ``--die-with-parent``, ``--new-session``, ``/`` bound read-only, fresh ``/proc``
    and ``/dev``, tmpfs ``/tmp``; the rlimits are set inside by ``prlimit``. As root
    it runs as the fresh uid (bubblewrap's unprivileged mode), which needs
    unprivileged user namespaces (Debian's default).
``namespaces``
    No bubblewrap: the same namespaces made by :mod:`rlfleet.common.sandbox_launch`
    (``unshare(2)``, ``mount_setattr(2)``, Linux >= 5.12), the rlimits set by it.
``none``
    Neither works (a container without namespace rights): rlimits, the fresh uid
    and a fresh working directory only, and only when the user opted in
    (``allow_unisolated``); otherwise the report's mode is ``unavailable`` and
    :class:`Sandbox` refuses to run anything.

The interpreter (``python``): the service's own base interpreter when the sandbox
user can run it, else ``/usr/bin/python3`` or ``/usr/local/bin/python3``. A
virtualenv or pyenv interpreter under ``/root`` (mode 0700) is not reachable by an
unprivileged uid, so as root the system Python usually runs the code.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = [
    "ISOLATION_CHOICES",
    "IsolationReport",
    "RunResult",
    "Sandbox",
    "SandboxLimits",
    "SandboxUnavailable",
    "probe",
]

logger = logging.getLogger(__name__)

ISOLATION_CHOICES: Final = ("auto", "bwrap", "namespaces", "none")
"""What a user may ask for; ``auto`` tries ``bwrap``, then ``namespaces``, then ``none``
(the last only with ``allow_unisolated``)."""

_LAUNCHER = str(Path(__file__).with_name("sandbox_launch.py"))
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
_SANDBOX_ENV = {"PATH": _SANDBOX_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
_PYTHON_CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3")
# The service's own secrets, named by its environment (rlfleet.common.auth's names;
# this module imports nothing of rlfleet's): the credential file's folder holds every
# role's file when a launcher wrote the set, the TLS key is the service's identity.
_SECRET_ENV = ("RLFLEET_CREDENTIALS", "RLFLEET_TLS_KEY")
# Replaced by the sandbox's own views anyway (fresh tmpfs, proc, dev).
_REPLACED = ("/tmp", "/run", "/var/run", "/proc", "/dev")
_MAX_HIDDEN = 256

# As root each execution runs as a uid of its own: 256 per process, the process's
# pid (< 2**22, Linux's PID_MAX_LIMIT) picking the block, so two concurrent
# executions anywhere on the host never share one, and RLIMIT_NPROC counts one
# sandbox's processes only.
_UID_BASE = 1 << 30
_UIDS_PER_PROCESS = 256
_NOBODY = 65534
_KILL_WAIT_S = 5.0
_POLL_S = 0.1
_PIPE_GRACE_S = 0.2  # after the program exits, how long its pipes may stay open
_STATUS_MAX = 1 << 16


class SandboxUnavailable(RuntimeError):
    """No isolation could be set up, and running unconfined was not allowed."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one execution.

    Attributes:
        timeout_s: wall-clock seconds before the run is killed (``timed_out``).
        cpu_time_s: CPU seconds per process (``RLIMIT_CPU``; rounded up).
        memory_mb: address space per process (``RLIMIT_AS``), MiB.
        max_output_bytes: most bytes kept of stdout and of stderr each; more kills
            the run (``output_truncated``).
        max_processes: most processes (and threads) the sandbox may hold at once.
        tmp_mb: size of the writable ``/tmp``, MiB (also the largest file).
        max_open_files: ``RLIMIT_NOFILE``.
    """

    timeout_s: float = 5.0
    cpu_time_s: float = 5.0
    memory_mb: int = 1024
    max_output_bytes: int = 4 << 20
    max_processes: int = 32
    tmp_mb: int = 64
    max_open_files: int = 256

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_time_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name in ("memory_mb", "max_output_bytes", "max_processes", "tmp_mb", "max_open_files"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_processes < 4:
            raise ValueError(
                f"max_processes must be >= 4 (the sandbox's own processes count), "
                f"got {self.max_processes}"
            )

    def rlimits(self) -> dict[str, int]:
        """The ``RLIMIT_*`` values (soft = hard) every sandboxed process gets."""
        return {
            "CPU": max(1, math.ceil(self.cpu_time_s)),
            "AS": self.memory_mb << 20,
            "NPROC": self.max_processes,
            "FSIZE": self.tmp_mb << 20,
            "NOFILE": self.max_open_files,
            "CORE": 0,
        }

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> SandboxLimits:
        return cls(**value)


@dataclass(frozen=True)
class IsolationReport:
    """Which isolation is in force, with which interpreter, and why not better.

    Attributes:
        mode: ``bwrap``, ``namespaces``, ``none`` (rlimits only, allowed by the
            user) or ``unavailable`` (nothing runs).
        python: the interpreter programs run with ("" when none works).
        missing: why each better mode was not used.
    """

    mode: str
    python: str
    missing: tuple[str, ...] = ()

    @property
    def usable(self) -> bool:
        return self.mode != "unavailable"

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.mode == "unavailable":
            text = "UNAVAILABLE: no isolation works here, so untrusted code is refused"
        elif self.mode == "none":
            text = "NONE: rlimits only, NOT isolated (allowed by allow_unisolated)"
        else:
            text = f"{self.mode}, python {self.python}"
        if self.missing:
            text += "; not used: " + "; ".join(self.missing)
        return text

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "python": self.python, "missing": list(self.missing)}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> IsolationReport:
        return cls(str(value["mode"]), str(value["python"]), tuple(value["missing"]))


@dataclass
class RunResult:
    """What one execution did.

    Attributes:
        exit_code: the program's exit code; ``128 + N`` when signal N ended it (as
            a shell reports it); None when the sandbox killed it (time-out, output
            limit).
        stdout, stderr: what it wrote, at most ``max_output_bytes`` each.
        timed_out: it ran past ``timeout_s`` and was killed.
        output_truncated: it wrote more than ``max_output_bytes`` and was killed.
        setup_error: the sandbox could not be set up (the program never ran).
        wall_s: seconds from start to end.
        uid: the host uid it ran as.
    """

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    output_truncated: bool = False
    setup_error: str = ""
    wall_s: float = 0.0
    uid: int = -1

    @property
    def ok(self) -> bool:
        """Exited 0 within every limit."""
        return (
            self.exit_code == 0
            and not self.timed_out
            and not self.output_truncated
            and not self.setup_error
        )


# ------------------------------------------------------------------- sandbox uids


def _uid_map_covers(lo: int, hi: int) -> bool:
    """Whether this process's user namespace maps host uids ``[lo, hi)``."""
    try:
        lines = Path("/proc/self/uid_map").read_text().split("\n")
    except OSError:
        return False
    for line in lines:
        parts = line.split()
        if len(parts) == 3:
            inside, _outside, count = (int(p) for p in parts)
            if inside <= lo and hi <= inside + count:
                return True
    return False


class _Uids:
    """Hands out the uid each execution runs as (a fresh one per concurrent run as root)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_use: set[int] = set()
        self._next = 0
        self._base: int | None = None
        self.shared_reason = ""

    def _block(self) -> int | None:
        if self._base is None:
            base = _UID_BASE + (os.getpid() % (1 << 22)) * _UIDS_PER_PROCESS
            if _uid_map_covers(base, base + _UIDS_PER_PROCESS):
                self._base = base
            else:
                self._base = -1
                self.shared_reason = (
                    f"uids {_UID_BASE}.. are not mapped here: every sandbox runs as {_NOBODY}"
                )
        return None if self._base < 0 else self._base

    def note(self) -> str:
        """Why sandboxes share one uid here ("" when each gets its own)."""
        if os.geteuid() != 0:
            return ""
        with self._lock:
            self._block()
        return self.shared_reason

    def acquire(self) -> int:
        if os.geteuid() != 0:
            return os.getuid()
        with self._lock:
            base = self._block()
            if base is None:
                return _NOBODY
            for _ in range(_UIDS_PER_PROCESS):
                uid = base + self._next
                self._next = (self._next + 1) % _UIDS_PER_PROCESS
                if uid not in self._in_use:
                    self._in_use.add(uid)
                    return uid
        raise RuntimeError(f"more than {_UIDS_PER_PROCESS} concurrent sandboxes in one process")

    def release(self, uid: int) -> None:
        with self._lock:
            self._in_use.discard(uid)


_UIDS = _Uids()


# ------------------------------------------------------------------- interpreter


def _reachable_by_others(path: str) -> bool:
    """Whether a user with no relation to the file's owner can execute ``path``."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & stat.S_IXOTH:
        return False
    parent = os.path.dirname(real)
    while True:
        try:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


def _python_candidates(python: str | None) -> list[str]:
    if python:
        return [python]
    own = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    found: list[str] = []
    for candidate in (own, *_PYTHON_CANDIDATES):
        if not os.path.exists(candidate):
            continue
        real = os.path.realpath(candidate)
        if real in found:
            continue
        if os.geteuid() == 0 and not _reachable_by_others(real):
            continue  # a fresh uid cannot run it (e.g. under /root, mode 0700)
        found.append(real)
    return found


# ------------------------------------------------------------------- the runner


def _above_stdio(fd: int) -> int:
    """``fd`` moved to 3 or above (close-on-exec kept). A host process whose standard
    streams were closed gets 0-2 back from ``pipe`` / ``memfd_create``, and the child's
    stdin/stdout/stderr set-up would then overwrite the status pipe or a file."""
    if fd > 2:
        return fd
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return high


def _memfd(name: str, data: bytes) -> int:
    fd = _above_stdio(os.memfd_create(f"rlfleet-sandbox-{name}"))  # close-on-exec
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ValueError(f"sandbox file names are plain names, got {name!r}")


def _read_status(fd: int) -> str:
    """What the launcher reported (non-blocking: a leftover writer cannot stall us)."""
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    total = 0
    with contextlib.suppress(BlockingIOError, OSError):
        while total < _STATUS_MAX:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def _live_pids(uid: int) -> list[int]:
    """Processes running as ``uid`` that are not zombies (zombies hold nothing)."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read(512).rpartition(b")")[2].split()[:1]
        except OSError:
            continue  # gone meanwhile
        if state != [b"Z"]:
            found.append(int(entry))
    return found


def _settle(uid: int) -> list[int]:
    """Kill and wait out every process of ``uid`` (as root each run's uid is its own).

    In the namespace modes the kernel is already killing them (the PID namespace
    ended with its first process), but asynchronously; waiting here means a run
    leaves nothing running when it returns and its uid is free for the next one.

    Returns:
        Processes still alive after the wait (none, unless the kernel is stuck).
    """
    deadline = time.monotonic() + _KILL_WAIT_S
    while True:
        live = _live_pids(uid)
        if not live or time.monotonic() > deadline:
            return live
        for pid in live:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


class Sandbox:
    """Runs programs under one :class:`IsolationReport` and one set of limits.

    Thread-safe: concurrent :meth:`run` calls each get their own process and uid.

    Args:
        limits: per-execution limits.
        report: the isolation to use (from :func:`probe`); None probes now.
        isolation, python, allow_unisolated: passed to :func:`probe` when
            ``report`` is None.
        setting: the config section whose ``allow_unisolated`` the refusal names.

    Raises:
        SandboxUnavailable: the report's mode is ``unavailable``.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        report: IsolationReport | None = None,
        isolation: str = "auto",
        python: str | None = None,
        allow_unisolated: bool = False,
        setting: str = "reward.sandbox",
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.report = report or probe(
            isolation=isolation, python=python, allow_unisolated=allow_unisolated
        )
        if not self.report.usable:
            raise SandboxUnavailable(
                "no sandbox for untrusted code: "
                + "; ".join(self.report.missing)
                + " (install bubblewrap, allow user namespaces, or set "
                f"{setting}.allow_unisolated: true to run code with rlimits only)"
            )
        self.python = self.report.python

    def run_python(
        self,
        args: Sequence[str],
        *,
        stdin: bytes = b"",
        files: Mapping[str, bytes] | None = None,
        limits: SandboxLimits | None = None,
    ) -> RunResult:
        """``python -I ARGS`` in the sandbox (``files`` written into its ``/tmp`` first)."""
        return self.run([self.python, "-I", *args], stdin=stdin, files=files, limits=limits)

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes = b"",
        files: Mapping[str, bytes] | None = None,
        limits: SandboxLimits | None = None,
    ) -> RunResult:
        """Run ``argv`` (an absolute path first) with ``stdin`` as its standard input.

        ``files`` (name -> content) are written into the sandbox's working
        directory before it starts. Never raises for what the program does; raises
        ValueError for bad arguments and OSError when the host cannot start a
        process at all.
        """
        lim = limits or self.limits
        files = dict(files or {})
        for name in files:
            _check_name(name)
        if not argv or not os.path.isabs(argv[0]):
            raise ValueError(f"argv[0] must be an absolute path, got {argv[:1]!r}")
        uid = _UIDS.acquire()
        fds: list[int] = []
        workdir: str | None = None
        try:
            stdin_fd = _memfd("stdin", stdin)
            fds.append(stdin_fd)
            file_fds = {name: _memfd(name, data) for name, data in files.items()}
            fds.extend(file_fds.values())
            status_r, status_w = (_above_stdio(fd) for fd in os.pipe())
            fds.extend((status_r, status_w))
            mode = self.report.mode
            popen_kw: dict[str, Any] = {}
            # The interpreter stays visible whatever is hidden around it.
            hidden = hidden_paths([argv[0], sys.base_prefix]) if mode != "none" else ([], [])
            if mode == "bwrap":
                cmd = _bwrap_command(list(argv), lim, file_fds, status_w, hidden)
                pass_fds = [status_w, *file_fds.values()]
                if os.geteuid() == 0:
                    cmd, popen_kw = _as_user(cmd, uid)
            else:
                if mode == "none":
                    workdir = tempfile.mkdtemp(prefix="rlfleet-sandbox-")
                    if os.geteuid() == 0:
                        os.chown(workdir, uid, uid)
                spec = {
                    "namespaces": mode == "namespaces",
                    "parent_pid": os.getpid(),
                    "status_fd": status_w,
                    "uid": uid,
                    "gid": uid,
                    "argv": list(argv),
                    "env": _SANDBOX_ENV if mode == "namespaces" else _none_env(workdir),
                    "files": file_fds,
                    "tmp_bytes": lim.tmp_mb << 20,
                    "hide_folders": hidden[0],
                    "hide_files": hidden[1],
                    "rlimits": lim.rlimits(),
                    "workdir": workdir,
                }
                spec_fd = _memfd("spec", json.dumps(spec).encode())
                fds.append(spec_fd)
                cmd = [sys.executable, "-I", "-S", "-B", _LAUNCHER, str(spec_fd)]
                pass_fds = [spec_fd, status_w, *file_fds.values()]
            result = self._execute(cmd, stdin_fd, pass_fds, status_r, fds, lim, popen_kw)
            result.uid = uid
            return result
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            # Only a uid of this run's own (not the caller's, not a shared 65534).
            left = _settle(uid) if uid >= _UID_BASE else []
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
            if left:  # pragma: no cover - SIGKILL not taking effect within 5 s
                logger.error("sandbox uid %d still has processes %s; not reusing it", uid, left)
            else:
                _UIDS.release(uid)

    def _execute(
        self,
        cmd: list[str],
        stdin_fd: int,
        pass_fds: list[int],
        status_r: int,
        open_fds: list[int],
        lim: SandboxLimits,
        popen_kw: dict[str, Any],
    ) -> RunResult:
        """Start ``cmd``, read its output within the limits, and end it.

        ``open_fds`` are the caller's descriptors to close when done: the ones
        passed to the child are closed here right after the start (so the status
        pipe sees an end of file once the child is gone) and taken off the list, so
        nothing is closed twice (a number closed twice may by then be another
        thread's descriptor).
        """
        start = time.monotonic()
        deadline = start + lim.timeout_s
        proc = subprocess.Popen(
            cmd,
            stdin=stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=pass_fds,
            env={"PATH": _SANDBOX_PATH},
            cwd="/",
            start_new_session=True,
            **popen_kw,
        )
        for fd in pass_fds:  # the child holds its own copies
            os.close(fd)
            open_fds.remove(fd)
        timed_out = truncated = False
        out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        exited_at: float | None = None
        try:
            with selectors.DefaultSelector() as sel:
                for stream in out:
                    assert stream is not None
                    sel.register(stream, selectors.EVENT_READ)
                while sel.get_map() and not truncated:
                    now = time.monotonic()
                    if exited_at is None and proc.poll() is not None:
                        exited_at = now
                    if exited_at is not None and now - exited_at > _PIPE_GRACE_S:
                        break  # exited; what still holds its pipes is killed below
                    remaining = deadline - now
                    if remaining <= 0:
                        timed_out = True
                        break
                    for key, _ in sel.select(min(remaining, _POLL_S)):
                        chunk = os.read(key.fd, 1 << 16)
                        if not chunk:
                            sel.unregister(key.fileobj)
                            continue
                        buf = out[key.fileobj]  # type: ignore[index]
                        room = lim.max_output_bytes - len(buf)
                        buf += chunk[: max(0, room)]
                        if len(chunk) > room:
                            truncated = True
                            break
            if not timed_out and not truncated:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            # The whole group, also when the program exited: what it left behind
            # in its group goes too (in the namespace modes the kernel has already
            # killed the rest of the PID namespace).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if proc.poll() is None:
                try:
                    proc.wait(_KILL_WAIT_S)
                except subprocess.TimeoutExpired:  # pragma: no cover - a stuck kernel
                    logger.error("sandboxed process %d did not die after SIGKILL", proc.pid)
            for stream in out:
                if stream is not None:
                    stream.close()
        wall = time.monotonic() - start
        status = _read_status(status_r)
        killed = timed_out or truncated
        setup_error = _setup_error(self.report.mode, status, bytes(out[proc.stderr]))
        if setup_error and killed:
            setup_error = ""  # it ran (a status written late is not a set-up failure)
        code = proc.returncode
        exit_code = None if killed else (128 - code if code is not None and code < 0 else code)
        return RunResult(
            exit_code=exit_code,
            stdout=bytes(out[proc.stdout]),
            stderr=bytes(out[proc.stderr]),
            timed_out=timed_out,
            output_truncated=truncated,
            setup_error=setup_error,
            wall_s=wall,
        )


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def hidden_paths(keep: Sequence[str]) -> tuple[list[str], list[str]]:
    """The service's own files the program must not read, as ``(folders, files)``:
    an empty read-only tmpfs goes over each folder, ``/dev/null`` over each file.

    * the folder of the credential file (``RLFLEET_CREDENTIALS``: a launcher's set
      holds every role's file there) and the TLS key (``RLFLEET_TLS_KEY``);
    * when the service is not root (the program then runs as the service's own uid
      in a user namespace; as root it runs as a fresh uid that cannot read a 0700
      home anyway): every entry of its home folder but those holding a path of
      ``keep`` (the interpreter and its prefix), so keys, tokens and caches there
      stay out of the program's reach.

    Paths under the sandbox's own ``/tmp``, ``/run``, ``/proc`` and ``/dev`` are
    replaced anyway and left out, as are symbolic links and paths that are not there.
    """
    keep = [os.path.realpath(k) for k in keep if k]
    folders: list[str] = []
    files: list[str] = []

    def add(path: str) -> None:
        if os.path.islink(path) or any(_under(path, r) for r in _REPLACED):
            return
        if any(_under(k, path) for k in keep):  # would hide the interpreter
            return
        if os.path.isdir(path):
            folders.append(path)
        elif os.path.isfile(path):
            files.append(path)

    for name in _SECRET_ENV:
        value = os.environ.get(name)
        if not value:
            continue
        secret = os.path.realpath(value)
        folder = os.path.dirname(secret)
        # A folder of its own, not a system one (/etc, /home): else the file alone.
        if folder.count("/") >= 2 and not any(_under(k, folder) for k in keep):
            add(folder)
        else:
            add(secret)
    home = os.path.expanduser("~")
    if os.geteuid() != 0 and home not in ("", "/", "~") and os.path.isdir(home):
        home = os.path.realpath(home)
        with contextlib.suppress(OSError):
            for entry in sorted(os.listdir(home))[:_MAX_HIDDEN]:
                add(os.path.join(home, entry))
    folders = [
        f for f in dict.fromkeys(folders) if not any(_under(f, o) for o in folders if o != f)
    ]
    files = [f for f in dict.fromkeys(files) if not any(_under(f, o) for o in folders)]
    return folders, files


def _none_env(workdir: str | None) -> dict[str, str]:
    return {**_SANDBOX_ENV, "HOME": workdir or "/tmp", "TMPDIR": workdir or "/tmp"}


def _setup_error(mode: str, status: str, stderr: bytes) -> str:
    """Why the program never ran, or "" when it did."""
    if mode == "bwrap":
        # bubblewrap writes {"child-pid": N} once the sandbox is set up.
        if '"child-pid"' in status:
            return ""
        text = stderr.decode("utf-8", "replace").strip()
        return text[-2000:] or "bwrap exited before starting the program"
    lines = status.splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    if errors:
        return "; ".join(errors)[:2000]
    if "ready" in lines:
        return ""
    text = stderr.decode("utf-8", "replace").strip()
    return text[-2000:] or "the sandbox launcher exited before starting the program"


def _as_user(cmd: list[str], uid: int) -> tuple[list[str], dict[str, Any]]:
    """Run ``cmd`` as ``uid`` (group ``uid``, no supplementary groups).

    ``setpriv`` switches user after the exec, so Popen can start the child with
    vfork. Popen's own ``user=`` forces a plain fork, which runs gRPC's fork
    handlers in the child: in a process serving gRPC they restart its poller
    threads there, which then die on the descriptors Popen closes before the
    exec (SIGABRT, about 1 start in 200 with six threads starting programs).
    """
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return cmd, {"user": uid, "group": uid, "extra_groups": []}
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *cmd], {}


def _bwrap_command(
    argv: list[str],
    lim: SandboxLimits,
    files: Mapping[str, int],
    status_fd: int,
    hidden: tuple[list[str], list[str]] = ([], []),
) -> list[str]:
    bwrap = shutil.which("bwrap") or "bwrap"
    prlimit = shutil.which("prlimit") or "prlimit"
    cmd = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--ro-bind", "/", "/",
        "--proc", "/proc",
        "--dev", "/dev",
        "--remount-ro", "/dev",
        "--size", str(lim.tmp_mb << 20),
        "--tmpfs", "/tmp",
    ]  # fmt: skip
    for run in ("/run", "/var/run"):
        if os.path.isdir(run) and not os.path.islink(run):
            cmd += ["--size", "4096", "--tmpfs", run, "--remount-ro", run]
    secret_folders, secret_files = hidden
    for folder in secret_folders:
        cmd += ["--size", "4096", "--tmpfs", folder, "--remount-ro", folder]
    for path in secret_files:
        cmd += ["--ro-bind", "/dev/null", path]
    cmd += ["--hostname", "sandbox", "--chdir", "/tmp", "--clearenv"]
    for key, value in _SANDBOX_ENV.items():
        cmd += ["--setenv", key, value]
    cmd += ["--json-status-fd", str(status_fd)]
    for name, fd in files.items():
        cmd += ["--file", str(fd), f"/tmp/{name}"]
    limits = lim.rlimits()
    cmd += [
        "--",
        prlimit,
        *(f"--{flag}={limits[key]}" for flag, key in _PRLIMIT_FLAGS),
        "--",
        *argv,
    ]
    return cmd


_PRLIMIT_FLAGS = (
    ("cpu", "CPU"),
    ("as", "AS"),
    ("nproc", "NPROC"),
    ("fsize", "FSIZE"),
    ("nofile", "NOFILE"),
    ("core", "CORE"),
)


# ------------------------------------------------------------------- probing

_PROBE_MARK = "rlfleet-sandbox-ok"
_PROBE_LIMITS = SandboxLimits(timeout_s=20.0, cpu_time_s=10.0)
_probe_cache: dict[tuple[str, str | None, bool], IsolationReport] = {}
_probe_lock = threading.Lock()


def _mode_problem(mode: str) -> str:
    """Why ``mode`` cannot work here at all ("" when it may)."""
    if mode == "bwrap":
        if shutil.which("bwrap") is None:
            return "bwrap: not installed (apt-get install bubblewrap)"
        if shutil.which("prlimit") is None:
            return "bwrap: prlimit (util-linux) not found"
    if mode in ("namespaces", "none") and not hasattr(os, "memfd_create"):
        return f"{mode}: needs Linux (memfd_create)"
    return ""


def _trial(mode: str, python: str) -> str:
    """ "" when ``python`` runs under ``mode``, else what went wrong."""
    report = IsolationReport(mode, python)
    try:
        result = Sandbox(_PROBE_LIMITS, report=report).run_python(["-c", f"print({_PROBE_MARK!r})"])
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    if result.setup_error:
        return result.setup_error.splitlines()[-1][:300]
    if result.timed_out:
        return "timed out"
    if result.exit_code != 0 or _PROBE_MARK not in result.stdout.decode("utf-8", "replace"):
        err = result.stderr.decode("utf-8", "replace").strip()
        return f"exit code {result.exit_code}: {err[-300:]}"
    return ""


def probe(
    *, isolation: str = "auto", python: str | None = None, allow_unisolated: bool = False
) -> IsolationReport:
    """Find the best isolation that works here (a real trial run of each), once per process.

    Args:
        isolation: ``auto`` (``bwrap``, then ``namespaces``, then ``none``), or one mode.
        python: the interpreter to use; None tries the service's own, then
            ``/usr/bin/python3`` and ``/usr/local/bin/python3``.
        allow_unisolated: ``none`` (rlimits only) is acceptable.

    Returns:
        The report; its mode is ``unavailable`` when nothing acceptable works.
    """
    if isolation not in ISOLATION_CHOICES:
        raise ValueError(f"isolation must be one of {ISOLATION_CHOICES}, got {isolation!r}")
    if isolation == "none" and not allow_unisolated:
        raise ValueError("isolation 'none' runs untrusted code unconfined: needs allow_unisolated")
    key = (isolation, python, allow_unisolated)
    with _probe_lock:
        cached = _probe_cache.get(key)
        if cached is None:
            cached = _probe_cache[key] = _probe(isolation, python, allow_unisolated)
        return cached


def _probe(isolation: str, python: str | None, allow_unisolated: bool) -> IsolationReport:
    missing: list[str] = []
    if _UIDS.note():
        missing.append(_UIDS.note())
    candidates = _python_candidates(python)
    if not candidates:
        reason = (
            f"python {python!r} does not exist"
            if python
            else "no interpreter an unprivileged user can run (set reward.sandbox.python)"
        )
        return IsolationReport("unavailable", "", (reason,))
    modes = ["bwrap", "namespaces"] if isolation == "auto" else [isolation]
    if isolation == "auto" and allow_unisolated:
        modes.append("none")
    for mode in modes:
        problem = _mode_problem(mode)
        if problem:
            missing.append(problem)
            continue
        failures: list[str] = []
        for candidate in candidates:
            why = _trial(mode, candidate)
            if not why:
                return IsolationReport(mode, candidate, tuple(missing))
            failures.append(f"{candidate}: {why}")
        missing.append(f"{mode}: " + " | ".join(failures))
    return IsolationReport("unavailable", "", tuple(missing))
