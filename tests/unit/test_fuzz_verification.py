"""Property-based fuzzing of bundle verification (hypothesis; machinery in
``lab/ftis/lab/harness/fuzz.py``, the same generators ``bench/fuzz_verification.py`` runs at
100k examples).

Properties:

(a) arbitrary bytes into ``parse_envelope_bytes`` and into ``Coordinator.submit_bundle``
    give a result or an ``FtisError`` with a defined non-zero code, never another
    exception;
(b) structured mutations of a valid signed bundle (bytes flipped, inserted, deleted;
    fields changed and re-signed with the right key; wrong keys, leases, ids, clocks)
    are accepted or rejected with a code, and a rejection leaves the nodes, leases and
    bundles tables unchanged; an accepted bundle satisfies every documented rule;
(c) ``check_structure`` raises only ``FtisError`` and accepts exactly the bundles an
    independent oracle finds no fault in.

Each property also counts outcomes per code and asserts that many distinct codes are
reached, so the fuzzer gets past decoding into the deep checks.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftis.lab.harness.fuzz import (
    FuzzWorld,
    HypothesisDraw,
    run_check_structure,
    run_envelope_bytes,
    run_structured,
    run_submit_bytes,
)
from ftis.protocol.errors import ErrorCode

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(autouse=True)
def _no_logged_errors(caplog):
    """Rejections are logged at INFO and bans at WARNING (not captured, to keep the
    capture small). The coordinator swallows and logs exceptions in some bookkeeping
    paths (e.g. reputation evidence after a rejection): an ERROR record fails the test."""
    caplog.set_level(logging.ERROR)
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [f"{r.name}: {r.getMessage()}" for r in errors[:5]]


def _names(counts: Counter) -> dict[str, int]:
    return {ErrorCode.Name(code): n for code, n in sorted(counts.items())}


def test_arbitrary_bytes_into_parse_envelope_bytes() -> None:
    counts: Counter[int] = Counter()

    @FUZZ
    @given(st.data())
    def prop(data) -> None:
        counts[run_envelope_bytes(HypothesisDraw(data))] += 1

    prop()
    assert {ErrorCode.ENVELOPE_TOO_LARGE, ErrorCode.ENVELOPE_MALFORMED} <= set(counts), counts
    assert counts[0] > 0, "no input decoded at all"


def test_arbitrary_bytes_into_submit_bundle() -> None:
    world = FuzzWorld()
    counts: Counter[int] = Counter()

    @FUZZ
    @given(st.data())
    def prop(data) -> None:
        counts[run_submit_bytes(world, HypothesisDraw(data))] += 1

    prop()
    # Garbage is never accepted, and it reaches past envelope decoding.
    assert counts[0] == 0, _names(counts)
    reached = {
        ErrorCode.ENVELOPE_MALFORMED,
        ErrorCode.PAYLOAD_TYPE_INVALID,
        ErrorCode.SIGNATURE_INVALID,
        ErrorCode.PAYLOAD_MALFORMED,
    }
    assert len(reached & set(counts)) >= 3, _names(counts)
    assert len(counts) >= 5, _names(counts)


@pytest.mark.parametrize("tokenized", [False, True], ids=["random-ids", "uploaded-tokenizer"])
def test_structured_mutations_of_signed_bundles(tokenized: bool) -> None:
    """Mutated signed bundles: accepted (and then valid) or rejected with a code and no
    change to nodes, leases and bundles. With an uploaded tokenizer the text and prompt
    checks are reached too; after their proofs only the signer's row may change (the
    automatic ban), which ``FuzzWorld`` allows and verifies."""
    worlds = [FuzzWorld(tokenized=tokenized)]
    counts: Counter[int] = Counter()

    @settings(FUZZ, max_examples=250 if tokenized else 300)
    @given(st.data())
    def prop(data) -> None:
        if not worlds[-1].healthy() or worlds[-1].examples >= 150:
            worlds.append(FuzzWorld(tokenized=tokenized))  # small tables; survive bans
        counts[run_structured(worlds[-1], HypothesisDraw(data))] += 1

    prop()
    names = _names(counts)
    assert counts[0] > 0, f"nothing accepted: {names}"
    rejected = set(counts) - {0}
    # Every layer is reached: envelope, sender, lease and structure checks.
    for layer in (range(100, 110), range(110, 120), range(120, 130), range(130, 140)):
        assert rejected & set(layer), f"no rejection in {layer}: {names}"
    assert len(rejected) >= 15, names
    if tokenized:
        assert ErrorCode.TEXT_MISMATCH in rejected, names
        assert ErrorCode.PROMPT_MISMATCH in rejected, names


def test_check_structure_matches_oracle() -> None:
    counts: Counter[int] = Counter()

    @settings(FUZZ, max_examples=800)
    @given(st.data())
    def prop(data) -> None:
        counts[run_check_structure(HypothesisDraw(data))] += 1

    prop()
    names = _names(counts)
    assert counts[0] > 0, names
    # 9 of the 10 structural codes (130-139), so every rule is exercised
    assert len(set(counts) - {0}) >= 9, names
