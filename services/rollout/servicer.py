"""RolloutService over gRPC: validate, convert, delegate to :class:`RolloutCore`.

Errors are raised as ``rlfleet.common.errors`` classes and mapped to status codes
by the server's interceptor (``rlfleet.common.rpc``); corrupt weight bytes map to
``DATA_LOSS``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from rlfleet.common import tracing
from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.common.rpc import add_service
from rlfleet.rollout import serde
from rlfleet.rollout.core import RolloutCore
from rlfleet.rollout.engine import SampleOutput
from rlfleet.rollout.trajectories import TrajectoryStore
from rlfleet.v1 import rollout_pb2, rollout_pb2_grpc
from rlfleet.weightsync import wire

logger = logging.getLogger(__name__)

#: With ``pack_results``: samples per ``GenerateResult`` message at most, and tokens
#: (a packed message of 2**18 tokens with log-probs and versions is about 5 MB, well
#: inside the 64 MiB message limit).
_PACK_SAMPLES = 256
_PACK_TOKENS = 1 << 18

__all__ = ["Detokenizer", "RolloutServicer", "add_to_server"]

#: token ids -> text (the model's tokenizer ``decode``).
Detokenizer = Callable[[Sequence[int]], str]

#: Sessions one GetTrajectories may name, and the tokens one answer may carry (12-20
#: bytes each on the wire), and its bytes (under the 64 MiB message limit): the rest
#: waits for the next call.
MAX_TRAJECTORY_IDS = 1024
MAX_TRAJECTORY_TOKENS = 1 << 22
MAX_TRAJECTORY_BYTES = 48 << 20


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Thin adapter; every decision lives in the core."""

    def __init__(
        self,
        core: RolloutCore,
        detokenize: Detokenizer | None = None,
        trajectories: TrajectoryStore | None = None,
    ) -> None:
        self.core = core
        self._detokenize = detokenize
        self._trajectories = trajectories

    def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[rollout_pb2.GenerateResult]:
        return tracing.traced_stream(
            "rollout.generate",
            self._generate(request, context),
            replica=self.core.replica_id,
            prompts=len(request.prompts),
        )

    def _generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[rollout_pb2.GenerateResult]:
        if not request.prompts:
            raise InvalidArgument("the request has no prompts", field="prompts")
        for i, p in enumerate(request.prompts):
            if not p.token_ids:
                raise InvalidArgument(
                    "prompt has no tokens", field=f"prompts[{i}].token_ids", sample_index=i
                )
        params = serde.sampling_from_proto(request.sampling)
        detok = request.sampling.detokenize
        if detok and self._detokenize is None:
            raise InvalidArgument(
                "this replica has no tokenizer to detokenize with", field="sampling.detokenize"
            )
        seed_indices = None
        if any(p.HasField("seed_index") for p in request.prompts):
            seed_indices = [
                p.seed_index if p.HasField("seed_index") else i
                for i, p in enumerate(request.prompts)
            ]
        handle = self.core.submit(
            [list(p.token_ids) for p in request.prompts],
            params,
            min_weight_version=request.min_weight_version,
            seed_indices=seed_indices,
        )
        # The RPC ending early (cancelled, past its deadline) stops the generation;
        # False: it had already ended before the callback could be added.
        if not context.add_callback(handle.cancel):
            handle.cancel()
        ids = [p.id for p in request.prompts]
        replica = self.core.replica_id

        def result(sample: SampleOutput) -> rollout_pb2.GenerateResult:
            if detok and self._detokenize is not None:
                sample.text = self._detokenize(sample.token_ids)
            return serde.result_to_proto(
                sample, prompt_id=ids[sample.prompt_index], replica_id=replica
            )

        if not request.pack_results:
            for sample in handle:
                yield result(sample)
            return
        # Samples that finished together go out in one message: each message costs
        # the stream about 0.1 ms on each side, a third of a tiny model's decode step.
        for group in handle.batches(_PACK_SAMPLES):
            message: rollout_pb2.GenerateResult | None = None
            tokens = 0
            for sample in group:
                if message is not None and tokens + len(sample.token_ids) > _PACK_TOKENS:
                    yield message
                    message = None
                if message is None:
                    message, tokens = result(sample), 0
                else:
                    message.more.append(result(sample))
                tokens += len(sample.token_ids)
            if message is not None:
                yield message

    def UpdateWeights(
        self, request_iterator: Iterator[wire.WeightChunkView], context: grpc.ServicerContext
    ) -> rollout_pb2.UpdateWeightsResponse:
        result = self.core.update_weights_from_chunks(
            (c.version, c.chunk) for c in request_iterator
        )
        return wire.update_to_proto(result)

    def OpenWeightTransfer(
        self, request: rollout_pb2.WeightTransferOffer, context: grpc.ServicerContext
    ) -> rollout_pb2.WeightTransferPlan:
        return wire.plan_to_proto(self.core.open_transfer(wire.offer_from_proto(request)))

    def CommitWeightTransfer(
        self, request: rollout_pb2.WeightTransferCommit, context: grpc.ServicerContext
    ) -> rollout_pb2.UpdateWeightsResponse:
        return wire.update_to_proto(
            self.core.commit_transfer(
                request.transfer_id,
                list(request.crc32c),
                timeout_s=context.time_remaining(),
                cancelled=lambda: not context.is_active(),
            )
        )

    def AbortWeightTransfer(
        self, request: rollout_pb2.AbortWeightTransferRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.AbortWeightTransferResponse:
        if not request.update_id:
            raise InvalidArgument("no update_id to abort", field="update_id")
        return wire.abort_to_proto(self.core.abort_transfer(request.update_id, request.reason))

    def Sleep(
        self, request: rollout_pb2.SleepRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.SleepResponse:
        return rollout_pb2.SleepResponse(freed_bytes=self.core.sleep(request.level or 1))

    def WakeUp(
        self, request: rollout_pb2.WakeUpRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.WakeUpResponse:
        self.core.wake_up()
        return rollout_pb2.WakeUpResponse()

    def GetStatus(
        self, request: rollout_pb2.GetRolloutStatusRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.RolloutStatus:
        return serde.status_to_proto(self.core.status())

    def _store(self) -> TrajectoryStore:
        if self._trajectories is None:
            raise FailedPrecondition(
                "this replica records no trajectories: start it with --openai-port",
                code="NO_OPENAI_ENDPOINT",
            )
        return self._trajectories

    def GetTrajectories(
        self, request: rollout_pb2.GetTrajectoriesRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.TrajectoriesResponse:
        store = self._store()
        ids = list(dict.fromkeys(request.session_ids))  # each session once, in order
        if len(ids) > MAX_TRAJECTORY_IDS:
            raise InvalidArgument(
                f"{len(ids)} session ids, at most {MAX_TRAJECTORY_IDS} per call",
                field="session_ids",
                value=len(ids),
                code="LIMIT_EXCEEDED",
            )
        found: list[rollout_pb2.Trajectory] = []
        tokens = size = 0
        for t in store.get(ids):
            tokens += t.tokens
            if found and tokens > MAX_TRAJECTORY_TOKENS:
                break  # the caller asks again for the rest
            msg = serde.trajectory_to_proto(t)
            size += msg.ByteSize()
            if found and size > MAX_TRAJECTORY_BYTES:
                break
            found.append(msg)
        return rollout_pb2.TrajectoriesResponse(trajectories=found, replica_id=self.core.replica_id)

    def PopTrajectories(
        self, request: rollout_pb2.PopTrajectoriesRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.TrajectoriesResponse:
        store = self._store()
        taken = store.pop_finished(
            min(max(1, request.max_sessions), MAX_TRAJECTORY_IDS),
            max_tokens=MAX_TRAJECTORY_TOKENS,
        )
        out: list[rollout_pb2.Trajectory] = []
        size = 0
        for i, t in enumerate(taken):
            try:
                msg = serde.trajectory_to_proto(t)
            except (ValueError, TypeError) as e:  # e.g. text protobuf cannot encode
                logger.error("session %r dropped: it cannot be sent (%s)", t.session_id, e)
                continue
            size += msg.ByteSize()
            if size > MAX_TRAJECTORY_BYTES:
                if not out:
                    logger.error(
                        "session %r dropped: %d bytes, more than one answer carries (%d)",
                        t.session_id, msg.ByteSize(), MAX_TRAJECTORY_BYTES,
                    )  # fmt: skip
                    store.put_back(taken[i + 1 :])
                else:
                    store.put_back(taken[i:])  # the caller asks again for the rest
                break
            out.append(msg)
        return rollout_pb2.TrajectoriesResponse(trajectories=out, replica_id=self.core.replica_id)


def add_to_server(servicer: RolloutServicer, server: Any) -> None:
    """Register ``servicer`` (what ``rollout_pb2_grpc.add_RolloutServiceServicer_to_server``
    does), with ``UpdateWeights`` chunks parsed without copying their tensor bytes
    (:func:`~rlfleet.weightsync.wire.parse_weight_chunk`): the gRPC weight path copies
    each byte once, into the engine's staging."""
    add_service(
        server,
        rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
        servicer,
        parsers={"rlfleet.v1.WeightChunk": wire.parse_weight_chunk},
    )
