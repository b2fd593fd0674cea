"""`rlfleet scale rollout N` against a real scheduler with auth on: the driver's
credential records the desired count; other roles and bad counts are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfleet.cli import main
from rlfleet.common.auth import credential_set, generate_tokens, write_credential_set
from rlfleet.common.rpc import Security, using_security
from rlfleet.scheduler.registry import SchedulerCore
from rlfleet.scheduler.server import start_scheduler_server


def test_scale_records_the_desired_count_for_the_driver_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = generate_tokens()
    secrets = write_credential_set(tmp_path / "s", tokens)
    core = SchedulerCore()
    server_security = Security(credentials=credential_set(tokens)["scheduler"])
    with using_security(server_security), start_scheduler_server(core) as server:
        address = server.address
        monkeypatch.setenv("RLFLEET_CREDENTIALS", str(secrets / "driver.json"))
        assert main(["scale", "rollout", "3", "--scheduler", address]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out == {"role": "rollout", "replicas": 3, "request": 1}
        assert core.scale("rollout") == (3, 1)
        with pytest.raises(SystemExit) as refused:  # refused here, before any call
            main(["scale", "rollout", "0", "--scheduler", address])
        assert refused.value.code == 2 and "must be >= 1 (got 0)" in capsys.readouterr().err
        monkeypatch.setenv("RLFLEET_CREDENTIALS", str(secrets / "observer.json"))
        assert main(["scale", "rollout", "5", "--scheduler", address]) == 1
        assert "may not call" in capsys.readouterr().err
        assert core.scale("rollout") == (3, 1)


def test_watch_exec_runs_the_hook_with_each_new_desired_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The compose hook: `--watch-exec CMD` runs CMD with {replicas} each time the
    desired count changes (set here before the watch starts, then again)."""
    import sys
    import threading

    tokens = generate_tokens()
    secrets = write_credential_set(tmp_path / "s", tokens)
    core = SchedulerCore()
    out_file = tmp_path / "hook.txt"
    hook = f"{sys.executable} -c \"open({str(out_file)!r}, 'a').write('{{replicas}}\\n')\""
    server_security = Security(credentials=credential_set(tokens)["scheduler"])
    with using_security(server_security), start_scheduler_server(core) as server:
        monkeypatch.setenv("RLFLEET_CREDENTIALS", str(secrets / "observer.json"))
        core.set_scale("rollout", 2)
        timer = threading.Timer(1.0, core.set_scale, ("rollout", 3))
        timer.start()
        try:
            argv = ["scale", "rollout", "--scheduler", server.address, "--watch-exec", hook]
            assert main([*argv, "--interval-s", "0.1", "--max-runs", "2"]) == 0
        finally:
            timer.cancel()
    assert out_file.read_text().split() == ["2", "3"]
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["replicas"], r["exit_code"]) for r in runs] == [(2, 0), (3, 0)]
    # A count and a hook, or neither: refused.
    assert main(["scale", "rollout", "2", "--watch-exec", hook, "--scheduler", "x:1"]) == 2
    assert main(["scale", "rollout", "--watch-exec", "true", "--scheduler", "x:1"]) == 2


def test_scaling_a_detached_cluster_warns_that_nothing_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rlfleet up` without --foreground leaves no launcher behind: `rlfleet scale` on
    its state file still records the count at the scheduler, and says that nothing
    follows it; on a --foreground cluster it does not."""
    tokens = generate_tokens()
    secrets = write_credential_set(tmp_path / "s", tokens)
    core = SchedulerCore()
    server_security = Security(credentials=credential_set(tokens)["scheduler"])
    with using_security(server_security), start_scheduler_server(core) as server:
        monkeypatch.setenv("RLFLEET_CREDENTIALS", str(secrets / "driver.json"))
        for supervised, warned in ((False, True), (True, False)):
            state = {"handle": {"scheduler": server.address}, "processes": [],
                     "supervised": supervised}  # fmt: skip
            (tmp_path / "cluster.json").write_text(json.dumps(state))
            assert main(["scale", "rollout", "2", "--state-dir", str(tmp_path)]) == 0
            err = capsys.readouterr().err
            assert ("no launcher follows this count" in err) is warned, err
        assert core.scale("rollout")[0] == 2
