"""Tokenizer fingerprints: a hash of what decides token ids, nothing else.

``fingerprint = SHA-256(canonical JSON of {model type, vocab, merges, added tokens})``
computed from a Hugging Face ``tokenizer.json`` document. Two tokenizers with the same
fingerprint map the same text pieces to the same ids, so token-level importance weights
are meaningful between them (DESIGN.md section 6). Pure JSON: no ``tokenizers`` import,
so the coordinator can fingerprint uploaded tokenizer files too.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def tokenizer_fingerprint(tokenizer_json: str | dict[str, Any]) -> str:
    """64-hex SHA-256 fingerprint of a ``tokenizer.json`` document.

    Args:
        tokenizer_json: the file's text or its parsed dict.

    Raises:
        ValueError: if the document has no ``model`` section.
    """
    doc = json.loads(tokenizer_json) if isinstance(tokenizer_json, str) else tokenizer_json
    model = doc.get("model")
    if not isinstance(model, dict):
        raise ValueError("tokenizer.json has no 'model' section")
    vocab = model.get("vocab", {})
    if isinstance(vocab, dict):
        vocab = sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", []) or []]
    added = sorted((t.get("id"), t.get("content")) for t in doc.get("added_tokens", []) or [])
    canonical = json.dumps(
        {"type": model.get("type"), "vocab": vocab, "merges": merges, "added": added},
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()
