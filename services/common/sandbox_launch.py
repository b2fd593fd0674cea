"""The launcher of :mod:`rlfleet.common.sandbox`'s ``namespaces`` and ``none`` modes.

Run as a script (``python -I -S sandbox_launch.py SPEC_FD``), never imported by the
service: it uses the standard library only, so it starts in ~15 ms with no
site-packages. The spec (JSON, read from ``SPEC_FD``) says what to run and how:

``namespaces`` mode, as root (what CI and the containers run as):

1. unshare mount, PID, network, IPC, UTS and cgroup namespaces (still root);
2. fork: the child is PID 1 of the new PID namespace. It makes every mount
   private, marks the whole tree read-only and nosuid (``mount_setattr`` with
   ``AT_RECURSIVE``, Linux >= 5.12), mounts a fresh ``/proc`` (only the sandbox's
   processes), a size-limited tmpfs on ``/tmp`` (the one writable place, owned by
   the sandbox user), an empty read-only tmpfs over ``/run`` (hiding the host's
   unix sockets), over ``/dev/shm`` (its shared-memory segments) and over the
   service's secrets and home (``hide_folders``; ``/dev/null`` over ``hide_files``), and writes the program's files into ``/tmp``;
3. it drops to the sandbox user (a uid of its own, no groups, no capabilities),
   sets ``no_new_privs``, a seccomp filter that refuses new user namespaces (bwrap's
   ``--disable-userns``: inside one a program could mount a tmpfs of any size) and
   the rlimits, and forks the program, whose parent it
   stays: a reaper that exits with the program's status. When PID 1 exits the
   kernel kills everything left in the namespace.

As another user the order differs only in step 1: a new user namespace comes
first (mapping the caller's own uid), so steps 2-3 run with the capabilities the
kernel grants inside it; the program, not uid 0 there, loses them on exec.

``none`` mode (only where isolation is impossible and the user opted out): the
rlimits, the sandbox user and a fresh working directory, nothing else.

The launcher dies with its parent (``PR_SET_PDEATHSIG``), and so does PID 1. It
reports on ``status_fd``: ``ready`` just before the program is executed, or
``error: ...`` when setting up failed (exit code 125) or the exec failed (127).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import sys
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (asm-generic)

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2

# Classic BPF for the seccomp filter (linux/filter.h, linux/seccomp.h).
BPF_LD_W_ABS = 0x20
BPF_JEQ_K = 0x15
BPF_JGE_K = 0x35
BPF_JSET_K = 0x45
BPF_RET_K = 0x06
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
EPERM, ENOSYS = 1, 38
X32_SYSCALL_BIT = 0x40000000
#: machine -> (AUDIT_ARCH_*, clone, unshare, clone3)
_SYSCALLS = {
    "x86_64": (0xC000003E, 56, 272, 435),
    "aarch64": (0xC00000B7, 220, 97, 435),
}

SETUP_FAILED = 125
EXEC_FAILED = 127

_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class SetupError(Exception):
    pass


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _no_new_user_namespaces() -> bool:
    """Install a seccomp filter that refuses new user namespaces (``unshare`` and
    ``clone`` with ``CLONE_NEWUSER``: EPERM; ``clone3``, whose flags a filter cannot
    read: ENOSYS, and the C library falls back to ``clone``; system calls of another
    ABI, x32 or 32-bit: EPERM). In one, a program would hold every capability and
    could mount a tmpfs of any size, past the sandbox's ``/tmp`` limit. Needs
    ``no_new_privs``; inherited by every child and kept across ``exec``. False on a
    machine this does not know (only x86_64 and aarch64 are)."""
    known = _SYSCALLS.get(os.uname().machine)
    if known is None:
        return False
    arch, clone, unshare, clone3 = known
    deny, allow = SECCOMP_RET_ERRNO | EPERM, SECCOMP_RET_ALLOW
    program = [
        (BPF_LD_W_ABS, 0, 0, 4),  # 0: seccomp_data.arch
        (BPF_JEQ_K, 1, 0, arch),  # 1: native -> 3
        (BPF_RET_K, 0, 0, deny),  # 2
        (BPF_LD_W_ABS, 0, 0, 0),  # 3: seccomp_data.nr
        (BPF_JGE_K, 0, 1, X32_SYSCALL_BIT),  # 4: x32 -> 5, else 6
        (BPF_RET_K, 0, 0, deny),  # 5
        (BPF_JEQ_K, 0, 1, clone3),  # 6: clone3 -> 7, else 8
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS),  # 7
        (BPF_JEQ_K, 1, 0, unshare),  # 8: unshare -> 10
        (BPF_JEQ_K, 0, 2, clone),  # 9: clone -> 10, else 12
        (BPF_LD_W_ABS, 0, 0, 16),  # 10: the low half of args[0], the flags
        (BPF_JSET_K, 1, 0, CLONE_NEWUSER),  # 11: CLONE_NEWUSER -> 13
        (BPF_RET_K, 0, 0, allow),  # 12
        (BPF_RET_K, 0, 0, deny),  # 13
    ]
    filters = (_SockFilter * len(program))(*(_SockFilter(*ins) for ins in program))
    fprog = _SockFprog(len(program), filters)
    _check(
        _libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog), 0, 0),
        "seccomp filter (no new user namespaces)",
    )
    return True


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {fstype or 'flags'} on {target}",
    )


def _prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


def _die_with_parent(parent: int) -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(SETUP_FAILED)


def _die_with_launcher(lifeline: int) -> None:
    """PID 1: die with the launcher outside the namespace (its pid is not visible
    here, so a pipe it holds open tells whether it is still alive)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([lifeline], [], [], 0)[0]:  # end of file: the launcher is gone
        os._exit(SETUP_FAILED)
    os.close(lifeline)


def _exit_code(status: int) -> int:
    """A wait status as a shell reports it: the code, or 128 + the signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status) & 0xFF


def _wait_and_exit(child: int) -> None:
    """Reap every child (orphans included, as PID 1 must) until ``child`` exits."""
    while True:
        try:
            pid, status = os.wait()
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(SETUP_FAILED)
        if pid == child:
            os._exit(_exit_code(status))


def _write_id_map(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _enter_namespaces(root: bool) -> None:
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.geteuid(), os.getegid()
    if not root:
        flags |= CLONE_NEWUSER
    _check(_libc.unshare(flags), "unshare")
    # A cgroup namespace only hides the host's cgroup paths: optional.
    _libc.unshare(CLONE_NEWCGROUP)
    if not root:
        _write_id_map("/proc/self/setgroups", "deny")
        _write_id_map("/proc/self/uid_map", f"{uid} {uid} 1")
        _write_id_map("/proc/self/gid_map", f"{gid} {gid} 1")


def _mount_view(spec: dict[str, Any]) -> None:
    """The file system as the program sees it (run as PID 1 of the new namespaces)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    _check(
        _libc.syscall(
            SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)
        ),
        "mount_setattr (read-only view; needs Linux >= 5.12)",
    )
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    owner = f",uid={spec['uid']},gid={spec['gid']}" if os.geteuid() == 0 else ""
    _mount(
        "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['tmp_bytes']},mode=0700{owner}"
    )
    if os.path.isdir("/dev/shm"):  # hide the host's segments (a caller's own are readable)
        flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
        _mount("tmpfs", "/dev/shm", "tmpfs", flags, "size=4k")
    for hidden in ("/run", "/var/run"):
        if os.path.isdir(hidden) and not os.path.islink(hidden):
            _mount(
                "tmpfs", hidden, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k"
            )
    # The service's own secrets and, not as root, its home (sandbox.hidden_paths).
    for folder in spec.get("hide_folders", ()):
        _mount("tmpfs", folder, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k")
    for path in spec.get("hide_files", ()):
        _mount("/dev/null", path, None, MS_BIND)
    name = b"sandbox"
    _check(_libc.sethostname(name, len(name)), "sethostname")


def _write_files(spec: dict[str, Any], workdir: str) -> None:
    for name, fd in spec["files"].items():
        path = os.path.join(workdir, name)
        with os.fdopen(fd, "rb") as src, open(path, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        if os.geteuid() == 0:
            os.chown(path, spec["uid"], spec["gid"])


def _drop_privileges(spec: dict[str, Any]) -> None:
    if os.geteuid() == 0:
        uid, gid = spec["uid"], spec["gid"]
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if spec["namespaces"]:
        _no_new_user_namespaces()


def _set_limits(spec: dict[str, Any]) -> None:
    limits = spec["rlimits"]
    for name in ("CPU", "AS", "NPROC", "FSIZE", "NOFILE", "CORE"):
        value = int(limits[name])
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, value))


def _exec(spec: dict[str, Any], status_fd: int, workdir: str) -> None:
    """Become the program (never returns)."""
    try:
        os.chdir(workdir)
        os.set_inheritable(status_fd, False)
        os.write(status_fd, b"ready\n")
        keep = {0, 1, 2, status_fd}
        for fd in _open_fds():
            if fd not in keep:
                os.closerange(fd, fd + 1)
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except OSError as e:
        os.write(status_fd, f"error: exec {spec['argv'][0]}: {e}\n".encode())
        os._exit(EXEC_FAILED)


def _open_fds() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 1024))


def main(argv: list[str]) -> None:
    spec_fd = int(argv[1])
    with os.fdopen(spec_fd, "rb") as f:
        spec = json.loads(f.read())
    status_fd = int(spec["status_fd"])
    step = "starting"
    try:
        _die_with_parent(int(spec["parent_pid"]))
        if spec["namespaces"]:
            step = "namespaces"
            root = os.geteuid() == 0
            _enter_namespaces(root)
            lifeline, keepalive = os.pipe()
            pid1 = os.fork()
            if pid1:
                os.close(status_fd)
                os.close(lifeline)
                _wait_and_exit(pid1)
            os.close(keepalive)
            _die_with_launcher(lifeline)
            step = "mounts"
            _mount_view(spec)
            workdir = "/tmp"
        else:
            workdir = spec["workdir"]
        step = "files"
        _write_files(spec, workdir)
        step = "privileges"
        _drop_privileges(spec)
        step = "rlimits"
        _set_limits(spec)
    except (OSError, SetupError, ValueError, KeyError) as e:
        os.write(status_fd, f"error: {step}: {e}\n".encode())
        os._exit(SETUP_FAILED)
    if not spec["namespaces"]:
        _exec(spec, status_fd, workdir)
    child = os.fork()
    if child == 0:
        _exec(spec, status_fd, workdir)
    os.close(status_fd)
    _wait_and_exit(child)


if __name__ == "__main__":
    main(sys.argv)
