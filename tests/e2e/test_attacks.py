"""The attacks of the secure-by-default issue, each against a cluster started as
`rlfleet train` starts one (``LocalCluster`` with the default config: auth on, a
fresh credential set, every service its role's file), each of which must fail.

The attacker is this test: first with no token or a wrong one (someone who only
reaches the ports), then with a *stolen role token* (least privilege: a broken-into
rollout replica or a read-only observer must not get further). Addresses are
plain strings; nothing but 127.0.0.1 is ever dialed.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rlfleet.common.auth import read_credential_set
from rlfleet.common.config import config_from_dict
from rlfleet.common.rpc import Security, create_channel, using_security
from rlfleet.launch.cluster import ClusterHandle, LocalCluster
from rlfleet.v1 import (
    rollout_pb2,
    rollout_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

pytestmark = pytest.mark.timeout(300)

NO_AUTH = Security(credentials=None, insecure=True)


@pytest.fixture(scope="module")
def cluster(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ClusterHandle, dict[str, str]]]:
    run = tmp_path_factory.mktemp("attacks") / "run"
    config = config_from_dict(
        {
            "actor": {"model_path": str(tiny_model_dir)},
            "trainer": {"device": "cpu", "default_local_dir": str(run)},
            "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
        }
    )
    assert config.security.auth  # the default
    with LocalCluster(config, run, heartbeat_interval_s=0.5) as c:
        handle = c.start(timeout_s=180)
        yield handle, read_credential_set(handle.credentials_dir)


def _channel(address: str, token: str | None) -> grpc.Channel:
    if token is None:
        return create_channel(address, security=NO_AUTH, retry_unavailable=False)
    return create_channel(address, auth_token=token, retry_unavailable=False)


def _code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    code: grpc.StatusCode = info.value.code()
    return code


def _as(address: str, token: str | None, stub_cls: Any) -> Any:
    return stub_cls(_channel(address, token))


ATTACKERS = [None, "not-a-token-0123456789abcdef"]


@pytest.mark.parametrize("token", ATTACKERS)
def test_strangers_are_refused_everywhere(
    cluster: tuple[ClusterHandle, dict[str, str]], token: str | None
) -> None:
    h, _ = cluster
    trainer = _as(h.trainer, token, trainer_pb2_grpc.TrainerServiceStub)
    rollout = _as(h.rollout[0], token, rollout_pb2_grpc.RolloutServiceStub)
    sched = _as(h.scheduler or "", token, scheduler_pb2_grpc.SchedulerServiceStub)
    unauth = grpc.StatusCode.UNAUTHENTICATED
    calls = {
        # run code on the trainer / write and delete its files / steal the model
        "LoadCheckpoint": lambda: trainer.LoadCheckpoint(
            trainer_pb2.LoadCheckpointRequest(path="/tmp/evil.pt"), timeout=10
        ),
        "SaveCheckpoint": lambda: trainer.SaveCheckpoint(
            trainer_pb2.SaveCheckpointRequest(path="../../elsewhere"), timeout=10
        ),
        "PushWeights": lambda: trainer.PushWeights(
            trainer_pb2.PushWeightsRequest(
                targets=[trainer_pb2.RolloutTarget(address="127.0.0.1:9")]
            ),
            timeout=10,
        ),
        # break replicas
        "Sleep": lambda: rollout.Sleep(rollout_pb2.SleepRequest(level=1), timeout=10),
        "UpdateWeights": lambda: rollout.UpdateWeights(
            iter([rollout_pb2.WeightChunk(version=2**63)]), timeout=10
        ),
        # poison training / rewrite the registry
        "Register": lambda: sched.Register(
            scheduler_pb2.RegisterRequest(
                info=scheduler_pb2.ServiceInfo(
                    role=scheduler_pb2.ROLE_ROLLOUT, address="127.0.0.1:9"
                )
            ),
            timeout=10,
        ),
        "Deregister": lambda: sched.Deregister(
            scheduler_pb2.DeregisterRequest(service_id="rollout-1"), timeout=10
        ),
        "SetTrainingStatus": lambda: sched.SetTrainingStatus(
            scheduler_pb2.TrainingStatus(state="done"), timeout=10
        ),
        "ListServices": lambda: sched.ListServices(scheduler_pb2.ListServicesRequest(), timeout=10),
    }
    codes = {name: _code(call) for name, call in calls.items()}
    assert codes == dict.fromkeys(calls, unauth)


def test_metrics_and_service_discovery_need_a_token(
    cluster: tuple[ClusterHandle, dict[str, str]],
) -> None:
    h, tokens = cluster
    for name, address in h.metrics.items():
        for path in ("/metrics", "/sd") if name == "scheduler" else ("/metrics",):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(f"http://{address}{path}", timeout=5)
            assert info.value.code == 401, (name, path)
    # Prometheus' observer token reads them.
    request = urllib.request.Request(
        f"http://{h.metrics['scheduler']}/sd",
        headers={"Authorization": f"Bearer {tokens['observer']}"},
    )
    with urllib.request.urlopen(request, timeout=5) as r:
        assert {g["labels"]["role"] for g in json.loads(r.read())} >= {"rollout", "reward"}


def test_stolen_role_tokens_get_no_further_than_their_role(
    cluster: tuple[ClusterHandle, dict[str, str]],
) -> None:
    h, tokens = cluster
    denied = grpc.StatusCode.PERMISSION_DENIED
    # An observer only reads; a rollout replica cannot train, save, load or push.
    for role in ("observer", "rollout", "reward"):
        trainer = _as(h.trainer, tokens[role], trainer_pb2_grpc.TrainerServiceStub)
        assert (
            _code(
                lambda t=trainer: t.LoadCheckpoint(
                    trainer_pb2.LoadCheckpointRequest(path="evil.pt"), timeout=10
                )
            )
            == denied
        )
        assert (
            _code(
                lambda t=trainer: t.PushWeights(
                    trainer_pb2.PushWeightsRequest(
                        targets=[trainer_pb2.RolloutTarget(address="127.0.0.1:9")]
                    ),
                    timeout=10,
                )
            )
            == denied
        )
        assert trainer.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=10) is not None
    # Only the trainer (and the driver) may sleep replicas or push weights to them.
    for role in ("observer", "reward", "rollout", "scheduler"):
        rollout = _as(h.rollout[0], tokens[role], rollout_pb2_grpc.RolloutServiceStub)
        assert _code(lambda r=rollout: r.Sleep(rollout_pb2.SleepRequest(level=1), timeout=10)) == (
            denied
        )
        assert (
            _code(lambda r=rollout: r.UpdateWeights(iter([rollout_pb2.WeightChunk()]), timeout=10))
            == denied
        )
    # Only the driver publishes the training status.
    sched = _as(h.scheduler or "", tokens["rollout"], scheduler_pb2_grpc.SchedulerServiceStub)
    assert (
        _code(
            lambda: sched.SetTrainingStatus(scheduler_pb2.TrainingStatus(state="done"), timeout=10)
        )
        == denied
    )


def test_registry_cannot_be_rewritten_with_a_rollout_token(
    cluster: tuple[ClusterHandle, dict[str, str]],
) -> None:
    h, tokens = cluster
    sched = _as(h.scheduler or "", tokens["rollout"], scheduler_pb2_grpc.SchedulerServiceStub)
    entries = sched.ListServices(scheduler_pb2.ListServicesRequest(), timeout=10).services
    replica = next(e for e in entries if e.info.role == scheduler_pb2.ROLE_ROLLOUT)
    denied = grpc.StatusCode.PERMISSION_DENIED

    def register(**info: Any) -> Any:
        fields = {"role": scheduler_pb2.ROLE_ROLLOUT, "address": "127.0.0.1:9", **info}
        return sched.Register(
            scheduler_pb2.RegisterRequest(info=scheduler_pb2.ServiceInfo(**fields)), timeout=10
        )

    # Deregister a replica by its guessable id, or beat for it: not its owner.
    assert (
        _code(
            lambda: sched.Deregister(
                scheduler_pb2.DeregisterRequest(service_id=replica.info.service_id), timeout=10
            )
        )
        == denied
    )
    assert (
        _code(
            lambda: sched.Heartbeat(
                scheduler_pb2.HeartbeatRequest(service_id=replica.info.service_id), timeout=10
            )
        )
        == denied
    )
    # Take over the replica's entry by registering its address, or its id.
    assert _code(lambda: register(address=replica.info.address)) == denied
    assert _code(lambda: register(service_id=replica.info.service_id)) == denied
    # The same replica spelled another way is the same endpoint; odd spellings are
    # refused outright.
    port = replica.info.address.rpartition(":")[2]
    assert _code(lambda: register(address=f"localhost:{port}")) == denied
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: register(address=f"127.0.0.1:0{port}")) == invalid
    assert _code(lambda: register(address=f"127.1:{port}")) == invalid
    # Point agents (who send their key there) at another host, or at no URL at all.
    assert _code(lambda: register(capabilities={"openai_url": "http://192.0.2.7:80/v1"})) == (
        denied
    )
    assert _code(lambda: register(capabilities={"openai_url": "file:///etc/passwd"})) == invalid
    # Put another host's address (cloud metadata) into /sd, or register another role.
    assert _code(lambda: register(metrics_address="169.254.169.254:80")) == denied
    assert _code(lambda: register(address="192.0.2.7:50051")) == denied
    assert _code(lambda: register(role=scheduler_pb2.ROLE_TRAINER)) == denied
    assert _code(lambda: register(role=scheduler_pb2.ROLE_SCHEDULER)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    # The real replica is still there, alive.
    after = sched.ListServices(scheduler_pb2.ListServicesRequest(), timeout=10).services
    same = [e for e in after if e.info.service_id == replica.info.service_id]
    assert same and same[0].info.address == replica.info.address


def test_the_driver_cannot_be_made_to_leak_or_misplace_files(
    cluster: tuple[ClusterHandle, dict[str, str]], tmp_path: Path
) -> None:
    """Even the driver's token cannot push the model to an unregistered address or
    read/write checkpoints outside the run directory."""
    h, tokens = cluster
    trainer = _as(h.trainer, tokens["driver"], trainer_pb2_grpc.TrainerServiceStub)
    push = trainer_pb2.PushWeightsRequest(
        targets=[trainer_pb2.RolloutTarget(replica_id="thief", address="127.0.0.1:9")]
    )
    assert _code(lambda: trainer.PushWeights(push, timeout=30)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    outside = tmp_path / "outside"
    for request in (
        lambda: trainer.SaveCheckpoint(
            trainer_pb2.SaveCheckpointRequest(path="../../outside", step=1), timeout=60
        ),
        lambda: trainer.SaveCheckpoint(
            trainer_pb2.SaveCheckpointRequest(path=str(outside), step=1), timeout=60
        ),
        lambda: trainer.LoadCheckpoint(
            trainer_pb2.LoadCheckpointRequest(path=str(outside)), timeout=60
        ),
    ):
        assert _code(request) == grpc.StatusCode.INVALID_ARGUMENT
    assert not outside.exists()


@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm"])
def test_a_stolen_trainer_token_cannot_poison_or_stall_a_replica(
    cluster: tuple[ClusterHandle, dict[str, str]], tiny_model_dir: Path, transport: str
) -> None:
    """With the trainer's own token (the role allowed to push), NaN weights, all-zero
    weights and a version at 2^63 (which would make every later real push STALE)
    are refused over each transport, and the replica keeps serving what it had."""
    from transformers import AutoModelForCausalLM

    from rlfleet.common.errors import InvalidArgument
    from rlfleet.weightsync.sender import send_update

    h, tokens = cluster
    replica = h.rollout[0]
    status = _as(replica, tokens["observer"], rollout_pb2_grpc.RolloutServiceStub)

    def version() -> int:
        reply = status.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=10)
        return int(reply.weight_version)

    before = version()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sound = {n: p.detach().clone() for n, p in model.named_parameters()}
    nan = {n: t.clone() for n, t in sound.items()}
    next(iter(nan.values())).view(-1)[3] = float("nan")
    zeros = {n: t.new_zeros(t.shape) for n, t in sound.items()}
    attempts = [
        (nan, before + 1, "NON_FINITE_WEIGHTS"),
        (zeros, before + 1, "ZERO_WEIGHTS"),
        (sound, 2**63, "VERSION_JUMP"),
    ]
    for weights, at, code in attempts:
        with pytest.raises(InvalidArgument) as info:
            send_update(
                replica, weights, at, transports=(transport,), auth_token=tokens["trainer"],
                timeout_s=60,
            )  # fmt: skip
        assert info.value.code == code
    assert version() == before


class _Catcher(grpc.ServerInterceptor):
    """What a fake replica records: every bearer token its callers send."""

    def __init__(self) -> None:
        self.tokens: list[tuple[str, str]] = []

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                self.tokens.append((details.method, str(value)[len("Bearer ") :]))
        return continuation(details)


def test_a_fake_replica_learns_no_token_beyond_the_rollout_service(
    cluster: tuple[ClusterHandle, dict[str, str]],
) -> None:
    """Someone with the rollout credential registers a replica of their own: the
    registry lists it, so the driver asks it for its status and the trainer pushes
    it weights. What they send is bound to the rollout service: it works there (where
    the rollout credential already reaches), and nowhere else -- not to deregister
    the real replica, not to drive the trainer, not to score."""
    from concurrent import futures

    from rlfleet.common.auth import credential_set
    from rlfleet.common.errors import Internal
    from rlfleet.rollout.client import RemoteRolloutClient
    from rlfleet.v1 import reward_pb2, reward_pb2_grpc

    h, tokens = cluster
    catcher = _Catcher()
    fake = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[catcher])
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(
        rollout_pb2_grpc.RolloutServiceServicer(), fake
    )
    port = fake.add_insecure_port("127.0.0.1:0")
    fake.start()
    address = f"127.0.0.1:{port}"
    sched = _as(h.scheduler or "", tokens["rollout"], scheduler_pb2_grpc.SchedulerServiceStub)
    try:
        sched.Register(
            scheduler_pb2.RegisterRequest(
                info=scheduler_pb2.ServiceInfo(role=scheduler_pb2.ROLE_ROLLOUT, address=address)
            ),
            timeout=10,
        )
        listed = sched.ListServices(scheduler_pb2.ListServicesRequest(), timeout=10).services
        assert address in [e.info.address for e in listed]
        # The driver's own client asks the listed replica for its status; the driver
        # has the trainer push to it (both fail: the fake answers UNIMPLEMENTED).
        driver = Security(credentials=credential_set(tokens)["driver"])
        with using_security(driver), pytest.raises(Internal):
            RemoteRolloutClient(address, liveness_s=None).status()
        trainer = create_channel(h.trainer, security=driver)
        with contextlib.suppress(grpc.RpcError):
            trainer_pb2_grpc.TrainerServiceStub(trainer).PushWeights(
                trainer_pb2.PushWeightsRequest(
                    targets=[trainer_pb2.RolloutTarget(address=address)]
                ),
                timeout=60,
            )
    finally:
        fake.stop(0)
    caught = {token for _, token in catcher.tokens}
    assert len(caught) == 2  # the driver's and the trainer's
    assert {m.split("/")[1] for m, _ in catcher.tokens} == {"rlfleet.v1.RolloutService"}
    assert not caught & set(tokens.values())  # no role's token itself
    replica = next(e for e in listed if e.info.address == h.rollout[0])
    for token in caught:
        # Good at the rollout service (the caller's role there) ...
        real = _as(h.rollout[0], None, rollout_pb2_grpc.RolloutServiceStub)
        metadata = (("authorization", f"Bearer {token}"),)
        assert (
            real.GetStatus(
                rollout_pb2.GetRolloutStatusRequest(), metadata=metadata, timeout=10
            ).weight_version
            >= 0
        )
        # ... and nowhere else.
        refused = grpc.StatusCode.UNAUTHENTICATED
        scheduler = _as(h.scheduler or "", None, scheduler_pb2_grpc.SchedulerServiceStub)
        assert (
            _code(
                lambda s=scheduler, m=metadata: s.Deregister(
                    scheduler_pb2.DeregisterRequest(service_id=replica.info.service_id),
                    metadata=m,
                    timeout=10,
                )
            )
            == refused
        )
        stub = _as(h.trainer, None, trainer_pb2_grpc.TrainerServiceStub)
        assert (
            _code(
                lambda s=stub, m=metadata: s.SaveCheckpoint(
                    trainer_pb2.SaveCheckpointRequest(path="stolen"), metadata=m, timeout=10
                )
            )
            == refused
        )
        reward = _as(h.reward or "", None, reward_pb2_grpc.RewardServiceStub)
        assert (
            _code(
                lambda s=reward, m=metadata: s.Score(
                    reward_pb2.ScoreRequest(), metadata=m, timeout=10
                )
            )
            == refused
        )
    after = sched.ListServices(scheduler_pb2.ListServicesRequest(), timeout=10).services
    assert replica.info.service_id in [e.info.service_id for e in after]


@pytest.mark.parametrize(
    ("service", "unary", "stream"),
    [
        ("trainer", "GetStatus", "TrainStep"),
        ("rollout", "GetStatus", "UpdateWeights"),
        ("scheduler", "ListServices", None),
        ("reward", "Score", "ScoreStream"),
    ],
)
def test_malformed_protobuf_is_invalid_argument_on_every_service(
    cluster: tuple[ClusterHandle, dict[str, str]],
    service: str,
    unary: str,
    stream: str | None,
) -> None:
    """Bytes that do not parse as the method's request, with a token that may call it:
    INVALID_ARGUMENT naming ``request`` (not INTERNAL), on every service of the cluster."""
    from rlfleet.common.rpc import error_info

    h, tokens = cluster
    address = {
        "trainer": h.trainer,
        "rollout": h.rollout[0],
        "scheduler": h.scheduler or "",
        "reward": h.reward or "",
    }[service]
    token = tokens["trainer" if (service, stream) == ("rollout", "UpdateWeights") else "driver"]
    channel = _channel(address, token)
    prefix = f"/rlfleet.v1.{service.capitalize()}Service/"

    def refused(call: Any) -> None:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        details = error_info(info.value)
        assert details is not None and details.field == "request", details

    raw = channel.unary_unary(prefix + unary, request_serializer=None, response_deserializer=None)
    for garbage in (b"\xff\xff\xff\xff", b"\x0a\x05ab", bytes(range(256))):
        refused(lambda garbage=garbage: raw(garbage, timeout=10))
    if stream is not None:
        kind = channel.stream_unary if stream in ("TrainStep", "UpdateWeights") else None
        call = (kind or channel.stream_stream)(
            prefix + stream, request_serializer=None, response_deserializer=None
        )
        if kind is None:
            refused(lambda: list(call(iter([b"\xff\xff\xff"]), timeout=10)))
        else:
            refused(lambda: call(iter([b"\xff\xff\xff"]), timeout=10))
    channel.close()
