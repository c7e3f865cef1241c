"""Tokenizer fingerprints: a hash of everything that decides token ids or decoded text.

``fingerprint = SHA-256(canonical JSON of the sections below, tagged with``
:data:`FINGERPRINT_VERSION` ``)``, computed from a Hugging Face ``tokenizer.json`` document.

What is hashed, and why (issue 13, class 2 "tokenizer poisoning"): the coordinator keeps
one uploaded tokenizer per fingerprint and checks every node that registered that
fingerprint against it (``text == decode(token_ids)``, a ban-grade proof when it fails),
and receivers treat equal fingerprints as "same tokenizer" for token-level learning. So
two documents may share a fingerprint only if they encode text to the same ids *and*
decode ids to the same text. Everything the ``tokenizers`` library reads for either is in:

- ``model``: the whole section. ``vocab`` in id order (a dict's key order is not
  meaningful; Unigram's ``[piece, score]`` list is already in id order), ``merges`` as
  ``[left, right]`` pairs (the older ``"left right"`` strings are the same merges), and
  every other option verbatim: ``type``, ``unk_token``/``unk_id``, ``byte_fallback``,
  ``fuse_unk``, ``dropout``, ``continuing_subword_prefix``, ``end_of_word_suffix``,
  ``ignore_merges``, ``max_input_chars_per_word`` and any field a later library version
  adds;
- ``added_tokens``: each token's whole entry (``id``, ``content``, ``special``,
  ``normalized``, ``lstrip``, ``rstrip``, ``single_word``), in the file's order (the
  library adds them in that order; ``to_str()`` writes them in id order): the flags decide
  how text is split around them, and ``special`` decides ``skip_special_tokens``;
- ``normalizer`` and ``pre_tokenizer``: text -> pieces before the model sees them;
- ``post_processor``: the special tokens (BOS, ...) that ``encode`` adds;
- ``decoder``: ids -> text, the coordinator's text check. A changed decoder under an
  unchanged fingerprint is exactly the poisoning attack.

Any other top-level section is hashed as it is (a field a later library version adds is
covered before anyone decides whether it matters). Left out, because they change neither
ids nor text: ``version`` (the file format's), ``truncation`` and ``padding`` (per-call
settings that ``transformers`` switches on and off while batching, so hashing them would
split honest nodes loading the same files).

Canonical JSON: keys sorted, no whitespace, UTF-8 (``ensure_ascii=False``), sections that
are absent hashed as ``null`` (the library reads an absent section as ``null`` too). Any
other difference, even one the library would treat as equal (a flag left at its default
in one file and omitted in another), gives a *different* fingerprint: splitting two
equal tokenizers is safe, merging two different ones is not. Texts with duplicate JSON
keys are refused (``ValueError``): Python keeps the last value, and a parser that kept
the first would load something other than what was hashed.

The version tag :data:`FINGERPRINT_VERSION` is hashed too, so a fingerprint of this
scheme can never equal one of the earlier scheme (model type, vocab, merges and added
token ids and contents only), which let documents with different decoders collide.

Pure JSON: no ``tokenizers`` import, so the coordinator fingerprints uploaded files
without loading them first (and again after loading, see
``ftis.coordinator.tokenizer_store.check_upload``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

#: Hashed with the sections: bump it whenever the canonical form changes.
FINGERPRINT_VERSION = "ftis-tokenizer-fingerprint/2"
#: Top-level sections of ``tokenizer.json`` that decide encoding or decoding (besides
#: ``model`` and ``added_tokens``, which are canonicalized first); hashed as ``null``
#: when absent.
PIPELINE_SECTIONS = ("normalizer", "pre_tokenizer", "post_processor", "decoder")
#: Top-level sections that decide neither ids nor text: the only ones not hashed.
IGNORED_SECTIONS = ("version", "truncation", "padding")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"tokenizer.json has a duplicate key {key[:64]!r}")
        out[key] = value
    return out


def parse_tokenizer_json(text: str) -> dict[str, Any]:
    """``json.loads`` that refuses duplicate object keys.

    Raises:
        ValueError: not JSON, not an object, or a duplicate key.
    """
    doc = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    if not isinstance(doc, dict):
        raise ValueError("tokenizer.json is not a JSON object")
    return doc


def _canonical_merge(merge: Any) -> Any:
    """``"a b"`` -> ``["a", "b"]``; pairs (and anything malformed) are kept as they are."""
    if isinstance(merge, str):
        return merge.split(" ")
    return merge


def _vocab_order(item: tuple[str, Any]) -> tuple[int, Any, str]:
    """Id order; a malformed (non-integer) id sorts after all others, never raising."""
    token, token_id = item
    if isinstance(token_id, int) and not isinstance(token_id, bool):
        return 0, token_id, token
    return 1, json.dumps(token_id, sort_keys=True), token


def canonical_tokenizer(doc: dict[str, Any]) -> dict[str, Any]:
    """What the fingerprint hashes of a parsed ``tokenizer.json`` (see module docstring):
    ``{"fingerprint_version": FINGERPRINT_VERSION, "tokenizer": {every top-level section
    but IGNORED_SECTIONS, model and added_tokens canonicalized}}``.

    Raises:
        ValueError: if the document has no ``model`` section.
    """
    model = doc.get("model")
    if not isinstance(model, dict):
        raise ValueError("tokenizer.json has no 'model' section")
    model = dict(model)
    vocab = model.get("vocab")
    if isinstance(vocab, dict):  # a map: its key order means nothing
        model["vocab"] = sorted(vocab.items(), key=_vocab_order)
    if isinstance(model.get("merges"), list):  # a priority list: its order is kept
        model["merges"] = [_canonical_merge(m) for m in model["merges"]]
    added = doc.get("added_tokens")
    if added is not None and not isinstance(added, list):
        raise ValueError("tokenizer.json 'added_tokens' is not a list")
    sections = {k: v for k, v in doc.items() if k not in IGNORED_SECTIONS}
    sections.update({section: doc.get(section) for section in PIPELINE_SECTIONS})
    sections.update(model=model, added_tokens=added or [])
    return {"fingerprint_version": FINGERPRINT_VERSION, "tokenizer": sections}


def tokenizer_fingerprint(tokenizer_json: str | dict[str, Any]) -> str:
    """64-hex SHA-256 fingerprint of a ``tokenizer.json`` document (see module docstring).

    Args:
        tokenizer_json: the file's text (parsed with :func:`parse_tokenizer_json`) or its
            parsed dict.

    Raises:
        ValueError: not JSON, a duplicate key, or no ``model`` section.
    """
    doc = (parse_tokenizer_json(tokenizer_json) if isinstance(tokenizer_json, str)
           else tokenizer_json)
    canonical = json.dumps(canonical_tokenizer(doc), sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()
