"""Clients of the trainer: one interface, in-process or over gRPC.

::

    client = InProcessTrainerClient(core)          # same process, no sockets
    client = RemoteTrainerClient("127.0.0.1:50051") # a `rlfleet serve trainer`
    out, metrics = client.compute_log_prob(batch)  # {"old_log_probs", "entropys"}
    result = client.train_step(batch, on_policy=True)  # TrainStepResult: one hop per step
    client.push_weights([("r0", "127.0.0.1:50061")])

Both raise the same :mod:`rlfleet.common.errors` classes (the remote one maps gRPC
statuses back with :func:`rlfleet.common.rpc.to_rlfleet_error`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from rlfleet.common.codec.wire import (
    ChunkAssembler,
    iter_chunk_bytes,
    parse_chunk,
    serialize_chunk,
)
from rlfleet.common.errors import RlfleetError
from rlfleet.common.rpc import Watchdog, create_channel, health_probe, to_rlfleet_error
from rlfleet.trainer.core import TrainStepResult
from rlfleet.trainer.push import PushOutcome, push_to_targets
from rlfleet.trainer.serde import (
    decode_result,
    push_outcome_from_proto,
    status_from_proto,
    train_step_envelope,
    train_step_from_proto,
)
from rlfleet.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.weightsync.wire import transport_codes

__all__ = [
    "CheckpointInfo",
    "InProcessTrainerClient",
    "PushOutcome",
    "RemoteTrainerClient",
    "TrainStepResult",
    "TrainerClient",
    "UpdateResult",
]

Batch = dict[str, Any]


@dataclass(frozen=True)
class UpdateResult:
    metrics: dict[str, float]
    global_step: int
    weight_version: int


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    step: int = 0
    bytes: int = 0
    seconds: float = 0.0
    extra_state_json: str = ""


class TrainerClient(Protocol):
    """What the driver calls; see the module docstring."""

    def compute_log_prob(self, batch: Batch) -> tuple[Batch, dict[str, float]]: ...
    def compute_ref_log_prob(self, batch: Batch) -> tuple[Batch, dict[str, float]]: ...
    def compute_values(self, batch: Batch) -> tuple[Batch, dict[str, float]]: ...
    def compute_advantage(self, batch: Batch) -> tuple[Batch, dict[str, float]]: ...
    def update_critic(self, batch: Batch) -> UpdateResult: ...
    def update_actor(self, batch: Batch) -> UpdateResult: ...
    def train_step(
        self, batch: Batch, *, on_policy: bool = False, total_steps: int = 0
    ) -> TrainStepResult:
        """One PPO step on a scored batch, sent once (the trainer keeps it): old
        log-probs, ref, values, advantages, critic and actor updates, each timed on the
        trainer. ``on_policy``: every sample was generated with the weights the trainer
        holds now, which lets it skip a redundant old-log-prob pass. ``total_steps``:
        the run's total training steps, for the lr schedules (0: the trainer's own)."""
        ...

    def sft_step(self, batch: Batch) -> UpdateResult: ...
    def save_checkpoint(
        self, path: str = "", *, step: int = 0, extra_state_json: str = "", export_hf: bool = False
    ) -> CheckpointInfo: ...
    def load_checkpoint(self, path: str = "") -> CheckpointInfo: ...
    def push_weights(
        self,
        targets: Sequence[tuple[str, str]],
        *,
        version: int = 0,
        bucket_bytes: int = 0,
        transports: Sequence[str] = (),
    ) -> PushOutcome: ...
    def set_lr_scale(self, role: str, scale: float) -> float:
        """The lr of ``role`` becomes its configured lr times ``scale`` (in (0, 1],
        absolute); returns the lr now in effect."""
        ...

    def status(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class InProcessTrainerClient:
    """Calls a :class:`~rlfleet.trainer.core.TrainerCore` in this process."""

    def __init__(self, core: Any) -> None:
        from rlfleet.trainer.core import TrainerCore

        assert isinstance(core, TrainerCore)
        self.core = core

    def compute_log_prob(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        out: tuple[Batch, dict[str, float]] = self.core.compute_log_prob(batch)
        return out

    def compute_ref_log_prob(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        out: tuple[Batch, dict[str, float]] = self.core.compute_ref_log_prob(batch)
        return out

    def compute_values(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        out: tuple[Batch, dict[str, float]] = self.core.compute_values(batch)
        return out

    def compute_advantage(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        out: tuple[Batch, dict[str, float]] = self.core.compute_advantage(batch)
        return out

    def _result(self, metrics: dict[str, float]) -> UpdateResult:
        return UpdateResult(metrics, self.core.global_step, self.core.weight_version)

    def update_critic(self, batch: Batch) -> UpdateResult:
        return self._result(self.core.update_critic(batch))

    def update_actor(self, batch: Batch) -> UpdateResult:
        return self._result(self.core.update_actor(batch))

    def train_step(
        self, batch: Batch, *, on_policy: bool = False, total_steps: int = 0
    ) -> TrainStepResult:
        result: TrainStepResult = self.core.train_step_result(
            batch, on_policy=on_policy, total_steps=total_steps
        )
        return result

    def sft_step(self, batch: Batch) -> UpdateResult:
        return self._result(self.core.sft_step(batch))

    def save_checkpoint(
        self, path: str = "", *, step: int = 0, extra_state_json: str = "", export_hf: bool = False
    ) -> CheckpointInfo:
        from rlfleet.trainer import checkpoint

        folder, nbytes, seconds = checkpoint.save(
            self.core,
            path or None,
            step=step or None,
            extra_state_json=extra_state_json,
            export_hf=export_hf,
        )
        return CheckpointInfo(str(folder), step or self.core.global_step, nbytes, seconds)

    def load_checkpoint(self, path: str = "") -> CheckpointInfo:
        from rlfleet.trainer import checkpoint

        folder, step, extra = checkpoint.load(self.core, path or None)
        return CheckpointInfo(str(folder), step, extra_state_json=extra)

    def push_weights(
        self,
        targets: Sequence[tuple[str, str]],
        *,
        version: int = 0,
        bucket_bytes: int = 0,
        transports: Sequence[str] = (),
    ) -> PushOutcome:
        from rlfleet.weightsync.sender import DEFAULT_BUCKET_BYTES

        return push_to_targets(
            self.core,
            list(targets),
            version=version,
            bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
            transports=transports,
        )

    def set_lr_scale(self, role: str, scale: float) -> float:
        lr: float = self.core.set_lr_scale(role, scale)
        return lr

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.core.status()
        return status

    def close(self) -> None:
        pass


_METHOD = "/rlfleet.v1.TrainerService/"

DEFAULT_LIVENESS_S = 5.0
"""How often a call's trainer is health-checked while the call runs: a trainer that
is stopped or stuck fails the call within about three times this, not its deadline."""


class RemoteTrainerClient:
    """Calls a TrainerService at ``address``; errors come back as rlfleet errors.

    Each call runs under a :class:`~rlfleet.common.rpc.Watchdog` that health-checks
    the trainer every ``liveness_s`` (None: none); an error the transport raised
    names the trainer and its address.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 600.0,
        auth_token: str | None = None,
        liveness_s: float | None = DEFAULT_LIVENESS_S,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.liveness_s = liveness_s
        self._channel = create_channel(address, auth_token=auth_token)
        self._probe_channel = create_channel(address, retry_unavailable=False)
        self._stub = trainer_pb2_grpc.TrainerServiceStub(self._channel)

    def _watchdog(self, cancel: Callable[[], Any]) -> Watchdog | contextlib.nullcontext[None]:
        if not self.liveness_s:
            return contextlib.nullcontext()
        probe = health_probe(self._probe_channel, self.liveness_s)
        return Watchdog(probe, cancel, self.liveness_s, f"trainer {self.address}")

    def _error(self, e: grpc.RpcError, watchdog: Any) -> RlfleetError:
        if isinstance(watchdog, Watchdog) and watchdog.verdict is not None:
            return watchdog.error(self.address)
        err = to_rlfleet_error(e)
        if err.status in ("UNAVAILABLE", "DEADLINE_EXCEEDED") and self.address not in str(err):
            return type(err)(
                f"trainer {self.address}: {err}",
                field=err.field or "address",
                value=err.value if err.field else self.address,
                code=err.code,
                recoverable=err.recoverable,
            )
        return err

    def _call(self, method: Callable[..., Any], request: Any) -> Any:
        future = method.future(request, timeout=self.timeout_s)  # type: ignore[attr-defined]
        watchdog = self._watchdog(future.cancel)
        try:
            with watchdog:
                return future.result()
        except grpc.RpcError as e:
            raise self._error(e, watchdog) from e
        except grpc.FutureCancelledError as e:
            raise self._error(grpc.RpcError(), watchdog) from e

    def _stream(self, name: str, batch: Batch) -> tuple[Batch, dict[str, float]]:
        call = self._channel.stream_stream(
            _METHOD + name, request_serializer=serialize_chunk, response_deserializer=parse_chunk
        )
        responses: Any = call(iter_chunk_bytes(batch), timeout=self.timeout_s)
        watchdog = self._watchdog(responses.cancel)
        try:
            with watchdog:
                asm = ChunkAssembler()
                for chunk in responses:
                    if isinstance(watchdog, Watchdog):
                        watchdog.progress()
                    if asm.add(chunk):
                        break
            return decode_result(asm)
        except grpc.RpcError as e:
            raise self._error(e, watchdog) from e

    def _update(self, name: str, batch: Batch) -> UpdateResult:
        call = self._channel.stream_unary(
            _METHOD + name,
            request_serializer=serialize_chunk,
            response_deserializer=trainer_pb2.UpdateResponse.FromString,
        )
        resp: trainer_pb2.UpdateResponse = self._call(call, iter_chunk_bytes(batch))
        return UpdateResult(dict(resp.metrics), resp.global_step, resp.weight_version)

    def compute_log_prob(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        return self._stream("ComputeLogProb", batch)

    def compute_ref_log_prob(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        return self._stream("ComputeRefLogProb", batch)

    def compute_values(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        return self._stream("ComputeValues", batch)

    def compute_advantage(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        return self._stream("ComputeAdvantage", batch)

    def update_critic(self, batch: Batch) -> UpdateResult:
        return self._update("UpdateCritic", batch)

    def update_actor(self, batch: Batch) -> UpdateResult:
        return self._update("UpdateActor", batch)

    def train_step(
        self, batch: Batch, *, on_policy: bool = False, total_steps: int = 0
    ) -> TrainStepResult:
        call = self._channel.stream_unary(
            _METHOD + "TrainStep",
            request_serializer=serialize_chunk,  # bytes pass through
            response_deserializer=trainer_pb2.TrainStepResponse.FromString,
        )
        envelope = train_step_envelope(on_policy=on_policy, total_steps=total_steps)
        requests = iter_chunk_bytes(batch, envelope=envelope)
        return train_step_from_proto(self._call(call, requests))

    def sft_step(self, batch: Batch) -> UpdateResult:
        return self._update("SFTStep", batch)

    def save_checkpoint(
        self, path: str = "", *, step: int = 0, extra_state_json: str = "", export_hf: bool = False
    ) -> CheckpointInfo:
        req = trainer_pb2.SaveCheckpointRequest(
            path=path, step=step, extra_state_json=extra_state_json, export_hf=export_hf
        )
        resp: trainer_pb2.SaveCheckpointResponse = self._call(self._stub.SaveCheckpoint, req)
        return CheckpointInfo(resp.path, step, resp.bytes, resp.seconds)

    def load_checkpoint(self, path: str = "") -> CheckpointInfo:
        req = trainer_pb2.LoadCheckpointRequest(path=path)
        resp: trainer_pb2.LoadCheckpointResponse = self._call(self._stub.LoadCheckpoint, req)
        return CheckpointInfo(resp.path, resp.step, extra_state_json=resp.extra_state_json)

    def push_weights(
        self,
        targets: Sequence[tuple[str, str]],
        *,
        version: int = 0,
        bucket_bytes: int = 0,
        transports: Sequence[str] = (),
    ) -> PushOutcome:
        req = trainer_pb2.PushWeightsRequest(
            targets=[trainer_pb2.RolloutTarget(replica_id=r, address=a) for r, a in targets],
            version=version,
            bucket_bytes=bucket_bytes,
            transports=transport_codes(transports),
        )
        return push_outcome_from_proto(self._call(self._stub.PushWeights, req))

    def set_lr_scale(self, role: str, scale: float) -> float:
        req = trainer_pb2.SetLRScaleRequest(role=role, scale=scale)
        resp: trainer_pb2.SetLRScaleResponse = self._call(self._stub.SetLRScale, req)
        return float(resp.lr)

    def status(self) -> dict[str, Any]:
        return status_from_proto(
            self._call(self._stub.GetStatus, trainer_pb2.GetTrainerStatusRequest())
        )

    def close(self) -> None:
        self._channel.close()
        self._probe_channel.close()
