"""Start-up errors are one line each, naming the key or flag and the value, exit code 2,
before any service starts or any model loads."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rlfleet.cli import main


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    from rlfleet.driver.data.preprocess import preprocess

    out = tmp_path / "data"
    preprocess("arithmetic", None, out, n=8, n_test=2, digits=1, ops="+", seed=0)
    return out


@pytest.fixture()
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


def _config(tmp_path: Path, model: Path, data: Path, **extra: object) -> Path:
    raw = {
        "actor": {"model_path": str(model)},
        "data": {
            "train_files": str(data / "train.parquet"),
            "val_files": str(data / "test.parquet"),
        },
        "trainer": {"device": "cpu", "default_local_dir": str(tmp_path / "run")},
        "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
    }
    for key, value in extra.items():
        section, _, name = key.partition("__")
        raw.setdefault(section, {})[name] = value  # type: ignore[index]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _errors(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[str]:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all("Traceback" not in line for line in err)
    return err


def test_a_missing_config_file_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    err = _errors(capsys, ["train", "--config", str(tmp_path / "nope.yaml")])
    assert len(err) == 1 and err[0].startswith("rlfleet train: --config: cannot read it")
    assert "nope.yaml" in err[0]


@pytest.mark.parametrize("service", ["scheduler", "reward", "trainer", "rollout", "tools"])
def test_serve_with_a_missing_config_file_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, service: str
) -> None:
    missing = tmp_path / "nope.yaml"
    err = _errors(capsys, ["serve", service, "--insecure", "--config", str(missing)])
    assert len(err) == 1 and "cannot read it" in err[0] and str(missing) in err[0]


def test_serve_scheduler_refuses_an_impossible_local_plan_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "trainer": {"device": "cpu"},
                "resource_pools": {"train_pool": [4096], "rollout_pool": [1]},
            }
        )
    )
    err = _errors(
        capsys, ["serve", "scheduler", "--insecure", "--config", str(config), "--plan-local"]
    )
    assert len(err) == 1 and err[0].startswith("error: --plan-local:") and "4096" in err[0]


def test_invalid_yaml_is_one_line_with_where(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: {model_path: [\n")
    err = _errors(capsys, ["train", "--config", str(bad)])
    assert len(err) == 1 and err[0].startswith(f"rlfleet train: {bad}: not valid YAML: line 2")


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"actor__model_path": "does/not/exist/here"}, "actor.model_path: no such folder"),
        ({"actor__tokenizer_path": "TMP"}, "actor.tokenizer_path: has no tokenizer files"),
        ({"data__train_files": "missing.parquet"}, "data.train_files: no such file"),
        ({"reward__custom_function": {"path": "nowhere.py"}}, "reward.custom_function.path"),
        ({"resource_pools__train_pool": [64]}, "resource_pools:"),
        (
            {"actor__lora_rank": 8, "actor__target_modules": ["q_proj", "foo_proj"]},
            "actor.target_modules: the model has no module named foo_proj",
        ),
        (
            {"trainer__resume_mode": "resume_path", "trainer__resume_from_path": "/no/ckpt"},
            "trainer.resume_from_path: no such checkpoint folder",
        ),
    ],
)
def test_each_bad_input_is_one_line_naming_its_key(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    tiny_model_dir: Path,
    data: Path,
    extra: dict[str, object],
    key: str,
) -> None:
    extra = {k: (str(tmp_path) if v == "TMP" else v) for k, v in extra.items()}
    if "resource_pools__train_pool" in extra:
        path = _config(tmp_path, tiny_model_dir, data)
        raw = yaml.safe_load(path.read_text())
        raw["resource_pools"]["train_pool"] = extra["resource_pools__train_pool"]
        path.write_text(yaml.safe_dump(raw))
    else:
        path = _config(tmp_path, tiny_model_dir, data, **extra)
    err = _errors(capsys, ["train", "--config", str(path)])
    assert len(err) == 1 and err[0].startswith(f"rlfleet train: {key}"), err
    assert not (tmp_path / "run" / "logs").exists()  # nothing started


def test_a_taken_metrics_port_is_one_line(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    tiny_model_dir: Path,
    data: Path,
    busy_port: int,
) -> None:
    path = _config(tmp_path, tiny_model_dir, data)
    err = _errors(capsys, ["train", "--config", str(path), "--metrics-port", str(busy_port)])
    assert err == [f"rlfleet train: --metrics-port: cannot be bound: Address already in use "
                   f"(got {busy_port})"]  # fmt: skip


@pytest.mark.parametrize("service", ["rollout", "reward", "scheduler"])
def test_serve_on_a_taken_port_is_one_line_before_loading(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, busy_port: int, service: str
) -> None:
    argv = ["serve", service, "--port", str(busy_port), "--insecure"]
    if service == "rollout":
        argv += ["--model", str(tiny_model_dir)]
    err = _errors(capsys, argv)
    assert err == [
        f"error: --port {busy_port}: cannot be bound on 127.0.0.1: Address already in use"
    ]


def test_paths_under_home_are_found_as_verls_examples_write_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_dir: Path, data: Path
) -> None:
    """``~/models/...`` and ``~/data/...`` (verl's examples) are expanded once, in the
    config: preflight finds them, and so does every service that reads the value."""
    from rlfleet.common.config import config_from_dict
    from rlfleet.launch.preflight import preflight

    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "tiny").symlink_to(tiny_model_dir)
    (home / "data").symlink_to(data)
    monkeypatch.setenv("HOME", str(home))
    config = config_from_dict(
        {
            "actor": {"model_path": "~/models/tiny"},
            "data": {"train_files": "~/data/train.parquet", "val_files": "~/data/test.parquet"},
            "trainer": {"device": "cpu", "default_local_dir": "~/run"},
            "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
        }
    )
    assert config.actor.model_path == str(home / "models" / "tiny")
    assert config.rollout.model_path == config.actor.model_path
    assert config.data.train_files == [str(home / "data" / "train.parquet")]
    assert config.trainer.default_local_dir == str(home / "run")
    assert preflight(config) == []


@pytest.mark.parametrize("service", ["trainer", "rollout"])
def test_a_model_that_cannot_load_is_one_line_naming_its_key(tmp_path: Path, service: str) -> None:
    """``models/qwen`` looks like a hub id, so preflight leaves it to the loader; when
    the loader fails (here: offline, not cached), the service says so in one line
    naming the key and exits 2, and the launcher reports that line, not a traceback."""
    import os
    import subprocess
    import sys

    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "actor": {"model_path": "models/qwen"},
                "trainer": {"device": "cpu", "default_local_dir": str(tmp_path / "run")},
            }
        )
    )
    argv = [sys.executable, "-m", f"rlfleet.{service}.server", "--config", str(cfg)]
    argv += ["--host", "127.0.0.1", "--port", "0", "--insecure"]
    if service == "rollout":
        argv += ["--metrics-port", "-1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    key = "actor.model_path" if service == "trainer" else "rollout.model_path (--model)"
    assert len(errors) == 1 and errors[0].startswith(f"error: {key}"), out.stderr[-2000:]
    assert "cannot load 'models/qwen'" in errors[0] and "Traceback" not in out.stderr


def test_the_launcher_reports_a_services_one_line_error(tmp_path: Path) -> None:
    from rlfleet.launch.cluster import LocalCluster, _Proc

    log = tmp_path / "trainer.log"
    log.write_text("INFO loading\nerror: actor.model_path: cannot load 'x': gone\n")
    proc = _Proc("trainer", "trainer", [], {}, (), None, log)
    err = LocalCluster._failure(None, proc, "exited with code 2 during start-up")  # type: ignore[arg-type]
    assert str(err).splitlines() == [
        f"trainer: exited with code 2 during start-up: actor.model_path: cannot load 'x': "
        f"gone (log: {log})"
    ]
    assert not err.bad_input  # no process seen exiting with 2
    # A service that exited with 2 after its one line refused its input: rlfleet train
    # exits 2 too, as for its own start-up errors.
    import subprocess
    import sys

    for code, bad_input in ((2, True), (1, False)):
        popen = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
        popen.wait(timeout=60)
        proc = _Proc("trainer", "trainer", [], {}, (), None, log, popen=popen)
        err = LocalCluster._failure(None, proc, f"exited with code {code} during start-up")  # type: ignore[arg-type]
        assert err.bad_input is bad_input


def test_more_start_up_problems_are_found_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    tiny_model_dir: Path,
    data: Path,
    busy_port: int,
) -> None:
    """A custom reward file without the named function (read, not run), a batch larger
    than the training data, and an OpenAI port that is taken or shared by several
    replicas: each one line naming its key, exit 2, no service started."""
    score = tmp_path / "score.py"
    score.write_text("import math\n\ndef other(*args):\n    return 0.0\n")
    cases = [
        (
            {"reward__custom_function": {"path": str(score), "name": "compute_score"}},
            "reward.custom_function.name: ",
        ),
        ({"reward__custom_function": {"path": str(score), "name": "other"}}, None),
        ({"data__train_batch_size": 64}, "data.train_batch_size: larger than the 8 rows"),
        ({"rollout__openai": {"port": busy_port}}, "rollout.openai.port: cannot be bound"),
        (
            {"rollout__openai": {"port": busy_port + 1}, "rollout__replicas": 2},
            "rollout.openai.port: a fixed port serves one replica",
        ),
    ]
    from rlfleet.common.config import load_config
    from rlfleet.launch.preflight import preflight

    for extra, key in cases:
        path = _config(tmp_path, tiny_model_dir, data, **extra)
        if key is None:  # the named function is there: nothing to say
            assert preflight(load_config(str(path))) == []
            continue
        err = _errors(capsys, ["train", "--config", str(path)])
        assert any(line.startswith(f"rlfleet train: {key}") for line in err), (extra, err)
        assert not (tmp_path / "run" / "logs").exists()


def test_a_missing_model_under_a_local_folder_is_found_before_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``models/qwen`` with a folder ``models`` here is a local path, not a hub id:
    preflight reports it missing (before any service starts) instead of leaving it to
    a hub download; with no such folder, it is still left to the loader."""
    from rlfleet.common.config import config_from_dict
    from rlfleet.launch.preflight import preflight

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    config = config_from_dict(
        {
            "actor": {"model_path": "models/qwen"},
            "trainer": {"device": "cpu", "default_local_dir": str(tmp_path / "run")},
        }
    )
    assert not [i for i in preflight(config) if i.path == "actor.model_path"]
    (tmp_path / "models").mkdir()
    [issue] = [i for i in preflight(config) if i.path == "actor.model_path"]
    assert "no such folder" in issue.message and issue.value == "models/qwen"
