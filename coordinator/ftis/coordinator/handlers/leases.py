"""Lease handler: hand out tasks, each under its own lease."""

from __future__ import annotations

import uuid

from ftis.coordinator.handlers.context import Context
from ftis.coordinator.state.base import LeaseRecord, NodeRecord
from ftis.protocol.errors import ErrorCode, FtisError

#: Lease requests may ask for at most this many tasks at once.
MAX_LEASES_PER_REQUEST = 64


def check_lease_request(ctx: Context, node: NodeRecord, count: int, group_size: int,
                        max_new_tokens: int) -> None:
    """The request's bounds, and the node's tokenizer when one is required.

    Raises:
        FtisError: TOKENIZER_REQUIRED, REQUEST_INVALID.
    """
    cfg = ctx.config
    if cfg.require_tokenizer and not ctx.tokenizers.known(node.fingerprint):
        raise FtisError(ErrorCode.TOKENIZER_REQUIRED,
                        f"no tokenizer uploaded for fingerprint {node.fingerprint[:12]}; "
                        "call UploadTokenizer first")
    if not 1 <= count <= MAX_LEASES_PER_REQUEST:
        raise FtisError(ErrorCode.REQUEST_INVALID,
                        f"count {count} outside [1, {MAX_LEASES_PER_REQUEST}]")
    if not cfg.min_group_size <= group_size <= cfg.max_group_size:
        raise FtisError(ErrorCode.REQUEST_INVALID,
                        f"group_size {group_size} outside [{cfg.min_group_size}, "
                        f"{cfg.max_group_size}]")
    if not 1 <= max_new_tokens <= cfg.max_new_tokens_limit:
        raise FtisError(ErrorCode.REQUEST_INVALID,
                        f"max_new_tokens {max_new_tokens} outside [1, {cfg.max_new_tokens_limit}]")


def lease_tasks(ctx: Context, node: NodeRecord, count: int, group_size: int,
                max_new_tokens: int) -> list[LeaseRecord]:
    """Issue ``count`` fresh tasks to ``node``, each under its own lease.

    Task numbers come from the database's draw counter, so several worker processes
    never hand out the same number (:meth:`State.lease_block`); number ``n`` is
    ``ctx.tasks.at(n)``. A node assigned to a MERIT branch (``node.branch``) gets
    ``ctx.tasks.at(n, among)`` instead, ``among`` the mix positions of the branch's
    families (:class:`~ftis.coordinator.handlers.context.BranchCache`, no database read
    per lease): the same shared counter, so numbers stay unique across branches and
    workers, and the same entry and held-out split for a number as the whole mix would
    give if it picked that dataset. The lease records the branch.

    Args:
        count: tasks wanted, in [1, 64].
        group_size: G completions the node will submit per task, in
            [min_group_size, max_group_size].
        max_new_tokens: completion length bound, in [1, max_new_tokens_limit].

    Raises:
        FtisError: TOKENIZER_REQUIRED, REQUEST_INVALID, LEASE_LIMIT (the node's
            unanswered, unexpired leases plus ``count`` exceed ``max_outstanding_leases``),
            BRANCH_INVALID (the node's branch has no family in the task mix).
    """
    check_lease_request(ctx, node, count, group_size, max_new_tokens)
    now = ctx.clock()
    deadline = now + int(ctx.config.lease_ttl_s * 1000)
    among = ctx.branches.among(node.branch, now) if node.branch is not None else None
    branch = node.branch if among is not None else None

    def make(start: int) -> list[LeaseRecord]:
        leases = []
        for number in range(start, start + count):
            k, entry = ctx.tasks.at(number, among)
            leases.append(LeaseRecord(
                lease_id=uuid.uuid4().hex, task_id=uuid.uuid4().hex, node_id=node.node_id,
                dataset=entry.dataset, spec_index=k, entry=entry, group_size=group_size,
                max_new_tokens=max_new_tokens, issued_at_ms=now, deadline_ms=deadline,
                branch=branch))
        return leases

    leases = ctx.state.lease_block(node.node_id, count, now,
                                   ctx.config.max_outstanding_leases, make)
    ctx.seen.touch(node.node_id, now)
    return leases
