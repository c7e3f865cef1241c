"""``tokenizer_store.undecodable_id`` by set operations (:class:`DecodableIds`) agrees
with the definition, one ``id_to_token`` per id: on a word-level tokenizer with holes
in its ids and added tokens beyond them, and on the test harness's tokenizer."""

from __future__ import annotations

import random

from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel

from ftis.coordinator.tokenizer_store import (
    DecodableIds,
    decodable_ids,
    token_id_bound,
    undecodable_id,
)


def _reference(tokenizer: Tokenizer, ids: set[int]) -> int | None:
    """The definition: the smallest id that is negative or has no token."""
    for token_id in sorted(ids):
        if token_id < 0 or tokenizer.id_to_token(token_id) is None:
            return token_id
    return None


def _holey() -> Tokenizer:
    """Ids 0, 2, 5 in the model (holes 1, 3, 4), then two added tokens."""
    tok = Tokenizer(WordLevel({"a": 0, "b": 2, "c": 5}, unk_token="a"))
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    tok.add_tokens([AddedToken("zz")])
    return tok


def test_holes_and_bound_match_id_to_token() -> None:
    tok = _holey()
    known = DecodableIds(tok)
    added = {tok.token_to_id("<s>"), tok.token_to_id("zz")}
    assert known.bound == max({0, 2, 5} | added) + 1
    for i in range(-3, known.bound + 4):
        missing = i < 0 or i >= known.bound or i in known.holes
        assert missing == (i < 0 or tok.id_to_token(i) is None), i
    assert {1, 3, 4} - added <= known.holes
    # the id bound is past the largest id, not the count of tokens (5 here, ids 0-5)
    assert token_id_bound(tok) == known.bound == 6 > tok.get_vocab_size(with_added_tokens=True)


def test_smallest_missing_id_as_the_definition() -> None:
    tok = _holey()
    rng = random.Random(7)
    cases = [set(), {0}, {0, 2, 5}, {1}, {5, 4, 3}, {-1, 3}, {0, 99}, {2, 5, 1000, -7}]
    cases += [{rng.randrange(-2, 12) for _ in range(rng.randrange(1, 6))} for _ in range(200)]
    for ids in cases:
        assert undecodable_id(tok, ids) == _reference(tok, ids), ids
        assert undecodable_id(tok, sorted(ids)) == _reference(tok, ids), ids  # any iterable


def test_the_harness_tokenizer_agrees_and_is_cached() -> None:
    from ftis.lab.harness.coordinator import load_tokenizer

    tok = load_tokenizer()
    known = decodable_ids(tok)
    assert decodable_ids(tok) is known  # built once per tokenizer
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert known.bound == vocab and not known.holes  # contiguous ids
    rng = random.Random(0)
    for _ in range(50):
        ids = {rng.randrange(vocab) for _ in range(60)}
        assert undecodable_id(tok, ids) is None
        ids.add(rng.choice([vocab, vocab + 5, -1]))
        assert undecodable_id(tok, ids) == _reference(tok, ids)
