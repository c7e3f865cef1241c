"""Relay (PullBundles): cursor paging and filters."""

from __future__ import annotations

import pytest

from ftis.lab.harness.coordinator import (
    FP_A,
    FP_B,
    FakeClock,
    build_bundle,
    make_coordinator,
    register,
    seal_bundle,
)
from ftis.protocol.envelope import open_envelope
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.v1 import bundle_pb2


def _submit(coord, node, n: int, fingerprint: str = FP_A, correct=None) -> list[int]:
    """Lease and submit ``n`` bundles from ``node``; returns their sequences."""
    sequences = []
    for lease in coord.lease_tasks(node.node_id, n, 2, 16):
        bundle = build_bundle(lease, node, fingerprint=fingerprint, correct=correct)
        sequences.append(coord.submit_bundle(seal_bundle(bundle, node)).sequence)
    return sequences


@pytest.fixture
def coord():
    return make_coordinator(FakeClock())


def test_cursor_paging(coord) -> None:
    sender, reader = register(coord), register(coord)
    sent = _submit(coord, sender, 5)
    seen: list[int] = []
    cursor = 0
    pages = []
    while True:
        page, cursor = coord.pull_bundles(reader.node_id, cursor, 2)
        pages.append(len(page))
        seen.extend(b.sequence for b in page)
        if len(page) < 2:
            break
    assert seen == sent
    assert pages == [2, 2, 1]
    assert cursor == sent[-1]
    # Nothing new: empty page, cursor stays at the max sequence.
    page, again = coord.pull_bundles(reader.node_id, cursor, 2)
    assert page == [] and again == cursor
    # New bundles appear after the cursor.
    more = _submit(coord, sender, 1)
    page, cursor = coord.pull_bundles(reader.node_id, cursor, 64)
    assert [b.sequence for b in page] == more and cursor == more[0]


def test_full_page_cursor_is_last_returned_sequence(coord) -> None:
    sender, reader = register(coord), register(coord)
    sent = _submit(coord, sender, 3)
    page, cursor = coord.pull_bundles(reader.node_id, 0, 3)
    assert [b.sequence for b in page] == sent and cursor == sent[-1]


def test_max_bundles_is_clamped(coord) -> None:
    sender, reader = register(coord), register(coord)
    _submit(coord, sender, 3)
    assert len(coord.pull_bundles(reader.node_id, 0, 0)[0]) == 1
    assert len(coord.pull_bundles(reader.node_id, 0, 1000)[0]) == 3


def test_never_returns_own_bundles(coord) -> None:
    a, b = register(coord), register(coord)
    from_a = _submit(coord, a, 2)
    from_b = _submit(coord, b, 2)
    page_a, cursor_a = coord.pull_bundles(a.node_id, 0, 64)
    assert [x.sequence for x in page_a] == from_b
    assert cursor_a == max(from_a + from_b)
    page_b, _ = coord.pull_bundles(b.node_id, 0, 64)
    assert [x.sequence for x in page_b] == from_a


def test_fingerprint_filter(coord) -> None:
    same, other, reader = register(coord, FP_A), register(coord, FP_B), register(coord, FP_A)
    from_same = _submit(coord, same, 2, FP_A)
    from_other = _submit(coord, other, 2, FP_B)
    page, _ = coord.pull_bundles(reader.node_id, 0, 64, tokenizer_fingerprint=FP_A)
    assert [x.sequence for x in page] == from_same
    page, _ = coord.pull_bundles(reader.node_id, 0, 64, tokenizer_fingerprint=FP_B)
    assert [x.sequence for x in page] == from_other
    page, _ = coord.pull_bundles(reader.node_id, 0, 64)
    assert [x.sequence for x in page] == sorted(from_same + from_other)


def test_zero_variance_skip(coord) -> None:
    sender, reader = register(coord), register(coord)
    mixed = _submit(coord, sender, 1, correct=[True, False])
    all_right = _submit(coord, sender, 1, correct=[True, True])
    all_wrong = _submit(coord, sender, 1, correct=[False, False])
    page, cursor = coord.pull_bundles(reader.node_id, 0, 64, skip_zero_variance=True)
    assert [x.sequence for x in page] == mixed
    assert cursor == all_wrong[0]  # skipped groups are not re-examined
    page, _ = coord.pull_bundles(reader.node_id, 0, 64)
    assert [x.sequence for x in page] == mixed + all_right + all_wrong


def test_banned_sender_not_relayed(coord) -> None:
    bad, good, reader = register(coord), register(coord), register(coord)
    from_bad = _submit(coord, bad, 2)
    from_good = _submit(coord, good, 1)
    coord.ban(bad.node_id, "fabricated log-probs")
    page, _ = coord.pull_bundles(reader.node_id, 0, 64)
    assert [x.sequence for x in page] == from_good
    coord.unban(bad.node_id)
    page, _ = coord.pull_bundles(reader.node_id, 0, 64)
    assert [x.sequence for x in page] == sorted(from_bad + from_good)


def test_banned_or_unknown_reader_is_refused(coord) -> None:
    reader = register(coord)
    coord.ban(reader.node_id)
    cases = ((reader.node_id, ErrorCode.NODE_BANNED), ("0" * 32, ErrorCode.NODE_UNKNOWN))
    for node_id, code in cases:
        with pytest.raises(FtisError) as info:
            coord.pull_bundles(node_id, 0, 8)
        assert info.value.code == code


def test_relayed_envelope_still_verifies() -> None:
    # Quarantine off: a first bundle with a false claim would otherwise quarantine the
    # sender (tested in test_reputation.py).
    coord = make_coordinator(
        FakeClock(), reputation={"quarantine_threshold": 0.0, "probation_threshold": 0.0}
    )
    sender, reader = register(coord), register(coord)
    (lease,) = coord.lease_tasks(sender.node_id, 1, 2, 16)
    bundle = build_bundle(lease, sender, claimed=[0.0, 0.0])
    record = coord.submit_bundle(seal_bundle(bundle, sender))
    (relayed,), _ = coord.pull_bundles(reader.node_id, 0, 8)
    envelope = bundle_pb2.SignedEnvelope.FromString(relayed.envelope)
    opened, node_id = open_envelope(envelope, "bundle", bundle_pb2.Bundle, 1 << 20)
    assert opened == bundle and node_id == sender.node_id
    assert relayed.verified_rewards == [1.0, 0.0] == record.verified_rewards
    assert relayed.dataset == "chain_sum"
    # The sender's score after one mismatched claim: E = (0 + 1) / (0 + 2 + 2).
    assert relayed.sender_reputation == 0.25


def test_relay_carries_the_leased_question_from_coordinator_records(coord) -> None:
    """Cross-tokenizer receivers render their own prompt from the relayed question, which
    comes from the lease, never from the sender's bundle."""
    from ftis.coordinator.server.convert import relayed_bundle

    sender, reader = register(coord, FP_B), register(coord, FP_A)
    leases = coord.lease_tasks(sender.node_id, 2, 2, 16)
    for lease in leases:
        bundle = build_bundle(lease, sender, fingerprint=FP_B)
        coord.submit_bundle(seal_bundle(bundle, sender))
    page, _ = coord.pull_bundles(reader.node_id, 0, 64)
    assert [x.question for x in page] == [lease.entry.question for lease in leases]
    assert all(x.question for x in page)
    relayed = relayed_bundle(page[0], page[0].sender_reputation)
    assert relayed.task_question == leases[0].entry.question
