"""Abstract coordinator state and the plain records it hands out.

Records are frozen dataclasses, detached from any database session, so that callers
(verification, servicers, tests) never touch the ORM.

Rejected submissions change nothing in nodes, leases or bundles: the writes are one
audit row in the verdict log and, for a registered signer, its rejection counter
(``bundles_rejected``, kept beside its reputation, not in ``nodes``; ``rejections_by_code``
is counted from the log). Exceptions, documented in docs/error-codes.md: reputation
evidence rows, and a *proof* rejection (TEXT_MISMATCH, PROMPT_MISMATCH), which stores
the signed envelope and, with ``auto_ban_on_proof``, bans the sender.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ftis.coordinator.reputation import Evidence, Standing
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.tasks.source import TaskEntry


class DatabaseError(RuntimeError):
    """The database cannot be reached or initialised."""


@dataclass(frozen=True)
class NodeRecord:
    """A registered node.

    ``model_card`` is a serialized ``ftis.v1.ModelCard``; ``fingerprint`` and
    ``vocab_size`` are copied out of it. Times are unix milliseconds.
    """

    node_id: str
    public_key: bytes
    display_name: str
    model_card: bytes
    fingerprint: str
    vocab_size: int
    client_version: str
    registered_at_ms: int
    last_seen_ms: int
    policy_version: int
    banned: bool
    ban_reason: str
    bundles_accepted: int
    #: Rejected submissions since registration (a counter; the verdict log has details).
    bundles_rejected: int
    reward_mismatches: int
    completions: int
    completion_tokens: int
    latest_metrics: dict[str, float] = field(default_factory=dict)
    latest_metrics_step: int = 0
    #: Highest relay sequence served to the node (flushed with last-seen, so up to
    #: :data:`~ftis.coordinator.handlers.context.SEEN_FLUSH_S` behind).
    relay_served_seq: int = 0
    #: Reputation evidence as stored (decayed to ``rep_updated_ms``), see reputation.py.
    rep_good: float = 0.0
    rep_bad: float = 0.0
    rep_updated_ms: int = 0
    #: Bundles stored but not relayed (updated on every evidence event).
    quarantined: bool = False
    #: The MERIT branch the node is leased from (:class:`BranchRecord`); ``None``: the
    #: whole task mix.
    branch: str | None = None
    #: Audit-based probation: ``reputation.AUDIT_PENDING`` (0), ``AUDIT_PASSED`` (1) or
    #: ``AUDIT_FAILED_STATUS`` (-1); only read while ``audit_reporters`` > 0.
    audit_status: int = 0
    #: What the node's client does beyond the base protocol, as registered (the known
    #: ones only, ``ftis.protocol.capabilities``); re-registering replaces them.
    capabilities: tuple[str, ...] = ()

    @property
    def standing(self) -> Standing:
        return Standing(self.rep_good, self.rep_bad, self.rep_updated_ms, self.quarantined)


@dataclass(frozen=True)
class EvidenceRecord:
    """One stored reputation observation (``weight`` as applied, before decay)."""

    id: int
    node_id: str
    at_ms: int
    kind: str
    weight: float
    detail: str
    reporter_node_id: str
    bundle_id: str


@dataclass(frozen=True)
class LeaseRecord:
    """A task issued to one node. ``bundle_id`` is set once a bundle answered it.

    ``spec_index`` is the position of the task's dataset in the configured task mix
    (used to resume the task cursors after a restart). ``branch`` is the MERIT branch
    the node was leased from (``None``: the whole mix); accepted bundles are counted
    per branch from it.
    """

    lease_id: str
    task_id: str
    node_id: str
    dataset: str
    spec_index: int
    entry: TaskEntry
    group_size: int
    max_new_tokens: int
    issued_at_ms: int
    deadline_ms: int
    bundle_id: str | None = None
    branch: str | None = None


#: What a branch name may hold: letters, digits, ``_``, ``.``, ``-``, 1 to 64 of them.
BRANCH_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class BranchRecord:
    """A MERIT branch (docs/merit.md): a named sub-mix of the coordinator's task mix.
    A node assigned to it (:attr:`NodeRecord.branch`) is leased tasks of these families
    only; unassigned nodes are leased from the whole mix.

    Attributes:
        name: matches :data:`BRANCH_NAME`, e.g. ``"b0"``.
        families: ReasoningGYM dataset names, non-empty, each in at most one branch.
        tokens: the plan's token count of these families (the merge weight's basis;
            0 when not given). Informational: leases do not use it.
        defined_at_ms: when the branch was (re)defined.
        node_ids: the nodes assigned to it, oldest registration first
            (:meth:`State.list_branches` only).
        bundles_accepted: accepted bundles answering leases issued under it
            (:meth:`State.list_branches` only).
    """

    name: str
    families: tuple[str, ...]
    tokens: float = 0.0
    defined_at_ms: int = 0
    node_ids: tuple[str, ...] = ()
    bundles_accepted: int = 0


def check_branches(branches: Sequence[BranchRecord], kept: Sequence[BranchRecord] = ()
                   ) -> None:
    """Raise FtisError BRANCH_INVALID unless ``branches`` (about to be defined) and
    ``kept`` (existing ones they leave in place) have valid, distinct names, non-empty
    families, and no family named twice (in one branch or in two): MERIT's branches
    partition (part of) the mix, so a family trains in one branch only."""
    owner: dict[str, str] = {}
    names: set[str] = set()
    for b in [*branches, *kept]:
        if not isinstance(b.name, str) or not BRANCH_NAME.fullmatch(b.name):
            raise FtisError(ErrorCode.BRANCH_INVALID,
                            f"branch name {str(b.name)[:80]!r} is not 1-64 of [A-Za-z0-9_.-]")
        if b.name in names:
            raise FtisError(ErrorCode.BRANCH_INVALID, f"branch {b.name} defined twice")
        names.add(b.name)
        if not b.families:
            raise FtisError(ErrorCode.BRANCH_INVALID, f"branch {b.name} has no family")
        if not (b.tokens >= 0 and b.tokens < float("inf")):
            raise FtisError(ErrorCode.BRANCH_INVALID,
                            f"branch {b.name}: tokens {b.tokens!r} not a finite number >= 0")
        for family in b.families:
            if family in owner:
                where = "twice" if owner[family] == b.name else (
                    f"in branches {owner[family]} and {b.name}")
                raise FtisError(ErrorCode.BRANCH_INVALID,
                                f"family {family[:128]!r} named {where}; a family trains "
                                "in one branch only")
            owner[family] = b.name


@dataclass(frozen=True)
class NewBundle:
    """A verified bundle about to be stored.

    Attributes:
        bundle_id: hex SHA-256 of the envelope payload.
        envelope: the serialized ``SignedEnvelope`` as received.
        verified_rewards: coordinator's reward per completion, in [0, 1].
        reward_mismatches: completions whose claimed reward differed by more than 1e-6.
    """

    bundle_id: str
    node_id: str
    task_id: str
    lease_id: str
    fingerprint: str
    envelope: bytes
    verified_rewards: list[float]
    mean_reward: float
    zero_variance: bool
    completions: int
    completion_tokens: int
    size_bytes: int
    reward_mismatches: int
    policy_version: int
    #: The coordinator checked text == decode(token_ids) with the sender's tokenizer.
    text_verified: bool = False


@dataclass(frozen=True)
class BundleRecord:
    """A stored bundle; ``sequence`` is its position in the relay order (1, 2, ...)."""

    sequence: int
    bundle_id: str
    node_id: str
    task_id: str
    lease_id: str
    dataset: str
    fingerprint: str
    envelope: bytes
    verified_rewards: list[float]
    mean_reward: float
    zero_variance: bool
    completions: int
    completion_tokens: int
    size_bytes: int
    reward_mismatches: int
    policy_version: int
    stored_at_ms: int
    text_verified: bool = False
    #: The sender's reputation when the record was read for relaying (PullBundles).
    sender_reputation: float = 0.5
    #: The sender's stored evidence (filled by ``pull_bundles`` only).
    sender_standing: Standing | None = None
    #: The leased task's question (filled by ``pull_bundles`` only): receivers with another
    #: tokenizer render their own prompt from it (DESIGN.md section 6).
    question: str = ""
    #: Relayed for audit only (filled by ``pull_bundles`` only): its sender is on
    #: audit-based probation; the receiver must not train on it, only report its
    #: log-ratio statistics (docs/reputation.md "Audit-based probation").
    audit_only: bool = False


@dataclass(frozen=True)
class AuditRelay:
    """How a relay page treats senders on audit-based probation (``pull_bundles``).

    A sender is on probation when it has fewer than ``probation_bundles`` verified
    bundles or its ``audit_status`` is not passed. A requester that is not
    ``established`` gets none of their bundles; an established one gets those whose
    tokenizer fingerprint is ``fingerprint`` (its own), marked ``audit_only``, even
    zero-variance ones when the page skips zero variance (an audit compares log-probs).
    """

    probation_bundles: int
    established: bool
    fingerprint: str


@dataclass(frozen=True)
class StatsRecord:
    """Swarm-wide counters for the admin ``Stats`` call (``rejections_by_code``: code -> n)."""

    nodes: int
    active_nodes: int
    banned_nodes: int
    leases_outstanding: int
    bundles_accepted: int
    bundles_rejected: int
    completions: int
    completion_tokens: int
    mean_verified_reward: float
    rejections_by_code: dict[int, int]
    bundle_bytes: int
    quarantined_nodes: int = 0


#: ``update(standing, bundles_accepted) -> standing``: a pure reputation step (decay to
#: now, add the events, re-evaluate quarantine), e.g. ``reputation.apply`` with its
#: events, time and policy bound. The state calls it with the row locked, so concurrent
#: writers (threads or worker processes) never lose an update; storage does no
#: reputation arithmetic of its own.
StandingUpdate = Callable[[Standing, int], Standing]


@dataclass(frozen=True)
class SubmissionSnapshot:
    """Everything verifying one submission needs, read in one transaction.

    Attributes:
        node: the signer, ``None`` if unknown.
        lease: the lease of the bundle's ``task_id``, ``None`` if unknown.
        already_stored: a bundle with this id is stored (identical resubmission).
        negative_reporters: distinct reporters with negative feedback evidence on the
            signer since ``since_ms`` (dispute check).
        recent_submissions: the signer's verdict rows (accepted or rejected) with
            ``at_ms >= window_start_ms``; with ``recent_bytes`` (the ``size_bytes`` of
            its bundles stored in that window) the per-minute quota, shared by every
            worker process because it lives in the database.
    """

    node: NodeRecord | None
    lease: LeaseRecord | None
    already_stored: bool
    negative_reporters: frozenset[str] = frozenset()
    recent_submissions: int = 0
    recent_bytes: int = 0


@dataclass(frozen=True)
class Verdict:
    """The outcome of one submission, written by :meth:`State.commit_submission` in one
    transaction (issue 12: nothing acknowledged exists without its evidence).

    Attributes:
        node_id: the signer (``None`` when the signature did not verify: nothing but the
            verdict row is written then).
        bundle_id: hex SHA-256 of the payload, if it was decoded.
        code: 0 for accepted, else the rejecting ``ErrorCode``.
        reason: one line.
        bundle: the row to store; set iff ``code == 0``.
        evidence: reputation events on ``node_id``.
        proof_envelope: the signed envelope kept as proof (TEXT_MISMATCH,
            PROMPT_MISMATCH), or ``None``.
        ban_reason: ban ``node_id`` with this reason (auto-ban on proof), or ``None``.
    """

    node_id: str | None
    bundle_id: str | None
    code: int
    reason: str
    bundle: NewBundle | None = None
    evidence: tuple[Evidence, ...] = ()
    proof_envelope: bytes | None = None
    ban_reason: str | None = None


@dataclass(frozen=True)
class CommittedVerdict:
    """What :meth:`State.commit_submission` wrote: the stored bundle (accepted only),
    the signer after its evidence (``None`` if no node), and the proof id, if any."""

    bundle: BundleRecord | None
    node: NodeRecord | None
    proof_id: int | None = None


class State(abc.ABC):
    """Storage operations the coordinator needs. Implementations must be thread-safe
    and, on a server database, safe for several worker processes."""

    # -- the submit path (one read, one write) ---------------------------------
    @abc.abstractmethod
    def submission_snapshot(
        self, node_id: str, task_id: str, bundle_id: str, since_ms: int, window_start_ms: int
    ) -> SubmissionSnapshot:
        """One read transaction (one consistent snapshot): see :class:`SubmissionSnapshot`.
        Writes nothing."""

    @abc.abstractmethod
    def commit_submission(
        self, verdict: Verdict, now_ms: int, update: StandingUpdate | None = None,
        expected: NodeRecord | None = None,
    ) -> CommittedVerdict:
        """One write transaction: the verdict row; for ``code == 0`` the bundle (answers
        its lease with a conditional update, is stored with ``stored_quarantined`` = the
        signer's quarantine *before* this verdict's evidence, bumps the node's counters,
        ``last_seen_ms`` and ``policy_version``); the evidence rows and the node's
        standing (``update(standing, bundles_accepted)`` with the node locked and
        ``bundles_accepted`` counting this bundle; required when ``verdict.evidence`` is
        non-empty); the proof row; the ban. For a rejection of a registered node its
        ``bundles_rejected`` counter goes up by one.

        When ``verdict.node_id`` is ``None`` or names no registered node, only the verdict
        row is written (evidence, proof and ban need a node row).

        ``expected``: the signer as the submission snapshot read it. An implementation
        may then commit an accepted bundle without reading the node first, computing
        the standing from ``expected`` and writing only if the node's
        ``bundles_accepted`` and standing are still those (else it reads the node
        locked, as without ``expected``); the result is the same either way.

        Returns:
            The stored bundle (``code == 0``), the node after the write (``None`` if no
            node) and the proof id (``None`` if no proof was kept).

        Raises:
            FtisError: BUNDLE_REPLAYED if the lease was answered (or a bundle with this
                id stored) concurrently; NODE_UNKNOWN for ``code == 0`` from an unknown
                node. Nothing is written then: the caller commits a rejection verdict.
            ValueError: a bundle without ``code == 0`` (or the reverse), a bundle of
                another node than ``verdict.node_id``, or evidence without ``update``.
        """

    @abc.abstractmethod
    def record_seen(self, seen: Mapping[str, tuple[int, int | None]]) -> None:
        """Batch update of last-seen times in one transaction: ``{node_id:
        (last_seen_ms, policy_version or None)}``. ``last_seen_ms`` only moves forward:
        an entry older than the stored time changes nothing (its policy version is stale
        too); ``None`` keeps the stored policy version; unknown nodes are skipped."""

    @abc.abstractmethod
    def record_relay_served(self, served: Mapping[str, int]) -> None:
        """Batch update, in one transaction, of the highest relay sequence served to
        each node (``{node_id: sequence}``): ``relay_served_seq`` only moves forward;
        unknown nodes are skipped."""

    @abc.abstractmethod
    def apply_evidence_many(
        self, events: list[tuple[str, Evidence]], now_ms: int,
        update: Callable[[list[Evidence]], StandingUpdate],
        counted: tuple[str, Sequence[str]] | None = None,
    ) -> dict[str, NodeRecord]:
        """In one transaction, for each node named in ``events``: lock it (all of them
        first, in ``node_id`` order, so concurrent callers cannot deadlock), apply
        ``update(its events)`` to its standing (``(standing, bundles_accepted)``), append
        its evidence rows (``at_ms = now_ms``); and with ``counted = (reporter_id,
        bundle_ids)`` record those bundles as counted for that reporter's feedback
        (:meth:`reported_bundles`). Returns the nodes after, in order of first appearance
        (``{}`` for no events and nothing counted). Raises FtisError NODE_UNKNOWN if any
        node is unknown, FEEDBACK_INVALID if a counted bundle was already recorded for the
        reporter (a concurrent report); nothing is written then."""

    @abc.abstractmethod
    def lease_block(
        self, node_id: str, count: int, now_ms: int, max_outstanding: int,
        make: Callable[[int], list[LeaseRecord]],
    ) -> list[LeaseRecord]:
        """In one transaction, serialised per node across workers: count the node's
        unanswered, unexpired leases (``deadline_ms >= now_ms``); if that plus ``count``
        exceeds ``max_outstanding`` raise FtisError LEASE_LIMIT (``"<n> leases
        outstanding + <count> requested > limit <max>; submit or let them expire"``,
        nothing handed out); else take ``count`` consecutive task numbers ``start ..
        start + count - 1`` that no call of any process ever took before, insert
        ``make(start)`` and return it. Numbers come from the one shared draw counter,
        which an implementation may advance a block at a time per process (the SQL
        state: :data:`~ftis.coordinator.state.sql.TASK_BLOCK` numbers): numbers are then
        handed out in increasing order by one process, and some may be skipped (a gap:
        the unused rest of a block after a crash). Raises FtisError NODE_UNKNOWN for an
        unknown node; ``count`` may be 0."""

    @abc.abstractmethod
    def task_numbers_reserved(self) -> int:
        """The shared draw counter: task numbers reserved so far, handed out or not
        (every number handed out is below it)."""

    # -- nodes -----------------------------------------------------------------
    @abc.abstractmethod
    def upsert_node(
        self,
        *,
        node_id: str,
        public_key: bytes,
        display_name: str,
        model_card: bytes,
        fingerprint: str,
        vocab_size: int,
        client_version: str,
        now_ms: int,
        capabilities: Sequence[str] = (),
    ) -> NodeRecord:
        """Insert a node or update its card, name, client version, ``capabilities``
        (known ones, stored as given) and ``last_seen_ms`` (ban untouched)."""

    @abc.abstractmethod
    def get_node(self, node_id: str) -> NodeRecord | None:
        """The node with exactly this id, or ``None``."""

    @abc.abstractmethod
    def resolve_node(self, id_or_prefix: str) -> NodeRecord:
        """The node with this id, or the only node whose id starts with it.

        Raises:
            FtisError: NODE_UNKNOWN if none or several match.
        """

    @abc.abstractmethod
    def list_nodes(self) -> list[NodeRecord]:
        """All nodes, oldest registration first."""

    @abc.abstractmethod
    def set_ban(self, node_id: str, banned: bool, reason: str = "") -> NodeRecord:
        """Ban or unban a node (exact id). Raises FtisError NODE_UNKNOWN."""

    # -- leases ----------------------------------------------------------------
    @abc.abstractmethod
    def count_outstanding_leases(self, node_id: str | None, now_ms: int) -> int:
        """Unanswered leases with ``deadline_ms >= now_ms`` (of one node, or all)."""

    @abc.abstractmethod
    def insert_leases(self, leases: list[LeaseRecord]) -> None:
        """Store newly issued leases in one transaction."""

    @abc.abstractmethod
    def get_lease_by_task(self, task_id: str) -> LeaseRecord | None:
        """The lease issued for ``task_id``, or ``None``."""

    # -- bundles ---------------------------------------------------------------
    @abc.abstractmethod
    def store_bundle(self, bundle: NewBundle, now_ms: int) -> BundleRecord:
        """Durably store an accepted bundle in ONE transaction: insert the bundle, mark
        its lease answered, bump the node's counters, append an accepting verdict.
        Returns only after commit.

        Raises:
            FtisError: BUNDLE_REPLAYED if the lease was answered meanwhile (the unique
                ``lease_id`` constraint is the database-level replay guard).
        """

    @abc.abstractmethod
    def record_rejection(
        self, node_id: str | None, bundle_id: str | None, code: int, reason: str, now_ms: int
    ) -> None:
        """Append a rejecting verdict to the audit log and bump the node's
        ``bundles_rejected`` (if registered); nodes, leases and bundles are unchanged."""

    @abc.abstractmethod
    def pull_bundles(
        self,
        *,
        requester_id: str,
        cursor: int,
        limit: int,
        max_bytes: int,
        fingerprint: str = "",
        skip_zero_variance: bool = False,
        branch: str | None = None,
        audit: AuditRelay | None = None,
    ) -> tuple[list[BundleRecord], int]:
        """Relay page: bundles with ``sequence > cursor`` in sequence order, excluding the
        requester's own, banned senders', other fingerprints (when ``fingerprint``) and
        zero-variance groups (when ``skip_zero_variance``). At most ``limit`` bundles
        and, beyond the first, at most ``max_bytes`` of envelopes.

        With ``audit`` (audit-based probation on), senders on probation are relayed as
        :class:`AuditRelay` says, their bundles marked ``audit_only``.

        With ``branch`` (a MERIT branch name), only bundles whose lease was issued under
        that branch (``LeaseRecord.branch``); ``None``: every bundle, whatever branch or
        none its lease was issued under.

        Returns:
            ``(bundles, next_cursor)``: ``next_cursor`` is the last returned sequence if
            the page is full, else the largest sequence at query time.
        """

    @abc.abstractmethod
    def list_bundles(self, node_prefix: str = "", limit: int = 50) -> list[BundleRecord]:
        """Newest first, optionally only nodes whose id starts with ``node_prefix``."""

    @abc.abstractmethod
    def bundle_owners(self, bundle_ids: list[str]) -> dict[str, tuple[str, bool, int]]:
        """``{bundle_id: (node_id, text_verified, relay sequence)}`` for the stored ones
        among ``bundle_ids``."""

    @abc.abstractmethod
    def get_bundle(self, bundle_id: str) -> BundleRecord | None:
        """The stored bundle with this id, or ``None``."""

    @abc.abstractmethod
    def reported_bundles(self, reporter_id: str, bundle_ids: list[str]) -> set[str]:
        """Those of ``bundle_ids`` that ``reporter_id``'s feedback has already counted."""

    @abc.abstractmethod
    def count_text_unverified(self, node_id: str) -> tuple[int, int]:
        """``(stored bundles, of which not text-verified)`` of one node."""

    # -- tokenizers ------------------------------------------------------------
    @abc.abstractmethod
    def store_tokenizer(
        self,
        fingerprint: str,
        tokenizer_json_gz: bytes,
        vocab_size: int,
        uploaded_by: str,
        now_ms: int,
    ) -> bool:
        """Store an uploaded tokenizer; False (nothing changes) if already stored."""

    @abc.abstractmethod
    def get_tokenizer(self, fingerprint: str) -> bytes | None:
        """The gzip'd ``tokenizer.json`` with this fingerprint, or ``None``."""

    @abc.abstractmethod
    def has_tokenizer(self, fingerprint: str) -> bool:
        """Whether a tokenizer with this fingerprint was uploaded."""

    # -- reputation ------------------------------------------------------------
    @abc.abstractmethod
    def apply_evidence(
        self, node_id: str, events: list[Evidence], now_ms: int, update: StandingUpdate
    ) -> NodeRecord:
        """In one transaction, with the node's row locked: ``standing := update(standing,
        bundles_accepted)`` (e.g. ``reputation.standing_update(events, now, policy)``:
        decay, add, re-evaluate quarantine) and one evidence row per event.
        Raises FtisError NODE_UNKNOWN."""

    @abc.abstractmethod
    def list_evidence(self, node_id: str, limit: int = 50) -> list[EvidenceRecord]:
        """A node's evidence rows, newest first."""

    @abc.abstractmethod
    def record_audits(self, reporter_id: str, verdicts: Mapping[str, bool], now_ms: int,
                      decide: Callable[[int, int], int]) -> dict[str, tuple[int, int, int]]:
        """Store ``reporter_id``'s latest audit verdict on each sender
        (``{sender: plausible}``, replacing its earlier one) and re-decide each sender's
        ``audit_status`` as ``decide(plausible_reporters, implausible_reporters)`` over
        the stored verdicts, in one transaction. Senders that are not registered are
        skipped.

        Returns:
            ``{sender: (old_status, new_status, implausible_reporters)}``.
        """

    @abc.abstractmethod
    def set_audit_status(self, node_id: str, status: int) -> bool:
        """Set a node's ``audit_status`` (operator seeds); ``False`` if it is unknown."""

    @abc.abstractmethod
    def audit_reports(self, sender_id: str) -> dict[str, bool]:
        """``{reporter: plausible}``: the stored audit verdicts on ``sender_id``."""

    @abc.abstractmethod
    def negative_reporters(self, sender_id: str, since_ms: int) -> set[str]:
        """Distinct reporters with negative feedback evidence on ``sender_id`` since then."""

    @abc.abstractmethod
    def feedback_used(self, reporter_id: str, sender_id: str, since_ms: int) -> tuple[float, float]:
        """``(positive, negative)`` feedback weight (magnitudes) ``reporter_id`` put on
        ``sender_id`` since ``since_ms``."""

    @abc.abstractmethod
    def reset_bad_evidence(self, node_id: str, now_ms: int) -> NodeRecord:
        """Set the node's bad evidence to 0 and lift its quarantine (operator unban);
        appends an ``operator_reset`` evidence row."""

    # -- MERIT branches -----------------------------------------------------------
    @abc.abstractmethod
    def define_branches(self, branches: Sequence[BranchRecord], now_ms: int,
                        replace: bool = False) -> list[BranchRecord]:
        """In one transaction (serialised with every other branch change): define
        ``branches`` (``name``, ``families``, ``tokens`` are read; ``defined_at_ms`` is
        ``now_ms``). A branch of an existing name is redefined; its nodes stay assigned.
        With ``replace``, every other branch is dropped and its nodes unassigned.

        Returns:
            :meth:`list_branches` after the change.

        Raises:
            FtisError: BRANCH_INVALID (:func:`check_branches` over the new branches and
                those kept); nothing is written then. Whether the families are in the
                task mix is the caller's check (the state does not know the mix).
        """

    @abc.abstractmethod
    def list_branches(self, detail: bool = True) -> list[BranchRecord]:
        """Every branch by name, with its ``node_ids`` and ``bundles_accepted`` (with
        ``detail``; without, one read of the definitions only, for the lease path's
        cache: ``()`` and 0)."""

    @abc.abstractmethod
    def assign_branches(self, assignments: Mapping[str, str | None]) -> list[NodeRecord]:
        """In one transaction: ``{node_id: branch name or None}`` (exact node ids;
        ``None`` unassigns). Returns the nodes after, in the mapping's order.

        Raises:
            FtisError: NODE_UNKNOWN, BRANCH_UNKNOWN (a branch dropped concurrently
                included); nothing is written then.
        """

    # -- settings ----------------------------------------------------------------
    @abc.abstractmethod
    def get_setting(self, key: str) -> str | None:
        """A persisted setting (JSON text), or ``None``."""

    @abc.abstractmethod
    def put_setting(self, key: str, value: str, now_ms: int) -> None:
        """Persist a setting."""

    # -- metrics and stats -----------------------------------------------------
    @abc.abstractmethod
    def record_metrics(
        self, node_id: str, step: int, values: dict[str, float], now_ms: int
    ) -> None:
        """Append a metrics row and make it the node's latest metrics."""

    @abc.abstractmethod
    def rejections_by_code(self, node_id: str | None = None) -> dict[int, int]:
        """Rejecting verdicts per error code (of one node, or all)."""

    @abc.abstractmethod
    def stats(self, now_ms: int, active_window_ms: int) -> StatsRecord:
        """Swarm-wide counters; active = seen within ``active_window_ms``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections."""

    # -- history (read-only, bounded; the status page and /metrics) -----------------
    # Not abstract: the SQL storage's implementations live in
    # :mod:`ftis.coordinator.state.history` (functions over the SQLAlchemy engine of an
    # ``SqlState``); another storage overrides these. Every query scans at most
    # ``max_rows`` (default :data:`HISTORY_MAX_ROWS`) of the newest rows of its table (a
    # primary-key range), so a large database costs the status page no more than a small
    # one.

    def swarm_counts(self, now_ms: int, active_window_ms: int) -> SwarmCounts:
        """Node and lease counts for the gauges of ``/metrics`` (no bundle scan)."""
        from ftis.coordinator.state import history

        return history.swarm_counts(self, now_ms, active_window_ms)

    def reward_history(self, since_ms: int, bucket_ms: int,
                       max_rows: int | None = None) -> list[RewardBucket]:
        """Verified rewards of the bundles stored since ``since_ms``, summed per time
        bucket (``bucket_ms`` wide, from ``since_ms``), dataset and sender."""
        from ftis.coordinator.state import history

        return history.reward_history(self, since_ms, bucket_ms, max_rows)

    def verdict_history(self, since_ms: int, bucket_ms: int,
                        max_rows: int | None = None) -> list[VerdictBucket]:
        """Verdicts (0 = accepted, else the rejecting code) since ``since_ms``, counted
        per time bucket and code."""
        from ftis.coordinator.state import history

        return history.verdict_history(self, since_ms, bucket_ms, max_rows)

    def evidence_since(self, since_ms: int,
                       max_rows: int | None = None) -> list[EvidenceRecord]:
        """Every node's evidence rows since ``since_ms``, oldest first."""
        from ftis.coordinator.state import history

        return history.evidence_since(self, since_ms, max_rows)

    def metrics_history(self, since_ms: int, keys: tuple[str, ...],
                        max_rows: int | None = None) -> list[MetricsPoint]:
        """Metrics reports since ``since_ms`` (only ``keys`` of their values), oldest
        first."""
        from ftis.coordinator.state import history

        return history.metrics_history(self, since_ms, keys, max_rows)


#: Newest rows a history query scans at most (per table).
HISTORY_MAX_ROWS = 50_000


@dataclass(frozen=True)
class SwarmCounts:
    """Counts read at scrape time (``leases_expired``: unanswered leases past their
    deadline; ``quarantined_nodes`` excludes banned ones)."""

    nodes: int
    active_nodes: int
    quarantined_nodes: int
    banned_nodes: int
    leases_outstanding: int
    leases_expired: int


@dataclass(frozen=True)
class RewardBucket:
    """Stored bundles of one sender and dataset in one time bucket."""

    start_ms: int
    dataset: str
    node_id: str
    bundles: int
    completions: int
    #: sum of the completions' verified rewards
    reward_sum: float


@dataclass(frozen=True)
class VerdictBucket:
    """Verdicts with one code (0 = accepted) in one time bucket."""

    start_ms: int
    code: int
    count: int


@dataclass(frozen=True)
class MetricsPoint:
    """One metrics report of a node (``values``: the requested keys it holds)."""

    node_id: str
    at_ms: int
    step: int
    values: dict[str, float]
