"""Protobuf <-> reward types, in one place (STYLE.md 4: protobuf stays at the edge).

``google.protobuf.Value`` / ``Struct`` are converted by hand rather than with
``json_format``: this runs once per sample on the hot path.
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import struct_pb2

from rlfleet.common.errors import InvalidArgument
from rlfleet.reward.types import ChatMessage, RewardInfo, Sample, ScoreResult
from rlfleet.v1 import reward_pb2

__all__ = [
    "info_to_proto",
    "result_from_proto",
    "result_to_proto",
    "results_to_proto",
    "sample_from_proto",
    "sample_to_proto",
    "samples_from_request",
    "set_value",
    "struct_to_dict",
    "value_to_python",
]

_MAX_DEPTH = 32


def value_to_python(value: struct_pb2.Value, depth: int = 0) -> Any:
    """A ``Value`` as plain Python; integral numbers become ``int``; unset -> None."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "number_value":
        n = value.number_value
        return int(n) if n.is_integer() and abs(n) < 2**53 else n
    if kind == "bool_value":
        return value.bool_value
    if kind is None or kind == "null_value":
        return None
    if depth >= _MAX_DEPTH:
        raise ValueError(f"value nested deeper than {_MAX_DEPTH} levels")
    if kind == "list_value":
        return [value_to_python(v, depth + 1) for v in value.list_value.values]
    return struct_to_dict(value.struct_value, depth + 1)


def struct_to_dict(struct: struct_pb2.Struct, depth: int = 0) -> dict[str, Any]:
    if not struct.fields:
        return {}
    return {k: value_to_python(v, depth + 1) for k, v in struct.fields.items()}


def set_value(target: struct_pb2.Value, value: Any, depth: int = 0) -> None:
    """Write a Python value into a fresh ``Value`` (non-JSON types as their ``str``)."""
    if value is None:
        target.null_value = struct_pb2.NULL_VALUE
    elif isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int | float):
        f = float(value)
        if math.isfinite(f):
            target.number_value = f
        else:
            target.string_value = str(value)
    elif isinstance(value, str):
        target.string_value = value
    elif depth < _MAX_DEPTH and isinstance(value, dict):
        struct = target.struct_value
        struct.SetInParent()  # an empty dict is still a struct
        for k, v in value.items():
            set_value(struct.fields[str(k)], v, depth + 1)
    elif depth < _MAX_DEPTH and isinstance(value, list | tuple):
        values = target.list_value
        values.SetInParent()
        for v in value:
            set_value(values.values.add(), v, depth + 1)
    else:
        target.string_value = str(value)


def _fill_struct(struct: struct_pb2.Struct, data: dict[str, Any]) -> None:
    fields = struct.fields
    for k, v in data.items():
        # Fast paths for the flat details the built-in scorers return.
        if type(v) is str:
            fields[k].string_value = v
        elif type(v) is bool:
            fields[k].bool_value = v
        elif v is None:
            fields[k].null_value = struct_pb2.NULL_VALUE
        else:
            set_value(fields[str(k)], v)


def sample_from_proto(msg: reward_pb2.RewardSample, index: int) -> Sample:
    # Runs once per sample on the hot path: string ground truths and empty
    # extra_info / prompt_messages (the common case) skip the general converters.
    try:
        gt = msg.ground_truth
        kind = gt.WhichOneof("kind")
        ground_truth = gt.string_value if kind == "string_value" else value_to_python(gt)
        extra = msg.extra_info
        extra_info = struct_to_dict(extra) if extra.fields else {}
    except ValueError as exc:
        raise InvalidArgument(str(exc), field=f"samples[{index}]", sample_index=index) from exc
    messages = msg.prompt_messages
    return Sample(
        msg.data_source,
        msg.response,
        ground_truth,
        msg.prompt,
        [ChatMessage(m.role, m.content) for m in messages] if messages else [],
        extra_info,
        msg.id,
    )


def samples_from_request(request: reward_pb2.ScoreRequest, offset: int = 0) -> list[Sample]:
    return [sample_from_proto(s, offset + i) for i, s in enumerate(request.samples)]


def sample_to_proto(sample: Sample) -> reward_pb2.RewardSample:
    msg = reward_pb2.RewardSample(
        id=sample.id,
        data_source=sample.data_source,
        prompt=sample.prompt,
        response=sample.response,
    )
    for m in sample.prompt_messages:
        msg.prompt_messages.add(role=m.role, content=m.content)
    if sample.ground_truth is not None:
        set_value(msg.ground_truth, sample.ground_truth)
    if sample.extra_info:
        _fill_struct(msg.extra_info, sample.extra_info)
    return msg


def result_to_proto(
    result: ScoreResult, out: reward_pb2.ScoreResult | None = None
) -> reward_pb2.ScoreResult:
    msg = out if out is not None else reward_pb2.ScoreResult()
    # Only non-default fields are set: each assignment costs on the hot path.
    if result.id:
        msg.id = result.id
    msg.index = result.index
    msg.score = result.score
    msg.scorer = result.scorer
    if result.error:
        msg.error = result.error
    if result.timed_out:
        msg.timed_out = True
    if result.details:
        _fill_struct(msg.details, result.details)
    return msg


def results_to_proto(
    results: list[ScoreResult], out: reward_pb2.ScoreResponse | None = None
) -> reward_pb2.ScoreResponse:
    """A ``ScoreResponse`` holding ``results`` in order."""
    msg = out if out is not None else reward_pb2.ScoreResponse()
    add = msg.results.add
    for result in results:
        result_to_proto(result, add())
    return msg


def result_from_proto(msg: reward_pb2.ScoreResult) -> ScoreResult:
    return ScoreResult(
        index=msg.index,
        score=msg.score,
        scorer=msg.scorer,
        details=struct_to_dict(msg.details),
        error=msg.error,
        timed_out=msg.timed_out,
        id=msg.id,
    )


def info_to_proto(info: RewardInfo) -> reward_pb2.RewardInfo:
    return reward_pb2.RewardInfo(
        scorers=list(info.scorers),
        data_sources=info.data_sources,
        default_scorer=info.default_scorer,
        reward_model=info.reward_model,
        max_batch_size=info.max_batch_size,
        sample_timeout_s=info.sample_timeout_s,
        processes=info.processes,
    )
