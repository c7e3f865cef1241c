"""Stable rejection codes (``ftis.v1.ErrorCode``) and the exception that carries them.

Every rejection the coordinator sends has a code from this enum and a one-line reason;
the table with meanings lives in ``docs/error-codes.md``.
"""

from __future__ import annotations

from ftis.v1 import common_pb2

ErrorCode = common_pb2.ErrorCode


class FtisError(Exception):
    """A rejection with a stable :class:`ErrorCode` and a one-line reason.

    Attributes:
        code: ``ftis.v1.ErrorCode`` value (int), never 0.
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
        return common_pb2.Error(code=self.code, reason=self.reason)


def code_name(code: int) -> str:
    """Symbolic name of an error code, e.g. ``102 -> "SIGNATURE_INVALID"``."""
    try:
        return ErrorCode.Name(code)
    except ValueError:
        return f"UNKNOWN_{code}"


def raise_for_error(error: common_pb2.Error | None) -> None:
    """Raise :class:`FtisError` if a response's ``error`` field carries a code."""
    if error is not None and error.code != ErrorCode.ERROR_CODE_UNSPECIFIED:
        raise FtisError(error.code, error.reason)
