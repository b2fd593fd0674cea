"""Protobuf <-> trainer values, in one place (the servicer and the remote client).

Batches travel as chunk streams (:mod:`rlfleet.common.codec.wire`) on the wire path:
the sender serializes each ``TensorBatchChunk`` straight from the tensors
(:func:`iter_chunk_bytes`), the receiver parses it without copying the tensor bytes
(:func:`parse_chunk`) and assembles the batch; generated protobuf objects (which copy
every byte on each set and get) are never built for them. A streaming operation's
answer carries its metrics as JSON in the ``metrics`` meta entry. ``TrainStep``'s
``TrainStepRequest`` wraps each chunk; it is written and read around the chunk bytes
the same way (:func:`train_step_envelope`, :func:`parse_train_step_request`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from rlfleet.common.codec import wire as codec_wire
from rlfleet.common.codec.batch import CodecError
from rlfleet.common.codec.wire import (
    ChunkAssembler,
    ChunkView,
    Envelope,
    StreamTooLarge,
    iter_chunk_bytes,
)
from rlfleet.common.errors import InvalidArgument, ResourceExhausted
from rlfleet.trainer.core import TrainStepResult
from rlfleet.trainer.push import PushOutcome
from rlfleet.v1 import common_pb2, rollout_pb2, trainer_pb2
from rlfleet.weightsync import wire

__all__ = [
    "METRICS_META_KEY",
    "TrainStepPart",
    "decode_result",
    "decode_stream",
    "encode_result",
    "parse_train_step_request",
    "push_outcome_from_proto",
    "push_outcome_to_proto",
    "status_from_proto",
    "status_to_proto",
    "train_step_envelope",
    "train_step_from_proto",
    "train_step_to_proto",
]

METRICS_META_KEY = "metrics"

Batch = dict[str, Any]


def decode_stream(
    chunks: Iterable[common_pb2.TensorBatchChunk], *, max_bytes: int | None = None
) -> Batch:
    """Reassemble a request stream into a batch, reading it to its end (a chunk after
    the last one is refused).

    Raises:
        ResourceExhausted: the stream would hold more than ``max_bytes`` (checked per
            chunk as it arrives).
        InvalidArgument: a malformed stream; ``field`` names the chunk field or tensor.
    """
    asm = ChunkAssembler(max_bytes=max_bytes)
    try:
        for chunk in chunks:
            asm.add(chunk)
        values, _meta = asm.result(to="torch")
    except StreamTooLarge as e:
        raise ResourceExhausted(
            f"batch stream too large (trainer.max_request_bytes={max_bytes}): {e}",
            field=e.field or "chunks",
            value=e.value,
        ) from e
    except CodecError as e:
        raise InvalidArgument(
            f"malformed batch stream: {e}", field=e.field or "chunks", value=e.value
        ) from e
    return values


def encode_result(batch: Batch, metrics: dict[str, float]) -> Iterator[bytes]:
    """A streaming operation's answer, serialized chunks: the keys it adds, its
    metrics in the meta."""
    return iter_chunk_bytes(batch, {METRICS_META_KEY: json.dumps(metrics)})


class TrainStepPart:
    """One parsed ``TrainStepRequest``: its chunk (tensor bytes not copied) and the
    step's fields (read from the first part)."""

    __slots__ = ("chunk", "on_policy", "total_steps")

    def __init__(self, chunk: ChunkView, on_policy: bool, total_steps: int = 0) -> None:
        self.chunk = chunk
        self.on_policy = on_policy
        self.total_steps = total_steps


_TRAIN_STEP_CHUNK = 1  # TrainStepRequest.chunk


def train_step_envelope(*, on_policy: bool, total_steps: int = 0) -> Envelope:
    """Codec chunks framed as ``TrainStepRequest``s in place (the chunk as field 1,
    the step's fields after it), so that no chunk is copied again to frame it."""
    head = trainer_pb2.TrainStepRequest(on_policy=on_policy, total_steps=total_steps)
    return Envelope(field=_TRAIN_STEP_CHUNK, suffix=head.SerializeToString())


def parse_train_step_request(data: bytes | memoryview) -> TrainStepPart:
    """A ``TrainStepRequest`` (any valid encoding) with its chunk parsed by
    :func:`parse_chunk`. Raises ``CodecError`` on malformed bytes."""
    chunk, head = codec_wire.parse_envelope(data, _TRAIN_STEP_CHUNK, trainer_pb2.TrainStepRequest)
    return TrainStepPart(chunk, head.on_policy, head.total_steps)


def decode_result(asm: ChunkAssembler) -> tuple[Batch, dict[str, float]]:
    """The client's side of :func:`encode_result`, from a filled assembler."""
    values, meta = asm.result(to="torch")
    return values, json.loads(meta.get(METRICS_META_KEY, "{}"))


def train_step_to_proto(result: TrainStepResult) -> trainer_pb2.TrainStepResponse:
    return trainer_pb2.TrainStepResponse(
        metrics=result.metrics,
        global_step=result.global_step,
        weight_version=result.weight_version,
        actor_updated=result.actor_updated,
    )


def train_step_from_proto(resp: trainer_pb2.TrainStepResponse) -> TrainStepResult:
    return TrainStepResult(
        dict(resp.metrics), resp.global_step, resp.weight_version, resp.actor_updated
    )


def push_outcome_to_proto(outcome: PushOutcome) -> trainer_pb2.PushWeightsResponse:
    grpc_code = rollout_pb2.WEIGHT_TRANSPORT_GRPC
    return trainer_pb2.PushWeightsResponse(
        version=outcome.version,
        bytes=outcome.bytes,
        results=[
            trainer_pb2.PushResult(
                replica_id=rid,
                ok=ok,
                error=outcome.errors.get(rid, ""),
                transport=wire.TRANSPORT_CODES.get(outcome.transports.get(rid, ""), grpc_code),
                seconds=outcome.seconds.get(rid, 0.0),
            )
            for rid, ok in outcome.ok.items()
        ],
    )


def push_outcome_from_proto(resp: trainer_pb2.PushWeightsResponse) -> PushOutcome:
    return PushOutcome(
        version=resp.version,
        bytes=resp.bytes,
        ok={r.replica_id: r.ok for r in resp.results},
        errors={r.replica_id: r.error for r in resp.results if r.error},
        transports={
            r.replica_id: wire.TRANSPORT_NAMES.get(r.transport, "grpc")
            for r in resp.results
            if r.ok
        },
        seconds={r.replica_id: r.seconds for r in resp.results if r.ok},
    )


def status_to_proto(status: dict[str, Any]) -> trainer_pb2.TrainerStatus:
    return trainer_pb2.TrainerStatus(**status)


def status_from_proto(s: trainer_pb2.TrainerStatus) -> dict[str, Any]:
    return {
        "global_step": s.global_step,
        "weight_version": s.weight_version,
        "backend": s.backend,
        "world_size": s.world_size,
        "roles": list(s.roles),
        "model": s.model,
    }
