# Generated from protos/rlfleet/v1 by tools/gen_protos.py. Do not edit.
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_ROLLOUT: _ClassVar[Role]
    ROLE_REWARD: _ClassVar[Role]
    ROLE_TRAINER: _ClassVar[Role]
    ROLE_SCHEDULER: _ClassVar[Role]

class ServiceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVICE_STATE_UNSPECIFIED: _ClassVar[ServiceState]
    SERVICE_STATE_ALIVE: _ClassVar[ServiceState]
    SERVICE_STATE_DEAD: _ClassVar[ServiceState]
ROLE_UNSPECIFIED: Role
ROLE_ROLLOUT: Role
ROLE_REWARD: Role
ROLE_TRAINER: Role
ROLE_SCHEDULER: Role
SERVICE_STATE_UNSPECIFIED: ServiceState
SERVICE_STATE_ALIVE: ServiceState
SERVICE_STATE_DEAD: ServiceState

class Device(_message.Message):
    __slots__ = ("kind", "index", "name", "memory_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    index: int
    name: str
    memory_bytes: int
    def __init__(self, kind: _Optional[str] = ..., index: _Optional[int] = ..., name: _Optional[str] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("service_id", "role", "address", "node", "devices", "capabilities", "capacity", "metrics_address", "pid")
    class CapabilitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    service_id: str
    role: Role
    address: str
    node: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    capabilities: _containers.ScalarMap[str, str]
    capacity: int
    metrics_address: str
    pid: int
    def __init__(self, service_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., node: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., capabilities: _Optional[_Mapping[str, str]] = ..., capacity: _Optional[int] = ..., metrics_address: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("info", "lease")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    info: ServiceInfo
    lease: str
    def __init__(self, info: _Optional[_Union[ServiceInfo, _Mapping]] = ..., lease: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("service_id", "heartbeat_interval_s", "weight_version", "lease")
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    service_id: str
    heartbeat_interval_s: float
    weight_version: int
    lease: str
    def __init__(self, service_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., weight_version: _Optional[int] = ..., lease: _Optional[str] = ...) -> None: ...

class ServiceLoad(_message.Message):
    __slots__ = ("queue_depth", "tokens_per_second", "weight_version")
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    queue_depth: int
    tokens_per_second: float
    weight_version: int
    def __init__(self, queue_depth: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., weight_version: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("service_id", "load", "lease")
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    service_id: str
    load: ServiceLoad
    lease: str
    def __init__(self, service_id: _Optional[str] = ..., load: _Optional[_Union[ServiceLoad, _Mapping]] = ..., lease: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("service_id", "lease")
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    service_id: str
    lease: str
    def __init__(self, service_id: _Optional[str] = ..., lease: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListServicesRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: Role
    def __init__(self, role: _Optional[_Union[Role, str]] = ...) -> None: ...

class ServiceEntry(_message.Message):
    __slots__ = ("info", "state", "last_heartbeat_unix", "load")
    INFO_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    info: ServiceInfo
    state: ServiceState
    last_heartbeat_unix: float
    load: ServiceLoad
    def __init__(self, info: _Optional[_Union[ServiceInfo, _Mapping]] = ..., state: _Optional[_Union[ServiceState, str]] = ..., last_heartbeat_unix: _Optional[float] = ..., load: _Optional[_Union[ServiceLoad, _Mapping]] = ...) -> None: ...

class ListServicesResponse(_message.Message):
    __slots__ = ("services",)
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    services: _containers.RepeatedCompositeFieldContainer[ServiceEntry]
    def __init__(self, services: _Optional[_Iterable[_Union[ServiceEntry, _Mapping]]] = ...) -> None: ...

class Pool(_message.Message):
    __slots__ = ("gpus_per_node",)
    GPUS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    gpus_per_node: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, gpus_per_node: _Optional[_Iterable[int]] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("resource_pools", "mapping")
    class ResourcePoolsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Pool
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Pool, _Mapping]] = ...) -> None: ...
    class MappingEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RESOURCE_POOLS_FIELD_NUMBER: _ClassVar[int]
    MAPPING_FIELD_NUMBER: _ClassVar[int]
    resource_pools: _containers.MessageMap[str, Pool]
    mapping: _containers.ScalarMap[str, str]
    def __init__(self, resource_pools: _Optional[_Mapping[str, Pool]] = ..., mapping: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("role", "pool", "service_id", "devices")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    role: str
    pool: str
    service_id: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    def __init__(self, role: _Optional[str] = ..., pool: _Optional[str] = ..., service_id: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("assignments", "colocated")
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    assignments: _containers.RepeatedCompositeFieldContainer[Assignment]
    colocated: bool
    def __init__(self, assignments: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ..., colocated: _Optional[bool] = ...) -> None: ...

class GetPlacementRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTrainingStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetScaleRequest(_message.Message):
    __slots__ = ("role", "replicas")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    role: Role
    replicas: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., replicas: _Optional[int] = ...) -> None: ...

class GetScaleRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: Role
    def __init__(self, role: _Optional[_Union[Role, str]] = ...) -> None: ...

class Scale(_message.Message):
    __slots__ = ("role", "replicas", "generation")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    role: Role
    replicas: int
    generation: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., replicas: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class TrainingStatus(_message.Message):
    __slots__ = ("global_step", "total_steps", "weight_version", "metrics", "state")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    total_steps: int
    weight_version: int
    metrics: _containers.ScalarMap[str, float]
    state: str
    def __init__(self, global_step: _Optional[int] = ..., total_steps: _Optional[int] = ..., weight_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., state: _Optional[str] = ...) -> None: ...
