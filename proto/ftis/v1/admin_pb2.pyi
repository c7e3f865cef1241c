from ftis.v1 import bundle_pb2 as _bundle_pb2
from ftis.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "display_name", "model_card", "registered_at_ms", "last_seen_ms", "banned", "ban_reason", "policy_version", "bundles_accepted", "bundles_rejected", "reward_mismatches", "latest_metrics", "latest_metrics_step", "reputation", "evidence_good", "evidence_bad", "quarantined", "probation", "branch")
    class LatestMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_CARD_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_MS_FIELD_NUMBER: _ClassVar[int]
    BANNED_FIELD_NUMBER: _ClassVar[int]
    BAN_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUNDLES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BUNDLES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    REWARD_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    LATEST_METRICS_FIELD_NUMBER: _ClassVar[int]
    LATEST_METRICS_STEP_FIELD_NUMBER: _ClassVar[int]
    REPUTATION_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_GOOD_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_BAD_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    PROBATION_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    display_name: str
    model_card: _bundle_pb2.ModelCard
    registered_at_ms: int
    last_seen_ms: int
    banned: bool
    ban_reason: str
    policy_version: int
    bundles_accepted: int
    bundles_rejected: int
    reward_mismatches: int
    latest_metrics: _containers.ScalarMap[str, float]
    latest_metrics_step: int
    reputation: float
    evidence_good: float
    evidence_bad: float
    quarantined: bool
    probation: bool
    branch: str
    def __init__(self, node_id: _Optional[str] = ..., display_name: _Optional[str] = ..., model_card: _Optional[_Union[_bundle_pb2.ModelCard, _Mapping]] = ..., registered_at_ms: _Optional[int] = ..., last_seen_ms: _Optional[int] = ..., banned: _Optional[bool] = ..., ban_reason: _Optional[str] = ..., policy_version: _Optional[int] = ..., bundles_accepted: _Optional[int] = ..., bundles_rejected: _Optional[int] = ..., reward_mismatches: _Optional[int] = ..., latest_metrics: _Optional[_Mapping[str, float]] = ..., latest_metrics_step: _Optional[int] = ..., reputation: _Optional[float] = ..., evidence_good: _Optional[float] = ..., evidence_bad: _Optional[float] = ..., quarantined: _Optional[bool] = ..., probation: _Optional[bool] = ..., branch: _Optional[str] = ...) -> None: ...

class Evidence(_message.Message):
    __slots__ = ("at_ms", "kind", "weight", "detail", "reporter_node_id", "bundle_id")
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REPORTER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_ID_FIELD_NUMBER: _ClassVar[int]
    at_ms: int
    kind: str
    weight: float
    detail: str
    reporter_node_id: str
    bundle_id: str
    def __init__(self, at_ms: _Optional[int] = ..., kind: _Optional[str] = ..., weight: _Optional[float] = ..., detail: _Optional[str] = ..., reporter_node_id: _Optional[str] = ..., bundle_id: _Optional[str] = ...) -> None: ...

class ReputationConfig(_message.Message):
    __slots__ = ("quarantine_threshold", "half_life_s", "probation_bundles", "probation_threshold", "feedback_weight", "log_ratio_tolerance", "auto_ban_on_proof", "feedback_cap", "filtered_frac_limit", "corroborating_reporters", "corroborated_cap", "reporter_maturity_s", "shift_margin", "shift_z", "shift_min_completions", "audit_reporters")
    QUARANTINE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    HALF_LIFE_S_FIELD_NUMBER: _ClassVar[int]
    PROBATION_BUNDLES_FIELD_NUMBER: _ClassVar[int]
    PROBATION_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    LOG_RATIO_TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    AUTO_BAN_ON_PROOF_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_CAP_FIELD_NUMBER: _ClassVar[int]
    FILTERED_FRAC_LIMIT_FIELD_NUMBER: _ClassVar[int]
    CORROBORATING_REPORTERS_FIELD_NUMBER: _ClassVar[int]
    CORROBORATED_CAP_FIELD_NUMBER: _ClassVar[int]
    REPORTER_MATURITY_S_FIELD_NUMBER: _ClassVar[int]
    SHIFT_MARGIN_FIELD_NUMBER: _ClassVar[int]
    SHIFT_Z_FIELD_NUMBER: _ClassVar[int]
    SHIFT_MIN_COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_REPORTERS_FIELD_NUMBER: _ClassVar[int]
    quarantine_threshold: float
    half_life_s: float
    probation_bundles: int
    probation_threshold: float
    feedback_weight: float
    log_ratio_tolerance: float
    auto_ban_on_proof: bool
    feedback_cap: float
    filtered_frac_limit: float
    corroborating_reporters: int
    corroborated_cap: float
    reporter_maturity_s: float
    shift_margin: float
    shift_z: float
    shift_min_completions: int
    audit_reporters: int
    def __init__(self, quarantine_threshold: _Optional[float] = ..., half_life_s: _Optional[float] = ..., probation_bundles: _Optional[int] = ..., probation_threshold: _Optional[float] = ..., feedback_weight: _Optional[float] = ..., log_ratio_tolerance: _Optional[float] = ..., auto_ban_on_proof: _Optional[bool] = ..., feedback_cap: _Optional[float] = ..., filtered_frac_limit: _Optional[float] = ..., corroborating_reporters: _Optional[int] = ..., corroborated_cap: _Optional[float] = ..., reporter_maturity_s: _Optional[float] = ..., shift_margin: _Optional[float] = ..., shift_z: _Optional[float] = ..., shift_min_completions: _Optional[int] = ..., audit_reporters: _Optional[int] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class GetNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class GetNodeResponse(_message.Message):
    __slots__ = ("error", "node", "rejections_by_code", "evidence")
    class RejectionsByCodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_BY_CODE_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    node: NodeInfo
    rejections_by_code: _containers.ScalarMap[str, int]
    evidence: _containers.RepeatedCompositeFieldContainer[Evidence]
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., node: _Optional[_Union[NodeInfo, _Mapping]] = ..., rejections_by_code: _Optional[_Mapping[str, int]] = ..., evidence: _Optional[_Iterable[_Union[Evidence, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("nodes", "active_nodes", "banned_nodes", "leases_outstanding", "bundles_accepted", "bundles_rejected", "completions", "completion_tokens", "mean_verified_reward", "rejections_by_code", "bundle_bytes", "quarantined_nodes")
    class RejectionsByCodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_NODES_FIELD_NUMBER: _ClassVar[int]
    BANNED_NODES_FIELD_NUMBER: _ClassVar[int]
    LEASES_OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    BUNDLES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BUNDLES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_VERIFIED_REWARD_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_BY_CODE_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: int
    active_nodes: int
    banned_nodes: int
    leases_outstanding: int
    bundles_accepted: int
    bundles_rejected: int
    completions: int
    completion_tokens: int
    mean_verified_reward: float
    rejections_by_code: _containers.ScalarMap[str, int]
    bundle_bytes: int
    quarantined_nodes: int
    def __init__(self, nodes: _Optional[int] = ..., active_nodes: _Optional[int] = ..., banned_nodes: _Optional[int] = ..., leases_outstanding: _Optional[int] = ..., bundles_accepted: _Optional[int] = ..., bundles_rejected: _Optional[int] = ..., completions: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., mean_verified_reward: _Optional[float] = ..., rejections_by_code: _Optional[_Mapping[str, int]] = ..., bundle_bytes: _Optional[int] = ..., quarantined_nodes: _Optional[int] = ...) -> None: ...

class BundleInfo(_message.Message):
    __slots__ = ("sequence", "bundle_id", "node_id", "task_id", "dataset", "completions", "completion_tokens", "mean_verified_reward", "policy_version", "stored_at_ms", "size_bytes", "reward_mismatches")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_VERIFIED_REWARD_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STORED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REWARD_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    bundle_id: str
    node_id: str
    task_id: str
    dataset: str
    completions: int
    completion_tokens: int
    mean_verified_reward: float
    policy_version: int
    stored_at_ms: int
    size_bytes: int
    reward_mismatches: int
    def __init__(self, sequence: _Optional[int] = ..., bundle_id: _Optional[str] = ..., node_id: _Optional[str] = ..., task_id: _Optional[str] = ..., dataset: _Optional[str] = ..., completions: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., mean_verified_reward: _Optional[float] = ..., policy_version: _Optional[int] = ..., stored_at_ms: _Optional[int] = ..., size_bytes: _Optional[int] = ..., reward_mismatches: _Optional[int] = ...) -> None: ...

class ListBundlesRequest(_message.Message):
    __slots__ = ("node_id", "limit")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    limit: int
    def __init__(self, node_id: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ListBundlesResponse(_message.Message):
    __slots__ = ("bundles",)
    BUNDLES_FIELD_NUMBER: _ClassVar[int]
    bundles: _containers.RepeatedCompositeFieldContainer[BundleInfo]
    def __init__(self, bundles: _Optional[_Iterable[_Union[BundleInfo, _Mapping]]] = ...) -> None: ...

class BanNodeRequest(_message.Message):
    __slots__ = ("node_id", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class BanNodeResponse(_message.Message):
    __slots__ = ("error", "node")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    node: NodeInfo
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class UnbanNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class UnbanNodeResponse(_message.Message):
    __slots__ = ("error", "node")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    node: NodeInfo
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class GetReputationConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetReputationConfigResponse(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: ReputationConfig
    def __init__(self, config: _Optional[_Union[ReputationConfig, _Mapping]] = ...) -> None: ...

class SetReputationConfigRequest(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: ReputationConfig
    def __init__(self, config: _Optional[_Union[ReputationConfig, _Mapping]] = ...) -> None: ...

class SetReputationConfigResponse(_message.Message):
    __slots__ = ("error", "config")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    config: ReputationConfig
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., config: _Optional[_Union[ReputationConfig, _Mapping]] = ...) -> None: ...

class BranchInfo(_message.Message):
    __slots__ = ("name", "families", "tokens", "defined_at_ms", "node_ids", "bundles_accepted")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FAMILIES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFINED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    BUNDLES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    families: _containers.RepeatedScalarFieldContainer[str]
    tokens: float
    defined_at_ms: int
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    bundles_accepted: int
    def __init__(self, name: _Optional[str] = ..., families: _Optional[_Iterable[str]] = ..., tokens: _Optional[float] = ..., defined_at_ms: _Optional[int] = ..., node_ids: _Optional[_Iterable[str]] = ..., bundles_accepted: _Optional[int] = ...) -> None: ...

class ListBranchesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBranchesResponse(_message.Message):
    __slots__ = ("branches", "task_mix", "unassigned_nodes")
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    TASK_MIX_FIELD_NUMBER: _ClassVar[int]
    UNASSIGNED_NODES_FIELD_NUMBER: _ClassVar[int]
    branches: _containers.RepeatedCompositeFieldContainer[BranchInfo]
    task_mix: _containers.RepeatedScalarFieldContainer[str]
    unassigned_nodes: int
    def __init__(self, branches: _Optional[_Iterable[_Union[BranchInfo, _Mapping]]] = ..., task_mix: _Optional[_Iterable[str]] = ..., unassigned_nodes: _Optional[int] = ...) -> None: ...

class DefineBranchesRequest(_message.Message):
    __slots__ = ("branches", "replace")
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    branches: _containers.RepeatedCompositeFieldContainer[BranchInfo]
    replace: bool
    def __init__(self, branches: _Optional[_Iterable[_Union[BranchInfo, _Mapping]]] = ..., replace: _Optional[bool] = ...) -> None: ...

class DefineBranchesResponse(_message.Message):
    __slots__ = ("error", "branches")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    branches: _containers.RepeatedCompositeFieldContainer[BranchInfo]
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., branches: _Optional[_Iterable[_Union[BranchInfo, _Mapping]]] = ...) -> None: ...

class AssignBranchRequest(_message.Message):
    __slots__ = ("node_ids", "branch", "round_robin")
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_ROBIN_FIELD_NUMBER: _ClassVar[int]
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    branch: str
    round_robin: bool
    def __init__(self, node_ids: _Optional[_Iterable[str]] = ..., branch: _Optional[str] = ..., round_robin: _Optional[bool] = ...) -> None: ...

class NodeBranch(_message.Message):
    __slots__ = ("node_id", "branch")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    branch: str
    def __init__(self, node_id: _Optional[str] = ..., branch: _Optional[str] = ...) -> None: ...

class AssignBranchResponse(_message.Message):
    __slots__ = ("error", "assignments")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    assignments: _containers.RepeatedCompositeFieldContainer[NodeBranch]
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., assignments: _Optional[_Iterable[_Union[NodeBranch, _Mapping]]] = ...) -> None: ...
