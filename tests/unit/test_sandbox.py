"""The code sandbox (rlfleet.common.sandbox): each test runs real programs in it.

Every behaviour is checked under each isolation that works here: ``bwrap`` (skips
without bubblewrap) and ``namespaces``, the fallback (skips only where the kernel
refuses namespaces). Nothing is mocked: a program tries the hostile thing and the
test checks, from outside, that it did not happen.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlfleet.common import sandbox as sb
from rlfleet.common.sandbox import (
    IsolationReport,
    RunResult,
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    probe,
)

REPO = Path(__file__).resolve().parents[2]
MODES = ("bwrap", "namespaces")
FAST = SandboxLimits(timeout_s=10.0, cpu_time_s=10.0, memory_mb=512, max_processes=16)


def _report(mode: str) -> IsolationReport:
    report = probe(isolation=mode)
    if not report.usable:
        why = "; ".join(report.missing)
        if mode == "bwrap":
            pytest.skip(f"bubblewrap does not work here: {why}")
        pytest.skip(f"this kernel refuses the namespaces the fallback needs: {why}")
    return report


@pytest.fixture(params=MODES)
def box(request: pytest.FixtureRequest) -> Sandbox:
    return Sandbox(FAST, report=_report(request.param))


def run(box: Sandbox, source: str, **kw: object) -> RunResult:
    return box.run_python(["main.py"], files={"main.py": textwrap.dedent(source).encode()}, **kw)  # type: ignore[arg-type]


def text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def live_processes(uid: int) -> list[int]:
    """PIDs of processes (zombies excepted: they hold nothing) running as ``uid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid and not fields.get(
            "State", ""
        ).strip().startswith("Z"):
            found.append(int(entry))
    return found


# --------------------------------------------------------------------- basics


def test_runs_a_program_with_stdin_and_files(box: Sandbox) -> None:
    result = box.run_python(
        ["main.py"],
        stdin=b"hello",
        files={
            "main.py": b"import os, sys\nprint(sys.stdin.read().upper(), os.getcwd(), "
            b"open('data.txt').read())\n",
            "data.txt": b"from a file",
        },
    )
    assert result.ok, result
    assert text(result.stdout).split() == ["HELLO", "/tmp", "from", "a", "file"]
    assert result.exit_code == 0 and not result.setup_error


def test_exit_codes_and_signals_are_reported(box: Sandbox) -> None:
    assert run(box, "import sys; sys.exit(3)").exit_code == 3
    killed = run(box, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert killed.exit_code == 128 + 11 and not killed.ok


# --------------------------------------------------------------------- network


def test_no_network_even_to_the_hosts_loopback(box: Sandbox) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        result = run(
            box,
            f"""
            import socket
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect(("127.0.0.1", {port}))
                print("connected")
            except OSError as e:
                print("refused", e.errno)
            """,
        )
        assert result.ok, result
        assert text(result.stdout).startswith("refused"), result.stdout
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the host's listener


# --------------------------------------------------------------------- files


def test_file_system_is_read_only_but_its_tmp(box: Sandbox, tmp_path: Path) -> None:
    # World-writable places on the host: only the read-only view can stop these.
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    name = f"rlfleet-sandbox-test-{uuid.uuid4().hex}"
    targets = [str(open_dir / name), f"/var/tmp/{name}", f"/dev/shm/{name}", f"/{name}"]
    result = run(
        box,
        f"""
        import os
        for path in {targets!r}:
            try:
                with open(path, "w") as f:
                    f.write("escaped")
                print("WROTE", path)
            except OSError as e:
                print("blocked", e.errno)
        with open("/tmp/inside.txt", "w") as f:
            f.write("ok")
        print("tmp", open("/tmp/inside.txt").read())
        """,
    )
    assert result.ok, result
    out = text(result.stdout)
    assert "WROTE" not in out
    assert out.count("blocked") == len(targets)
    assert "tmp ok" in out
    for target in targets:
        assert not os.path.exists(target), target


def test_tmp_is_fresh_and_bounded(box: Sandbox) -> None:
    limits = SandboxLimits(timeout_s=10, cpu_time_s=10, tmp_mb=4)
    first = box.run_python(
        ["-c", "open('/tmp/left.txt', 'w').write('x'); import os; print(os.listdir('/tmp'))"],
        limits=limits,
    )
    second = box.run_python(["-c", "import os; print(os.listdir('/tmp'))"], limits=limits)
    assert "left.txt" in text(first.stdout)
    assert text(second.stdout).strip() == "[]"
    big = box.run_python(["-c", "open('/tmp/big', 'wb').write(b'x' * (16 << 20))"], limits=limits)
    assert big.exit_code != 0  # 16 MiB into a 4 MiB /tmp


@pytest.mark.skipif(os.geteuid() != 0, reason="as root the sandbox runs as a fresh uid")
def test_root_only_files_are_unreadable(box: Sandbox, tmp_path: Path) -> None:
    secret = Path("/var/tmp") / f"rlfleet-secret-{uuid.uuid4().hex}"
    secret.write_text("token")
    secret.chmod(0o600)
    try:
        result = run(
            box,
            f"""
            import os
            print(os.getuid() != 0)
            try:
                print(open({str(secret)!r}).read())
            except OSError as e:
                print("denied", e.errno)
            """,
        )
    finally:
        secret.unlink()
    assert text(result.stdout).split()[:2] == ["True", "denied"], result


def test_the_hosts_shared_memory_segments_are_not_there(box: Sandbox) -> None:
    """/dev/shm is a fresh one (weight-plane segments live in the host's, readable by
    a sandbox that runs as the service's own user when not root)."""
    name = f"rlfleet-test-{uuid.uuid4().hex}"
    segment = Path("/dev/shm") / name
    segment.write_bytes(b"weights")
    try:
        result = run(
            box,
            f"""
            import os
            print(os.path.exists({str(segment)!r}), os.listdir("/dev/shm"))
            """,
        )
    finally:
        segment.unlink()
    assert result.exit_code == 0, text(result.stderr)
    assert text(result.stdout).strip() == "False []"


# --------------------------------------------------------------------- secrets


def test_parent_environment_is_not_visible(box: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFLEET_SHARED_TOKEN", "s3cret-token")
    monkeypatch.setenv("RLFLEET_SANDBOX_TEST_SECRET", "another")
    result = run(box, "import os, json; print(json.dumps(dict(os.environ)))")
    assert result.ok, result
    assert "s3cret-token" not in text(result.stdout)
    assert "another" not in text(result.stdout)
    import json

    env = json.loads(result.stdout)
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "PWD", "LC_CTYPE"}


def test_no_inherited_descriptors(box: Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "held-open"
    secret.write_text("descriptor secret")
    fd = os.open(secret, os.O_RDONLY)
    os.set_inheritable(fd, True)
    try:
        result = run(
            box,
            """
            import os
            found = []
            for name in os.listdir("/proc/self/fd"):
                try:
                    data = os.pread(int(name), 100, 0)
                except OSError:
                    continue
                found.append(data)
            print(b"descriptor secret" in b"".join(found))
            """,
        )
    finally:
        os.close(fd)
    assert text(result.stdout).strip() == "False", result


# --------------------------------------------------------------------- limits


def test_fork_bomb_is_bounded_and_leaves_nothing(box: Sandbox) -> None:
    limits = SandboxLimits(timeout_s=3.0, cpu_time_s=3.0, max_processes=16)
    result = box.run_python(
        [
            "-c",
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        ],
        limits=limits,
    )
    assert not result.ok
    if os.geteuid() == 0:  # the fresh uid is the sandbox's alone
        assert result.uid >= sb._UID_BASE
        assert live_processes(result.uid) == []


def test_fork_count_stops_at_the_limit(box: Sandbox) -> None:
    limits = SandboxLimits(timeout_s=10.0, cpu_time_s=10.0, max_processes=16)
    result = box.run_python(
        [
            "-c",
            textwrap.dedent(
                """
                import os, time
                n = 0
                for _ in range(200):
                    try:
                        pid = os.fork()
                    except OSError:
                        break
                    if pid == 0:
                        time.sleep(5)
                        os._exit(0)
                    n += 1
                print(n)
                """
            ),
        ],
        limits=limits,
    )
    assert result.ok, result
    assert 0 < int(result.stdout) < 16


def test_memory_blow_up_fails_inside(box: Sandbox) -> None:
    limits = SandboxLimits(timeout_s=10.0, cpu_time_s=10.0, memory_mb=256)
    result = box.run_python(["-c", "x = bytearray(2 << 30)"], limits=limits)
    assert result.exit_code == 1
    assert "MemoryError" in text(result.stderr)


def test_no_user_namespace_to_mount_a_tmpfs_of_its_own(box: Sandbox) -> None:
    """A program cannot make a user namespace (where it would hold every capability
    and could mount a tmpfs of any size, past the /tmp limit): unshare and clone with
    CLONE_NEWUSER are refused; threads and child processes still work."""
    result = run(
        box,
        """
        import ctypes, os, subprocess, sys, threading
        libc = ctypes.CDLL(None, use_errno=True)
        print("unshare", libc.unshare(0x10000000), ctypes.get_errno())
        t = threading.Thread(target=lambda: print("thread ran"))
        t.start(); t.join()
        out = subprocess.run([sys.executable, "-c", "print('child ran')"], capture_output=True)
        print(out.stdout.decode().strip())
        """,
    )
    out = text(result.stdout)
    assert result.exit_code == 0, text(result.stderr)
    code, errno = out.split("\n")[0].split()[1:]
    assert int(code) == -1 and int(errno) in (1, 28)  # EPERM here, ENOSPC (bwrap's way)
    assert "thread ran" in out and "child ran" in out


def test_infinite_loop_hits_the_wall_clock(box: Sandbox) -> None:
    limits = SandboxLimits(timeout_s=1.0, cpu_time_s=60.0)
    for program in ("while True: pass", "import time; time.sleep(3600)"):
        start = time.monotonic()
        result = box.run_python(["-c", program], limits=limits)
        assert result.timed_out and result.exit_code is None, result
        assert time.monotonic() - start < 30  # killed, not waited for


def test_cpu_limit_kills_a_spinning_program(box: Sandbox) -> None:
    limits = SandboxLimits(timeout_s=60.0, cpu_time_s=1.0)
    result = box.run_python(["-c", "while True: pass"], limits=limits)
    assert not result.timed_out
    assert result.exit_code in (128 + 9, 128 + 24)  # SIGKILL / SIGXCPU


def test_output_flood_is_truncated(box: Sandbox) -> None:
    limits = SandboxLimits(timeout_s=20.0, cpu_time_s=20.0, max_output_bytes=4096)
    result = box.run_python(["-c", "while True: print('x' * 1000)"], limits=limits)
    assert result.output_truncated and not result.timed_out
    assert len(result.stdout) == 4096 and result.exit_code is None


def test_a_daemon_does_not_outlive_the_run(box: Sandbox) -> None:
    result = run(
        box,
        """
        import os, time
        if os.fork() == 0:
            os.setsid()
            time.sleep(60)
        print("parent done")
        """,
    )
    assert result.ok and text(result.stdout).strip() == "parent done"
    if os.geteuid() == 0:
        assert live_processes(result.uid) == []


def test_concurrent_runs_stay_apart(box: Sandbox) -> None:
    """Threads sharing one Sandbox: each run its own process, uid, files and output."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> RunResult:
        return box.run_python(
            ["main.py"],
            stdin=f"input {i}".encode(),
            files={
                "main.py": b"import sys; print(sys.stdin.read(), open('own.txt').read())",
                "own.txt": f"file {i}".encode(),
            },
        )

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(12)))
    assert [text(r.stdout).strip() for r in results] == [
        f"input {i} file {i}" for i in range(12)
    ], [r for r in results if not r.ok]
    if os.geteuid() == 0:
        assert all(r.uid >= sb._UID_BASE for r in results)


def test_runs_started_beside_a_live_grpc_server_all_start(box: Sandbox) -> None:
    """A tools or reward server starts programs while gRPC's poller threads run.

    A plain fork() there runs gRPC's fork handlers in the child, which restart a
    poller that then dies on the descriptors closed before the exec (SIGABRT in
    about 1 start in 300 before the fix): every one of many starts must run.
    """
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=10)
        with futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: box.run_python(["-c", f"print({i})"]), range(900)))
    finally:
        channel.close()
        server.stop(None)
    failed = [(i, r) for i, r in enumerate(results) if text(r.stdout).strip() != str(i)]
    assert failed == [], failed[:3]


def test_a_root_caller_switches_user_after_the_exec() -> None:
    cmd, popen_kw = sb._as_user(["/bin/true"], 1234)
    if shutil.which("setpriv") is None:
        assert popen_kw == {"user": 1234, "group": 1234, "extra_groups": []}
    else:
        assert popen_kw == {} and cmd[-2:] == ["--", "/bin/true"]
        assert {"--reuid=1234", "--regid=1234", "--clear-groups"} <= set(cmd)


# --------------------------------------------------------------------- probing


def test_probe_says_what_is_in_force() -> None:
    report = probe()
    if report.usable:
        assert report.mode in ("bwrap", "namespaces") and report.python
        assert report.mode in report.describe()
    if shutil.which("bwrap") is None:
        assert any("bwrap" in m and "not installed" in m for m in report.missing)


def test_without_bubblewrap_the_fallback_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _report("namespaces")
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap (nor prlimit) to be found
    report = sb._probe("auto", None, False)  # uncached
    assert report.mode == "namespaces"
    assert report.missing == ("bwrap: not installed (apt-get install bubblewrap)",)
    assert "not used: bwrap: not installed" in report.describe()


def test_unavailable_isolation_refuses_to_run() -> None:
    report = IsolationReport("unavailable", "", ("bwrap: not installed",))
    with pytest.raises(SandboxUnavailable, match="allow_unisolated"):
        Sandbox(report=report)
    with pytest.raises(ValueError, match="allow_unisolated"):
        probe(isolation="none")


def test_unisolated_mode_runs_only_when_allowed() -> None:
    report = probe(isolation="none", allow_unisolated=True)
    assert report.mode == "none" and "NOT isolated" in report.describe()
    box = Sandbox(FAST, report=report)
    result = box.run_python(["-c", "import os; print(sorted(os.environ))"])
    assert result.ok, result
    assert "RLFLEET" not in text(result.stdout)


def test_bad_arguments() -> None:
    report = IsolationReport("namespaces", sys.executable)
    box = Sandbox(FAST, report=report)
    with pytest.raises(ValueError, match="plain names"):
        box.run(["/bin/true"], files={"../x": b""})
    with pytest.raises(ValueError, match="absolute"):
        box.run(["true"])
    with pytest.raises(ValueError, match="max_processes"):
        SandboxLimits(max_processes=1)


# --------------------------------------------------------------------- as an ordinary user


@pytest.fixture()
def standalone_copy() -> Iterator[Path]:
    """The two sandbox files in a world-readable folder (the module is standard library only)."""
    folder = Path(tempfile.mkdtemp(prefix="rlfleet-sandbox-copy-"))
    try:
        for name in ("sandbox.py", "sandbox_launch.py"):
            shutil.copy(REPO / "services" / "common" / name, folder / name)
        folder.chmod(0o755)
        for f in folder.iterdir():
            f.chmod(0o644)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


USER_PROGRAM = """
import os, socket
out = []
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
    out.append("connected")
except OSError:
    out.append("no-network")
try:
    open("/var/tmp/rlfleet-user-escape", "w")
    out.append("wrote")
except OSError:
    out.append("read-only")
for name in ("HOME_SECRET", "CREDENTIALS", "SIBLING"):
    try:
        print(open(os.environ.get(name) or "/nonexistent").read(), end=" ")
        out.append("read-" + name)
    except OSError:
        out.append("hidden")
n = 0
for _ in range(100):
    try:
        if os.fork() == 0:
            import time; time.sleep(3); os._exit(0)
        n += 1
    except OSError:
        break
out.append(str(n))
print(" ".join(out))
"""

USER_SCRIPT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sandbox", {path!r})
sb = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sb
spec.loader.exec_module(sb)
report = sb.probe(isolation={mode!r})
if not report.usable:
    print(json.dumps({{"unusable": report.describe()}}))
    sys.exit(0)
limits = sb.SandboxLimits(timeout_s=10, cpu_time_s=10, max_processes=8)
import os
paths = {{k: os.environ[k] for k in ("HOME_SECRET", "CREDENTIALS", "SIBLING")}}
program = f"import os; os.environ.update({{paths!r}})\\n" + sys.stdin.read()
result = sb.Sandbox(limits, report=report).run_python(["-c", program])
print(json.dumps({{"stdout": result.stdout.decode(), "ok": result.ok, "uid": result.uid}}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process as another user")
@pytest.mark.parametrize("mode", MODES)
def test_as_an_ordinary_user(mode: str, standalone_copy: Path) -> None:
    """Not root (a developer's machine): the sandbox runs as the caller's own uid in a
    user namespace, and still has no network, a read-only view and a process limit,
    and cannot read that user's own files: its home, its credential set."""
    python = "/usr/bin/python3"
    if not os.path.exists(python) or not sb._reachable_by_others(python):
        pytest.skip(f"no interpreter an ordinary user can run at {python}")
    if mode == "bwrap":
        _report("bwrap")
    script = USER_SCRIPT.format(path=str(standalone_copy / "sandbox.py"), mode=mode)
    uid = 1_000_000_000 - 7  # a uid no account has
    # The user's own files, readable by that user: a home with a key in it, and a
    # credential set (its role's file named by RLFLEET_CREDENTIALS, another beside it).
    # Not under /tmp, which the sandbox replaces anyway.
    home = Path(tempfile.mkdtemp(prefix="rlfleet-home-", dir="/var/tmp"))
    try:
        (home / ".ssh").mkdir()
        (home / ".ssh" / "id_ed25519").write_text("home-key")
        secrets = Path(tempfile.mkdtemp(prefix="rlfleet-secrets-", dir="/var/tmp"))
        (secrets / "reward.json").write_text("reward-token")
        (secrets / "driver.json").write_text("driver-token")
        for path in (home, home / ".ssh", home / ".ssh" / "id_ed25519", secrets,
                     *secrets.iterdir()):  # fmt: skip
            os.chown(path, uid, uid)
            path.chmod(0o700 if path.is_dir() else 0o600)
        proc = subprocess.run(
            [python, "-c", script],
            input=USER_PROGRAM,
            user=uid,
            group=uid,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=120,
            env={
                "PATH": "/usr/bin:/bin",
                "HOME": str(home),
                "RLFLEET_CREDENTIALS": str(secrets / "reward.json"),
                "HOME_SECRET": str(home / ".ssh" / "id_ed25519"),
                "CREDENTIALS": str(secrets / "reward.json"),
                "SIBLING": str(secrets / "driver.json"),
            },
            cwd="/",
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(secrets, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "unusable" in out:
        pytest.skip(f"{mode} as an ordinary user does not work here: {out['unusable']}")
    assert out["ok"], out
    assert out["uid"] == uid
    words = out["stdout"].split()
    assert words[:5] == ["no-network", "read-only", "hidden", "hidden", "hidden"], out
    assert 0 < int(words[5]) < 8
    assert not os.path.exists("/var/tmp/rlfleet-user-escape")


def test_hidden_paths_cover_the_credential_folder_but_never_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The credential file's folder is hidden whole; a credential file in a system
    folder (/etc) or in the interpreter's own folder is hidden alone; /tmp is the
    sandbox's own anyway."""
    folder = Path(tempfile.mkdtemp(prefix="rlfleet-creds-", dir="/var/tmp"))
    try:
        (folder / "reward.json").write_text("{}")
        (folder / "python3").write_text("")
        monkeypatch.setenv("RLFLEET_CREDENTIALS", str(folder / "reward.json"))
        monkeypatch.delenv("RLFLEET_TLS_KEY", raising=False)
        monkeypatch.setenv("HOME", "/")
        assert sb.hidden_paths(["/usr/bin/python3"]) == ([str(folder)], [])
        assert sb.hidden_paths([str(folder / "python3")]) == ([], [str(folder / "reward.json")])
        monkeypatch.setenv("RLFLEET_CREDENTIALS", "/etc/passwd")
        assert sb.hidden_paths(["/usr/bin/python3"]) == ([], ["/etc/passwd"])
        monkeypatch.setenv("RLFLEET_CREDENTIALS", "/tmp/x/reward.json")
        assert sb.hidden_paths(["/usr/bin/python3"]) == ([], [])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
