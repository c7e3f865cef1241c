"""MERIT branch training (issue 16, step 3): a node assigned to a branch is leased only
tasks of its branch's families, from the one shared task-number counter; unassigned
nodes get the whole mix; the admin handlers validate branches against the task mix."""

from __future__ import annotations

from collections import Counter

import pytest

from ftis.coordinator.handlers import admin
from ftis.coordinator.state.base import BranchRecord
from ftis.lab.harness.coordinator import (
    FakeClock,
    build_bundle,
    make_coordinator,
    register,
    seal_bundle,
)
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.tasks import HeldoutSplit
from ftis.tasks.source import TaskSpec

ONE_DIGIT = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
MIX = [
    TaskSpec(dataset="chain_sum", config=ONE_DIGIT),
    TaskSpec(dataset="products", config=ONE_DIGIT),
    TaskSpec(dataset="gcd", config={"min_numbers": 2, "max_numbers": 2, "max_value": 30}),
    TaskSpec(dataset="chain_sum", weight=2.0,  # a family may sit at several mix positions
             config={"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}),
]
HELDOUT = 0.3


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def coord(clock):
    return make_coordinator(clock, tasks=MIX, heldout_fraction=HELDOUT,
                            max_outstanding_leases=10_000)


def _b(name: str, *families: str, tokens: float = 0.0) -> BranchRecord:
    return BranchRecord(name=name, families=families, tokens=tokens)


def _lease_many(coord, node_id: str, draws: int, per_call: int = 16) -> list:
    out: list = []
    while len(out) < draws:
        out += coord.lease_tasks(node_id, min(per_call, draws - len(out)), 2, 16)
    return out


def test_assigned_nodes_lease_only_their_branch_and_the_rest_span_the_mix(coord) -> None:
    admin.define_branches(coord.ctx, [_b("b0", "chain_sum"), _b("b1", "products", "gcd")])
    a, b, c = register(coord), register(coord), register(coord)
    admin.assign_branch(coord.ctx, [a.node_id], "b0")
    admin.assign_branch(coord.ctx, [b.node_id[:16]], "b1")  # a unique prefix
    draws = 240
    got = {who.node_id: _lease_many(coord, who.node_id, draws) for who in (a, b, c)}
    datasets = {n: Counter(x.dataset for x in leases) for n, leases in got.items()}
    assert set(datasets[a.node_id]) == {"chain_sum"}
    assert set(datasets[b.node_id]) == {"products", "gcd"}
    assert set(datasets[c.node_id]) == {"chain_sum", "products", "gcd"}  # the whole mix
    # b0's chain_sum comes from both of its mix positions, by weight (1:2)
    spec = Counter(x.spec_index for x in got[a.node_id])
    assert set(spec) == {0, 3} and 0.2 < spec[0] / draws < 0.46
    # the lease records its branch, and the database has it
    assert {x.branch for x in got[a.node_id]} == {"b0"}
    assert {x.branch for x in got[c.node_id]} == {None}
    stored = coord.state.get_lease_by_task(got[b.node_id][0].task_id)
    first = got[b.node_id][0].entry
    assert stored.branch == "b1"
    assert (stored.entry.question, stored.entry.answer) == (first.question, first.answer)
    # held-out entries are never leased, in a branch or not
    split = HeldoutSplit(HELDOUT)
    everything = [x for leases in got.values() for x in leases]
    assert all(split.part(x.dataset, x.entry.question, x.entry.metadata) == "train"
               for x in everything)
    # one shared counter: every lease is its own task (no (position, entry) twice)
    assert len({(x.spec_index, x.entry.index) for x in everything}) == len(everything)
    assert coord.state.task_numbers_reserved() >= len(everything)


def test_leases_are_task_numbers_mapped_into_the_sub_mix(coord) -> None:
    """Number n of a branch node is ``tasks.at(n, among)``: any worker process maps it
    the same way, and the numbers come from the same counter as everyone's."""
    admin.define_branches(coord.ctx, [_b("b1", "products", "gcd")])
    a, c = register(coord), register(coord)
    admin.assign_branch(coord.ctx, [a.node_id], "b1")
    first = coord.lease_tasks(c.node_id, 5, 2, 16)   # numbers 0-4, whole mix
    branch = coord.lease_tasks(a.node_id, 7, 2, 16)  # numbers 5-11, positions 1 and 2
    assert [(x.spec_index, x.entry) for x in first] == [coord.ctx.tasks.at(n) for n in range(5)]
    assert [(x.spec_index, x.entry) for x in branch] == [
        coord.ctx.tasks.at(n, (1, 2)) for n in range(5, 12)]


def test_a_branch_lease_is_verified_from_its_stored_entry(coord) -> None:
    admin.define_branches(coord.ctx, [_b("b1", "products")])
    node = register(coord)
    admin.assign_branch(coord.ctx, [node.node_id], "b1")
    (lease,) = coord.lease_tasks(node.node_id, 1, 2, 16)
    assert lease.dataset == "products"
    record = coord.submit_bundle(seal_bundle(build_bundle(lease, node), node))
    assert record.verified_rewards == [1.0, 0.0] and record.dataset == "products"
    overview = admin.list_branches(coord.ctx)
    assert [(x.name, x.node_ids, x.bundles_accepted) for x in overview.branches] == [
        ("b1", (node.node_id,), 1)]
    assert overview.task_mix == ["chain_sum", "products", "gcd"]
    assert overview.unassigned_nodes == 0


def test_the_relay_serves_a_branch_node_only_its_branch_bundles(coord) -> None:
    """PullBundles through the handler: nodes of b0 and b1 see only bundles of leases
    issued under their own branch; an unassigned node sees every branch's and the
    whole mix's bundles (it trains on the whole mix)."""
    admin.define_branches(coord.ctx, [_b("b0", "chain_sum"), _b("b1", "products", "gcd")])
    a0, b0, a1, free = (register(coord) for _ in range(4))
    admin.assign_branch(coord.ctx, [a0.node_id, b0.node_id], "b0")
    admin.assign_branch(coord.ctx, [a1.node_id], "b1")
    sent: dict[str, str] = {}
    for who in (a0, b0, a1, free):
        (lease,) = coord.lease_tasks(who.node_id, 1, 2, 16)
        record = coord.submit_bundle(seal_bundle(build_bundle(lease, who), who))
        sent[record.bundle_id] = lease.branch or "-"

    def relayed(who) -> list[str]:
        page, _ = coord.pull_bundles(who.node_id, 0, 64)
        return sorted(sent[b.bundle_id] for b in page)

    assert relayed(a0) == ["b0"]                 # b0's other node, not itself
    assert relayed(b0) == ["b0"]
    assert relayed(a1) == []                     # b1 holds only a1's own bundle
    assert relayed(free) == ["b0", "b0", "b1"]   # everything but its own
    # unassigned again, a1 learns from the whole mix and is relayed everything
    admin.assign_branch(coord.ctx, [a1.node_id], None)
    assert relayed(a1) == ["-", "b0", "b0"]


def test_unassigning_and_redefining_take_effect_at_once(coord) -> None:
    admin.define_branches(coord.ctx, [_b("b0", "gcd")])
    node = register(coord)
    admin.assign_branch(coord.ctx, [node.node_id], "b0")
    assert {x.dataset for x in _lease_many(coord, node.node_id, 20)} == {"gcd"}
    admin.define_branches(coord.ctx, [_b("b0", "products")])  # redefined: node stays
    assert {x.dataset for x in _lease_many(coord, node.node_id, 20)} == {"products"}
    admin.assign_branch(coord.ctx, [node.node_id], None)
    assert len({x.dataset for x in _lease_many(coord, node.node_id, 60)}) == 3
    admin.assign_branch(coord.ctx, [node.node_id], "b0")
    admin.define_branches(coord.ctx, [_b("b9", "chain_sum")], replace=True)  # b0 dropped
    assert coord.state.get_node(node.node_id).branch is None
    assert len({x.dataset for x in _lease_many(coord, node.node_id, 60)}) == 3


def test_a_dropped_branch_in_a_stale_node_record_means_the_whole_mix(coord, clock) -> None:
    """Another worker process dropped the branch: this process's node record (cached
    for a second) still names it; the branch cache re-reads and finds it gone."""
    admin.define_branches(coord.ctx, [_b("b0", "gcd")])
    node = register(coord)
    admin.assign_branch(coord.ctx, [node.node_id], "b0")
    stale = coord.node(node.node_id)
    coord.state.define_branches([_b("b1", "products")], clock(), replace=True)  # elsewhere
    from ftis.coordinator.handlers import leases

    got = leases.lease_tasks(coord.ctx, stale, 40, 2, 16)
    assert {x.branch for x in got} == {None} and len({x.dataset for x in got}) == 3


def test_branch_definitions_from_another_process_are_read_within_a_second(coord,
                                                                          clock) -> None:
    admin.define_branches(coord.ctx, [_b("b0", "gcd")])
    node = register(coord)
    admin.assign_branch(coord.ctx, [node.node_id], "b0")
    coord.lease_tasks(node.node_id, 1, 2, 16)  # cached now
    coord.state.define_branches([_b("b0", "products")], clock())  # another process
    assert coord.lease_tasks(node.node_id, 1, 2, 16)[0].dataset == "gcd"  # still cached
    clock.advance(1.5)
    assert {x.dataset for x in _lease_many(coord, node.node_id, 10)} == {"products"}


def test_a_branch_whose_families_left_the_mix_refuses_leases(clock) -> None:
    coord = make_coordinator(clock, tasks=MIX[:2])
    coord.state.define_branches([_b("b0", "letter_counting")], clock())  # not via admin
    node = register(coord)
    coord.state.assign_branches({node.node_id: "b0"})
    with pytest.raises(FtisError) as info:
        coord.lease_tasks(node.node_id, 1, 2, 16)
    assert info.value.code == ErrorCode.BRANCH_INVALID and "task mix" in info.value.reason
    assert "(letter_counting)" in info.value.reason
    assert coord.state.count_outstanding_leases(node.node_id, clock()) == 0
    with pytest.raises(FtisError):  # again, from the cache
        coord.lease_tasks(node.node_id, 1, 2, 16)


def test_replacing_with_no_branches_clears_them_all(coord) -> None:
    admin.define_branches(coord.ctx, [_b("b0", "gcd"), _b("b1", "products")])
    node = register(coord)
    admin.assign_branch(coord.ctx, [node.node_id], "b1")
    assert admin.define_branches(coord.ctx, [], replace=True) == []
    assert coord.state.get_node(node.node_id).branch is None
    assert len({x.dataset for x in _lease_many(coord, node.node_id, 60)}) == 3


@pytest.mark.parametrize(("branches", "needle"), [
    ([_b("b0", "letter_counting")], "not in the coordinator's task mix"),
    ([_b("b0", "chain_sum"), _b("b1", "chain_sum")], "in branches b0 and b1"),
    ([_b("b0")], "no family"),
    ([_b("b 0", "gcd")], "is not 1-64"),
])
def test_define_refuses_bad_branches(coord, branches, needle) -> None:
    with pytest.raises(FtisError) as info:
        admin.define_branches(coord.ctx, branches)
    assert info.value.code == ErrorCode.BRANCH_INVALID and needle in info.value.reason
    assert coord.state.list_branches() == []


def test_assign_refuses_unknown_nodes_and_branches(coord) -> None:
    admin.define_branches(coord.ctx, [_b("b0", "gcd")])
    node = register(coord)
    for ids, branch, code in [([node.node_id], "nope", ErrorCode.BRANCH_UNKNOWN),
                              (["ffff" * 16], "b0", ErrorCode.NODE_UNKNOWN),
                              ([], "b0", ErrorCode.REQUEST_INVALID)]:
        with pytest.raises(FtisError) as info:
            admin.assign_branch(coord.ctx, ids, branch)
        assert info.value.code == code
    assert coord.state.get_node(node.node_id).branch is None


def test_round_robin_spreads_unassigned_unbanned_nodes(coord) -> None:
    with pytest.raises(FtisError) as info:
        admin.assign_round_robin(coord.ctx)
    assert info.value.code == ErrorCode.BRANCH_INVALID
    admin.define_branches(coord.ctx, [_b("b0", "chain_sum"), _b("b1", "products", "gcd")])
    nodes = [register(coord) for _ in range(6)]
    admin.assign_branch(coord.ctx, [nodes[0].node_id, nodes[1].node_id], "b0")
    coord.ban(nodes[2].node_id, "x")
    order = [n.node_id for n in coord.state.list_nodes()]  # oldest registration first
    rest = sorted((nodes[3].node_id, nodes[4].node_id, nodes[5].node_id), key=order.index)
    got = admin.assign_round_robin(coord.ctx)
    # b0 has 2 already: b1, b1, then b0 (ties go to the first name)
    assert [(n.node_id, n.branch) for n in got] == [
        (rest[0], "b1"), (rest[1], "b1"), (rest[2], "b0")]
    assert coord.state.get_node(nodes[2].node_id).branch is None  # banned: left alone
    assert admin.assign_round_robin(coord.ctx) == []  # nobody left
