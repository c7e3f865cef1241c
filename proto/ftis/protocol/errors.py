"""Stable rejection codes (``ftis.v1.ErrorCode``) and the exception that carries them.

Every rejection the coordinator sends has a code from this enum and a one-line reason;
the table with meanings lives in ``docs/error-codes.md``. :class:`LocalErrorCode` adds
the codes of checks a client runs itself on relayed bundles (17x); those never travel on
the wire.

Blocks: 10x envelope and signed payload (incl. PAYLOAD_UNKNOWN_FIELDS,
PAYLOAD_NOT_CANONICAL), 11x sender, 12x lease, 13x structure, 14x registration and
requests, 15x checks against the sender's tokenizer (incl. TOKEN_NOT_IN_TOKENIZER,
VOCAB_SIZE_MISMATCH) and feedback, 16x quotas, 17x local (never sent), 18x structure
continued, bounds on signed values (LOGPROB_TOO_SMALL, PROMPT_TOO_LONG), 199 internal.
"""

from __future__ import annotations

from typing import cast

from ftis.v1 import common_pb2

ErrorCode = common_pb2.ErrorCode


class LocalErrorCode:
    """Codes of the receiver's own checks of relayed bundles (``ExternalPool.add``).

    Block 17x of the :class:`ErrorCode` numbering, which the wire enum leaves free; these
    codes are never sent (:meth:`FtisError.to_proto` refuses them) and the coordinator
    never raises them. The checks that repeat the coordinator's use the wire codes
    (e.g. ``NODE_MISMATCH``, ``TOKEN_OUT_OF_VOCAB``, ``TEXT_MISMATCH``).
    """

    #: the relay returned a bundle signed by the receiver itself
    RELAY_OWN_BUNDLE = 170
    #: the relayed ``verified_rewards`` are not one per completion
    RELAY_REWARDS_MISMATCH = 171
    #: the bundle comes from another tokenizer and the receiver has no re-tokenizer
    TOKENIZER_FOREIGN = 172
    #: a bundle from another tokenizer cannot be re-tokenized for the receiver
    RETOKENIZE_FAILED = 173

    def __new__(cls) -> LocalErrorCode:
        """Prevent instantiation."""
        raise TypeError(f"{cls.__name__} cannot be instantiated.")


#: ``{code: name}`` of :class:`LocalErrorCode`.
LOCAL_ERROR_CODES: dict[int, str] = {
    v: k for k, v in vars(LocalErrorCode).items() if k.isupper() and isinstance(v, int)
}


class FtisError(Exception):
    """A rejection with a stable :class:`ErrorCode` and a one-line reason.

    Attributes:
        code: ``ftis.v1.ErrorCode`` value (int), never 0; or a :class:`LocalErrorCode`.
        reason: one line of human-readable text.
    """

    def __init__(self, code: int, reason: str) -> None:
        if code == ErrorCode.ERROR_CODE_UNSPECIFIED:
            raise ValueError("FtisError needs a non-zero error code")
        self.code = int(code)
        self.reason = reason.replace("\n", " ")
        super().__init__(f"{code_name(self.code)}: {self.reason}")

    @property
    def name(self) -> str:
        return code_name(self.code)

    def to_proto(self) -> common_pb2.Error:
        if self.code in LOCAL_ERROR_CODES:
            raise ValueError(f"{self.name} is a local code and is never sent")
        # protoc's .pyi types enum values as ErrorCode (an int subclass); at run time
        # they are plain ints, as self.code is
        return common_pb2.Error(code=cast(ErrorCode, self.code), reason=self.reason)


def code_name(code: int) -> str:
    """Symbolic name of an error code, e.g. ``102 -> "SIGNATURE_INVALID"`` (also the
    :class:`LocalErrorCode` names)."""
    if code in LOCAL_ERROR_CODES:
        return LOCAL_ERROR_CODES[code]
    try:
        return ErrorCode.Name(code)
    except ValueError:
        return f"UNKNOWN_{code}"


def raise_for_error(error: common_pb2.Error | None) -> None:
    """Raise :class:`FtisError` if a response's ``error`` field carries a code."""
    if error is not None and error.code != ErrorCode.ERROR_CODE_UNSPECIFIED:
        raise FtisError(error.code, error.reason)
