from ftis.v1 import bundle_pb2 as _bundle_pb2
from ftis.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterPayload(_message.Message):
    __slots__ = ("model_card", "client_version", "timestamp_ms", "display_name", "capabilities")
    MODEL_CARD_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    model_card: _bundle_pb2.ModelCard
    client_version: str
    timestamp_ms: int
    display_name: str
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_card: _Optional[_Union[_bundle_pb2.ModelCard, _Mapping]] = ..., client_version: _Optional[str] = ..., timestamp_ms: _Optional[int] = ..., display_name: _Optional[str] = ..., capabilities: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("envelope",)
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    envelope: _bundle_pb2.SignedEnvelope
    def __init__(self, envelope: _Optional[_Union[_bundle_pb2.SignedEnvelope, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("error", "node_id", "heartbeat_interval_ms", "server_time_ms", "tokenizer_known")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_KNOWN_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    node_id: str
    heartbeat_interval_ms: int
    server_time_ms: int
    tokenizer_known: bool
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., node_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ..., server_time_ms: _Optional[int] = ..., tokenizer_known: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "policy_version", "auth")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    policy_version: int
    auth: _common_pb2.RequestAuth
    def __init__(self, node_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., auth: _Optional[_Union[_common_pb2.RequestAuth, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("error", "server_time_ms", "reputation", "quarantined")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    REPUTATION_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    server_time_ms: int
    reputation: float
    quarantined: bool
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., server_time_ms: _Optional[int] = ..., reputation: _Optional[float] = ..., quarantined: _Optional[bool] = ...) -> None: ...

class LeaseTasksRequest(_message.Message):
    __slots__ = ("node_id", "count", "group_size", "max_new_tokens", "auth")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    count: int
    group_size: int
    max_new_tokens: int
    auth: _common_pb2.RequestAuth
    def __init__(self, node_id: _Optional[str] = ..., count: _Optional[int] = ..., group_size: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., auth: _Optional[_Union[_common_pb2.RequestAuth, _Mapping]] = ...) -> None: ...

class TaskLease(_message.Message):
    __slots__ = ("lease_id", "task_id", "dataset", "messages", "question", "deadline_ms", "group_size", "max_new_tokens")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    task_id: str
    dataset: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    question: str
    deadline_ms: int
    group_size: int
    max_new_tokens: int
    def __init__(self, lease_id: _Optional[str] = ..., task_id: _Optional[str] = ..., dataset: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., question: _Optional[str] = ..., deadline_ms: _Optional[int] = ..., group_size: _Optional[int] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class LeaseTasksResponse(_message.Message):
    __slots__ = ("error", "leases")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    leases: _containers.RepeatedCompositeFieldContainer[TaskLease]
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., leases: _Optional[_Iterable[_Union[TaskLease, _Mapping]]] = ...) -> None: ...

class SubmitBundleRequest(_message.Message):
    __slots__ = ("envelope",)
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    envelope: _bundle_pb2.SignedEnvelope
    def __init__(self, envelope: _Optional[_Union[_bundle_pb2.SignedEnvelope, _Mapping]] = ...) -> None: ...

class SubmitBundleResponse(_message.Message):
    __slots__ = ("error", "bundle_id", "verified_rewards", "reward_mismatches")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_ID_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_REWARDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    bundle_id: str
    verified_rewards: _containers.RepeatedScalarFieldContainer[float]
    reward_mismatches: int
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., bundle_id: _Optional[str] = ..., verified_rewards: _Optional[_Iterable[float]] = ..., reward_mismatches: _Optional[int] = ...) -> None: ...

class PullBundlesRequest(_message.Message):
    __slots__ = ("node_id", "cursor", "max_bundles", "tokenizer_fingerprint", "skip_zero_variance", "auth")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    MAX_BUNDLES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SKIP_ZERO_VARIANCE_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    cursor: int
    max_bundles: int
    tokenizer_fingerprint: str
    skip_zero_variance: bool
    auth: _common_pb2.RequestAuth
    def __init__(self, node_id: _Optional[str] = ..., cursor: _Optional[int] = ..., max_bundles: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., skip_zero_variance: _Optional[bool] = ..., auth: _Optional[_Union[_common_pb2.RequestAuth, _Mapping]] = ...) -> None: ...

class RelayedBundle(_message.Message):
    __slots__ = ("sequence", "bundle_id", "envelope", "verified_rewards", "stored_at_ms", "sender_reputation", "task_question", "audit_only")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_ID_FIELD_NUMBER: _ClassVar[int]
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_REWARDS_FIELD_NUMBER: _ClassVar[int]
    STORED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    SENDER_REPUTATION_FIELD_NUMBER: _ClassVar[int]
    TASK_QUESTION_FIELD_NUMBER: _ClassVar[int]
    AUDIT_ONLY_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    bundle_id: str
    envelope: _bundle_pb2.SignedEnvelope
    verified_rewards: _containers.RepeatedScalarFieldContainer[float]
    stored_at_ms: int
    sender_reputation: float
    task_question: str
    audit_only: bool
    def __init__(self, sequence: _Optional[int] = ..., bundle_id: _Optional[str] = ..., envelope: _Optional[_Union[_bundle_pb2.SignedEnvelope, _Mapping]] = ..., verified_rewards: _Optional[_Iterable[float]] = ..., stored_at_ms: _Optional[int] = ..., sender_reputation: _Optional[float] = ..., task_question: _Optional[str] = ..., audit_only: _Optional[bool] = ...) -> None: ...

class PullBundlesResponse(_message.Message):
    __slots__ = ("error", "bundles", "next_cursor")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BUNDLES_FIELD_NUMBER: _ClassVar[int]
    NEXT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    bundles: _containers.RepeatedCompositeFieldContainer[RelayedBundle]
    next_cursor: int
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., bundles: _Optional[_Iterable[_Union[RelayedBundle, _Mapping]]] = ..., next_cursor: _Optional[int] = ...) -> None: ...

class SenderFeedback(_message.Message):
    __slots__ = ("sender_node_id", "groups", "tokens", "mean_log_ratio", "filtered_frac", "truncated_frac", "text_mismatches", "invalid_bundles", "bundle_ids", "log_ratio_completions", "log_ratio_stderr")
    SENDER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOG_RATIO_FIELD_NUMBER: _ClassVar[int]
    FILTERED_FRAC_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FRAC_FIELD_NUMBER: _ClassVar[int]
    TEXT_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    INVALID_BUNDLES_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOG_RATIO_COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    LOG_RATIO_STDERR_FIELD_NUMBER: _ClassVar[int]
    sender_node_id: str
    groups: int
    tokens: int
    mean_log_ratio: float
    filtered_frac: float
    truncated_frac: float
    text_mismatches: int
    invalid_bundles: int
    bundle_ids: _containers.RepeatedScalarFieldContainer[str]
    log_ratio_completions: int
    log_ratio_stderr: float
    def __init__(self, sender_node_id: _Optional[str] = ..., groups: _Optional[int] = ..., tokens: _Optional[int] = ..., mean_log_ratio: _Optional[float] = ..., filtered_frac: _Optional[float] = ..., truncated_frac: _Optional[float] = ..., text_mismatches: _Optional[int] = ..., invalid_bundles: _Optional[int] = ..., bundle_ids: _Optional[_Iterable[str]] = ..., log_ratio_completions: _Optional[int] = ..., log_ratio_stderr: _Optional[float] = ...) -> None: ...

class ReportMetricsRequest(_message.Message):
    __slots__ = ("node_id", "step", "values", "feedback", "auth")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    step: int
    values: _containers.ScalarMap[str, float]
    feedback: _containers.RepeatedCompositeFieldContainer[SenderFeedback]
    auth: _common_pb2.RequestAuth
    def __init__(self, node_id: _Optional[str] = ..., step: _Optional[int] = ..., values: _Optional[_Mapping[str, float]] = ..., feedback: _Optional[_Iterable[_Union[SenderFeedback, _Mapping]]] = ..., auth: _Optional[_Union[_common_pb2.RequestAuth, _Mapping]] = ...) -> None: ...

class ReportMetricsResponse(_message.Message):
    __slots__ = ("error", "dropped_feedback")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    dropped_feedback: _containers.RepeatedCompositeFieldContainer[DroppedFeedback]
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., dropped_feedback: _Optional[_Iterable[_Union[DroppedFeedback, _Mapping]]] = ...) -> None: ...

class DroppedFeedback(_message.Message):
    __slots__ = ("index", "sender_node_id", "error")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SENDER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    index: int
    sender_node_id: str
    error: _common_pb2.Error
    def __init__(self, index: _Optional[int] = ..., sender_node_id: _Optional[str] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class UploadTokenizerRequest(_message.Message):
    __slots__ = ("node_id", "fingerprint", "tokenizer_json_gz", "auth")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_GZ_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    fingerprint: str
    tokenizer_json_gz: bytes
    auth: _common_pb2.RequestAuth
    def __init__(self, node_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., tokenizer_json_gz: _Optional[bytes] = ..., auth: _Optional[_Union[_common_pb2.RequestAuth, _Mapping]] = ...) -> None: ...

class UploadTokenizerResponse(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...
