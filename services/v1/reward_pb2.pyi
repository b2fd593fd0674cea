# Generated from protos/rlfleet/v1 by tools/gen_protos.py. Do not edit.
from google.protobuf import struct_pb2 as _struct_pb2
from rlfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RewardSample(_message.Message):
    __slots__ = ("id", "data_source", "prompt", "prompt_messages", "response", "ground_truth", "extra_info", "prompt_ids", "response_ids")
    ID_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INFO_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    data_source: str
    prompt: str
    prompt_messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    response: str
    ground_truth: _struct_pb2.Value
    extra_info: _struct_pb2.Struct
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[str] = ..., data_source: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., response: _Optional[str] = ..., ground_truth: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., extra_info: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("samples", "pack_results")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PACK_RESULTS_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[RewardSample]
    pack_results: bool
    def __init__(self, samples: _Optional[_Iterable[_Union[RewardSample, _Mapping]]] = ..., pack_results: _Optional[bool] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("id", "index", "score", "scorer", "details", "error", "timed_out", "more")
    ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    SCORER_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    id: str
    index: int
    score: float
    scorer: str
    details: _struct_pb2.Struct
    error: str
    timed_out: bool
    more: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    def __init__(self, id: _Optional[str] = ..., index: _Optional[int] = ..., score: _Optional[float] = ..., scorer: _Optional[str] = ..., details: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., error: _Optional[str] = ..., timed_out: _Optional[bool] = ..., more: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ...) -> None: ...

class GetRewardInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RewardInfo(_message.Message):
    __slots__ = ("scorers", "data_sources", "default_scorer", "reward_model", "max_batch_size", "sample_timeout_s", "processes")
    class DataSourcesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SCORERS_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SCORER_FIELD_NUMBER: _ClassVar[int]
    REWARD_MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    scorers: _containers.RepeatedScalarFieldContainer[str]
    data_sources: _containers.ScalarMap[str, str]
    default_scorer: str
    reward_model: str
    max_batch_size: int
    sample_timeout_s: float
    processes: int
    def __init__(self, scorers: _Optional[_Iterable[str]] = ..., data_sources: _Optional[_Mapping[str, str]] = ..., default_scorer: _Optional[str] = ..., reward_model: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., sample_timeout_s: _Optional[float] = ..., processes: _Optional[int] = ...) -> None: ...
