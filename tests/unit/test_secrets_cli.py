"""`rlfleet secrets init / rotate`: a credential set per cluster, private files, and a
rotation after which the old tokens open nothing."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from rlfleet.cli import main
from rlfleet.common.auth import _read_file, read_credential_set
from rlfleet.common.roles import PRINCIPALS


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_init_writes_private_files_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "secrets"
    assert main(["secrets", "init", "--dir", str(root)]) == 0
    assert _mode(root) == 0o700
    for role in PRINCIPALS:
        assert _mode(root / f"{role}.json") == 0o600, role
    tokens = read_credential_set(root)
    assert set(tokens) == set(PRINCIPALS) and len(set(tokens.values())) == len(PRINCIPALS)
    assert main(["secrets", "init", "--dir", str(root)]) == 1
    assert "rotate" in capsys.readouterr().err
    assert main(["secrets", "init", "--dir", str(root), "--if-missing"]) == 0
    assert read_credential_set(root) == tokens


def test_rotate_replaces_every_token_and_the_old_ones_open_nothing(tmp_path: Path) -> None:
    root = tmp_path / "secrets"
    assert main(["secrets", "init", "--dir", str(root)]) == 0
    old = read_credential_set(root)
    assert main(["secrets", "rotate", "--dir", str(root)]) == 0
    new = read_credential_set(root)
    assert set(new) == set(old) and not set(new.values()) & set(old.values())
    # What a service restarted on its rotated file accepts.
    authenticator = _read_file(root / "trainer.json").authenticator()
    assert authenticator.role_of(new["driver"]) == "driver"
    assert all(authenticator.role_of(token) is None for token in old.values())
    for role in PRINCIPALS:
        assert _mode(root / f"{role}.json") == 0o600, role


def test_rotate_without_a_set_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["secrets", "rotate", "--dir", str(tmp_path / "none")]) == 1
    assert "rlfleet secrets init" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
