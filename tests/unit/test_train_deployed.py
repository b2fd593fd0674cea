"""`rlfleet train` against services that run already (docker compose, Kubernetes): with
every service given and credentials in the environment it launches nothing and the
driver speaks with the environment's credentials and TLS."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common.auth import CredentialError, write_credential_set
from rlfleet.common.config import config_from_dict
from rlfleet.launch.train import _deployed_security

RAW = {"data": {"train_files": "x.parquet"}, "actor": {"model_path": "m"}}
ENV_NAMES = (
    "RLFLEET_CREDENTIALS",
    "RLFLEET_CREDENTIALS_JSON",
    "RLFLEET_AUTH_TOKEN",
    "RLFLEET_INSECURE",
    "RLFLEET_TLS_CERT",
    "RLFLEET_TLS_KEY",
    "RLFLEET_TLS_CA",
    "RLFLEET_TLS_REQUIRE_CLIENT_CERT",
    "RLFLEET_TLS_SERVER_NAME",
)
EVERY_SERVICE = [
    "services.trainer=127.0.0.1:1",
    "services.reward=127.0.0.1:2",
    "services.scheduler=127.0.0.1:3",
]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_environments_driver_credentials_and_tls_are_used(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secrets = write_credential_set(tmp_path / "secrets")
    ca = tmp_path / "ca.pem"
    ca.write_text("not read here\n")
    clean_env.setenv("RLFLEET_CREDENTIALS", str(secrets / "driver.json"))
    clean_env.setenv("RLFLEET_TLS_CA", str(ca))
    clean_env.setenv("RLFLEET_TLS_SERVER_NAME", "rlfleet")
    security = _deployed_security(config_from_dict(RAW, EVERY_SERVICE))
    assert security is not None and security.role == "driver"
    assert security.tls is not None
    assert security.tls.ca == str(ca) and security.tls.server_name_override == "rlfleet"


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # nothing given: LocalCluster launches everything
        EVERY_SERVICE[:2],  # no rollout replicas and no registry to find them in
        EVERY_SERVICE[1:],  # no trainer
    ],
)
def test_a_cluster_is_launched_unless_every_service_is_given(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, overrides: list[str]
) -> None:
    secrets = write_credential_set(tmp_path / "secrets")
    clean_env.setenv("RLFLEET_CREDENTIALS", str(secrets / "driver.json"))
    assert _deployed_security(config_from_dict(RAW, overrides)) is None


def test_without_credentials_in_the_environment_a_cluster_is_launched(
    clean_env: pytest.MonkeyPatch,
) -> None:
    assert _deployed_security(config_from_dict(RAW, EVERY_SERVICE)) is None


def test_unusable_credentials_are_an_error(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("RLFLEET_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(CredentialError, match=r"missing\.json"):
        _deployed_security(config_from_dict(RAW, EVERY_SERVICE))


def test_services_given_without_their_credentials_are_a_one_line_start_up_error(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Training against a running cluster (`rlfleet up`, compose) without its
    credentials: refused before anything starts or is written, naming what to set;
    a fresh credential set would only make its services refuse the driver."""
    from rlfleet.launch.preflight import preflight

    def issues(overrides: list[str]) -> list[str]:
        found = preflight(config_from_dict(RAW, overrides))
        return [str(i) for i in found if i.path.startswith("services.")]

    [line] = issues(EVERY_SERVICE)
    assert line.startswith("services.scheduler:") and "RLFLEET_CREDENTIALS" in line
    assert "\n" not in line
    [line] = issues(["services.reward=127.0.0.1:2"])  # one service given is enough
    assert line.startswith("services.reward:")
    assert issues([]) == []  # nothing given: the launcher makes the credentials
    assert issues([*EVERY_SERVICE, f"security.credentials_dir={tmp_path}"]) == []
    assert issues([*EVERY_SERVICE, "security.auth=false"]) == []
    secrets = write_credential_set(tmp_path / "secrets")
    clean_env.setenv("RLFLEET_CREDENTIALS", str(secrets / "driver.json"))
    assert issues(EVERY_SERVICE) == []
