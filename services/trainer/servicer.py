"""TrainerService over gRPC: reassemble, call :class:`TrainerCore`, encode the answer.

Batches arrive as chunk streams (:mod:`rlfleet.common.codec.wire`); a malformed stream
(a chunk out of order or after the last one, a bad checksum, ...) is
``INVALID_ARGUMENT``, and a stream that would hold more than
``trainer.max_request_bytes`` is ``RESOURCE_EXHAUSTED`` as soon as a chunk declares or
brings that much, without reading the rest. Streaming operations answer with the keys
they add, and their metrics as JSON in the ``metrics`` meta entry. ``TrainStep`` (the
driver's one call per PPO step) takes its chunks wrapped in ``TrainStepRequest``, whose
first message also says whether the batch is on-policy. Errors raised by the core
(``InvalidArgument`` naming the key and shapes, ``FailedPrecondition`` for a role this
trainer does not hold) map to status codes through :mod:`rlfleet.common.rpc`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

import grpc

from rlfleet.common import tracing
from rlfleet.common.codec.wire import parse_chunk, serialize_chunk
from rlfleet.common.errors import PermissionDenied
from rlfleet.common.rpc import add_service
from rlfleet.trainer import checkpoint
from rlfleet.trainer.core import TrainerCore
from rlfleet.trainer.push import check_push_targets, push_to_targets, refused_push_targets
from rlfleet.trainer.serde import (
    METRICS_META_KEY,
    decode_stream,
    encode_result,
    parse_train_step_request,
    push_outcome_to_proto,
    status_to_proto,
    train_step_to_proto,
)
from rlfleet.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from rlfleet.weightsync import wire
from rlfleet.weightsync.sender import DEFAULT_BUCKET_BYTES

__all__ = [
    "METRICS_META_KEY",
    "TrainerServicer",
    "add_to_server",
    "decode_stream",
    "encode_result",
    "push_to_targets",
    "refused_push_targets",
]


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """Thin adapter from TrainerService to :class:`TrainerCore`."""

    def __init__(
        self,
        core: TrainerCore,
        *,
        default_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        push_targets: Callable[[], Collection[str]] | None = None,
    ) -> None:
        """``push_targets``: the addresses ``PushWeights`` may send the model to (the
        scheduler's registered rollout replicas); None: any loopback address and the
        config's ``services.rollout`` (see :func:`refused_push_targets`)."""
        self.core = core
        self.default_bucket_bytes = default_bucket_bytes
        self.push_targets = push_targets
        self.max_request_bytes = core.config.trainer.max_request_bytes

    def _batch(self, chunks: Iterator[common_pb2.TensorBatchChunk]) -> dict[str, Any]:
        return decode_stream(chunks, max_bytes=self.max_request_bytes)

    # -------------------------------------------------------------- batch in, batch out

    def ComputeLogProb(
        self, request_iterator: Iterator[common_pb2.TensorBatchChunk], context: grpc.ServicerContext
    ) -> Iterator[common_pb2.TensorBatchChunk]:
        return encode_result(*self.core.compute_log_prob(self._batch(request_iterator)))

    def ComputeRefLogProb(
        self, request_iterator: Iterator[common_pb2.TensorBatchChunk], context: grpc.ServicerContext
    ) -> Iterator[common_pb2.TensorBatchChunk]:
        return encode_result(*self.core.compute_ref_log_prob(self._batch(request_iterator)))

    def ComputeValues(
        self, request_iterator: Iterator[common_pb2.TensorBatchChunk], context: grpc.ServicerContext
    ) -> Iterator[common_pb2.TensorBatchChunk]:
        return encode_result(*self.core.compute_values(self._batch(request_iterator)))

    def ComputeAdvantage(
        self, request_iterator: Iterator[common_pb2.TensorBatchChunk], context: grpc.ServicerContext
    ) -> Iterator[common_pb2.TensorBatchChunk]:
        return encode_result(*self.core.compute_advantage(self._batch(request_iterator)))

    # -------------------------------------------------------------- updates

    def _update(self, metrics: dict[str, float]) -> trainer_pb2.UpdateResponse:
        return trainer_pb2.UpdateResponse(
            metrics=metrics,
            global_step=self.core.global_step,
            weight_version=self.core.weight_version,
        )

    def UpdateCritic(
        self, request_iterator: Iterator[common_pb2.TensorBatchChunk], context: grpc.ServicerContext
    ) -> trainer_pb2.UpdateResponse:
        return self._update(self.core.update_critic(self._batch(request_iterator)))

    def UpdateActor(
        self, request_iterator: Iterator[common_pb2.TensorBatchChunk], context: grpc.ServicerContext
    ) -> trainer_pb2.UpdateResponse:
        return self._update(self.core.update_actor(self._batch(request_iterator)))

    def TrainStep(
        self,
        request_iterator: Iterator[trainer_pb2.TrainStepRequest],
        context: grpc.ServicerContext,
    ) -> trainer_pb2.TrainStepResponse:
        first: list[trainer_pb2.TrainStepRequest] = []

        def chunks() -> Iterator[common_pb2.TensorBatchChunk]:
            for request in request_iterator:
                if not first:
                    first.append(request)
                yield request.chunk

        with tracing.span("trainer.train_step") as attrs:
            batch = self._batch(chunks())
            on_policy = bool(first) and first[0].on_policy
            total_steps = first[0].total_steps if first else 0
            attrs["on_policy"] = on_policy
            result = self.core.train_step_result(
                batch, on_policy=on_policy, total_steps=total_steps
            )
        return train_step_to_proto(result)

    def SFTStep(
        self, request_iterator: Iterator[common_pb2.TensorBatchChunk], context: grpc.ServicerContext
    ) -> trainer_pb2.UpdateResponse:
        return self._update(self.core.sft_step(self._batch(request_iterator)))

    # -------------------------------------------------------------- lifecycle

    def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        path, nbytes, seconds = checkpoint.save(
            self.core,
            request.path or None,
            step=request.step or None,
            extra_state_json=request.extra_state_json,
            export_hf=request.export_hf,
        )
        return trainer_pb2.SaveCheckpointResponse(path=str(path), bytes=nbytes, seconds=seconds)

    def LoadCheckpoint(
        self, request: trainer_pb2.LoadCheckpointRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.LoadCheckpointResponse:
        path, step, extra = checkpoint.load(self.core, request.path or None)
        return trainer_pb2.LoadCheckpointResponse(path=str(path), step=step, extra_state_json=extra)

    def PushWeights(
        self, request: trainer_pb2.PushWeightsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.PushWeightsResponse:
        targets = [(t.replica_id or t.address, t.address) for t in request.targets]
        check_push_targets(targets)  # malformed: INVALID_ARGUMENT, before the permission check
        allowed = (
            self.push_targets()
            if self.push_targets is not None
            else self.core.config.services.rollout
        )
        refused = refused_push_targets(
            [a for _, a in targets], allowed, registry=self.push_targets is not None
        )
        if refused and len(refused) == len(targets):
            i, why = next(iter(refused.items()))
            raise PermissionDenied(why, field=f"targets[{i}].address", value=targets[i][1])
        left = context.time_remaining()
        response = push_outcome_to_proto(
            push_to_targets(
                self.core,
                [t for i, t in enumerate(targets) if i not in refused],
                version=request.version,
                bucket_bytes=request.bucket_bytes or self.default_bucket_bytes,
                transports=wire.transport_names(request.transports),
                # Within the caller's deadline: past it nobody waits for the answer.
                timeout_s=600.0 if left is None else max(1.0, min(600.0, left)),
            )
        )
        # A target that left the registry (died, scaled away) fails alone: the others
        # still get the weights, and the caller drops it.
        for i, why in refused.items():
            response.results.append(
                trainer_pb2.PushResult(replica_id=targets[i][0], ok=False, error=why)
            )
        return response

    def SetLRScale(
        self, request: trainer_pb2.SetLRScaleRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.SetLRScaleResponse:
        return trainer_pb2.SetLRScaleResponse(
            lr=self.core.set_lr_scale(request.role, request.scale)
        )

    def GetStatus(
        self, request: trainer_pb2.GetTrainerStatusRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.TrainerStatus:
        return status_to_proto(self.core.status())


def add_to_server(servicer: TrainerServicer, server: Any) -> None:
    """Register ``servicer`` (what ``trainer_pb2_grpc.add_TrainerServiceServicer_to_server``
    does), with batch streams on the wire path: chunks are parsed without copying
    their tensor bytes, and answers go out as the bytes :func:`encode_result` built."""
    add_service(
        server,
        trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"],
        servicer,
        parsers={
            "rlfleet.v1.TensorBatchChunk": parse_chunk,
            "rlfleet.v1.TrainStepRequest": parse_train_step_request,
        },
        serializers={"rlfleet.v1.TensorBatchChunk": serialize_chunk},
    )
