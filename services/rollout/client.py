"""Rollout clients: one interface, an in-process and a remote implementation.

::

    client = RemoteRolloutClient("127.0.0.1:50051")     # or InProcessRolloutClient(core)
    for sample in client.generate([[3, 7, 9]], SamplingParams(n=4, temperature=1.0)):
        ...
    client.update_weights(model.state_dict(), version=7)   # shm > tcp > grpc chunks

``update_weights`` sends through :func:`rlfleet.weightsync.sender.send_update` (the
bulk data plane, shared memory on the same host, else raw TCP, falling back to the
portable gRPC chunk stream); the trainer's bucketed push to many replicas is
:func:`rlfleet.weightsync.sender.push_weights`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import grpc

from rlfleet.common.errors import RlfleetError
from rlfleet.common.rpc import DEFAULT_TIMEOUT_S, Watchdog, create_channel, to_rlfleet_error
from rlfleet.rollout import serde
from rlfleet.rollout.core import RolloutCore, RolloutStatusInfo
from rlfleet.rollout.engine import SampleOutput, SamplingParams
from rlfleet.v1 import rollout_pb2, rollout_pb2_grpc
from rlfleet.weightsync.sender import send_update
from rlfleet.weightsync.wire import AUTO, UpdateResult

__all__ = [
    "InProcessRolloutClient",
    "RemoteRolloutClient",
    "RolloutClient",
]

logger = logging.getLogger(__name__)


class RolloutClient(Protocol):
    """What the scheduler and trainer use to talk to a rollout replica."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        min_weight_version: int = 0,
        seed_indices: Sequence[int] | None = None,
    ) -> Iterator[SampleOutput]:
        """Samples as they finish, each tagged with prompt/sample index and weight
        version (``seed_indices``: see :class:`~rlfleet.rollout.engine.GenerationRequest`)."""
        ...

    def update_weights(
        self,
        named_tensors: Mapping[str, Any],
        version: int,
        *,
        transports: Sequence[str] = AUTO,
    ) -> UpdateResult: ...

    def status(self, *, probe: bool = False) -> RolloutStatusInfo:
        """The replica's load and weight version. ``probe``: a hint the caller can do
        without (no retries, a deadline of :data:`PROBE_TIMEOUT_S`)."""
        ...

    def sleep(self, level: int = 1) -> int: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


class InProcessRolloutClient:
    """Calls a :class:`RolloutCore` in this process (weights handed over as tensors)."""

    def __init__(self, core: RolloutCore) -> None:
        self.core = core

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        min_weight_version: int = 0,
        seed_indices: Sequence[int] | None = None,
    ) -> Iterator[SampleOutput]:
        return self.core.generate(
            prompts, params, min_weight_version=min_weight_version, seed_indices=seed_indices
        )

    def update_weights(
        self,
        named_tensors: Mapping[str, Any],
        version: int,
        *,
        transports: Sequence[str] = AUTO,
    ) -> UpdateResult:
        return self.core.update_weights(named_tensors, version)

    def status(self, *, probe: bool = False) -> RolloutStatusInfo:
        return self.core.status()

    def sleep(self, level: int = 1) -> int:
        return self.core.sleep(level)

    def wake_up(self) -> None:
        self.core.wake_up()

    def close(self) -> None:
        pass


def _error(e: grpc.RpcError) -> RlfleetError:
    return to_rlfleet_error(e)


DEFAULT_LIVENESS_S = 4.0
"""How long a ``Generate`` stream may go without a sample before the replica is
probed (``GetStatus`` with the same deadline); a replica that is stopped or stuck
is thus given up within about three times this (12 s), not the stream's deadline."""
PROBE_TIMEOUT_S = 1.0
"""Deadline of a ``status(probe=True)`` call: a replica that does not answer its load
within it is treated as the most loaded one."""


class RemoteRolloutClient:
    """Talks to a rollout replica over gRPC; raises the errors the service raised.

    Args:
        address: ``host:port`` of the replica, or an existing channel.
        generate_timeout_s: deadline of a whole ``Generate`` stream.
        liveness_s: see :data:`DEFAULT_LIVENESS_S`; None: no probing (a stream then
            waits for samples up to its deadline).
    """

    def __init__(
        self,
        address: str | grpc.Channel,
        *,
        auth_token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        generate_timeout_s: float = 600.0,
        liveness_s: float | None = DEFAULT_LIVENESS_S,
    ) -> None:
        self.address = address if isinstance(address, str) else "<channel>"
        self._liveness_s = liveness_s
        if isinstance(address, str):
            self.channel = create_channel(address, auth_token=auth_token)
            # Generate gets a channel without gRPC's retry policy: a stream that has not
            # sent its first sample yet counts as uncommitted, and retrying it against a
            # replica that died never ended (the driver then waited out the whole
            # deadline). A generation should not be replayed silently anyway: the
            # caller sees UNAVAILABLE at once and re-queues the prompts.
            self._generate_channel = create_channel(
                address, auth_token=auth_token, retry_unavailable=False
            )
            self._own = True
        else:
            self.channel = self._generate_channel = address
            self._own = False
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self._generate_stub = rollout_pb2_grpc.RolloutServiceStub(self._generate_channel)
        self._timeout_s = timeout_s
        self._generate_timeout_s = generate_timeout_s

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        min_weight_version: int = 0,
        detokenize: bool = False,
        prompt_ids: Sequence[str] | None = None,
        seed_indices: Sequence[int] | None = None,
    ) -> Iterator[SampleOutput]:
        ids = list(prompt_ids) if prompt_ids is not None else [""] * len(prompts)
        messages = [
            rollout_pb2.Prompt(id=i, token_ids=list(p)) for i, p in zip(ids, prompts, strict=True)
        ]
        if seed_indices is not None:
            for m, k in zip(messages, seed_indices, strict=True):
                m.seed_index = int(k)
        request = rollout_pb2.GenerateRequest(
            prompts=messages,
            sampling=serde.sampling_to_proto(params, detokenize=detokenize),
            min_weight_version=min_weight_version,
            pack_results=True,
        )
        stream = self._generate_stub.Generate(request, timeout=self._generate_timeout_s)
        watchdog = None
        if self._liveness_s:
            limit = self._liveness_s

            def probe() -> bool:  # GetStatus: the servicer answers, not just the process
                self.stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=limit)
                return True

            watchdog = Watchdog(probe, stream.cancel, limit, f"rollout replica {self.address}")
            watchdog.__enter__()
        try:
            for msg in stream:
                if watchdog is not None:
                    watchdog.progress()
                yield serde.result_from_proto(msg)
                for packed in msg.more:  # samples that finished with it (pack_results)
                    yield serde.result_from_proto(packed)
        except grpc.RpcError as e:
            if watchdog is not None and watchdog.verdict is not None:
                raise watchdog.error(self.address) from e
            err = _error(e)
            if err.recoverable and self.address not in str(err):
                raise type(err)(
                    f"rollout replica {self.address}: {err}",
                    field=err.field,
                    value=err.value,
                    code=err.code,
                    recoverable=err.recoverable,
                ) from e
            raise err from e
        finally:
            if watchdog is not None:
                watchdog.__exit__()
            stream.cancel()

    def update_weights(
        self,
        named_tensors: Mapping[str, Any],
        version: int,
        *,
        transports: Sequence[str] = AUTO,
    ) -> UpdateResult:
        return send_update(self.channel, named_tensors, version, transports=transports)

    def status(self, *, probe: bool = False) -> RolloutStatusInfo:
        # A probe takes the channel without retries: a dead replica costs one refused
        # connection, not the retry policy's backoffs (about 3 s).
        stub, timeout = (
            (self._generate_stub, min(PROBE_TIMEOUT_S, self._timeout_s))
            if probe
            else (self.stub, self._timeout_s)
        )
        try:
            msg = stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise _error(e) from e
        return serde.status_from_proto(msg)

    def sleep(self, level: int = 1) -> int:
        try:
            msg = self.stub.Sleep(rollout_pb2.SleepRequest(level=level), timeout=self._timeout_s)
        except grpc.RpcError as e:
            raise _error(e) from e
        return int(msg.freed_bytes)

    def wake_up(self) -> None:
        try:
            self.stub.WakeUp(rollout_pb2.WakeUpRequest(), timeout=self._timeout_s)
        except grpc.RpcError as e:
            raise _error(e) from e

    def close(self) -> None:
        if self._own:
            self.channel.close()
            self._generate_channel.close()

    def __enter__(self) -> RemoteRolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
