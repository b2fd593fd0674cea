"""Credential sets, the method policy and a process's security from its environment."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlfleet.common import auth
from rlfleet.common.auth import (
    ADMIN,
    METHOD_ROLES,
    Authenticator,
    CredentialError,
    Credentials,
    allowed,
    credential_set,
    generate_tokens,
    load_credentials,
    read_credential_set,
    token_digest,
    write_credential_set,
)
from rlfleet.common.roles import PRINCIPALS
from rlfleet.common.rpc import Security, init_service_security, is_loopback, tls_from_env
from rlfleet.v1 import reward_pb2, rollout_pb2, scheduler_pb2, tools_pb2, trainer_pb2


def test_a_set_has_one_distinct_token_per_role_and_files_are_private(tmp_path: Path) -> None:
    tokens = generate_tokens()
    assert set(tokens) == set(PRINCIPALS) and len(set(tokens.values())) == len(PRINCIPALS)
    root = write_credential_set(tmp_path / "s", tokens)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for role in PRINCIPALS:
        assert stat.S_IMODE((root / f"{role}.json").stat().st_mode) == 0o600
    assert (root / "observer.token").read_text() == tokens["observer"]
    assert read_credential_set(root) == tokens
    # A role's file holds its own token only: digests of the others.
    data = json.loads((root / "rollout.json").read_text())
    assert data["token"] == tokens["rollout"]
    assert tokens["driver"] not in (root / "rollout.json").read_text()
    assert data["verifiers"]["driver"] == token_digest(tokens["driver"])


def test_the_authenticator_tells_roles_apart_and_refuses_the_rest() -> None:
    tokens = generate_tokens()
    a = credential_set(tokens)["reward"].authenticator()
    for role, token in tokens.items():
        assert a.role_of(token) == role
    assert a.role_of("x" * 43) is None and a.role_of("") is None
    assert a.role_of(tokens["driver"] + "x") is None
    with pytest.raises(CredentialError):
        Authenticator({})


def test_tokens_sent_are_bound_to_the_service_called() -> None:
    """What a process sends is an HMAC of its token over the audience: each service
    tells the role from it, and it means nothing to any other audience."""
    tokens = generate_tokens()
    a = credential_set(tokens)["reward"].authenticator()
    rollout, reward = "rlfleet.v1.RolloutService", "rlfleet.v1.RewardService"
    for role, token in tokens.items():
        sent = auth.audience_token(token, rollout)
        assert len(sent) == 43 and sent != token
        assert sent != auth.audience_token(token, reward)
        assert a.role_of(sent, rollout) == role
        assert a.role_of(sent, reward) is None and a.role_of(sent) is None
        assert a.role_of(token, rollout) == role  # the token itself still works
    assert auth.method_audience("/rlfleet.v1.TrainerService/TrainStep") == (
        "rlfleet.v1.TrainerService"
    )
    assert auth.method_audience("/grpc.health.v1.Health/Check") is None
    assert auth.http_audience("/v1/chat/completions") == auth.HTTP_OPENAI
    assert auth.http_audience("/metrics") == auth.http_audience("/sd") == auth.HTTP_METRICS
    shared = Credentials.shared("a-shared-token-of-some-length").authenticator()
    sent = auth.audience_token("a-shared-token-of-some-length", reward)
    assert shared.role_of(sent, reward) == ADMIN and shared.role_of(sent, rollout) is None


def test_a_credential_file_without_audiences_says_how_to_renew_it(tmp_path: Path) -> None:
    root = write_credential_set(tmp_path / "s")
    data = json.loads((root / "rollout.json").read_text())
    old = {k: v for k, v in data.items() if k != "audiences"}
    (root / "rollout.json").write_text(json.dumps(old))
    with pytest.raises(CredentialError, match="secrets rotate"):
        load_credentials({auth.CREDENTIALS_ENV: str(root / "rollout.json")})
    forged = dict(data)
    forged["audiences"] = {a: dict(v) for a, v in data["audiences"].items()}
    forged["audiences"][auth.HTTP_METRICS]["rollout"] = "0" * 64
    (root / "rollout.json").write_text(json.dumps(forged))
    with pytest.raises(CredentialError, match="does not match audiences"):
        load_credentials({auth.CREDENTIALS_ENV: str(root / "rollout.json")})


def test_every_method_of_every_service_has_a_policy() -> None:
    methods = {
        f"/rlfleet.v1.{svc.name}/{m.name}"
        for module in (rollout_pb2, reward_pb2, trainer_pb2, scheduler_pb2, tools_pb2)
        for svc in module.DESCRIPTOR.services_by_name.values()
        for m in svc.methods
    }
    assert methods == set(METHOD_ROLES), methods ^ set(METHOD_ROLES)
    assert all(roles <= set(PRINCIPALS) for roles in METHOD_ROLES.values())


def test_least_privilege() -> None:
    trainer = "/rlfleet.v1.TrainerService/"
    rollout = "/rlfleet.v1.RolloutService/"
    sched = "/rlfleet.v1.SchedulerService/"
    assert allowed("driver", trainer + "PushWeights")
    for role in ("trainer", "rollout", "reward", "scheduler", "observer"):
        for m in ("PushWeights", "LoadCheckpoint", "SaveCheckpoint", "TrainStep"):
            assert not allowed(role, trainer + m), (role, m)
        assert allowed(role, trainer + "GetStatus")
    for m in ("UpdateWeights", "OpenWeightTransfer", "Sleep", "WakeUp"):
        assert {r for r in PRINCIPALS if allowed(r, rollout + m)} == {"trainer", "driver"}
    assert {r for r in PRINCIPALS if allowed(r, sched + "SetTrainingStatus")} == {"driver"}
    assert not allowed("observer", sched + "Register")
    assert not allowed("observer", "/rlfleet.v1.RewardService/Score")
    assert allowed("observer", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    assert not allowed("driver", "/some.Other/Method") and allowed(ADMIN, "/some.Other/Method")


def test_credentials_from_the_environment(tmp_path: Path) -> None:
    root = write_credential_set(tmp_path / "s")
    creds = load_credentials({auth.CREDENTIALS_ENV: str(root / "trainer.json")})
    assert creds is not None and creds.role == "trainer"
    inline = load_credentials({auth.CREDENTIALS_JSON_ENV: json.dumps(creds.to_json())})
    assert inline == Credentials(
        creds.role, creds.token, creds.verifiers, auth.CREDENTIALS_JSON_ENV, creds.audiences
    )
    shared = load_credentials({auth.SHARED_TOKEN_ENV: "s3cret"})
    assert shared is not None and shared.role == ADMIN
    assert load_credentials({}) is None
    assert "token" not in repr(creds) or creds.token not in repr(creds)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("not json", "not JSON"),
        ('{"role": "king", "token": "x", "verifiers": {}}', "role must be"),
        ('{"role": "driver", "token": "short", "verifiers": {}}', "at least 16"),
        ('{"role": "driver", "token": "' + "a" * 20 + '", "verifiers": {}}', "non-empty"),
        (
            '{"role": "driver", "token": "' + "a" * 20 + '", "verifiers": {"driver": "00"}}',
            "SHA-256",
        ),
        (
            '{"role": "driver", "token": "'
            + "a" * 20
            + '", "verifiers": {"driver": "'
            + "0" * 64
            + '"}}',
            "does not match",
        ),
    ],
)
def test_bad_credential_files_say_what_is_wrong(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(CredentialError, match=match):
        load_credentials({auth.CREDENTIALS_ENV: str(path)})
    with pytest.raises(CredentialError, match="cannot read"):
        load_credentials({auth.CREDENTIALS_ENV: str(tmp_path / "missing.json")})


def _args(**kw: object) -> SimpleNamespace:
    base = {"insecure": False, "tls_cert": None, "tls_key": None, "tls_ca": None}
    return SimpleNamespace(**{**base, "tls_require_client_cert": False, **kw})


def test_a_service_without_credentials_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (auth.CREDENTIALS_ENV, auth.CREDENTIALS_JSON_ENV, auth.SHARED_TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(auth.INSECURE_ENV, raising=False)
    with pytest.raises(CredentialError, match="--insecure"):
        Security.from_env(dict(os.environ))
    # --insecure works on loopback only.
    from rlfleet.common.rpc import current_security, set_security

    before = current_security()
    try:
        sec = init_service_security(_args(insecure=True), what="t", host="127.0.0.1")
        assert sec.insecure and sec.credentials is None
        with pytest.raises(CredentialError, match="beyond loopback"):
            init_service_security(_args(insecure=True), what="t", host="0.0.0.0")
    finally:
        set_security(before)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")


def test_tls_from_env_checks_pairs_and_files(tmp_path: Path) -> None:
    assert tls_from_env({}) is None
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(CredentialError, match="go together"):
        tls_from_env({auth.TLS_ENV["cert"]: str(cert)})
    with pytest.raises(CredentialError, match="no such file"):
        tls_from_env({auth.TLS_ENV["ca"]: str(tmp_path / "nope.pem")})
    with pytest.raises(CredentialError, match="needs"):
        tls_from_env({auth.TLS_ENV["cert"]: str(cert), auth.TLS_ENV["key"]: str(cert),
                      auth.TLS_ENV["require_client_cert"]: "1"})  # fmt: skip
    tls = tls_from_env({auth.TLS_ENV["ca"]: str(cert), auth.TLS_ENV["server_name"]: "rlfleet"})
    assert tls is not None and tls.server_name_override == "rlfleet"
    sec = Security(credentials=None, tls=tls, insecure=True)
    assert sec.tls_env() == {auth.TLS_ENV["ca"]: str(cert), auth.TLS_ENV["server_name"]: "rlfleet"}


def test_the_agent_role_reaches_the_openai_endpoint_and_its_trajectories_only(
    tmp_path: Path,
) -> None:
    from rlfleet.common.auth import OPENAI_ENDPOINT_ROLES

    tokens = generate_tokens()
    root = write_credential_set(tmp_path / "s", tokens)
    assert (root / "agent.token").read_text() == tokens["agent"]
    assert stat.S_IMODE((root / "agent.token").stat().st_mode) == 0o600
    agent_may = sorted(m for m in METHOD_ROLES if allowed("agent", m))
    assert agent_may == [
        "/rlfleet.v1.RewardService/GetInfo",
        "/rlfleet.v1.RolloutService/GetStatus",
        "/rlfleet.v1.RolloutService/GetTrajectories",
        "/rlfleet.v1.SchedulerService/GetPlacement",
        "/rlfleet.v1.SchedulerService/GetScale",
        "/rlfleet.v1.SchedulerService/GetTrainingStatus",
        "/rlfleet.v1.SchedulerService/ListServices",
        "/rlfleet.v1.TrainerService/GetStatus",
    ]  # reads, and its own sessions: no Generate, no weights, no PopTrajectories
    assert allowed("driver", "/rlfleet.v1.RolloutService/PopTrajectories")
    assert {"agent", "driver"} == OPENAI_ENDPOINT_ROLES


def test_a_set_written_before_the_agent_role_still_reads(tmp_path: Path) -> None:
    tokens = generate_tokens()
    root = write_credential_set(tmp_path / "old", tokens)
    (root / "agent.json").unlink()
    (root / "agent.token").unlink()
    old = read_credential_set(root)
    assert old == {r: t for r, t in tokens.items() if r != "agent"}
    creds = credential_set(old)
    assert creds["rollout"].authenticator().role_of(tokens["agent"]) is None
    (root / "driver.json").unlink()  # the roles that were always there stay required
    with pytest.raises(CredentialError):
        read_credential_set(root)


def test_turning_authentication_off_is_loud_and_never_implicit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No credentials and no --insecure: refused, naming both ways out; --insecure (or
    RLFLEET_INSECURE=1): allowed, with a warning that says what anyone may then do."""
    import logging

    from rlfleet.common.auth import CredentialError
    from rlfleet.common.rpc import Security

    with pytest.raises(CredentialError, match="--insecure"):
        Security.from_env({}, what="rlfleet serve reward")
    for env, flag in (({}, True), ({"RLFLEET_INSECURE": "1"}, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            security = Security.from_env(env, insecure=flag, what="rlfleet serve reward")
        assert security.insecure and security.credentials is None
        [record] = [r for r in caplog.records if "AUTHENTICATION IS OFF" in r.getMessage()]
        assert record.levelno == logging.WARNING
        assert "rlfleet serve reward" in record.getMessage()


def test_tls_flags_map_onto_the_environment_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every TLS setting is one flag and one variable: --tls-server-name included."""
    import argparse

    from rlfleet.common.rpc import add_security_arguments, security_from_args

    for name in ("CERT", "KEY", "CA", "SERVER_NAME", "REQUIRE_CLIENT_CERT"):
        monkeypatch.delenv(f"RLFLEET_TLS_{name}", raising=False)
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    parser = argparse.ArgumentParser()
    add_security_arguments(parser)
    args = parser.parse_args(["--insecure", "--tls-ca", str(ca), "--tls-server-name", "rlfleet"])
    tls = security_from_args(args, what="test").tls
    assert tls is not None and tls.ca == str(ca) and tls.server_name_override == "rlfleet"
