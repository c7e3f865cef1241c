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
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class ModelCard(_message.Message):
    __slots__ = ("base_model", "parameter_count", "peft", "dtype", "quantization", "tokenizer_fingerprint", "vocab_size", "trainable_parameter_count")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    PEFT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    parameter_count: int
    peft: str
    dtype: str
    quantization: str
    tokenizer_fingerprint: str
    vocab_size: int
    trainable_parameter_count: int
    def __init__(self, base_model: _Optional[str] = ..., parameter_count: _Optional[int] = ..., peft: _Optional[str] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., trainable_parameter_count: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "logprobs", "text", "claimed_reward", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_REWARD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    claimed_reward: float
    finish_reason: FinishReason
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., claimed_reward: _Optional[float] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class Bundle(_message.Message):
    __slots__ = ("task_id", "lease_id", "node_id", "model_card", "policy_version", "sampling", "prompt_token_ids", "prompt_text", "completions", "created_at_ms")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_CARD_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    lease_id: str
    node_id: str
    model_card: ModelCard
    policy_version: int
    sampling: SamplingParams
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    created_at_ms: int
    def __init__(self, task_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., node_id: _Optional[str] = ..., model_card: _Optional[_Union[ModelCard, _Mapping]] = ..., policy_version: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., created_at_ms: _Optional[int] = ...) -> None: ...

class SignedEnvelope(_message.Message):
    __slots__ = ("payload_type", "payload", "public_key", "signature")
    PAYLOAD_TYPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    payload_type: str
    payload: bytes
    public_key: bytes
    signature: bytes
    def __init__(self, payload_type: _Optional[str] = ..., payload: _Optional[bytes] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...
