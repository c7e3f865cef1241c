"""The small context every handler works on: settings, storage, clock and the
in-process caches (tokenizers, rate limiters, last-seen times, the reputation policy).

Everything that must hold across worker processes (leases, the task draw counter,
bundle quotas, reputation) lives in the database; what lives here is a cache or a
per-process limit (documented per field).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ftis.coordinator.config import CoordinatorConfig
from ftis.coordinator.quotas import ExpiringKeys, Quotas
from ftis.coordinator.reputation import ReputationConfig
from ftis.coordinator.rescoring import RescoringPool
from ftis.coordinator.spot_check_pool import SpotChecker
from ftis.coordinator.state.base import NodeRecord, State
from ftis.coordinator.tokenizer_store import TokenizerCache
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.tasks import HeldoutSplit, TaskSource, TaskSpec

log = logging.getLogger(__name__)

Clock = Callable[[], int]
#: ``settings`` key of the reputation policy changed through the admin API.
REPUTATION_SETTING = "reputation"
#: How often buffered last-seen times are written (seconds).
SEEN_FLUSH_S = 2.0


def wall_clock_ms() -> int:
    """Current unix time in milliseconds."""
    return time.time_ns() // 1_000_000


class SeenBuffer:
    """Last-seen times and policy versions kept in memory and written in batches
    (:meth:`State.record_seen`), so that read paths (lease, pull, heartbeat) write
    nothing themselves. :meth:`flush` is called by the server's flusher thread every
    :data:`SEEN_FLUSH_S` and on shutdown; at most that much last-seen information is
    lost on a crash (nothing acknowledged depends on it).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, int | None]] = {}
        self._served: dict[str, int] = {}

    def touch(self, node_id: str, now_ms: int, policy_version: int | None = None) -> None:
        """Record that ``node_id`` was seen at ``now_ms`` (at ``policy_version``)."""
        with self._lock:
            old = self._seen.get(node_id)
            if old is not None:
                now_ms = max(now_ms, old[0])
                if policy_version is None:
                    policy_version = old[1]
            self._seen[node_id] = (now_ms, policy_version)

    def served(self, node_id: str, sequence: int) -> None:
        """Record that relay sequences up to ``sequence`` were served to ``node_id``."""
        with self._lock:
            self._served[node_id] = max(sequence, self._served.get(node_id, 0))

    def served_through(self, node_id: str) -> int:
        """The highest relay sequence served to ``node_id`` by this process and not yet
        flushed (0 if none); the state has the flushed value."""
        with self._lock:
            return self._served.get(node_id, 0)

    def flush(self, state: State) -> int:
        """Write the buffered times and relay sequences (:meth:`State.record_seen`,
        :meth:`State.record_relay_served`); returns how many nodes were seen."""
        with self._lock:
            batch, self._seen = self._seen, {}
            served, self._served = self._served, {}
        try:
            if batch:
                state.record_seen(batch)
            if served:
                state.record_relay_served(served)
        except Exception:  # keep them for the next flush
            with self._lock:
                for node_id, value in batch.items():
                    self._seen.setdefault(node_id, value)
                for node_id, seq in served.items():
                    self._served[node_id] = max(seq, self._served.get(node_id, 0))
            raise
        return len(batch)


#: How long an authenticated node's record is reused by this process (seconds).
NODE_CACHE_S = 1.0


class NodeCache:
    """Node records read by authentication, reused for :data:`NODE_CACHE_S`, so that a
    volunteer's lease, pull and heartbeat calls do not each read its row. Bans,
    re-registrations and standing changes (evidence) made by this process drop the entry
    at once; another worker
    process's ban takes effect here within :data:`NODE_CACHE_S` (the submit path never
    uses the cache: its snapshot reads the node afresh)."""

    def __init__(self, ttl_s: float = NODE_CACHE_S, capacity: int = 100_000) -> None:
        self.ttl_ms = int(ttl_s * 1000)
        self.capacity = capacity
        self._lock = threading.Lock()
        self._nodes: dict[str, tuple[int, NodeRecord]] = {}

    def get(self, node_id: str, now_ms: int) -> NodeRecord | None:
        with self._lock:
            hit = self._nodes.get(node_id)
        if hit is None or now_ms - hit[0] > self.ttl_ms or now_ms < hit[0]:
            return None
        return hit[1]

    def put(self, node_id: str, node: NodeRecord, now_ms: int) -> None:
        with self._lock:
            if len(self._nodes) >= self.capacity:
                self._nodes.clear()
            self._nodes[node_id] = (now_ms, node)

    def drop(self, node_id: str) -> None:
        with self._lock:
            self._nodes.pop(node_id, None)


#: How long this process reuses the branch definitions it read (seconds).
BRANCH_CACHE_S = 1.0


class BranchCache:
    """MERIT branch definitions as mix positions, read from the state at most once per
    :data:`BRANCH_CACHE_S` (:meth:`State.list_branches` without detail: one small read
    per second, not per lease) and at once when a node names a branch not cached.

    A branch is read as the positions ``k`` of the task mix whose dataset is one of its
    families (a dataset may appear at several positions, with different configs).
    Definitions changed by this process's admin calls take effect at once
    (:meth:`drop`); another worker process's within :data:`BRANCH_CACHE_S`, as bans do.
    """

    def __init__(self, state: State, specs: Sequence[TaskSpec],
                 ttl_s: float = BRANCH_CACHE_S) -> None:
        self.state = state
        self.specs = list(specs)
        self.ttl_ms = int(ttl_s * 1000)
        self._lock = threading.Lock()
        self._read_at: int | None = None
        self._among: dict[str, tuple[int, ...]] = {}
        self._families: dict[str, tuple[str, ...]] = {}

    def _load(self, now_ms: int) -> None:
        branches = self.state.list_branches(detail=False)
        among = {b.name: tuple(k for k, spec in enumerate(self.specs)
                               if spec.dataset in b.families) for b in branches}
        with self._lock:
            self._among = among
            self._families = {b.name: b.families for b in branches}
            self._read_at = now_ms

    def among(self, name: str, now_ms: int) -> tuple[int, ...] | None:
        """The mix positions of branch ``name``'s families, or ``None`` if no such
        branch exists (it was dropped, and with it the node's assignment: the node is
        leased from the whole mix, as the database now says).

        Raises:
            FtisError: BRANCH_INVALID if none of its families is in the task mix (the
                mix was changed after the branch was defined).
        """
        with self._lock:
            known = (self._read_at is not None and 0 <= now_ms - self._read_at <= self.ttl_ms
                     and name in self._among)
        if not known:
            self._load(now_ms)
        with self._lock:
            hit = self._among.get(name)
            families = self._families.get(name, ())
        if hit is None:
            return None
        if not hit:
            raise FtisError(ErrorCode.BRANCH_INVALID,
                            f"branch {name}'s families ({', '.join(families)}) are not in "
                            "the coordinator's task mix; the operator must reassign this "
                            "node or redefine the branches")
        return hit

    def drop(self) -> None:
        """Forget the cached definitions (this process changed them)."""
        with self._lock:
            self._read_at = None


#: Milliseconds a sender's bundles are refused from memory after a recorded RATE_LIMITED.
REFUSAL_HOLD_MS = 1000


class RefusalHold:
    """Senders whose last submission was refused by their quota, and until when.

    While held, a sender's next submissions are refused (RATE_LIMITED) right after the
    signature, with no database read or write: the one refusal recorded already charged
    it, and a sender over its quota by thousands a second (``make bench-attack``,
    ``bundle_spam``) would otherwise buy a read and a write transaction with each. After
    :data:`REFUSAL_HOLD_MS` the database decides again. Per process (the quota itself
    is counted in the database, across workers)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._held = ExpiringKeys(capacity)
        #: submissions refused from memory (not in the verdict log)
        self.refused = 0

    def hold(self, node_id: str, until_ms: int) -> None:
        self._held.hold(node_id, until_ms)

    def held(self, node_id: str, now_ms: int) -> bool:
        if not self._held.held(node_id, now_ms):
            return False
        self.refused += 1
        return True


@dataclass
class Context:
    """What handlers need. Build it with :meth:`create`.

    Attributes:
        config: settings (limits, task mix, TTLs).
        state: storage (the database; shared by every worker process).
        clock: unix milliseconds (injectable for tests).
        tasks: the task mix; task number ``n`` (reserved from the database's draw
            counter) is ``tasks.at(n)`` in every process.
        quotas: per-process rate limiters for pulls, tokenizer uploads and
            registrations (a client's connection stays on one worker process; bundle
            quotas are counted in the database instead).
        tokenizers: per-process cache of uploaded tokenizers.
        rescoring: re-scores submitted completions in worker processes, with a budget.
        spot_checks: checks claimed log-probs against held weights (``None``: off).
        refusals: senders refused from memory for a moment after a recorded quota refusal.
        seen: buffered last-seen times.
        nodes: node records reused by authentication for up to a second.
        branches: MERIT branch definitions reused by leases for up to a second (a
            node's branch name is in its record; see :class:`BranchCache`).
        policy: the reputation policy in force (settings row if set, else the config's).
    """

    config: CoordinatorConfig
    state: State
    clock: Clock
    tasks: TaskSource
    quotas: Quotas
    tokenizers: TokenizerCache
    rescoring: RescoringPool = field(default_factory=lambda: RescoringPool(workers=0))
    spot_checks: SpotChecker | None = None
    refusals: RefusalHold = field(default_factory=RefusalHold)
    seen: SeenBuffer = field(default_factory=SeenBuffer)
    nodes: NodeCache = field(default_factory=NodeCache)
    branches: BranchCache = field(init=False)
    policy: ReputationConfig = field(default_factory=ReputationConfig)
    upload_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def create(cls, config: CoordinatorConfig, state: State,
               clock: Clock = wall_clock_ms) -> Context:
        """A context over ``state``; the reputation policy is loaded from its settings."""
        ctx = cls(
            config=config,
            state=state,
            clock=clock,
            tasks=TaskSource(list(config.tasks), seed=config.task_seed,
                             split=HeldoutSplit(config.heldout_fraction), part="train"),
            quotas=Quotas(
                pulls_per_minute=config.pulls_per_minute,
                pull_bytes_per_minute=config.pull_bytes_per_minute,
                reports_per_minute=config.reports_per_minute,
                heartbeats_per_minute=config.heartbeats_per_minute,
                tokenizer_uploads_per_minute=config.tokenizer_uploads_per_minute,
                registrations_per_minute=config.registrations_per_minute,
                registrations_per_host_per_minute=config.registrations_per_host_per_minute,
                clock=lambda: clock() / 1000.0,
            ),
            tokenizers=TokenizerCache(state, config.tokenizer_cache_size,
                                      config.max_tokenizer_json_bytes),
            rescoring=RescoringPool(config.rescoring_workers, config.rescoring_budget_s,
                                    loop_served=config.swarm_server == "aio-inline",
                                    inline_chars=config.rescoring_inline_chars),
            spot_checks=(SpotChecker(config.spot_checks) if config.spot_checks.enabled
                         else None),
        )
        ctx.policy = ctx.load_policy()
        return ctx

    def __post_init__(self) -> None:
        self.branches = BranchCache(self.state, self.tasks.specs)

    def load_policy(self) -> ReputationConfig:
        """The stored reputation policy, or the config's (a bad stored row is logged)."""
        stored = self.state.get_setting(REPUTATION_SETTING)
        if stored:
            try:
                return ReputationConfig.from_dict(json.loads(stored))
            except (ValueError, TypeError):
                log.exception("ignoring invalid stored reputation settings")
        return self.config.reputation
