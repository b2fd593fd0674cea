# Generated from protos/rlfleet/v1 by tools/gen_protos.py. Do not edit.
from rlfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class WeightTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_TRANSPORT_UNSPECIFIED: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_GRPC: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_TCP: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_SHM: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_NCCL: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_CUDA_IPC: _ClassVar[WeightTransport]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
WEIGHT_TRANSPORT_UNSPECIFIED: WeightTransport
WEIGHT_TRANSPORT_GRPC: WeightTransport
WEIGHT_TRANSPORT_TCP: WeightTransport
WEIGHT_TRANSPORT_SHM: WeightTransport
WEIGHT_TRANSPORT_NCCL: WeightTransport
WEIGHT_TRANSPORT_CUDA_IPC: WeightTransport

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed", "logprobs", "detokenize", "ignore_eos")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    logprobs: bool
    detokenize: bool
    ignore_eos: bool
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., detokenize: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("id", "token_ids", "seed_index")
    ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_INDEX_FIELD_NUMBER: _ClassVar[int]
    id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed_index: int
    def __init__(self, id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., seed_index: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompts", "sampling", "min_weight_version", "pack_results")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PACK_RESULTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    min_weight_version: int
    pack_results: bool
    def __init__(self, request_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., min_weight_version: _Optional[int] = ..., pack_results: _Optional[bool] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("prompt_id", "prompt_index", "sample_index", "token_ids", "logprobs", "text", "finish_reason", "weight_version", "replica_id", "loss_mask", "token_weight_versions", "more")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    prompt_index: int
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    finish_reason: FinishReason
    weight_version: int
    replica_id: str
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    token_weight_versions: _containers.RepeatedScalarFieldContainer[int]
    more: _containers.RepeatedCompositeFieldContainer[GenerateResult]
    def __init__(self, prompt_id: _Optional[str] = ..., prompt_index: _Optional[int] = ..., sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., weight_version: _Optional[int] = ..., replica_id: _Optional[str] = ..., loss_mask: _Optional[_Iterable[bool]] = ..., token_weight_versions: _Optional[_Iterable[int]] = ..., more: _Optional[_Iterable[_Union[GenerateResult, _Mapping]]] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("version", "chunk")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    version: int
    chunk: _common_pb2.TensorBatchChunk
    def __init__(self, version: _Optional[int] = ..., chunk: _Optional[_Union[_common_pb2.TensorBatchChunk, _Mapping]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "bytes", "tensors", "seconds", "staged")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes: int
    tensors: int
    seconds: float
    staged: bool
    def __init__(self, version: _Optional[int] = ..., bytes: _Optional[int] = ..., tensors: _Optional[int] = ..., seconds: _Optional[float] = ..., staged: _Optional[bool] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _common_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class WeightTransferOffer(_message.Message):
    __slots__ = ("version", "tensors", "total_bytes", "transports", "sender_host", "bucket", "more_buckets", "update_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    SENDER_HOST_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    MORE_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    total_bytes: int
    transports: _containers.RepeatedScalarFieldContainer[WeightTransport]
    sender_host: str
    bucket: int
    more_buckets: bool
    update_id: str
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., transports: _Optional[_Iterable[_Union[WeightTransport, str]]] = ..., sender_host: _Optional[str] = ..., bucket: _Optional[int] = ..., more_buckets: _Optional[bool] = ..., update_id: _Optional[str] = ...) -> None: ...

class WeightTransferPlan(_message.Message):
    __slots__ = ("transfer_id", "transport", "endpoint", "token", "update_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    transport: WeightTransport
    endpoint: str
    token: str
    update_id: str
    def __init__(self, transfer_id: _Optional[str] = ..., transport: _Optional[_Union[WeightTransport, str]] = ..., endpoint: _Optional[str] = ..., token: _Optional[str] = ..., update_id: _Optional[str] = ...) -> None: ...

class WeightTransferCommit(_message.Message):
    __slots__ = ("transfer_id", "crc32c")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_id: _Optional[str] = ..., crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortWeightTransferRequest(_message.Message):
    __slots__ = ("update_id", "reason")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    reason: str
    def __init__(self, update_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortWeightTransferResponse(_message.Message):
    __slots__ = ("aborted", "staged_buckets", "freed_bytes")
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    STAGED_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    staged_buckets: int
    freed_bytes: int
    def __init__(self, aborted: _Optional[bool] = ..., staged_buckets: _Optional[int] = ..., freed_bytes: _Optional[int] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("freed_bytes",)
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    def __init__(self, freed_bytes: _Optional[int] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRolloutStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("replica_id", "model", "engine", "dtype", "device", "weight_version", "queue_depth", "tokens_per_second", "sleeping", "generated_tokens_total", "weight_staged_bytes", "weight_spare_bytes")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SPARE_BYTES_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    model: str
    engine: str
    dtype: str
    device: str
    weight_version: int
    queue_depth: int
    tokens_per_second: float
    sleeping: bool
    generated_tokens_total: int
    weight_staged_bytes: int
    weight_spare_bytes: int
    def __init__(self, replica_id: _Optional[str] = ..., model: _Optional[str] = ..., engine: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., weight_version: _Optional[int] = ..., queue_depth: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., sleeping: _Optional[bool] = ..., generated_tokens_total: _Optional[int] = ..., weight_staged_bytes: _Optional[int] = ..., weight_spare_bytes: _Optional[int] = ...) -> None: ...

class GetTrajectoriesRequest(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PopTrajectoriesRequest(_message.Message):
    __slots__ = ("max_sessions",)
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    max_sessions: int
    def __init__(self, max_sessions: _Optional[int] = ...) -> None: ...

class TrajectoryCompletion(_message.Message):
    __slots__ = ("prompt_token_ids", "token_ids", "logprobs", "weight_version", "finish_reason", "temperature", "created_unix_s")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version: int
    finish_reason: FinishReason
    temperature: float
    created_unix_s: float
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., weight_version: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., temperature: _Optional[float] = ..., created_unix_s: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("session_id", "completions", "finished", "reward", "info")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    completions: _containers.RepeatedCompositeFieldContainer[TrajectoryCompletion]
    finished: bool
    reward: float
    info: _containers.ScalarMap[str, str]
    def __init__(self, session_id: _Optional[str] = ..., completions: _Optional[_Iterable[_Union[TrajectoryCompletion, _Mapping]]] = ..., finished: _Optional[bool] = ..., reward: _Optional[float] = ..., info: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TrajectoriesResponse(_message.Message):
    __slots__ = ("trajectories", "replica_id")
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    replica_id: str
    def __init__(self, trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ..., replica_id: _Optional[str] = ...) -> None: ...
