"""Protobuf <-> reward types, in one place (STYLE.md 4: protobuf stays at the edge).

``google.protobuf.Value`` / ``Struct`` are converted by hand rather than with
``json_format``: this runs once per sample on the hot path.
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import struct_pb2

from rlfleet.common.errors import InvalidArgument
from rlfleet.reward.types import ChatMessage, RewardInfo, Sample, SampleLimits, ScoreResult
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
_NO_LIMITS = SampleLimits(max_text_chars=1 << 62, max_name_chars=1 << 62)


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
    # ``depth`` counts containers: value_to_python adds the level of a nested one.
    return {k: value_to_python(v, depth) for k, v in struct.fields.items()}


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


def _too_long(index: int, name: str, size: int, limit: int, unit: str) -> InvalidArgument:
    return InvalidArgument(
        f"{name} of sample {index} has {size} {unit}, over the limit of {limit}",
        field=f"samples[{index}].{name}",
        value=size,
        sample_index=index,
        code="TOO_LARGE",
    )


def sample_from_proto(
    msg: reward_pb2.RewardSample, index: int, limits: SampleLimits = _NO_LIMITS
) -> Sample:
    """One sample, its fields checked against ``limits`` (``InvalidArgument`` naming the
    field, with the size as the value and the sample's index)."""
    # Runs once per sample on the hot path: string ground truths and empty
    # extra_info / prompt_messages (the common case) skip the general converters.
    text_max, name_max = limits.max_text_chars, limits.max_name_chars
    data_source, response, prompt, sample_id = msg.data_source, msg.response, msg.prompt, msg.id
    if len(data_source) > name_max:
        raise _too_long(index, "data_source", len(data_source), name_max, "characters")
    if len(sample_id) > name_max:
        raise _too_long(index, "id", len(sample_id), name_max, "characters")
    if len(response) > text_max:
        raise _too_long(index, "response", len(response), text_max, "characters")
    if len(prompt) > text_max:
        raise _too_long(index, "prompt", len(prompt), text_max, "characters")
    field = "ground_truth"
    try:
        gt = msg.ground_truth
        kind = gt.WhichOneof("kind")
        if kind == "string_value":
            ground_truth = gt.string_value
            if len(ground_truth) > text_max:
                raise _too_long(index, "ground_truth", len(ground_truth), text_max, "characters")
        else:
            if kind in ("list_value", "struct_value") and gt.ByteSize() > text_max:
                raise _too_long(index, "ground_truth", gt.ByteSize(), text_max, "bytes")
            ground_truth = value_to_python(gt)
        field = "extra_info"
        extra = msg.extra_info
        extra_info: dict[str, Any] = {}
        if extra.fields:
            if extra.ByteSize() > text_max:
                raise _too_long(index, "extra_info", extra.ByteSize(), text_max, "bytes")
            extra_info = struct_to_dict(extra)
    except ValueError as exc:
        raise InvalidArgument(
            str(exc), field=f"samples[{index}].{field}", sample_index=index
        ) from exc
    messages = msg.prompt_messages
    chat: list[ChatMessage] = []
    if messages:
        chat = [ChatMessage(m.role, m.content) for m in messages]
        size = sum(len(m.role) + len(m.content) for m in chat)
        if size > text_max:
            raise _too_long(index, "prompt_messages", size, text_max, "characters")
    prompt_ids: list[int] = []
    response_ids: list[int] = []
    if msg.prompt_ids or msg.response_ids:
        # A token is at least one character of text: the text bound bounds the ids.
        for name, ids in (("prompt_ids", msg.prompt_ids), ("response_ids", msg.response_ids)):
            if len(ids) > text_max:
                raise _too_long(index, name, len(ids), text_max, "token ids")
        prompt_ids, response_ids = list(msg.prompt_ids), list(msg.response_ids)
    return Sample(
        data_source, response, ground_truth, prompt, chat, extra_info, sample_id,
        prompt_ids, response_ids,
    )  # fmt: skip


def samples_from_request(
    request: reward_pb2.ScoreRequest,
    offset: int = 0,
    *,
    max_samples: int | None = None,
    limits: SampleLimits = _NO_LIMITS,
) -> list[Sample]:
    """The request's samples, indexed from ``offset`` (a stream's running count).

    Raises:
        InvalidArgument: more than ``max_samples`` samples (checked before any is
            converted), or a field over ``limits``.
    """
    count = len(request.samples)
    if max_samples is not None and count > max_samples:
        raise InvalidArgument(
            f"request of {count} samples is over the limit of {max_samples}",
            field="samples",
            value=count,
            code="TOO_LARGE",
        )
    return [sample_from_proto(s, offset + i, limits) for i, s in enumerate(request.samples)]


def sample_to_proto(sample: Sample) -> reward_pb2.RewardSample:
    msg = reward_pb2.RewardSample(
        id=sample.id,
        data_source=sample.data_source,
        prompt=sample.prompt,
        response=sample.response,
    )
    for m in sample.prompt_messages:
        msg.prompt_messages.add(role=m.role, content=m.content)
    if sample.prompt_ids:
        msg.prompt_ids.extend(sample.prompt_ids)
    if sample.response_ids:
        msg.response_ids.extend(sample.response_ids)
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
