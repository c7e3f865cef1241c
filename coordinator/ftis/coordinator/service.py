"""The coordinator's behaviour, independent of gRPC.

:class:`Coordinator` implements every volunteer and operator operation on top of a
:class:`~ftis.coordinator.state.base.State`; each method raises
:class:`~ftis.protocol.errors.FtisError` on a rejection. The gRPC servicers only
translate messages; tests call this class directly with a fake clock.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from ftis.coordinator.config import CoordinatorConfig
from ftis.coordinator.state.base import BundleRecord, LeaseRecord, NodeRecord, State
from ftis.coordinator.verify import accept_bundle, check_node, verify_registration
from ftis.protocol.bundles import MAX_GRPC_MESSAGE_BYTES
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.tasks import TaskSource
from ftis.v1 import bundle_pb2

log = logging.getLogger(__name__)

Clock = Callable[[], int]
#: Lease requests may ask for at most this many tasks at once.
MAX_LEASES_PER_REQUEST = 64
#: Bundles per relay page are clamped to [1, MAX_PULL_BUNDLES].
MAX_PULL_BUNDLES = 64
#: Envelope bytes per relay page beyond the first bundle (keeps replies under the
#: receiver's gRPC message limit).
PULL_PAGE_BYTES = MAX_GRPC_MESSAGE_BYTES // 2
#: A node seen within this window counts as active in Stats.
ACTIVE_WINDOW_MS = 5 * 60 * 1000
MAX_METRICS = 256
MAX_METRIC_NAME_CHARS = 128


def wall_clock_ms() -> int:
    """Current unix time in milliseconds."""
    return time.time_ns() // 1_000_000


class Coordinator:
    """Task leasing, bundle acceptance, relay, metrics and admin operations.

    Args:
        config: settings (limits, task mix, TTLs).
        state: storage.
        clock: returns unix milliseconds (injectable for tests).

    On construction the task cursors resume after the leases already stored.
    """

    def __init__(
        self, config: CoordinatorConfig, state: State, clock: Clock = wall_clock_ms
    ) -> None:
        self.config = config
        self.state = state
        self.clock = clock
        self.tasks = TaskSource(list(config.tasks), seed=config.task_seed)
        issued = state.lease_counts()
        self.tasks.skip(
            [issued.get((k, spec.dataset), 0) for k, spec in enumerate(self.tasks.specs)]
        )
        self._lease_lock = threading.Lock()

    # -- volunteer operations ------------------------------------------------------
    def register(self, envelope: bundle_pb2.SignedEnvelope) -> NodeRecord:
        """Register a node, or update its model card and last-seen time.

        Raises:
            FtisError: envelope codes, REGISTRATION_INVALID, NODE_BANNED.
        """
        now = self.clock()
        payload, node_id = verify_registration(
            envelope,
            max_payload_bytes=self.config.max_bundle_bytes,
            clock_skew_ms=int(self.config.register_clock_skew_s * 1000),
            now_ms=now,
        )
        existing = self.state.get_node(node_id)
        if existing is not None and existing.banned:
            raise FtisError(
                ErrorCode.NODE_BANNED, f"node {node_id} is banned: {existing.ban_reason}"
            )
        card = payload.model_card
        node = self.state.upsert_node(
            node_id=node_id,
            public_key=bytes(envelope.public_key),
            display_name=payload.display_name,
            model_card=card.SerializeToString(deterministic=True),
            fingerprint=card.tokenizer_fingerprint,
            vocab_size=card.vocab_size,
            client_version=payload.client_version,
            now_ms=now,
        )
        log.info("node %s registered (%s, %s)", node_id, payload.display_name, card.base_model)
        return node

    def heartbeat(self, node_id: str, policy_version: int) -> int:
        """Record that a node is alive at ``policy_version``; returns server time (ms).

        Raises:
            FtisError: NODE_UNKNOWN, NODE_BANNED.
        """
        now = self.clock()
        check_node(self.state, node_id)
        self.state.touch_node(node_id, now, policy_version)
        return now

    def lease_tasks(
        self, node_id: str, count: int, group_size: int, max_new_tokens: int
    ) -> list[LeaseRecord]:
        """Issue ``count`` fresh tasks to a node, each under its own lease.

        Args:
            count: tasks wanted, in [1, 64].
            group_size: G completions the node will submit per task, in
                [min_group_size, max_group_size].
            max_new_tokens: completion length bound, in [1, max_new_tokens_limit].

        Raises:
            FtisError: NODE_UNKNOWN, NODE_BANNED, REQUEST_INVALID, LEASE_LIMIT (when the
                node's unanswered, unexpired leases plus ``count`` exceed the limit).
        """
        cfg = self.config
        check_node(self.state, node_id)
        if not 1 <= count <= MAX_LEASES_PER_REQUEST:
            raise FtisError(
                ErrorCode.REQUEST_INVALID, f"count {count} outside [1, {MAX_LEASES_PER_REQUEST}]"
            )
        if not cfg.min_group_size <= group_size <= cfg.max_group_size:
            raise FtisError(
                ErrorCode.REQUEST_INVALID,
                f"group_size {group_size} outside [{cfg.min_group_size}, {cfg.max_group_size}]",
            )
        if not 1 <= max_new_tokens <= cfg.max_new_tokens_limit:
            raise FtisError(
                ErrorCode.REQUEST_INVALID,
                f"max_new_tokens {max_new_tokens} outside [1, {cfg.max_new_tokens_limit}]",
            )
        with self._lease_lock:
            now = self.clock()
            outstanding = self.state.count_outstanding_leases(node_id, now)
            if outstanding + count > cfg.max_outstanding_leases:
                raise FtisError(
                    ErrorCode.LEASE_LIMIT,
                    f"{outstanding} leases outstanding + {count} requested > "
                    f"limit {cfg.max_outstanding_leases}; submit or let them expire",
                )
            deadline = now + int(cfg.lease_ttl_s * 1000)
            leases = []
            for _ in range(count):
                cursors = self.tasks.cursors
                entry = self.tasks.draw()
                # The mix entry that was drawn is the one whose cursor moved.
                spec_index = next(
                    k
                    for k, (a, b) in enumerate(zip(cursors, self.tasks.cursors, strict=True))
                    if a != b
                )
                leases.append(
                    LeaseRecord(
                        lease_id=uuid.uuid4().hex,
                        task_id=uuid.uuid4().hex,
                        node_id=node_id,
                        dataset=entry.dataset,
                        spec_index=spec_index,
                        entry=entry,
                        group_size=group_size,
                        max_new_tokens=max_new_tokens,
                        issued_at_ms=now,
                        deadline_ms=deadline,
                    )
                )
            self.state.insert_leases(leases)
        self.state.touch_node(node_id, now)
        return leases

    def submit_bundle(self, envelope: bundle_pb2.SignedEnvelope | bytes) -> BundleRecord:
        """Verify and durably store a signed bundle (see :mod:`ftis.coordinator.verify`).

        Raises:
            FtisError: the first failing check's code.
        """
        return accept_bundle(
            self.state,
            envelope,
            max_bundle_bytes=self.config.max_bundle_bytes,
            now_ms=self.clock(),
        )

    def pull_bundles(
        self,
        node_id: str,
        cursor: int,
        max_bundles: int,
        tokenizer_fingerprint: str = "",
        skip_zero_variance: bool = False,
    ) -> tuple[list[BundleRecord], int]:
        """A relay page for ``node_id`` (never its own bundles, nor banned senders').

        ``max_bundles`` is clamped to [1, 64]; a page also stops before exceeding
        :data:`PULL_PAGE_BYTES` of envelopes (it always holds at least one bundle).

        Returns:
            ``(bundles, next_cursor)``, see :meth:`State.pull_bundles`.

        Raises:
            FtisError: NODE_UNKNOWN, NODE_BANNED.
        """
        check_node(self.state, node_id)
        limit = min(max(int(max_bundles), 1), MAX_PULL_BUNDLES)
        page = self.state.pull_bundles(
            requester_id=node_id,
            cursor=max(int(cursor), 0),
            limit=limit,
            max_bytes=PULL_PAGE_BYTES,
            fingerprint=tokenizer_fingerprint,
            skip_zero_variance=skip_zero_variance,
        )
        self.state.touch_node(node_id, self.clock())
        return page

    def report_metrics(self, node_id: str, step: int, values: dict[str, float]) -> None:
        """Store a metrics report (non-finite values are kept as "nan"/"inf" strings).

        Raises:
            FtisError: NODE_UNKNOWN, NODE_BANNED, REQUEST_INVALID (more than 256 values
                or a name longer than 128 characters).
        """
        check_node(self.state, node_id)
        if len(values) > MAX_METRICS:
            raise FtisError(ErrorCode.REQUEST_INVALID, f"more than {MAX_METRICS} metrics")
        if any(len(k) > MAX_METRIC_NAME_CHARS for k in values):
            raise FtisError(ErrorCode.REQUEST_INVALID, "metric name longer than 128 characters")
        clean = {str(k): float(v) for k, v in values.items()}
        self.state.record_metrics(node_id, int(step), clean, self.clock())

    # -- operator operations -----------------------------------------------------------
    def ban(self, id_or_prefix: str, reason: str = "") -> NodeRecord:
        """Ban a node (full id or unique prefix): its calls are refused and its bundles
        no longer relayed. Raises FtisError NODE_UNKNOWN."""
        node = self.state.resolve_node(id_or_prefix)
        log.warning("banning node %s: %s", node.node_id, reason)
        return self.state.set_ban(node.node_id, True, reason or "banned by operator")

    def unban(self, id_or_prefix: str) -> NodeRecord:
        """Lift a ban. Raises FtisError NODE_UNKNOWN."""
        node = self.state.resolve_node(id_or_prefix)
        log.warning("unbanning node %s", node.node_id)
        return self.state.set_ban(node.node_id, False, "")
