# Generated from protos/rlfleet/v1 by tools/gen_protos.py. Do not edit.
from rlfleet.v1 import common_pb2 as _common_pb2
from rlfleet.v1 import rollout_pb2 as _rollout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateResponse(_message.Message):
    __slots__ = ("metrics", "global_step", "weight_version")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    global_step: int
    weight_version: int
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ..., global_step: _Optional[int] = ..., weight_version: _Optional[int] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("chunk", "on_policy", "total_steps")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ON_POLICY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.TensorBatchChunk
    on_policy: bool
    total_steps: int
    def __init__(self, chunk: _Optional[_Union[_common_pb2.TensorBatchChunk, _Mapping]] = ..., on_policy: _Optional[bool] = ..., total_steps: _Optional[int] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("metrics", "global_step", "weight_version", "actor_updated")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTOR_UPDATED_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    global_step: int
    weight_version: int
    actor_updated: bool
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ..., global_step: _Optional[int] = ..., weight_version: _Optional[int] = ..., actor_updated: _Optional[bool] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("path", "step", "extra_state_json", "export_hf")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EXTRA_STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    EXPORT_HF_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    extra_state_json: str
    export_hf: bool
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., extra_state_json: _Optional[str] = ..., export_hf: _Optional[bool] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "bytes", "seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    bytes: int
    seconds: float
    def __init__(self, path: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("path", "step", "extra_state_json")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EXTRA_STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    extra_state_json: str
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., extra_state_json: _Optional[str] = ...) -> None: ...

class RolloutTarget(_message.Message):
    __slots__ = ("replica_id", "address")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("targets", "version", "transports", "bucket_bytes")
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedCompositeFieldContainer[RolloutTarget]
    version: int
    transports: _containers.RepeatedScalarFieldContainer[_rollout_pb2.WeightTransport]
    bucket_bytes: int
    def __init__(self, targets: _Optional[_Iterable[_Union[RolloutTarget, _Mapping]]] = ..., version: _Optional[int] = ..., transports: _Optional[_Iterable[_Union[_rollout_pb2.WeightTransport, str]]] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("replica_id", "ok", "error", "transport", "seconds")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    ok: bool
    error: str
    transport: _rollout_pb2.WeightTransport
    seconds: float
    def __init__(self, replica_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., transport: _Optional[_Union[_rollout_pb2.WeightTransport, str]] = ..., seconds: _Optional[float] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("version", "bytes", "results")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes: int
    results: _containers.RepeatedCompositeFieldContainer[PushResult]
    def __init__(self, version: _Optional[int] = ..., bytes: _Optional[int] = ..., results: _Optional[_Iterable[_Union[PushResult, _Mapping]]] = ...) -> None: ...

class SetLRScaleRequest(_message.Message):
    __slots__ = ("role", "scale")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    role: str
    scale: float
    def __init__(self, role: _Optional[str] = ..., scale: _Optional[float] = ...) -> None: ...

class SetLRScaleResponse(_message.Message):
    __slots__ = ("lr",)
    LR_FIELD_NUMBER: _ClassVar[int]
    lr: float
    def __init__(self, lr: _Optional[float] = ...) -> None: ...

class GetTrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("global_step", "weight_version", "backend", "world_size", "roles", "model")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    weight_version: int
    backend: str
    world_size: int
    roles: _containers.RepeatedScalarFieldContainer[str]
    model: str
    def __init__(self, global_step: _Optional[int] = ..., weight_version: _Optional[int] = ..., backend: _Optional[str] = ..., world_size: _Optional[int] = ..., roles: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ...) -> None: ...
