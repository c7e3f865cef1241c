"""Tokenizer fingerprints cover everything that decides ids or decoded text (issue 13,
class 2), and nothing else: formatting, key order, padding and truncation do not count."""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
from typing import Any

import pytest

from ftis.client.models.card import fingerprint_of
from ftis.client.models.tiny import build_tiny_tokenizer
from ftis.coordinator.tokenizer_store import check_upload
from ftis.coordinator.verify import check_submission, open_bundle
from ftis.lab.harness.coordinator import (
    build_bundle,
    load_tokenizer,
    make_coordinator,
    register_with_tokenizer,
    seal_bundle,
    snapshot,
    tokenizer_fp,
    tokenizer_json,
)
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.protocol.fingerprint import (
    FINGERPRINT_VERSION,
    canonical_tokenizer,
    tokenizer_fingerprint,
)

DOC: dict[str, Any] = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [{"id": 3, "content": "<s>", "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True}],
    "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
    "model": {"type": "BPE", "dropout": None, "unk_token": None,
              "continuing_subword_prefix": None, "end_of_word_suffix": None,
              "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
              "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]},
}
#: The canonical form of :data:`DOC`, written out: vocab in id order, merges as pairs,
#: every section that decides ids or text, the version tag; no version/padding/truncation.
DOC_CANONICAL = (
    '{"fingerprint_version":"ftis-tokenizer-fingerprint/2","tokenizer":{"added_tokens":'
    '[{"content":"<s>","id":3,"lstrip":false,"normalized":false,"rstrip":false,'
    '"single_word":false,"special":true}],"decoder":null,"model":{"byte_fallback":false,'
    '"continuing_subword_prefix":null,"dropout":null,"end_of_word_suffix":null,'
    '"fuse_unk":false,"ignore_merges":false,"merges":[["a","b"]],"type":"BPE",'
    '"unk_token":null,"vocab":[["a",0],["b",1],["ab",2]]},"normalizer":null,'
    '"post_processor":null,"pre_tokenizer":null}}')
#: Its SHA-256: a change of the canonical form must change this value (and the tag).
DOC_FINGERPRINT = "00505be02ff68a4ba62b3bd7accc277448c730b991d364518dc4f320e3ce22c1"


def _with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(DOC)
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


def test_fingerprint_value_and_version_tag():
    assert FINGERPRINT_VERSION == "ftis-tokenizer-fingerprint/2"
    assert canonical_tokenizer(DOC)["fingerprint_version"] == FINGERPRINT_VERSION
    # a document cannot overwrite the tag: its sections sit one level down
    tagged = {**DOC, "fingerprint_version": "ftis-tokenizer-fingerprint/1"}
    assert canonical_tokenizer(tagged)["fingerprint_version"] == FINGERPRINT_VERSION
    assert tokenizer_fingerprint(tagged) != DOC_FINGERPRINT
    assert hashlib.sha256(DOC_CANONICAL.encode()).hexdigest() == DOC_FINGERPRINT
    assert tokenizer_fingerprint(DOC) == DOC_FINGERPRINT


def test_fingerprint_ignores_formatting_order_padding_and_truncation():
    fp = tokenizer_fingerprint(DOC)
    assert tokenizer_fingerprint(json.dumps(DOC, indent=4, sort_keys=True)) == fp
    reordered = {k: DOC[k] for k in reversed(list(DOC))}
    reordered["model"] = {**DOC["model"], "vocab": {"ab": 2, "b": 1, "a": 0}}
    assert tokenizer_fingerprint(reordered) == fp
    assert tokenizer_fingerprint(_with(("model", "merges"), ["a b"])) == fp
    assert tokenizer_fingerprint(_with(("version",), "2.0")) == fp
    assert tokenizer_fingerprint(_with(("padding",), {"strategy": "BatchLongest",
                                                      "pad_id": 3})) == fp
    assert tokenizer_fingerprint(_with(("truncation",), {"max_length": 8})) == fp
    without_pipeline = {k: v for k, v in DOC.items()
                        if k not in ("normalizer", "pre_tokenizer", "post_processor",
                                     "decoder")}
    assert tokenizer_fingerprint(without_pipeline) == fp  # absent is null, as in the library


@pytest.mark.parametrize(("path", "value"), [
    (("decoder",), {"type": "Fuse"}),
    (("normalizer",), {"type": "NFC"}),
    (("normalizer",), {"type": "Lowercase"}),
    (("pre_tokenizer",), {"type": "Whitespace"}),
    (("post_processor",), {"type": "TemplateProcessing", "special_tokens": {}}),
    (("model", "type"), "WordPiece"),
    (("model", "vocab"), {"a": 0, "b": 2, "ab": 1}),
    (("model", "merges"), []),
    (("model", "byte_fallback"), True),
    (("model", "unk_token"), "<unk>"),
    (("model", "continuing_subword_prefix"), "##"),
    (("model", "end_of_word_suffix"), "</w>"),
    (("model", "fuse_unk"), True),
    (("model", "dropout"), 0.1),
    (("model", "ignore_merges"), True),
    (("added_tokens", 0, "special"), False),
    (("added_tokens", 0, "normalized"), True),
    (("added_tokens", 0, "lstrip"), True),
    (("added_tokens", 0, "rstrip"), True),
    (("added_tokens", 0, "single_word"), True),
    (("added_tokens", 0, "content"), "<S>"),
    (("added_tokens", 0, "id"), 4),
    (("a_section_a_later_library_reads",), {"type": "Anything"}),
])
def test_every_encoding_or_decoding_setting_changes_the_fingerprint(path, value):
    assert tokenizer_fingerprint(_with(path, value)) != DOC_FINGERPRINT


def test_a_default_left_out_gives_a_different_fingerprint():
    """Splitting two equal tokenizers is safe, merging two different ones is not: an
    omitted field is not assumed to be its default."""
    doc = copy.deepcopy(DOC)
    del doc["model"]["fuse_unk"]
    assert tokenizer_fingerprint(doc) != DOC_FINGERPRINT


def test_duplicate_keys_and_documents_without_model_are_refused():
    text = json.dumps(DOC)
    doubled = text.replace('"decoder": null', '"decoder": {"type": "Fuse"}, "decoder": null')
    assert doubled != text
    with pytest.raises(ValueError, match="duplicate key 'decoder'"):
        tokenizer_fingerprint(doubled)
    with pytest.raises(ValueError, match="no 'model' section"):
        tokenizer_fingerprint({**DOC, "model": None})
    with pytest.raises(ValueError, match="not a JSON object"):
        tokenizer_fingerprint("[1, 2]")


def _poisoned(text: str, section: str) -> str:
    """The real test tokenizer with one pipeline section replaced, via the library."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers

    tok = Tokenizer.from_str(text)
    if section == "decoder":  # decodes every "1" as "7"
        tok.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace("1", "7")])
    elif section == "normalizer":
        tok.normalizer = normalizers.Lowercase()
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    return tok.to_str()


@pytest.mark.parametrize("section", ["decoder", "normalizer", "pre_tokenizer"])
def test_a_changed_pipeline_section_changes_the_fingerprint_and_the_output(section):
    from tokenizers import Tokenizer

    honest_text = tokenizer_json()
    poisoned_text = _poisoned(honest_text, section)
    honest, poisoned = Tokenizer.from_str(honest_text), Tokenizer.from_str(poisoned_text)
    # only the one section differs ...
    h, p = json.loads(honest_text), json.loads(poisoned_text)
    assert [k for k in h if h[k] != p[k]] == [section]
    # ... and it changes what the tokenizer does
    sample = "Question: 12 + 31 = 43"
    ids = honest.encode(sample).ids
    if section == "decoder":
        assert honest.decode(ids) == sample and poisoned.decode(ids) == sample.replace("1", "7")
    elif section == "normalizer":
        assert poisoned.encode(sample).ids != ids
    else:
        assert poisoned.encode(sample).ids != ids
    assert tokenizer_fingerprint(poisoned_text) != tokenizer_fingerprint(honest_text)


@pytest.mark.parametrize("section", ["decoder", "normalizer", "pre_tokenizer"])
def test_an_upload_claiming_the_honest_fingerprint_with_a_changed_section_is_refused(
        section):
    honest_fp = tokenizer_fingerprint(tokenizer_json())
    gz = gzip.compress(_poisoned(tokenizer_json(), section).encode())
    with pytest.raises(FtisError) as info:
        check_upload(gz, honest_fp, honest_fp, max_gz_bytes=1 << 24, max_json_bytes=1 << 26)
    assert info.value.code == ErrorCode.TOKENIZER_INVALID
    assert info.value.reason.startswith("uploaded tokenizer has fingerprint ")
    assert info.value.reason.endswith(f"expected {honest_fp}")


def test_an_upload_the_library_loads_differently_from_its_text_is_refused():
    """A field the library ignores is hashed from the text but absent from what loads:
    the fingerprint of the loaded tokenizer (``to_str()``) must match as well."""
    doc = json.loads(tokenizer_json())
    doc["decoder"]["ignored_by_the_library"] = 1
    text = json.dumps(doc)
    claimed = tokenizer_fingerprint(text)
    with pytest.raises(FtisError) as info:
        check_upload(gzip.compress(text.encode()), claimed, claimed,
                     max_gz_bytes=1 << 24, max_json_bytes=1 << 26)
    assert info.value.code == ErrorCode.TOKENIZER_INVALID
    assert "as loaded has fingerprint" in info.value.reason


def test_the_library_serialization_round_trips_to_the_same_fingerprint():
    from tokenizers import Tokenizer

    text = tokenizer_json()
    assert tokenizer_fingerprint(Tokenizer.from_str(text).to_str()) == tokenizer_fingerprint(text)
    tok, vocab = check_upload(gzip.compress(text.encode()), tokenizer_fingerprint(text),
                              tokenizer_fingerprint(text), max_gz_bytes=1 << 24,
                              max_json_bytes=1 << 26)
    assert vocab == 400 and tok.decode(tok.encode("3 + 4 = 7").ids) == "3 + 4 = 7"


def test_tiny_tokenizers_of_different_vocab_differ():
    a, b = build_tiny_tokenizer(300), build_tiny_tokenizer(280)
    assert fingerprint_of(a) == fingerprint_of(build_tiny_tokenizer(300))
    assert fingerprint_of(a) != fingerprint_of(b)


def test_padding_and_truncation_while_batching_leave_the_fingerprint_alone():
    """``transformers`` switches the backend's padding and truncation on while it pads a
    batch; a node's fingerprint must not depend on whether it has batched yet."""
    tok = build_tiny_tokenizer(300)
    before = fingerprint_of(tok)
    tok(["3 + 4 =", "12 + 31 = 43"], padding="max_length", truncation=True, max_length=6)
    tok.backend_tokenizer.enable_padding(pad_id=0, pad_token="<|endoftext|>", length=9)
    tok.backend_tokenizer.enable_truncation(max_length=7)
    assert json.loads(tok.backend_tokenizer.to_str())["padding"] is not None
    assert fingerprint_of(tok) == before


# -- the coordinator judges a node's text only with its own card's tokenizer ----------------


def test_a_stored_tokenizer_whose_fingerprint_does_not_match_its_key_is_never_used():
    """A row written under the earlier fingerprint scheme (or altered in the database):
    ``TokenizerCache.get`` recomputes the fingerprint and refuses it."""
    coord = make_coordinator(require_tokenizer=True)
    other = gzip.compress(tokenizer_json("a different corpus").encode())
    claimed = tokenizer_fp()
    assert coord.state.store_tokenizer(claimed, other, 400, "someone", coord.clock())
    assert coord.tokenizers.get(claimed) is None
    assert coord.tokenizers.id_bound(claimed) is None
    honest = tokenizer_fp("honest")
    assert coord.state.store_tokenizer(honest, gzip.compress(tokenizer_json("honest").encode()),
                                       400, "someone", coord.clock())
    tok = coord.tokenizers.get(honest)
    assert tok is not None and tokenizer_fingerprint(tok.to_str()) == honest


def test_check_submission_refuses_a_tokenizer_held_under_another_fingerprint():
    """The invariant of ``verify.py``: a text check (TEXT_MISMATCH bans) runs only with
    the tokenizer of the sender's registered fingerprint; anything else is a coordinator
    bug (``RuntimeError``, an INTERNAL reply), never a verdict against the sender."""
    coord = make_coordinator(require_tokenizer=True)
    node = register_with_tokenizer(coord)
    other = register_with_tokenizer(coord, "a different corpus")
    (lease,) = coord.lease_tasks(node.node_id, 1, 2, 64)
    envelope = seal_bundle(build_bundle(lease, node, tokenizer=load_tokenizer()), node)
    opened = open_bundle(envelope, max_bundle_bytes=coord.config.max_bundle_bytes)
    now = coord.clock()
    snap = coord.state.submission_snapshot(node.node_id, lease.task_id, opened.bundle_id,
                                           now, now)
    own_fp, other_fp = tokenizer_fp(), tokenizer_fp("a different corpus")
    assert snap.node.fingerprint == own_fp != other_fp
    assert coord.state.get_node(other.node_id).fingerprint == other_fp
    foreign = coord.tokenizers.get(other_fp)
    for tok, fp in ((foreign, other_fp), (foreign, None), (coord.tokenizers.get(own_fp), None)):
        with pytest.raises(RuntimeError, match="refused"):
            check_submission(opened, snap, now_ms=now, tokenizer=tok, tokenizer_fingerprint=fp)
    verified = check_submission(opened, snap, now_ms=now, tokenizer=coord.tokenizers.get(own_fp),
                                tokenizer_fingerprint=own_fp)
    assert verified.text_verified and verified.verified_rewards == [1.0, 0.0]
    before = len(snapshot(coord)["bundles"])
    record = coord.submit_bundle(envelope)  # the handler passes the registered fingerprint
    assert record.text_verified and len(snapshot(coord)["bundles"]) == before + 1
    assert not coord.state.get_node(node.node_id).banned
