"""Uploaded tokenizers: validation of an upload and an LRU of loaded tokenizers.

The coordinator checks bundle text against the sender's tokenizer (DESIGN.md §5: "text
present and, where the coordinator knows the tokenizer, equal to the decoded tokens").
Nodes upload their ``tokenizer.json`` gzip-compressed (``UploadTokenizer``); it is
accepted only if

1. the compressed size is at most ``max_tokenizer_gz_bytes``;
2. it decompresses (bounded reader: at most ``max_tokenizer_json_bytes`` are ever
   produced, so zip bombs cost nothing) to UTF-8 JSON without duplicate keys;
3. :func:`ftis.protocol.fingerprint.tokenizer_fingerprint` of that JSON equals the
   fingerprint in the request and the node's registered model card;
4. it loads with ``tokenizers.Tokenizer.from_str``, and the fingerprint of what loaded
   (``tokenizer.to_str()``) is that fingerprint too: whatever the library ignored,
   defaulted or read differently from Python's JSON parser shows up as a difference, so
   the stored tokenizer is exactly the one the fingerprint describes;
5. the registered model card's ``vocab_size`` fits the tokenizer
   (:func:`check_vocab_size`: at least the tokenizer's id bound, at most
   :func:`max_card_vocab` of it). The same comparison runs when a node registers with a
   fingerprint whose tokenizer is already known, and when it "uploads" one that is.

Why one upload may serve every node of a fingerprint (issue 13, class 2, "tokenizer
poisoning"): the fingerprint hashes everything that decides encoding and decoding
(model, added tokens with their flags, normalizer, pre-tokenizer, post-processor,
decoder; see :mod:`ftis.protocol.fingerprint`), and rules 3-4 recompute it from the
uploaded bytes. Two tokenizers stored or held under one fingerprint therefore decode
every id sequence to the same text, short of a SHA-256 collision or a ``tokenizers``
bug: the first uploader cannot choose how anyone else's ids are decoded, and an upload
with, say, a changed decoder has a different fingerprint and is refused for the honest
one (TOKENIZER_INVALID). :meth:`TokenizerCache.get` recomputes the fingerprint of a
stored file once more when it loads it, so a row written under an older fingerprint
scheme (or altered in the database) is never used to judge anyone.

At submission every token id must be one the tokenizer can decode
(:func:`undecodable_id`): ``decode`` silently skips unknown ids, so the text check alone
would pass a bundle whose ids the tokenizer does not have.

Text is compared with ``tokenizer.decode(token_ids, skip_special_tokens=False)`` of the
``tokenizers`` backend: clients must produce completion text exactly that way.
"""

from __future__ import annotations

import gzip
import io
import logging
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ftis.coordinator.quotas import ExpiringKeys
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.protocol.fingerprint import tokenizer_fingerprint

if TYPE_CHECKING:  # pragma: no cover
    from tokenizers import Tokenizer

    from ftis.coordinator.state.base import State

log = logging.getLogger(__name__)


def gunzip_bounded(data: bytes, max_bytes: int) -> bytes:
    """Decompress gzip ``data``, producing at most ``max_bytes``.

    Raises:
        FtisError: TOKENIZER_INVALID if ``data`` is not gzip or inflates beyond
            ``max_bytes``.
    """
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb") as stream:
            out = stream.read(max_bytes + 1)
    except (OSError, EOFError, zlib.error) as exc:
        raise FtisError(ErrorCode.TOKENIZER_INVALID, f"not valid gzip data: {exc}") from None
    if len(out) > max_bytes:
        raise FtisError(
            ErrorCode.TOKENIZER_INVALID,
            f"tokenizer.json inflates beyond the limit of {max_bytes} bytes",
        )
    return out


def load_tokenizer(json_text: str) -> Tokenizer:
    """``tokenizers.Tokenizer.from_str``; TOKENIZER_INVALID if it does not load."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(json_text)
    except Exception as exc:  # the Rust binding raises plain Exception subclasses
        raise FtisError(
            ErrorCode.TOKENIZER_INVALID, f"tokenizer.json does not load: {str(exc)[:200]}"
        ) from None


#: Fingerprints whose id bound :class:`TokenizerCache` remembers (each entry ~200 bytes).
MAX_REMEMBERED_BOUNDS = 65_536
#: Seconds a process remembers that no tokenizer is stored for a fingerprint (a node
#: that never uploads one would otherwise cost a database read per submission); an
#: upload to this process ends it at once, one to another worker process within this.
MISSING_TTL_S = 1.0
#: Padding a model card's ``vocab_size`` may have beyond its tokenizer: embedding
#: matrices are often rounded up to a multiple of 64-1024 rows (Qwen2.5: 151,936 rows
#: for 151,665 tokens, +271; DeepSeek-V3: +465; Phi-3: +53), while the embedded models
#: have none (SmolLM2-135M: 49,152 = 49,152; Gemma-3-270M: 262,144 = 262,144, its 6,384
#: added tokens inside). At least this many rows, or 1/64 of the tokenizer's.
VOCAB_PADDING_MIN = 1024
VOCAB_PADDING_FRACTION = 64


def token_id_bound(tokenizer: Tokenizer) -> int:
    """One more than the largest id the tokenizer knows (added tokens included). Not
    ``get_vocab_size``, which counts tokens: a vocabulary with holes in its ids has
    fewer tokens than its largest id."""
    return decodable_ids(tokenizer).bound


def max_card_vocab(tokenizer_bound: int) -> int:
    """Largest model-card ``vocab_size`` accepted for a tokenizer with this id bound."""
    return tokenizer_bound + max(VOCAB_PADDING_MIN, tokenizer_bound // VOCAB_PADDING_FRACTION)


def check_vocab_size(card_vocab_size: int, tokenizer: Tokenizer | int) -> int:
    """The model card's ``vocab_size`` (embedding rows) against the tokenizer (or its
    :func:`token_id_bound`): at least its id bound (the model must be able to emit every
    token), at most :func:`max_card_vocab` (padding, not a made-up size). Returns the
    tokenizer's id bound.

    Raises:
        FtisError: VOCAB_SIZE_MISMATCH.
    """
    bound = tokenizer if isinstance(tokenizer, int) else token_id_bound(tokenizer)
    if not bound <= card_vocab_size <= max_card_vocab(bound):
        raise FtisError(
            ErrorCode.VOCAB_SIZE_MISMATCH,
            f"model card vocab_size {card_vocab_size} does not fit the tokenizer's {bound} "
            f"ids (allowed: {bound} to {max_card_vocab(bound)}); register the model's "
            "embedding size",
        )
    return bound


class DecodableIds:
    """The ids a tokenizer has a token for: ``[0, bound)`` less ``holes``.

    ``bound`` is one past the largest id of its vocabulary and added tokens, ``holes``
    the ids below it that are in neither (``id_to_token`` is ``None`` for exactly these; a
    test checks the two agree). Built once per loaded tokenizer (about 20 ms for a
    49,152-token vocabulary) and kept beside it (:func:`decodable_ids`).
    """

    __slots__ = ("bound", "holes")

    def __init__(self, tokenizer: Tokenizer) -> None:
        known = set(tokenizer.get_vocab(with_added_tokens=True).values())
        self.bound = max(known) + 1 if known else 0
        self.holes = frozenset(set(range(self.bound)) - known)

    def first_missing(self, token_ids: set[int]) -> int | None:
        """The smallest of ``token_ids`` outside ``[0, bound)`` or in ``holes``, or
        ``None``: set operations in C, no call into the tokenizer per id."""
        if not token_ids:
            return None
        low, high = min(token_ids), max(token_ids)
        if low >= 0 and high < self.bound and self.holes.isdisjoint(token_ids):
            return None
        return min(i for i in token_ids if i < 0 or i >= self.bound or i in self.holes)


#: :class:`DecodableIds` of each live tokenizer, dropped with the tokenizer.
_DECODABLE: weakref.WeakKeyDictionary[Tokenizer, DecodableIds] = weakref.WeakKeyDictionary()
_DECODABLE_LOCK = threading.Lock()


def decodable_ids(tokenizer: Tokenizer) -> DecodableIds:
    """:class:`DecodableIds` of ``tokenizer``, built on first use and kept while the
    tokenizer lives."""
    with _DECODABLE_LOCK:
        ids = _DECODABLE.get(tokenizer)
    if ids is None:
        ids = DecodableIds(tokenizer)
        with _DECODABLE_LOCK:
            _DECODABLE[tokenizer] = ids
    return ids


def undecodable_id(tokenizer: Tokenizer, token_ids: Iterable[int]) -> int | None:
    """The smallest of ``token_ids`` the tokenizer has no token for (``None`` if it knows
    them all): negative ids, ids beyond its vocabulary and added tokens, and holes
    between them (:class:`DecodableIds`: set operations, about a quarter of the time of
    one ``id_to_token`` per id, ``bench/undecodable_ids.py``)."""
    ids = token_ids if isinstance(token_ids, set) else set(token_ids)
    return decodable_ids(tokenizer).first_missing(ids)


def loaded_fingerprint(tokenizer: Tokenizer) -> str:
    """Fingerprint of a loaded tokenizer as the library serializes it (``to_str()``);
    ``""`` if that does not serialize or fingerprint."""
    try:
        return tokenizer_fingerprint(tokenizer.to_str())
    except Exception:  # the Rust binding raises plain Exception subclasses
        return ""


def check_upload(
    gz: bytes,
    fingerprint: str,
    registered_fingerprint: str,
    *,
    max_gz_bytes: int,
    max_json_bytes: int,
    card_vocab_size: int | None = None,
) -> tuple[Tokenizer, int]:
    """Validate an upload (rules 1-4 of the module docstring, and 5 when
    ``card_vocab_size``, the registered model card's, is given).

    Args:
        gz: the gzip'd ``tokenizer.json`` as uploaded.
        fingerprint: the fingerprint named in the request.
        registered_fingerprint: the node's registered model card's.

    Returns:
        ``(tokenizer, vocab_size)`` with the vocabulary size including added tokens; the
        tokenizer's fingerprint, recomputed both from the uploaded text and from what
        the library loaded, is ``fingerprint``.

    Raises:
        FtisError: TOKENIZER_INVALID (size; the request's fingerprint differs from the
            registered one; not gzip/UTF-8/JSON, duplicate keys, no ``model``; the
            recomputed fingerprint differs, reason "uploaded tokenizer has fingerprint
            ..." or "... as loaded has fingerprint ..."; does not load) or
            VOCAB_SIZE_MISMATCH.
    """
    if len(gz) > max_gz_bytes:
        raise FtisError(
            ErrorCode.TOKENIZER_INVALID,
            f"compressed tokenizer is {len(gz)} bytes, limit {max_gz_bytes}",
        )
    if fingerprint != registered_fingerprint:
        raise FtisError(
            ErrorCode.TOKENIZER_INVALID,
            "fingerprint differs from the registered model card; re-register first",
        )
    raw = gunzip_bounded(gz, max_json_bytes)
    try:
        text = raw.decode("utf-8")
        actual = tokenizer_fingerprint(text)
    except (UnicodeDecodeError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise FtisError(
            ErrorCode.TOKENIZER_INVALID, f"not a tokenizer.json document: {str(exc)[:200]}"
        ) from None
    if actual != fingerprint:
        raise FtisError(
            ErrorCode.TOKENIZER_INVALID,
            f"uploaded tokenizer has fingerprint {actual}, expected {fingerprint}",
        )
    tokenizer = load_tokenizer(text)
    loaded = loaded_fingerprint(tokenizer)
    if loaded != fingerprint:
        raise FtisError(
            ErrorCode.TOKENIZER_INVALID,
            f"uploaded tokenizer as loaded has fingerprint {loaded}, expected {fingerprint} "
            "(upload the library's own serialization, tokenizer.to_str())",
        )
    if card_vocab_size is not None:
        check_vocab_size(card_vocab_size, tokenizer)
    return tokenizer, int(tokenizer.get_vocab_size(with_added_tokens=True))


class TokenizerCache:
    """LRU of loaded tokenizers by fingerprint, backed by the ``tokenizers`` table.

    Fingerprints found missing in the table are remembered for :data:`MISSING_TTL_S`
    seconds, so a node without an uploaded tokenizer (allowed while
    ``require_tokenizer`` is off) costs one database read per second, not one per
    submission.

    Args:
        state: where uploaded tokenizers are stored.
        capacity: tokenizers kept loaded.
        max_json_bytes: bound when decompressing a stored tokenizer.
        clock: seconds (monotonic), for the missing-fingerprint memory.
    """

    def __init__(self, state: State, capacity: int = 8, max_json_bytes: int = 64 << 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.state = state
        self.capacity = max(1, capacity)
        self.max_json_bytes = max_json_bytes
        self.clock = clock
        self._loaded: OrderedDict[str, Tokenizer] = OrderedDict()
        self._bounds: dict[str, int] = {}
        self._missing = ExpiringKeys(MAX_REMEMBERED_BOUNDS)  # until clock() seconds
        self._lock = threading.Lock()

    def put(self, fingerprint: str, tokenizer: Tokenizer) -> None:
        """Hold ``tokenizer`` under ``fingerprint``: only a tokenizer that
        :func:`check_upload` accepted for exactly this fingerprint."""
        with self._lock:
            self._missing.release(fingerprint)
            self._loaded[fingerprint] = tokenizer
            self._loaded.move_to_end(fingerprint)
            while len(self._loaded) > self.capacity:
                self._loaded.popitem(last=False)

    def get(self, fingerprint: str) -> Tokenizer | None:
        """The tokenizer with this fingerprint, or ``None`` if none was uploaded.

        A stored file is loaded only if its recomputed fingerprint is ``fingerprint``
        (1.3 s for Gemma 3's 12 MB file, once per load); otherwise, e.g. a row stored
        under an earlier fingerprint scheme, an error is logged and ``None`` returned,
        so the file never judges anyone's text.
        """
        with self._lock:
            tokenizer = self._loaded.get(fingerprint)
            if tokenizer is not None:
                self._loaded.move_to_end(fingerprint)
                return tokenizer
        if self._missing.held(fingerprint, self.clock()):
            return None
        gz = self.state.get_tokenizer(fingerprint)
        if gz is None:
            self._missing.hold(fingerprint, self.clock() + MISSING_TTL_S)
            return None
        text = gunzip_bounded(gz, self.max_json_bytes).decode("utf-8")
        try:
            actual = tokenizer_fingerprint(text)
        except (ValueError, TypeError, AttributeError, RecursionError):
            actual = ""
        if actual != fingerprint:
            log.error("stored tokenizer %s has fingerprint %s: not used",
                      fingerprint[:16], actual[:16] or "(none)")
            return None
        tokenizer = load_tokenizer(text)
        self.put(fingerprint, tokenizer)
        return tokenizer

    def id_bound(self, fingerprint: str) -> int | None:
        """:func:`token_id_bound` of the tokenizer with this fingerprint (``None`` if none
        was uploaded), remembered per fingerprint apart from the LRU, so that comparing
        model cards with it (registration, upload) never reloads an evicted tokenizer
        more than once per process."""
        with self._lock:
            bound = self._bounds.get(fingerprint)
        if bound is not None:
            return bound
        tokenizer = self.get(fingerprint)
        if tokenizer is None:
            return None
        bound = token_id_bound(tokenizer)
        with self._lock:
            if len(self._bounds) >= MAX_REMEMBERED_BOUNDS:
                self._bounds.clear()
            self._bounds[fingerprint] = bound
        return bound

    def known(self, fingerprint: str) -> bool:
        """Whether a tokenizer with this fingerprint was uploaded (loaded or stored)."""
        with self._lock:
            if fingerprint in self._loaded:
                return True
        if self._missing.held(fingerprint, self.clock()):
            return False
        if self.state.has_tokenizer(fingerprint):
            return True
        self._missing.hold(fingerprint, self.clock() + MISSING_TTL_S)
        return False

    def __len__(self) -> int:
        return len(self._loaded)


def decode(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    """``tokenizer.decode(ids, skip_special_tokens=False)``, the text clients must send."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=False)
