"""The compose files ship secure (the secure-by-default issue: `deploy/docker-compose.yml`
bound 0.0.0.0 with no token and no TLS). Read as data here, in every `make test`; the
opt-in `tests/e2e/test_compose.py` runs them (`make test-compose`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RLFLEET = ("scheduler", "reward", "trainer", "rollout", "driver")


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / name).read_text(encoding="utf-8"))
    return data["services"]


def _words(value: Any) -> list[str]:
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else str(value).split()


def test_every_rlfleet_service_has_its_role_credential_and_mtls() -> None:
    services = _load("docker-compose.yml")
    for name in RLFLEET:
        env = services[name]["environment"]
        assert env["RLFLEET_CREDENTIALS"] == f"/secrets/{name}.json", name
        for key in ("RLFLEET_TLS_CERT", "RLFLEET_TLS_KEY", "RLFLEET_TLS_CA"):
            assert env[key].startswith("/secrets/tls/"), (name, key)
        assert env["RLFLEET_TLS_REQUIRE_CLIENT_CERT"] == "1", name
        mounts = services[name]["volumes"]
        assert any(v.endswith(f"/mounts/{name}:/secrets:ro") for v in mounts), name


@pytest.mark.parametrize(
    "name", ["docker-compose.yml", "docker-compose.host.yml", "docker-compose.gpu.yml"]
)
def test_no_file_turns_authentication_off_or_publishes_beyond_loopback(name: str) -> None:
    for service, spec in _load(name).items():
        words = _words(spec.get("command")) + _words(spec.get("entrypoint"))
        assert "--insecure" not in words, (name, service)
        env = spec.get("environment") or {}
        assert str(env.get("RLFLEET_INSECURE", "")) in ("", "0"), (name, service)
        for port in spec.get("ports") or ():
            assert str(port).startswith("127.0.0.1:"), (name, service, port)
