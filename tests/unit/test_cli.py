"""The `rlfleet` console script: installed, lists its subcommands, fails clearly."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet import __version__
from rlfleet.cli import SUBCOMMANDS, main


def _script() -> str:
    found = shutil.which("rlfleet", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("the rlfleet console script is not installed next to this interpreter")
    return found


def test_console_script_lists_every_subcommand() -> None:
    out = subprocess.run([_script(), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in SUBCOMMANDS:
        assert name in out.stdout


def test_version() -> None:
    out = subprocess.run([_script(), "--version"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"rlfleet {__version__}"


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_unknown_command_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2
    assert "no-such-command" in capsys.readouterr().err


def test_overrides_go_anywhere_on_the_line(capsys: pytest.CaptureFixture[str]) -> None:
    """As with Hydra, `key=value` after a flag is an override too; a stray flag is not."""
    example = Path(__file__).resolve().parents[2] / "examples" / "arithmetic_ppo.yaml"
    code = main([
        "train", "--config", str(example), "actor.model_path=/nowhere/a",
        "--in-process", "data.train_files=/nowhere/b.parquet",
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "'/nowhere/a'" in err and "'/nowhere/b.parquet'" in err
    with pytest.raises(SystemExit):
        main(["train", "--config", str(example), "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


_WRITES_A_LOT = """
import sys
from rlfleet import cli
real = cli._load
def load(module, attr):
    if attr != "run":
        return real(module, attr)
    def run(args):
        for _ in range(200_000):
            print("x" * 100)
        return 0
    return run
cli._load = load
sys.exit(cli.main(["status"]))
"""


def test_a_reader_that_goes_away_ends_a_command_quietly() -> None:
    """`rlfleet reward score ... | head`: the pipe closes early; no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITES_A_LOT],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10) == b"x" * 10
    proc.stdout.close()  # as head does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err, err
