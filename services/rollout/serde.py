"""Protobuf <-> rollout dataclasses, in one place (servicer and remote client).

The weight messages (``UpdateWeightsResponse``, the bulk plane's offer, plan and
abort) convert in :mod:`rlfleet.weightsync.wire`, with the rest of weight sync."""

from __future__ import annotations

import math

import numpy as np

from rlfleet.common.errors import InvalidArgument
from rlfleet.rollout.core import RolloutStatusInfo
from rlfleet.rollout.engine import DEFAULT_MAX_TOKENS, FinishReason, SampleOutput, SamplingParams
from rlfleet.rollout.trajectories import Completion, Trajectory
from rlfleet.v1 import rollout_pb2

__all__ = [
    "result_from_proto",
    "result_to_proto",
    "sampling_from_proto",
    "sampling_to_proto",
    "status_from_proto",
    "status_to_proto",
    "trajectory_from_proto",
    "trajectory_to_proto",
]


def sampling_from_proto(msg: rollout_pb2.SamplingParams) -> SamplingParams:
    """Proto defaults become engine defaults: ``n`` 0 -> 1, ``top_p`` 0 -> 1,
    ``top_k`` <= 0 -> off, ``max_tokens`` 0 -> ``DEFAULT_MAX_TOKENS``. Raises
    ``InvalidArgument`` naming the field for a value no engine can take."""
    temperature = float(msg.temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidArgument(
            f"temperature must be a finite number >= 0, got {temperature}",
            field="sampling.temperature",
            value=temperature,
        )
    top_p = float(msg.top_p) or 1.0
    if not 0 < top_p <= 1:
        raise InvalidArgument(
            f"top_p must be in (0, 1] (0 means 1), got {top_p}", field="sampling.top_p", value=top_p
        )
    return SamplingParams(
        n=max(1, msg.n),
        temperature=temperature,
        top_p=top_p,
        top_k=msg.top_k if msg.top_k > 0 else -1,
        max_tokens=msg.max_tokens or DEFAULT_MAX_TOKENS,
        stop_token_ids=tuple(msg.stop_token_ids),
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs,
        ignore_eos=msg.ignore_eos,
    )


def sampling_to_proto(p: SamplingParams, *, detokenize: bool = False) -> rollout_pb2.SamplingParams:
    msg = rollout_pb2.SamplingParams(
        n=p.n,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=max(0, p.top_k),
        max_tokens=p.max_tokens,
        stop_token_ids=list(p.stop_token_ids),
        logprobs=p.logprobs,
        detokenize=detokenize,
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def result_to_proto(
    s: SampleOutput, *, prompt_id: str = "", replica_id: str = ""
) -> rollout_pb2.GenerateResult:
    return rollout_pb2.GenerateResult(
        prompt_id=prompt_id,
        prompt_index=s.prompt_index,
        sample_index=s.sample_index,
        token_ids=s.token_ids,
        logprobs=s.logprobs,
        text=s.text,
        finish_reason=int(s.finish_reason),
        weight_version=s.weight_version,
        replica_id=replica_id,
        loss_mask=s.loss_mask,
        token_weight_versions=s.token_weight_versions,
    )


def result_from_proto(msg: rollout_pb2.GenerateResult) -> SampleOutput:
    return SampleOutput(
        prompt_index=msg.prompt_index,
        sample_index=msg.sample_index,
        token_ids=list(msg.token_ids),
        logprobs=list(msg.logprobs),
        finish_reason=FinishReason(msg.finish_reason or FinishReason.ABORT),
        weight_version=msg.weight_version,
        text=msg.text,
        loss_mask=list(msg.loss_mask),  # bools: 0/1 as ints
        token_weight_versions=list(msg.token_weight_versions),
    )


def status_to_proto(s: RolloutStatusInfo) -> rollout_pb2.RolloutStatus:
    return rollout_pb2.RolloutStatus(
        replica_id=s.replica_id,
        model=s.model,
        engine=s.engine,
        dtype=s.dtype,
        device=s.device,
        weight_version=s.weight_version,
        queue_depth=max(0, s.queue_depth),
        tokens_per_second=s.tokens_per_second,
        sleeping=s.sleeping,
        generated_tokens_total=s.generated_tokens_total,
        weight_staged_bytes=s.weight_staged_bytes,
        weight_spare_bytes=s.weight_spare_bytes,
    )


def status_from_proto(msg: rollout_pb2.RolloutStatus) -> RolloutStatusInfo:
    return RolloutStatusInfo(
        replica_id=msg.replica_id,
        model=msg.model,
        engine=msg.engine,
        dtype=msg.dtype,
        device=msg.device,
        weight_version=msg.weight_version,
        queue_depth=msg.queue_depth,
        tokens_per_second=msg.tokens_per_second,
        sleeping=msg.sleeping,
        generated_tokens_total=msg.generated_tokens_total,
        weight_staged_bytes=msg.weight_staged_bytes,
        weight_spare_bytes=msg.weight_spare_bytes,
    )


def trajectory_to_proto(t: Trajectory) -> rollout_pb2.Trajectory:
    msg = rollout_pb2.Trajectory(
        session_id=t.session_id,
        completions=[
            rollout_pb2.TrajectoryCompletion(
                prompt_token_ids=c.prompt_ids.tolist(),
                token_ids=c.token_ids.tolist(),
                logprobs=c.logprobs.tolist(),
                weight_version=c.weight_version,
                finish_reason=int(c.finish_reason),
                temperature=c.temperature,
                created_unix_s=c.created,
            )
            for c in t.completions
        ],
        finished=t.finished,
        info=t.info,
    )
    if t.reward is not None:
        msg.reward = t.reward
    return msg


def trajectory_from_proto(msg: rollout_pb2.Trajectory) -> Trajectory:
    """Raises ``InvalidArgument`` when a completion's token ids and log-probs do not pair up."""
    return Trajectory(
        session_id=msg.session_id,
        completions=[
            Completion.of(
                np.array(c.prompt_token_ids, dtype=np.int32),
                np.array(c.token_ids, dtype=np.int32),
                np.array(c.logprobs, dtype=np.float32),
                weight_version=c.weight_version,
                finish_reason=FinishReason(c.finish_reason or FinishReason.ABORT),
                temperature=c.temperature,
                created=c.created_unix_s,
            )
            for c in msg.completions
        ],
        finished=msg.finished,
        reward=msg.reward if msg.HasField("reward") else None,
        info=dict(msg.info),
    )
