"""Who may call what: per-role credentials, the method policy, and the process's security.

A cluster has one *credential set*: a random bearer token per role
(:data:`PRINCIPALS`). Each process gets the file of its own role only::

    <secrets dir>/            mode 0700, made by `rlfleet secrets init` or a launcher
      driver.json             {"role": "driver", "token": "...", "verifiers": {...}}
      trainer.json  rollout.json  reward.json  scheduler.json  observer.json  agent.json
      tools.json
      observer.token          the observer's bare token (Prometheus' credentials_file)
      agent.token             the agent's bare token (an OpenAI client's api_key)

``verifiers`` maps every role to the SHA-256 of that role's token, so a service can
tell which role a caller holds without being able to act as any role but its own:
a rollout replica that is broken into cannot mint the driver's token.

**Tokens bound to an audience.** A process never sends its token itself. On every
call it sends :func:`audience_token`: an HMAC of its token over the *audience*, the
gRPC service called (``rlfleet.v1.RolloutService``, ...) or the HTTP endpoint
(:data:`HTTP_METRICS`, :data:`HTTP_OPENAI`). ``audiences`` in each file holds the
SHA-256 of every role's token for every audience, so a server tells the role of an
audience token as it does of a token. The driver and the trainer dial addresses the
scheduler's registry lists, which anyone holding the rollout credential can fill:
what such a fake replica receives is good for the rollout service's methods only
(where that credential already reaches), never for the scheduler, the trainer or
the reward service. Servers also take a role's token itself, for tools outside
rlfleet (``grpcurl``, Prometheus' ``observer.token``, an agent's ``agent.token``).

A process finds its credentials in the environment, never on its command line
(where ``ps`` shows them):

* ``RLFLEET_CREDENTIALS``: path of its role's JSON file;
* ``RLFLEET_CREDENTIALS_JSON``: the same JSON inline (Ray actors, Kubernetes secrets);
* ``RLFLEET_AUTH_TOKEN`` (legacy): one shared token; whoever holds it has every role
  (:data:`ADMIN`). Operators who run a single service for other systems use this.

Running without authentication takes an explicit ``--insecure`` (or
``RLFLEET_INSECURE=1``) and logs a warning; a server that finds no credentials and
was not told so refuses to start.

The policy (:data:`METHOD_ROLES`) says which roles may call each method; methods
not listed are refused to all but :data:`ADMIN`. Health checks stay open (probes
reveal only serving status). Ownership rules that depend on the request (a replica
may only register itself, only the registrant may deregister) live in the
servicers, which read the caller's role with :func:`caller_role`.

Nothing here imports torch or grpc.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "ADMIN",
    "ALL_ROLES",
    "AUDIENCES",
    "CREDENTIALS_ENV",
    "CREDENTIALS_JSON_ENV",
    "HTTP_METRICS",
    "HTTP_OPENAI",
    "INSECURE_ENV",
    "METHOD_ROLES",
    "OPENAI_ENDPOINT_ROLES",
    "SHARED_TOKEN_ENV",
    "TLS_ENV",
    "TLS_SERVER_NAME",
    "Authenticator",
    "CredentialError",
    "Credentials",
    "allowed",
    "audience_token",
    "caller_role",
    "credential_set",
    "credentials_env",
    "credentials_in_env",
    "generate_tokens",
    "http_audience",
    "load_credentials",
    "method_audience",
    "read_credential_set",
    "token_digest",
    "using_caller",
    "write_credential_set",
]

from rlfleet.common.roles import PRINCIPALS

logger = logging.getLogger(__name__)

ADMIN = "admin"
"""The role of a shared token (``RLFLEET_AUTH_TOKEN``): every method."""

ALL_ROLES: frozenset[str] = frozenset(PRINCIPALS)

CREDENTIALS_ENV = "RLFLEET_CREDENTIALS"
CREDENTIALS_JSON_ENV = "RLFLEET_CREDENTIALS_JSON"
SHARED_TOKEN_ENV = "RLFLEET_AUTH_TOKEN"
INSECURE_ENV = "RLFLEET_INSECURE"
TLS_ENV = {
    "cert": "RLFLEET_TLS_CERT",
    "key": "RLFLEET_TLS_KEY",
    "ca": "RLFLEET_TLS_CA",
    "require_client_cert": "RLFLEET_TLS_REQUIRE_CLIENT_CERT",
    "server_name": "RLFLEET_TLS_SERVER_NAME",
}
TLS_SERVER_NAME = "rlfleet"
"""A name `rlfleet secrets tls` puts in every certificate (see RLFLEET_TLS_SERVER_NAME)."""
"""Environment variables of the TLS material every service and client reads."""

_CALLERS = frozenset({"driver", "trainer", "rollout"})
_WORKERS = frozenset({"rollout", "reward", "trainer", "driver"})

# Full gRPC method name -> roles allowed (ADMIN is always allowed).
METHOD_ROLES: dict[str, frozenset[str]] = {
    # Rollout: the driver asks for generations; weights and sleep come from the
    # trainer (or the driver when it pushes through the trainer's client).
    "/rlfleet.v1.RolloutService/Generate": frozenset({"driver"}),
    "/rlfleet.v1.RolloutService/UpdateWeights": frozenset({"trainer", "driver"}),
    "/rlfleet.v1.RolloutService/OpenWeightTransfer": frozenset({"trainer", "driver"}),
    "/rlfleet.v1.RolloutService/CommitWeightTransfer": frozenset({"trainer", "driver"}),
    "/rlfleet.v1.RolloutService/AbortWeightTransfer": frozenset({"trainer", "driver"}),
    "/rlfleet.v1.RolloutService/Sleep": frozenset({"trainer", "driver"}),
    "/rlfleet.v1.RolloutService/WakeUp": frozenset({"trainer", "driver"}),
    "/rlfleet.v1.RolloutService/GetStatus": ALL_ROLES,
    # Trajectories recorded by the OpenAI endpoint: the driver takes finished ones to
    # train on; an agent may read sessions back (it knows their ids).
    "/rlfleet.v1.RolloutService/GetTrajectories": frozenset({"driver", "agent"}),
    "/rlfleet.v1.RolloutService/PopTrajectories": frozenset({"driver"}),
    # Reward: text in, scores out, for whoever trains or generates.
    "/rlfleet.v1.RewardService/Score": _CALLERS,
    "/rlfleet.v1.RewardService/ScoreStream": _CALLERS,
    "/rlfleet.v1.RewardService/GetInfo": ALL_ROLES,
    # Trainer: only the driver trains, saves, loads and pushes.
    **{
        f"/rlfleet.v1.TrainerService/{m}": frozenset({"driver"})
        for m in (
            "ComputeLogProb",
            "ComputeRefLogProb",
            "ComputeValues",
            "ComputeAdvantage",
            "UpdateCritic",
            "UpdateActor",
            "TrainStep",
            "SFTStep",
            "SaveCheckpoint",
            "LoadCheckpoint",
            "PushWeights",
            "SetLRScale",
        )
    },
    "/rlfleet.v1.TrainerService/GetStatus": ALL_ROLES,
    # Scheduler: services register themselves (the launcher, as driver, registers
    # those that cannot); the servicer checks role against the entry and ownership.
    "/rlfleet.v1.SchedulerService/Register": _WORKERS,
    "/rlfleet.v1.SchedulerService/Heartbeat": _WORKERS,
    "/rlfleet.v1.SchedulerService/Deregister": _WORKERS,
    "/rlfleet.v1.SchedulerService/ListServices": ALL_ROLES,
    "/rlfleet.v1.SchedulerService/Plan": frozenset({"driver"}),
    "/rlfleet.v1.SchedulerService/GetPlacement": ALL_ROLES,
    "/rlfleet.v1.SchedulerService/GetTrainingStatus": ALL_ROLES,
    "/rlfleet.v1.SchedulerService/SetTrainingStatus": frozenset({"driver"}),
    "/rlfleet.v1.SchedulerService/SetScale": frozenset({"driver"}),
    "/rlfleet.v1.SchedulerService/GetScale": ALL_ROLES,
    # Tools: rollout replicas call them during multi-turn rollouts (the driver too,
    # for in-process rollouts and tests); every cluster role may list them (not an
    # external agent: it reaches the OpenAI endpoint and its sessions only).
    "/rlfleet.v1.ToolService/ListTools": ALL_ROLES - {"agent"},
    "/rlfleet.v1.ToolService/CallTool": frozenset({"rollout", "driver"}),
}

#: Roles that may use a rollout replica's OpenAI-compatible HTTP endpoint (generate,
#: list models, finish sessions with a reward); :data:`ADMIN` too.
OPENAI_ENDPOINT_ROLES: frozenset[str] = frozenset({"agent", "driver"})

_REFLECTION_PREFIX = "/grpc.reflection."

HTTP_METRICS = "http:metrics"
"""The audience of every service's ``/metrics`` and the scheduler's ``/sd``."""
HTTP_OPENAI = "http:openai"
"""The audience of a rollout replica's OpenAI-compatible endpoint."""

#: What a token can be bound to: each gRPC service of the cluster (reflection too)
#: and each kind of HTTP endpoint. A caller of anything else (health checks, open to
#: all) sends no token.
AUDIENCES: tuple[str, ...] = (
    "rlfleet.v1.SchedulerService",
    "rlfleet.v1.RolloutService",
    "rlfleet.v1.RewardService",
    "rlfleet.v1.TrainerService",
    "rlfleet.v1.ToolService",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
    HTTP_METRICS,
    HTTP_OPENAI,
)


def method_audience(method: str) -> str | None:
    """The audience of a full gRPC method name (``/pkg.Service/Method``), or None."""
    service = method[1:].split("/", 1)[0] if method.startswith("/") else ""
    return service if service in AUDIENCES else None


def http_audience(path: str) -> str:
    """The audience of an HTTP path on an rlfleet endpoint."""
    return HTTP_OPENAI if path == "/v1" or path.startswith("/v1/") else HTTP_METRICS


def audience_token(token: str, audience: str) -> str:
    """What a holder of ``token`` sends to ``audience``: base64url of
    HMAC-SHA256(token, audience), 43 characters. Good at that audience only."""
    mac = hmac.new(token.encode(), b"rlfleet audience " + audience.encode(), hashlib.sha256)
    return base64.urlsafe_b64encode(mac.digest()).rstrip(b"=").decode()


def _audience_verifiers(tokens: Mapping[str, str]) -> dict[str, dict[str, str]]:
    return {
        a: {role: token_digest(audience_token(t, a)) for role, t in tokens.items()}
        for a in AUDIENCES
    }


def allowed(role: str, method: str) -> bool:
    """Whether ``role`` may call the full gRPC ``method`` (``/pkg.Service/Method``)."""
    if role == ADMIN:
        return True
    if method.startswith(_REFLECTION_PREFIX):
        return role in ALL_ROLES
    roles = METHOD_ROLES.get(method)
    return roles is not None and role in roles


class CredentialError(ValueError):
    """Credentials are missing, unreadable or malformed; the message says which and where."""


def token_digest(token: str) -> str:
    """SHA-256 hex of a token: what a verifier stores instead of the token."""
    return hashlib.sha256(token.encode()).hexdigest()


def _check_token(token: Any, where: str) -> str:
    if (
        not isinstance(token, str)
        or len(token) < 16
        or not token.isascii()
        or not token.isprintable()
        or " " in token
    ):
        raise CredentialError(
            f"{where}: a token must be at least 16 printable ASCII characters without spaces"
        )
    return token


class Authenticator:
    """Maps a presented bearer token to the role it belongs to (constant time per role).

    Args:
        verifiers: role -> :func:`token_digest` of that role's token.
        audiences: audience -> role -> :func:`token_digest` of that role's
            :func:`audience_token` for the audience.
    """

    def __init__(
        self,
        verifiers: Mapping[str, str],
        audiences: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        if not verifiers:
            raise CredentialError("an authenticator needs at least one verifier")
        self._verifiers = {role: bytes.fromhex(d) for role, d in verifiers.items()}
        self._audiences = {
            a: {role: bytes.fromhex(d) for role, d in by_role.items()}
            for a, by_role in (audiences or {}).items()
        }

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self._verifiers)

    def role_of(self, token: str | bytes, audience: str | None = None) -> str | None:
        """The role whose token this is, or whose token for ``audience`` it is; None
        for neither. Every verifier is compared."""
        raw = token.encode() if isinstance(token, str) else bytes(token)
        digest = hashlib.sha256(raw).digest()
        found = None
        bound = self._audiences.get(audience, {}) if audience is not None else {}
        for verifiers in (self._verifiers, bound):
            for role, expected in verifiers.items():
                if hmac.compare_digest(digest, expected):
                    found = role
        return found


@dataclasses.dataclass(frozen=True)
class Credentials:
    """One process's credentials: its own role and token, and who may call it.

    Attributes:
        role: the role this process acts as (:data:`PRINCIPALS` or :data:`ADMIN`).
        token: bearer token it presents on outgoing calls.
        verifiers: role -> token digest of every role its servers accept.
        source: where they were read from (for messages; never the token).
        audiences: audience -> role -> digest of that role's :func:`audience_token`.
    """

    role: str
    token: str = dataclasses.field(repr=False)
    verifiers: Mapping[str, str]
    source: str = ""
    audiences: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)

    def authenticator(self) -> Authenticator:
        return Authenticator(self.verifiers, self.audiences)

    @classmethod
    def shared(cls, token: str, source: str = SHARED_TOKEN_ENV) -> Credentials:
        """A single shared token: every holder is :data:`ADMIN`."""
        if not token or not token.isascii() or not token.isprintable() or " " in token:
            raise CredentialError(f"{source}: the token must be printable ASCII without spaces")
        return cls(
            role=ADMIN,
            token=token,
            verifiers={ADMIN: token_digest(token)},
            source=source,
            audiences=_audience_verifiers({ADMIN: token}),
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str) -> Credentials:
        role = data.get("role")
        if role not in PRINCIPALS and role != ADMIN:
            raise CredentialError(f"{source}: role must be one of {PRINCIPALS}, got {role!r}")
        token = _check_token(data.get("token"), f"{source}: token")
        verifiers = data.get("verifiers")
        if not isinstance(verifiers, Mapping) or not verifiers:
            raise CredentialError(f"{source}: verifiers must be a non-empty object")
        for r, d in verifiers.items():
            if r not in PRINCIPALS and r != ADMIN:
                raise CredentialError(f"{source}: verifiers: unknown role {r!r}")
            if not isinstance(d, str) or len(d) != 64:
                raise CredentialError(f"{source}: verifiers.{r}: not a SHA-256 hex digest")
            try:
                bytes.fromhex(d)
            except ValueError as e:
                raise CredentialError(f"{source}: verifiers.{r}: {e}") from e
        if verifiers.get(role) != token_digest(token):
            raise CredentialError(f"{source}: the token does not match verifiers.{role}")
        audiences = _read_audiences(data.get("audiences"), verifiers, str(role), token, source)
        return cls(
            role=str(role),
            token=token,
            verifiers=dict(verifiers),
            source=source,
            audiences=audiences,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "token": self.token,
            "verifiers": dict(self.verifiers),
            "audiences": {a: dict(v) for a, v in self.audiences.items()},
        }


def _read_audiences(
    audiences: Any, verifiers: Mapping[str, Any], role: str, token: str, source: str
) -> dict[str, dict[str, str]]:
    """The ``audiences`` of a credential file, checked: every audience, the roles of
    ``verifiers``, digests, and this role's own entries matching its token."""
    if audiences is None:
        raise CredentialError(
            f"{source}: no 'audiences' (a credential set made by an older rlfleet): "
            "`rlfleet secrets rotate --dir DIR` rewrites it"
        )
    if not isinstance(audiences, Mapping) or set(audiences) != set(AUDIENCES):
        raise CredentialError(f"{source}: audiences must be an object with keys {AUDIENCES}")
    checked: dict[str, dict[str, str]] = {}
    for a, by_role in audiences.items():
        if not isinstance(by_role, Mapping) or set(by_role) != set(verifiers):
            raise CredentialError(f"{source}: audiences.{a}: one digest per role of verifiers")
        for r, d in by_role.items():
            try:
                if not isinstance(d, str) or len(bytes.fromhex(d)) != 32:
                    raise ValueError("not 32 bytes")
            except ValueError as e:
                raise CredentialError(
                    f"{source}: audiences.{a}.{r}: not a SHA-256 hex digest"
                ) from e
        if by_role[role] != token_digest(audience_token(token, a)):
            raise CredentialError(f"{source}: the token does not match audiences.{a}.{role}")
        checked[a] = dict(by_role)
    return checked


def generate_tokens() -> dict[str, str]:
    """A fresh credential set: 256 random bits per role."""
    return {role: secrets.token_urlsafe(32) for role in PRINCIPALS}


def credential_set(tokens: Mapping[str, str]) -> dict[str, Credentials]:
    """Role -> :class:`Credentials` of a token set (each verifying every role)."""
    verifiers = {role: token_digest(t) for role, t in tokens.items()}
    audiences = _audience_verifiers(tokens)
    return {
        role: Credentials(role=role, token=t, verifiers=verifiers, source=role, audiences=audiences)
        for role, t in tokens.items()
    }


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_credential_set(directory: str | Path, tokens: Mapping[str, str] | None = None) -> Path:
    """Write a credential set into ``directory`` (mode 0700, files 0600); returns it.

    One ``<role>.json`` per role (give each process its own) and
    ``observer.token`` and ``agent.token`` (bare tokens: Prometheus' credentials
    file, an agent's ``OPENAI_API_KEY``).
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    creds = credential_set(tokens or generate_tokens())
    for role, c in creds.items():
        _write_private(root / f"{role}.json", json.dumps(c.to_json(), indent=1) + "\n")
    for bare in ("observer", "agent"):  # bare tokens: Prometheus, OPENAI_API_KEY
        if bare in creds:
            _write_private(root / f"{bare}.token", creds[bare].token)
    return root


#: Principals added after credential sets were first written: a set without them
#: still reads (nobody can act as them until `rlfleet secrets rotate` adds them).
_LATER_PRINCIPALS = frozenset({"agent", "tools"})


def read_credential_set(directory: str | Path) -> dict[str, str]:
    """Role -> token of a set written by :func:`write_credential_set`."""
    root = Path(directory)
    tokens = {}
    for role in PRINCIPALS:
        path = root / f"{role}.json"
        if role in _LATER_PRINCIPALS and not path.exists():
            logger.warning(
                "%s has no %s: no %s can authenticate (`rlfleet secrets rotate --dir %s` adds it)",
                root,
                path.name,
                role,
                root,
            )
            continue
        tokens[role] = _read_file(path).token
    return tokens


def _read_file(path: Path) -> Credentials:
    source = str(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise CredentialError(f"{CREDENTIALS_ENV}={source}: cannot read: {e.strerror}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CredentialError(f"{source}: not JSON: {e}") from e
    if not isinstance(data, dict):
        raise CredentialError(f"{source}: expected a JSON object")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        logger.warning("%s is readable by group or others (mode %03o); chmod 600 it", source, mode)
    return Credentials.from_json(data, source)


def load_credentials(env: Mapping[str, str] | None = None) -> Credentials | None:
    """This process's credentials from the environment, or None when there are none.

    Raises:
        CredentialError: a variable is set but its credentials are unusable.
    """
    env = os.environ if env is None else env
    path = env.get(CREDENTIALS_ENV)
    if path:
        return _read_file(Path(path))
    inline = env.get(CREDENTIALS_JSON_ENV)
    if inline:
        try:
            data = json.loads(inline)
        except json.JSONDecodeError as e:
            raise CredentialError(f"{CREDENTIALS_JSON_ENV}: not JSON: {e}") from e
        if not isinstance(data, dict):
            raise CredentialError(f"{CREDENTIALS_JSON_ENV}: expected a JSON object")
        return Credentials.from_json(data, CREDENTIALS_JSON_ENV)
    shared = env.get(SHARED_TOKEN_ENV)
    if shared:
        return Credentials.shared(shared)
    return None


def credentials_in_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment names credentials (any variable :func:`load_credentials`
    reads), usable or not."""
    env = os.environ if env is None else env
    return any(env.get(n) for n in (CREDENTIALS_ENV, CREDENTIALS_JSON_ENV, SHARED_TOKEN_ENV))


def credentials_env(creds: Credentials) -> dict[str, str]:
    """Environment that hands ``creds`` to a child process (inline, never argv)."""
    return {CREDENTIALS_JSON_ENV: json.dumps(creds.to_json())}


# ------------------------------------------------------------------ the caller

_CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlfleet_caller", default=None)


def caller_role() -> str | None:
    """The authenticated role of the gRPC call being handled (None: auth is off)."""
    return _CALLER.get()


@contextlib.contextmanager
def using_caller(role: str | None) -> Iterator[None]:
    """Run a block as if handling a call from ``role`` (the auth interceptor uses this)."""
    token = _CALLER.set(role)
    try:
        yield
    finally:
        _CALLER.reset(token)
