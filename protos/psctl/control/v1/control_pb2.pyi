from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_STARTING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_PAUSED: _ClassVar[JobState]
    JOB_STATE_CHECKPOINTING: _ClassVar[JobState]
    JOB_STATE_RECOVERING: _ClassVar[JobState]
    JOB_STATE_STOPPING: _ClassVar[JobState]
    JOB_STATE_DONE: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]

class TaskHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_HEALTH_UNSPECIFIED: _ClassVar[TaskHealth]
    TASK_HEALTH_SERVING: _ClassVar[TaskHealth]
    TASK_HEALTH_NOT_SERVING: _ClassVar[TaskHealth]
    TASK_HEALTH_UNREACHABLE: _ClassVar[TaskHealth]
    TASK_HEALTH_UNKNOWN: _ClassVar[TaskHealth]

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATE_UNSPECIFIED: _ClassVar[TaskState]
    TASK_STATE_JOINING: _ClassVar[TaskState]
    TASK_STATE_SERVING: _ClassVar[TaskState]
    TASK_STATE_DRAINING: _ClassVar[TaskState]
    TASK_STATE_LEFT: _ClassVar[TaskState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_STARTING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_PAUSED: JobState
JOB_STATE_CHECKPOINTING: JobState
JOB_STATE_RECOVERING: JobState
JOB_STATE_STOPPING: JobState
JOB_STATE_DONE: JobState
JOB_STATE_FAILED: JobState
TASK_HEALTH_UNSPECIFIED: TaskHealth
TASK_HEALTH_SERVING: TaskHealth
TASK_HEALTH_NOT_SERVING: TaskHealth
TASK_HEALTH_UNREACHABLE: TaskHealth
TASK_HEALTH_UNKNOWN: TaskHealth
TASK_STATE_UNSPECIFIED: TaskState
TASK_STATE_JOINING: TaskState
TASK_STATE_SERVING: TaskState
TASK_STATE_DRAINING: TaskState
TASK_STATE_LEFT: TaskState

class Task(_message.Message):
    __slots__ = ("type", "index", "address", "health", "health_address", "failures", "metrics_url", "pid", "state")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    HEALTH_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    type: str
    index: int
    address: str
    health: TaskHealth
    health_address: str
    failures: int
    metrics_url: str
    pid: int
    state: TaskState
    def __init__(self, type: _Optional[str] = ..., index: _Optional[int] = ..., address: _Optional[str] = ..., health: _Optional[_Union[TaskHealth, str]] = ..., health_address: _Optional[str] = ..., failures: _Optional[int] = ..., metrics_url: _Optional[str] = ..., pid: _Optional[int] = ..., state: _Optional[_Union[TaskState, str]] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("path", "step", "time_unix_seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    time_unix_seconds: float
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., time_unix_seconds: _Optional[float] = ...) -> None: ...

class Table(_message.Message):
    __slots__ = ("name", "rows", "admitted", "evicted", "bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    admitted: int
    evicted: int
    bytes: int
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., admitted: _Optional[int] = ..., evicted: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class Tunnel(_message.Message):
    __slots__ = ("address", "updated_unix_seconds", "peers", "refused")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    address: str
    updated_unix_seconds: float
    peers: _containers.RepeatedCompositeFieldContainer[TunnelPeer]
    refused: _containers.RepeatedCompositeFieldContainer[TunnelRefusal]
    def __init__(self, address: _Optional[str] = ..., updated_unix_seconds: _Optional[float] = ..., peers: _Optional[_Iterable[_Union[TunnelPeer, _Mapping]]] = ..., refused: _Optional[_Iterable[_Union[TunnelRefusal, _Mapping]]] = ...) -> None: ...

class TunnelPeer(_message.Message):
    __slots__ = ("address", "handshake_unix_seconds")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    address: str
    handshake_unix_seconds: float
    def __init__(self, address: _Optional[str] = ..., handshake_unix_seconds: _Optional[float] = ...) -> None: ...

class TunnelRefusal(_message.Message):
    __slots__ = ("source", "count", "last_unix_seconds")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LAST_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    source: str
    count: int
    last_unix_seconds: float
    def __init__(self, source: _Optional[str] = ..., count: _Optional[int] = ..., last_unix_seconds: _Optional[float] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("job", "state", "global_step", "target_steps", "steps_per_second", "examples_per_second", "loss", "metrics", "eval_metrics", "eval_step", "last_checkpoint", "tasks", "uptime_seconds", "steps_per_execution", "message", "tables", "cluster_generation", "tunnel", "freshness")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class EvalMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    EVAL_METRICS_FIELD_NUMBER: _ClassVar[int]
    EVAL_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_EXECUTION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_GENERATION_FIELD_NUMBER: _ClassVar[int]
    TUNNEL_FIELD_NUMBER: _ClassVar[int]
    FRESHNESS_FIELD_NUMBER: _ClassVar[int]
    job: str
    state: JobState
    global_step: int
    target_steps: int
    steps_per_second: float
    examples_per_second: float
    loss: float
    metrics: _containers.ScalarMap[str, float]
    eval_metrics: _containers.ScalarMap[str, float]
    eval_step: int
    last_checkpoint: Checkpoint
    tasks: _containers.RepeatedCompositeFieldContainer[Task]
    uptime_seconds: float
    steps_per_execution: int
    message: str
    tables: _containers.RepeatedCompositeFieldContainer[Table]
    cluster_generation: int
    tunnel: Tunnel
    freshness: Freshness
    def __init__(self, job: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., global_step: _Optional[int] = ..., target_steps: _Optional[int] = ..., steps_per_second: _Optional[float] = ..., examples_per_second: _Optional[float] = ..., loss: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., eval_metrics: _Optional[_Mapping[str, float]] = ..., eval_step: _Optional[int] = ..., last_checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., tasks: _Optional[_Iterable[_Union[Task, _Mapping]]] = ..., uptime_seconds: _Optional[float] = ..., steps_per_execution: _Optional[int] = ..., message: _Optional[str] = ..., tables: _Optional[_Iterable[_Union[Table, _Mapping]]] = ..., cluster_generation: _Optional[int] = ..., tunnel: _Optional[_Union[Tunnel, _Mapping]] = ..., freshness: _Optional[_Union[Freshness, _Mapping]] = ...) -> None: ...

class Freshness(_message.Message):
    __slots__ = ("files_trained", "files_waiting", "input_lag_seconds", "newest_file", "published_version", "publish_age_seconds", "export_dir", "following", "publish_decision")
    FILES_TRAINED_FIELD_NUMBER: _ClassVar[int]
    FILES_WAITING_FIELD_NUMBER: _ClassVar[int]
    INPUT_LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_FILE_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPORT_DIR_FIELD_NUMBER: _ClassVar[int]
    FOLLOWING_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_DECISION_FIELD_NUMBER: _ClassVar[int]
    files_trained: int
    files_waiting: int
    input_lag_seconds: float
    newest_file: str
    published_version: int
    publish_age_seconds: float
    export_dir: str
    following: bool
    publish_decision: str
    def __init__(self, files_trained: _Optional[int] = ..., files_waiting: _Optional[int] = ..., input_lag_seconds: _Optional[float] = ..., newest_file: _Optional[str] = ..., published_version: _Optional[int] = ..., publish_age_seconds: _Optional[float] = ..., export_dir: _Optional[str] = ..., following: _Optional[bool] = ..., publish_decision: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStatusRequest(_message.Message):
    __slots__ = ("interval_seconds",)
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    interval_seconds: float
    def __init__(self, interval_seconds: _Optional[float] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: Checkpoint
    def __init__(self, checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    def __init__(self, state: _Optional[_Union[JobState, str]] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    def __init__(self, state: _Optional[_Union[JobState, str]] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    def __init__(self, state: _Optional[_Union[JobState, str]] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("workers", "ps", "cluster_json")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_JSON_FIELD_NUMBER: _ClassVar[int]
    workers: int
    ps: int
    cluster_json: str
    def __init__(self, workers: _Optional[int] = ..., ps: _Optional[int] = ..., cluster_json: _Optional[str] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("cluster_generation", "message")
    CLUSTER_GENERATION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    cluster_generation: int
    message: str
    def __init__(self, cluster_generation: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
