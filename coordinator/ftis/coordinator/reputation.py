"""Node reputation: a Beta reputation score with exponential forgetting.

Model (Beta reputation, Jøsang & Ismail 2002; see REFERENCE.md "Beta reputation"):
every node carries decayed evidence ``good`` (r) and ``bad`` (s). Before new evidence
is added, both are multiplied by ``0.5 ** (dt / half_life)`` where ``dt`` is the time
since the last update, so old behaviour is forgotten at the same rate in both
directions. The score is the expected value of Beta(r + 1, s + 1)::

    E = (good + 1) / (good + bad + 2)        # in (0, 1); 0.5 for a node with no history

A node is *quarantined* (its bundles are stored and acknowledged but not relayed) while
its score is below its threshold: ``probation_threshold`` while it has fewer than
``probation_bundles`` verified bundles, ``quarantine_threshold`` afterwards. It leaves
quarantine only once the score exceeds the threshold by :data:`RECOVERY_MARGIN`
(hysteresis, so a node near the threshold does not flap).

Everything here is pure (no database, no clock): :class:`SqlState` and
:class:`~ftis.coordinator.service.Coordinator` call these functions; docs/reputation.md
describes the whole scheme and every evidence kind.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

# -- evidence kinds and their weights (> 0 good, < 0 bad; before decay) ----------------
#: A bundle passed every check and was stored with all claimed rewards correct.
BUNDLE_VERIFIED = "bundle_verified"
WEIGHT_BUNDLE_VERIFIED = 1.0
#: Stored bundle whose claimed rewards differ from the coordinator's; per mismatched
#: completion. Claims are signed, so a liar sinks fast. Replaces the +1 of the bundle.
REWARD_MISMATCH = "reward_mismatch"
WEIGHT_REWARD_MISMATCH = -2.0
#: Any rejection after the signature verified (other than the kinds below).
REJECTED = "rejected"
WEIGHT_REJECTED = -1.0
#: Rejection LEASE_EXPIRED: slow hardware is not malice.
LEASE_EXPIRED = "lease_expired"
WEIGHT_LEASE_EXPIRED = -0.25
#: Rejection BUNDLE_REPLAYED.
REPLAYED = "replayed"
WEIGHT_REPLAYED = -1.0
#: Rejection RATE_LIMITED (bundles or bytes per minute).
RATE_LIMITED = "rate_limited"
WEIGHT_RATE_LIMITED = -0.5
#: A signed bundle whose text is not the decoding of its tokens (TEXT_MISMATCH) or whose
#: prompt does not contain the leased question (PROMPT_MISMATCH): proof of misbehaviour,
#: stored in the ``proofs`` table and (``auto_ban_on_proof``) answered with a ban.
TEXT_MISMATCH = "text_mismatch"
PROMPT_MISMATCH = "prompt_mismatch"
WEIGHT_PROOF = -4.0
#: Receiver feedback about a sender (weight = +/- feedback_weight x reporter score).
FEEDBACK = "feedback"
#: Feedback that names unknown senders or bundles, the reporter itself, or holds
#: non-finite values; charged to the reporter.
FEEDBACK_INVALID = "feedback_invalid"
WEIGHT_FEEDBACK_INVALID = -1.0
#: Feedback claiming text mismatches on bundles whose text the coordinator verified
#: itself; charged to the reporter, the claim is ignored.
FALSE_REPORT = "false_report"
WEIGHT_FALSE_REPORT = -3.0
#: Operator ``unban``: bad evidence reset to 0 (recorded with the removed amount).
OPERATOR_RESET = "operator_reset"

#: A quarantined node is released once its score exceeds its threshold by this much.
RECOVERY_MARGIN = 0.05


@dataclass(frozen=True)
class ReputationConfig:
    """Reputation policy (defaults are the documented ones; see docs/reputation.md).

    Attributes:
        quarantine_threshold: score below which a node past probation is quarantined.
        half_life_s: evidence half-life in seconds (exponential forgetting).
        probation_bundles: verified bundles a node needs before probation ends.
        probation_threshold: the stricter threshold applied while on probation.
        feedback_weight: scale of one receiver report relative to a verified bundle
            (multiplied by the reporter's own score).
        log_ratio_tolerance: ``|mean_log_ratio|`` (nats/token) above which a report is
            negative.
        auto_ban_on_proof: ban automatically on a signed inconsistent bundle.
        feedback_cap: most feedback weight (per direction) one reporter can put on one
            sender within one half-life.
        filtered_frac_limit: a report with ``filtered_frac`` above this is negative.
        corroborating_reporters: when at least this many distinct reporters have made
            negative reports on a sender within one half-life, their negative reports
            on it are no longer capped (one false reporter still cannot do it; 0 = never).
    """

    quarantine_threshold: float = 0.3
    half_life_s: float = 6 * 3600.0
    probation_bundles: int = 5
    probation_threshold: float = 0.45
    feedback_weight: float = 0.5
    log_ratio_tolerance: float = 1.5
    auto_ban_on_proof: bool = True
    feedback_cap: float = 2.0
    filtered_frac_limit: float = 0.5
    corroborating_reporters: int = 2

    def __post_init__(self) -> None:
        problems = validate(self)
        if problems:
            raise ValueError("; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ReputationConfig:
        """Build from a mapping, ignoring unknown keys (older/newer settings rows)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def updated(self, **changes: Any) -> ReputationConfig:
        """A copy with ``changes`` (validated)."""
        return replace(self, **changes)


def validate(cfg: ReputationConfig) -> list[str]:
    """Range violations of ``cfg`` (empty when valid)."""
    problems = []

    def unit(name: str, value: float) -> None:
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            problems.append(f"{name} must be in [0, 1], got {value}")

    unit("quarantine_threshold", cfg.quarantine_threshold)
    unit("probation_threshold", cfg.probation_threshold)
    unit("filtered_frac_limit", cfg.filtered_frac_limit)
    if not (math.isfinite(cfg.half_life_s) and cfg.half_life_s > 0):
        problems.append(f"half_life_s must be > 0, got {cfg.half_life_s}")
    if not (isinstance(cfg.probation_bundles, int) and 0 <= cfg.probation_bundles <= 1_000_000):
        problems.append(f"probation_bundles must be in [0, 1000000], got {cfg.probation_bundles}")
    if not (math.isfinite(cfg.feedback_weight) and 0.0 <= cfg.feedback_weight <= 10.0):
        problems.append(f"feedback_weight must be in [0, 10], got {cfg.feedback_weight}")
    if not (math.isfinite(cfg.log_ratio_tolerance) and cfg.log_ratio_tolerance > 0):
        problems.append(f"log_ratio_tolerance must be > 0, got {cfg.log_ratio_tolerance}")
    if cfg.corroborating_reporters < 0 or cfg.corroborating_reporters == 1:
        problems.append("corroborating_reporters must be 0 (off) or >= 2")
    if not (math.isfinite(cfg.feedback_cap) and cfg.feedback_cap >= 0):
        problems.append(f"feedback_cap must be >= 0, got {cfg.feedback_cap}")
    return problems


@dataclass(frozen=True)
class Evidence:
    """One observation about a node (``weight`` > 0 good, < 0 bad, before decay)."""

    kind: str
    weight: float
    detail: str = ""
    reporter_node_id: str = ""
    bundle_id: str = ""


@dataclass(frozen=True)
class Standing:
    """A node's reputation state as stored (evidence decayed to ``updated_at_ms``)."""

    good: float = 0.0
    bad: float = 0.0
    updated_at_ms: int = 0
    quarantined: bool = False


def decay_factor(dt_ms: int, half_life_s: float) -> float:
    """``0.5 ** (dt / half_life)``; 1 for ``dt <= 0``."""
    if dt_ms <= 0:
        return 1.0
    return 0.5 ** (dt_ms / 1000.0 / half_life_s)


def decayed(standing: Standing, now_ms: int, half_life_s: float) -> tuple[float, float]:
    """``(good, bad)`` decayed from ``standing.updated_at_ms`` to ``now_ms``."""
    factor = decay_factor(now_ms - standing.updated_at_ms, half_life_s)
    return standing.good * factor, standing.bad * factor


def score(good: float, bad: float) -> float:
    """Beta reputation ``E = (good + 1) / (good + bad + 2)``."""
    return (good + 1.0) / (good + bad + 2.0)


def current_score(standing: Standing, now_ms: int, half_life_s: float) -> float:
    """The score with evidence decayed to ``now_ms``."""
    return score(*decayed(standing, now_ms, half_life_s))


def on_probation(verified_bundles: int, cfg: ReputationConfig) -> bool:
    """New nodes (fewer than ``probation_bundles`` verified bundles) are on probation."""
    return verified_bundles < cfg.probation_bundles


def threshold(verified_bundles: int, cfg: ReputationConfig) -> float:
    """The quarantine threshold that applies to a node with this many verified bundles."""
    if on_probation(verified_bundles, cfg):
        return cfg.probation_threshold
    return cfg.quarantine_threshold


def next_quarantined(
    was_quarantined: bool, value: float, verified_bundles: int, cfg: ReputationConfig
) -> bool:
    """Quarantine with hysteresis: enter below the threshold, leave above it + margin."""
    limit = threshold(verified_bundles, cfg)
    if was_quarantined:
        return value <= limit + RECOVERY_MARGIN
    return value < limit


def apply(
    standing: Standing,
    events: list[Evidence],
    now_ms: int,
    verified_bundles: int,
    cfg: ReputationConfig,
) -> Standing:
    """Decay ``standing`` to ``now_ms``, add ``events``, re-evaluate quarantine."""
    good, bad = decayed(standing, now_ms, cfg.half_life_s)
    for event in events:
        if event.weight >= 0:
            good += event.weight
        else:
            bad -= event.weight
    quarantined = next_quarantined(standing.quarantined, score(good, bad), verified_bundles, cfg)
    return Standing(
        good=good,
        bad=bad,
        updated_at_ms=max(now_ms, standing.updated_at_ms),
        quarantined=quarantined,
    )


def rejection_evidence(code_name: str) -> Evidence:
    """Evidence for a rejected submission whose signature verified (by error code name)."""
    kinds = {
        "LEASE_EXPIRED": (LEASE_EXPIRED, WEIGHT_LEASE_EXPIRED),
        "BUNDLE_REPLAYED": (REPLAYED, WEIGHT_REPLAYED),
        "RATE_LIMITED": (RATE_LIMITED, WEIGHT_RATE_LIMITED),
        "TEXT_MISMATCH": (TEXT_MISMATCH, WEIGHT_PROOF),
        "PROMPT_MISMATCH": (PROMPT_MISMATCH, WEIGHT_PROOF),
    }
    kind, weight = kinds.get(code_name, (REJECTED, WEIGHT_REJECTED))
    return Evidence(kind=kind, weight=weight, detail=code_name)


def bundle_evidence(reward_mismatches: int, bundle_id: str, disputed: bool = False) -> Evidence:
    """+1 for a verified bundle with correct claims, else -2 per mismatched completion.

    ``disputed``: corroborated receiver reports say the sender's log-probs are off, which
    the coordinator cannot check itself; its verified bundles then earn 0 instead of +1,
    so the negative reports are not outpaced by the sender's bundle rate.
    """
    if reward_mismatches > 0:
        return Evidence(
            kind=REWARD_MISMATCH,
            weight=WEIGHT_REWARD_MISMATCH * reward_mismatches,
            detail=f"{reward_mismatches} claimed rewards differ from the verified ones",
            bundle_id=bundle_id,
        )
    if disputed:
        return Evidence(kind=BUNDLE_VERIFIED, weight=0.0, bundle_id=bundle_id,
                        detail="disputed by corroborated receiver reports: no credit")
    return Evidence(kind=BUNDLE_VERIFIED, weight=WEIGHT_BUNDLE_VERIFIED, bundle_id=bundle_id)


def feedback_is_negative(
    *,
    text_mismatches: int,
    invalid_bundles: int,
    mean_log_ratio: float,
    filtered_frac: float,
    cfg: ReputationConfig,
) -> bool:
    """Whether one receiver report about a sender counts against it."""
    return (
        text_mismatches > 0
        or invalid_bundles > 0
        or abs(mean_log_ratio) > cfg.log_ratio_tolerance
        or filtered_frac > cfg.filtered_frac_limit
    )


def feedback_weight(negative: bool, reporter_score: float, cfg: ReputationConfig) -> float:
    """``+/- feedback_weight x reporter score`` (before the per-reporter cap)."""
    magnitude = cfg.feedback_weight * reporter_score
    return -magnitude if negative else magnitude


def capped(weight: float, already_used: float, cfg: ReputationConfig) -> float:
    """Clip ``weight`` so that ``|weight| + already_used <= feedback_cap`` (same sign)."""
    room = max(0.0, cfg.feedback_cap - already_used)
    return math.copysign(min(abs(weight), room), weight) if weight else 0.0
