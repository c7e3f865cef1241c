"""Tokenizer fingerprints depend on vocab and merges only."""

import json

from ftis.client.models.card import fingerprint_of
from ftis.client.models.tiny import build_tiny_tokenizer
from ftis.protocol.fingerprint import tokenizer_fingerprint


def test_fingerprint_ignores_formatting_but_not_vocab():
    doc = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
           "added_tokens": [{"id": 3, "content": "<s>"}], "normalizer": None}
    fp = tokenizer_fingerprint(doc)
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert tokenizer_fingerprint(json.dumps(doc, indent=4)) == fp
    assert tokenizer_fingerprint({**doc, "normalizer": {"type": "NFC"}}) == fp
    assert tokenizer_fingerprint({**doc, "model": {**doc["model"], "merges": [["a", "b"]]}}) == fp
    changed = {**doc, "model": {**doc["model"], "vocab": {"a": 0, "b": 2, "ab": 1}}}
    assert tokenizer_fingerprint(changed) != fp


def test_tiny_tokenizers_of_different_vocab_differ():
    a, b = build_tiny_tokenizer(300), build_tiny_tokenizer(280)
    assert fingerprint_of(a) == fingerprint_of(build_tiny_tokenizer(300))
    assert fingerprint_of(a) != fingerprint_of(b)
