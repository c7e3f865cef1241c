from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ENVELOPE_TOO_LARGE: _ClassVar[ErrorCode]
    ENVELOPE_MALFORMED: _ClassVar[ErrorCode]
    SIGNATURE_INVALID: _ClassVar[ErrorCode]
    PAYLOAD_MALFORMED: _ClassVar[ErrorCode]
    PAYLOAD_TYPE_INVALID: _ClassVar[ErrorCode]
    PAYLOAD_UNKNOWN_FIELDS: _ClassVar[ErrorCode]
    PAYLOAD_NOT_CANONICAL: _ClassVar[ErrorCode]
    NODE_UNKNOWN: _ClassVar[ErrorCode]
    NODE_BANNED: _ClassVar[ErrorCode]
    NODE_MISMATCH: _ClassVar[ErrorCode]
    MODEL_CARD_MISMATCH: _ClassVar[ErrorCode]
    TASK_UNKNOWN: _ClassVar[ErrorCode]
    LEASE_UNKNOWN: _ClassVar[ErrorCode]
    LEASE_FOREIGN: _ClassVar[ErrorCode]
    LEASE_EXPIRED: _ClassVar[ErrorCode]
    BUNDLE_REPLAYED: _ClassVar[ErrorCode]
    TASK_MISMATCH: _ClassVar[ErrorCode]
    LEASE_LIMIT: _ClassVar[ErrorCode]
    GROUP_SIZE_MISMATCH: _ClassVar[ErrorCode]
    COMPLETION_TOO_LONG: _ClassVar[ErrorCode]
    TOKEN_OUT_OF_VOCAB: _ClassVar[ErrorCode]
    LOGPROB_NOT_FINITE: _ClassVar[ErrorCode]
    LOGPROB_POSITIVE: _ClassVar[ErrorCode]
    LOGPROB_COUNT_MISMATCH: _ClassVar[ErrorCode]
    TEXT_MISSING: _ClassVar[ErrorCode]
    COMPLETION_EMPTY: _ClassVar[ErrorCode]
    SAMPLING_INVALID: _ClassVar[ErrorCode]
    PROMPT_MISSING: _ClassVar[ErrorCode]
    REGISTRATION_INVALID: _ClassVar[ErrorCode]
    REQUEST_INVALID: _ClassVar[ErrorCode]
    AUTH_INVALID: _ClassVar[ErrorCode]
    AUTH_EXPIRED: _ClassVar[ErrorCode]
    MODEL_NOT_CHECKABLE: _ClassVar[ErrorCode]
    BRANCH_UNKNOWN: _ClassVar[ErrorCode]
    BRANCH_INVALID: _ClassVar[ErrorCode]
    TEXT_MISMATCH: _ClassVar[ErrorCode]
    PROMPT_MISMATCH: _ClassVar[ErrorCode]
    TOKENIZER_REQUIRED: _ClassVar[ErrorCode]
    TOKENIZER_INVALID: _ClassVar[ErrorCode]
    FEEDBACK_INVALID: _ClassVar[ErrorCode]
    TOKEN_NOT_IN_TOKENIZER: _ClassVar[ErrorCode]
    VOCAB_SIZE_MISMATCH: _ClassVar[ErrorCode]
    RATE_LIMITED: _ClassVar[ErrorCode]
    REGISTRATION_THROTTLED: _ClassVar[ErrorCode]
    REQUEST_TOO_LARGE: _ClassVar[ErrorCode]
    VERIFICATION_BUSY: _ClassVar[ErrorCode]
    LOGPROB_TOO_SMALL: _ClassVar[ErrorCode]
    PROMPT_TOO_LONG: _ClassVar[ErrorCode]
    SCORING_TIMEOUT: _ClassVar[ErrorCode]
    LOGPROB_SPOT_CHECK_FAILED: _ClassVar[ErrorCode]
    INTERNAL: _ClassVar[ErrorCode]
ERROR_CODE_UNSPECIFIED: ErrorCode
ENVELOPE_TOO_LARGE: ErrorCode
ENVELOPE_MALFORMED: ErrorCode
SIGNATURE_INVALID: ErrorCode
PAYLOAD_MALFORMED: ErrorCode
PAYLOAD_TYPE_INVALID: ErrorCode
PAYLOAD_UNKNOWN_FIELDS: ErrorCode
PAYLOAD_NOT_CANONICAL: ErrorCode
NODE_UNKNOWN: ErrorCode
NODE_BANNED: ErrorCode
NODE_MISMATCH: ErrorCode
MODEL_CARD_MISMATCH: ErrorCode
TASK_UNKNOWN: ErrorCode
LEASE_UNKNOWN: ErrorCode
LEASE_FOREIGN: ErrorCode
LEASE_EXPIRED: ErrorCode
BUNDLE_REPLAYED: ErrorCode
TASK_MISMATCH: ErrorCode
LEASE_LIMIT: ErrorCode
GROUP_SIZE_MISMATCH: ErrorCode
COMPLETION_TOO_LONG: ErrorCode
TOKEN_OUT_OF_VOCAB: ErrorCode
LOGPROB_NOT_FINITE: ErrorCode
LOGPROB_POSITIVE: ErrorCode
LOGPROB_COUNT_MISMATCH: ErrorCode
TEXT_MISSING: ErrorCode
COMPLETION_EMPTY: ErrorCode
SAMPLING_INVALID: ErrorCode
PROMPT_MISSING: ErrorCode
REGISTRATION_INVALID: ErrorCode
REQUEST_INVALID: ErrorCode
AUTH_INVALID: ErrorCode
AUTH_EXPIRED: ErrorCode
MODEL_NOT_CHECKABLE: ErrorCode
BRANCH_UNKNOWN: ErrorCode
BRANCH_INVALID: ErrorCode
TEXT_MISMATCH: ErrorCode
PROMPT_MISMATCH: ErrorCode
TOKENIZER_REQUIRED: ErrorCode
TOKENIZER_INVALID: ErrorCode
FEEDBACK_INVALID: ErrorCode
TOKEN_NOT_IN_TOKENIZER: ErrorCode
VOCAB_SIZE_MISMATCH: ErrorCode
RATE_LIMITED: ErrorCode
REGISTRATION_THROTTLED: ErrorCode
REQUEST_TOO_LARGE: ErrorCode
VERIFICATION_BUSY: ErrorCode
LOGPROB_TOO_SMALL: ErrorCode
PROMPT_TOO_LONG: ErrorCode
SCORING_TIMEOUT: ErrorCode
LOGPROB_SPOT_CHECK_FAILED: ErrorCode
INTERNAL: ErrorCode

class Error(_message.Message):
    __slots__ = ("code", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    reason: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class RequestAuth(_message.Message):
    __slots__ = ("timestamp_ms", "signature")
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    timestamp_ms: int
    signature: bytes
    def __init__(self, timestamp_ms: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...
