"""Bundle limits and structural checks shared by sender, coordinator and receivers."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ftis.protocol.errors import ErrorCode, FtisError
from ftis.v1 import bundle_pb2

#: Largest accepted envelope payload (bytes). A 16 x 1024-token bundle is ~200 KB.
MAX_BUNDLE_BYTES = 4 * 1024 * 1024
#: Largest gRPC message the coordinator will read; larger ones are refused by gRPC.
MAX_GRPC_MESSAGE_BYTES = 2 * MAX_BUNDLE_BYTES
MAX_TEXT_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class BundleLimits:
    """What a bundle for a given lease may contain."""

    group_size: int
    max_new_tokens: int
    vocab_size: int


def check_structure(bundle: bundle_pb2.Bundle, limits: BundleLimits) -> None:
    """Structural checks of DESIGN.md section 5, in order.

    Checks: sampling settings sane; prompt present; number of completions == G; per
    completion: at least one token, ``len(token_ids) <= max_new_tokens``,
    ``len(logprobs) == len(token_ids)``, every id in ``[0, vocab_size)``, every
    log-prob finite and ``<= 0``, text present.

    Raises:
        FtisError: SAMPLING_INVALID, PROMPT_MISSING, GROUP_SIZE_MISMATCH, COMPLETION_EMPTY,
            COMPLETION_TOO_LONG, LOGPROB_COUNT_MISMATCH, TOKEN_OUT_OF_VOCAB,
            LOGPROB_NOT_FINITE, LOGPROB_POSITIVE or TEXT_MISSING.
    """
    s = bundle.sampling
    if not (math.isfinite(s.temperature) and s.temperature > 0) or not (0 < s.top_p <= 1):
        raise FtisError(ErrorCode.SAMPLING_INVALID, "temperature must be > 0 and top_p in (0, 1]")
    if s.top_k < 0:
        raise FtisError(ErrorCode.SAMPLING_INVALID, "top_k must be >= 0")
    if not bundle.prompt_token_ids:
        raise FtisError(ErrorCode.PROMPT_MISSING, "prompt_token_ids is empty")
    if any(t < 0 or t >= limits.vocab_size for t in bundle.prompt_token_ids):
        raise FtisError(ErrorCode.TOKEN_OUT_OF_VOCAB, "prompt token id outside the vocabulary")
    n = len(bundle.completions)
    if n != limits.group_size:
        raise FtisError(
            ErrorCode.GROUP_SIZE_MISMATCH,
            f"bundle has {n} completions, lease requires {limits.group_size}",
        )
    for i, c in enumerate(bundle.completions):
        n_tok = len(c.token_ids)
        if n_tok == 0:
            raise FtisError(ErrorCode.COMPLETION_EMPTY, f"completion {i} has no tokens")
        if n_tok > limits.max_new_tokens:
            raise FtisError(
                ErrorCode.COMPLETION_TOO_LONG,
                f"completion {i} has {n_tok} tokens, limit {limits.max_new_tokens}",
            )
        if len(c.logprobs) != n_tok:
            raise FtisError(
                ErrorCode.LOGPROB_COUNT_MISMATCH,
                f"completion {i} has {n_tok} tokens but {len(c.logprobs)} log-probs",
            )
        bad = next((t for t in c.token_ids if t < 0 or t >= limits.vocab_size), None)
        if bad is not None:
            raise FtisError(
                ErrorCode.TOKEN_OUT_OF_VOCAB,
                f"completion {i}: token id {bad} outside [0, {limits.vocab_size})",
            )
        for lp in c.logprobs:
            if not math.isfinite(lp):
                raise FtisError(ErrorCode.LOGPROB_NOT_FINITE, f"completion {i}: log-prob {lp}")
            if lp > 0:
                raise FtisError(ErrorCode.LOGPROB_POSITIVE, f"completion {i}: log-prob {lp} > 0")
        if not c.text:
            raise FtisError(ErrorCode.TEXT_MISSING, f"completion {i} has no text")
        if len(c.text) > MAX_TEXT_CHARS_PER_TOKEN * n_tok:
            raise FtisError(ErrorCode.TEXT_MISSING, f"completion {i} text is implausibly long")


def completion_tokens(bundle: bundle_pb2.Bundle) -> int:
    """Total completion tokens of a bundle."""
    return sum(len(c.token_ids) for c in bundle.completions)
