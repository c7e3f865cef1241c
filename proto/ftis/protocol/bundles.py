"""Bundle limits and structural checks shared by sender, coordinator and receivers,
and the canonical-encoding check of signed payloads."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from google.protobuf.message import Message

from ftis.protocol.errors import ErrorCode, FtisError
from ftis.v1 import bundle_pb2

#: Largest accepted envelope payload (bytes). A 16 x 1024-token bundle is ~200 KB.
MAX_BUNDLE_BYTES = 4 * 1024 * 1024
#: Largest gRPC message the coordinator will read; larger ones are refused by gRPC.
MAX_GRPC_MESSAGE_BYTES = 2 * MAX_BUNDLE_BYTES
MAX_TEXT_CHARS_PER_TOKEN = 64
#: Lowest accepted sampler log-prob (nats per token). A token this unlikely
#: (p = e^-100 ~ 3.7e-44) is never sampled, so honest samplers stay far above it, and
#: it keeps every sum a receiver forms finite: 1024 tokens x 100 nats = 1.0e5, where
#: two tokens of -FLT_MAX (-3.4e38) already overflow a float32 sum to -inf.
MIN_LOGPROB = -100.0
#: Chat-template overhead a prompt may have beyond the leased messages' text, in tokens
#: (prompt ids) and in characters (``prompt_text``, the decoded prompt). Measured on the
#: embedded models for a chain_sum lease (152 characters of messages): SmolLM2-135M's
#: ChatML template adds 80 characters / 14 tokens, the plain prompt of Gemma-3-270M
#: (``render_plain_prompt``, BOS included) 61 / 23, Gemma 3's instruction template 62 / 10.
#: 256 leaves > 3x room for templates with longer headers (e.g. dated system headers).
PROMPT_TEMPLATE_SLACK = 256


@dataclass(frozen=True)
class BundleLimits:
    """What a bundle for a given lease may contain.

    Attributes:
        max_prompt_tokens: most ``prompt_token_ids`` (``None``: unbounded; the
            coordinator derives it from the leased messages, :func:`prompt_limits`).
        max_prompt_chars: most characters of ``prompt_text`` (``None``: unbounded).
    """

    group_size: int
    max_new_tokens: int
    vocab_size: int
    max_prompt_tokens: int | None = None
    max_prompt_chars: int | None = None


def prompt_limits(contents: Iterable[str]) -> tuple[int, int]:
    """``(max_prompt_tokens, max_prompt_chars)`` for a prompt rendered from chat messages
    with these contents, compared before anything is decoded.

    Tokens: no tokenizer emits more than one token per UTF-8 byte of text (byte-level
    BPE and byte fallback reach one per byte at worst; the measured models use 0.22), so
    the messages' UTF-8 bytes plus :data:`PROMPT_TEMPLATE_SLACK` bound the ids of any
    honest tokenizer. Characters: the messages' characters plus the same slack.
    """
    texts = list(contents)
    return (sum(len(t.encode("utf-8", "surrogatepass")) for t in texts) + PROMPT_TEMPLATE_SLACK,
            sum(len(t) for t in texts) + PROMPT_TEMPLATE_SLACK)


def check_structure(bundle: bundle_pb2.Bundle, limits: BundleLimits) -> None:
    """Structural checks of DESIGN.md section 5, in order.

    Checks: sampling settings sane; prompt present and (when the limits bound it) at
    most ``max_prompt_tokens`` ids and ``max_prompt_chars`` characters of
    ``prompt_text``, counted before any id is looked at; number of completions == G;
    per completion: at least one token, ``len(token_ids) <= max_new_tokens``,
    ``len(logprobs) == len(token_ids)``, every id in ``[0, vocab_size)``, every
    log-prob finite, ``<= 0`` and ``>= MIN_LOGPROB`` (-100 nats), text present.

    Raises:
        FtisError: SAMPLING_INVALID, PROMPT_MISSING, PROMPT_TOO_LONG,
            GROUP_SIZE_MISMATCH, COMPLETION_EMPTY, COMPLETION_TOO_LONG,
            LOGPROB_COUNT_MISMATCH, TOKEN_OUT_OF_VOCAB, LOGPROB_NOT_FINITE,
            LOGPROB_POSITIVE, LOGPROB_TOO_SMALL or TEXT_MISSING.
    """
    s = bundle.sampling
    if not (math.isfinite(s.temperature) and s.temperature > 0) or not (0 < s.top_p <= 1):
        raise FtisError(ErrorCode.SAMPLING_INVALID, "temperature must be > 0 and top_p in (0, 1]")
    if s.top_k < 0:
        raise FtisError(ErrorCode.SAMPLING_INVALID, "top_k must be >= 0")
    n_prompt = len(bundle.prompt_token_ids)
    if not n_prompt:
        raise FtisError(ErrorCode.PROMPT_MISSING, "prompt_token_ids is empty")
    if limits.max_prompt_tokens is not None and n_prompt > limits.max_prompt_tokens:
        raise FtisError(
            ErrorCode.PROMPT_TOO_LONG,
            f"{n_prompt} prompt token ids, the leased messages allow {limits.max_prompt_tokens}",
        )
    if limits.max_prompt_chars is not None and len(bundle.prompt_text) > limits.max_prompt_chars:
        raise FtisError(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt_text has {len(bundle.prompt_text)} characters, the leased messages "
            f"allow {limits.max_prompt_chars}",
        )
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
            if lp < MIN_LOGPROB:
                raise FtisError(
                    ErrorCode.LOGPROB_TOO_SMALL,
                    f"completion {i}: log-prob {lp:.6g} below {MIN_LOGPROB:g} nats",
                )
        if not c.text:
            raise FtisError(ErrorCode.TEXT_MISSING, f"completion {i} has no text")
        if len(c.text) > MAX_TEXT_CHARS_PER_TOKEN * n_tok:
            raise FtisError(ErrorCode.TEXT_MISSING, f"completion {i} text is implausibly long")


def completion_tokens(bundle: bundle_pb2.Bundle) -> int:
    """Total completion tokens of a bundle."""
    return sum(len(c.token_ids) for c in bundle.completions)


#: Messages visited when locating an unknown field for the rejection's reason.
_UNKNOWN_SEARCH_LIMIT = 256


def check_canonical(message: Message, payload: bytes) -> None:
    """The signed ``payload`` must be exactly the canonical encoding of ``message`` (its
    decoding): no field the protocol does not define, at any depth, and no other
    encoding of the same values (repeated or out-of-order fields, unpacked repeated
    scalars, over-long varints). So nothing rides in a signed payload beyond what the
    checks see: what is stored and relayed is what was verified. Senders produce
    canonical payloads by construction (``envelope.seal`` serializes deterministically).

    Raises:
        FtisError: PAYLOAD_UNKNOWN_FIELDS or PAYLOAD_NOT_CANONICAL.
    """
    known = type(message)()
    known.CopyFrom(message)
    known.DiscardUnknownFields()  # recursive
    if known.ByteSize() != message.ByteSize():
        where = _unknown_field_path(message) or "a nested message"
        raise FtisError(
            ErrorCode.PAYLOAD_UNKNOWN_FIELDS,
            f"signed {message.DESCRIPTOR.name} carries "
            f"{message.ByteSize() - known.ByteSize()} bytes of unknown fields (in {where})",
        )
    if known.SerializeToString(deterministic=True) != payload:
        raise FtisError(
            ErrorCode.PAYLOAD_NOT_CANONICAL,
            f"signed {message.DESCRIPTOR.name} is not canonically encoded ({len(payload)} "
            f"bytes for {known.ByteSize()} bytes of fields: repeated, reordered or "
            "unpacked fields)",
        )


def _unknown_field_path(message: Message) -> str | None:
    """Where the first unknown field sits (e.g. ``Bundle.completions[3]``), searching at
    most :data:`_UNKNOWN_SEARCH_LIMIT` messages (``None`` beyond)."""
    from google.protobuf import unknown_fields

    stack: list[tuple[Message, str]] = [(message, message.DESCRIPTOR.name)]
    visited = 0
    while stack and visited < _UNKNOWN_SEARCH_LIMIT:
        msg, path = stack.pop()
        visited += 1
        if len(unknown_fields.UnknownFieldSet(msg)):
            return path
        children: list[tuple[Message, str]] = []
        for field, value in msg.ListFields():
            if field.message_type is None:
                continue
            if field.is_repeated:
                children += [(v, f"{path}.{field.name}[{i}]") for i, v in enumerate(value)
                             if i < _UNKNOWN_SEARCH_LIMIT]
            else:
                children.append((value, f"{path}.{field.name}"))
        stack.extend(reversed(children))
    return None
