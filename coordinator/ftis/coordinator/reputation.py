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

Everything here is pure (no database, no clock): the handlers
(:mod:`ftis.coordinator.handlers`) decide evidence, proofs and bans with these functions
and the state writes them (calling :func:`apply` through :func:`standing_update` with the
node's row locked); docs/reputation.md describes the whole scheme and every evidence kind.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
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
#: Rejection LOGPROB_SPOT_CHECK_FAILED: the claimed log-probs are not the held weights'
#: (spot_check.py). As heavy as a proof (one failure quarantines a node on probation),
#: but statistical, so the envelope is not kept and there is no ban.
LOGPROB_SPOT_CHECK = "logprob_spot_check"
WEIGHT_LOGPROB_SPOT_CHECK = -4.0
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
#: Audit-based probation (``audit_reporters`` > 0): ``audit_reporters`` independent
#: established receivers judged the node's log-probs implausible while it was on
#: probation (:func:`audit_status`). Written once, when the audit turns to failed; as
#: heavy as a failed spot check (alone it quarantines a node with at most 3 verified
#: bundles; the node stays on probation either way), no proof, no ban.
AUDIT_FAILED = "audit_failed"
WEIGHT_AUDIT_FAILED = -4.0

#: A node's audit state (``nodes.audit_status``): no verdict yet, passed (k established
#: receivers judged its log-probs plausible), failed (k judged them implausible).
AUDIT_PENDING = 0
AUDIT_PASSED = 1
AUDIT_FAILED_STATUS = -1

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
        corroborating_reporters: when at least this many distinct established reporters
            have made negative reports on a sender within one half-life, their negative
            reports on it are capped at ``corroborated_cap`` instead of ``feedback_cap``
            (one false reporter still cannot do it; 0 = never).
        corroborated_cap: the per-reporter, per-half-life cap of corroborated negative
            feedback (>= ``feedback_cap``), so k established reporters can move a
            sender by at most ``k x corroborated_cap`` per half-life.
        reporter_maturity_s: a reporter's feedback weight grows linearly with its age
            (seconds since registration) up to full weight at this age; a reporter on
            probation or quarantined has weight 0 (docs/reputation.md "Who may report").
        shift_margin: mean log-ratio (nats/token) an honest sender's reports cannot
            exceed except by noise; a report whose mean exceeds it by ``shift_z``
            standard errors is negative (deflated, "shaded" log-probs; issue 13, class 4;
            :func:`shift_detected`). Honest expectation: <= 0.
        shift_z: standard errors of margin before a shift counts (one-sided).
        shift_min_completions: token-aligned completions a report needs before its
            shift is tested (the standard error of fewer is unreliable); 0 = off.
        audit_reporters: audit-based probation (docs/reputation.md "Audit-based
            probation"): 0 (default) = off, probation ends on ``probation_bundles``
            verified bundles as before; k >= 1 = probation also needs k distinct
            established receivers of the node's tokenizer to have judged its log-probs
            plausible from audit-only relays (:func:`audit_status`), and until then its
            bundles are relayed only to established receivers of its tokenizer, marked
            audit-only (not trained on).
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
    corroborated_cap: float = 10.0
    reporter_maturity_s: float = 1800.0
    shift_margin: float = 0.05
    shift_z: float = 3.0
    shift_min_completions: int = 8
    audit_reporters: int = 0

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
    if not (math.isfinite(cfg.corroborated_cap) and cfg.corroborated_cap >= cfg.feedback_cap):
        problems.append(f"corroborated_cap must be >= feedback_cap, got {cfg.corroborated_cap}")
    if not (math.isfinite(cfg.reporter_maturity_s) and cfg.reporter_maturity_s >= 0):
        problems.append(f"reporter_maturity_s must be >= 0, got {cfg.reporter_maturity_s}")
    if not (math.isfinite(cfg.shift_margin) and cfg.shift_margin >= 0):
        problems.append(f"shift_margin must be >= 0, got {cfg.shift_margin}")
    if not (math.isfinite(cfg.shift_z) and cfg.shift_z >= 0):
        problems.append(f"shift_z must be >= 0, got {cfg.shift_z}")
    if not (isinstance(cfg.shift_min_completions, int) and cfg.shift_min_completions >= 0):
        problems.append(f"shift_min_completions must be an int >= 0, got "
                        f"{cfg.shift_min_completions}")
    if not (isinstance(cfg.audit_reporters, int) and 0 <= cfg.audit_reporters <= 64):
        problems.append(f"audit_reporters must be an int in [0, 64], got {cfg.audit_reporters}")
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


def in_probation(verified_bundles: int, audit: int, cfg: ReputationConfig) -> bool:
    """Probation as relay, reporting and spot checks see it: fewer than
    ``probation_bundles`` verified bundles, or (audit-based probation,
    ``audit_reporters`` > 0) an audit that has not passed (``audit`` is the node's
    :data:`AUDIT_PENDING` / :data:`AUDIT_PASSED` / :data:`AUDIT_FAILED_STATUS`).

    The quarantine *threshold* (:func:`threshold`) stays on the count alone: an audit
    does not change how strictly a node's own evidence is judged, only who may learn
    from its bundles and whose reports count.
    """
    if on_probation(verified_bundles, cfg):
        return True
    return cfg.audit_reporters > 0 and audit != AUDIT_PASSED


def established(verified_bundles: int, audit: int, quarantined: bool, banned: bool,
                cfg: ReputationConfig) -> bool:
    """Past probation (:func:`in_probation`), not quarantined, not banned: a node whose
    reports count and who may receive audit-only bundles."""
    return not (banned or quarantined or in_probation(verified_bundles, audit, cfg))


def audit_judgement(f: FeedbackEntry, cfg: ReputationConfig) -> bool | None:
    """One established receiver's audit of a sender on probation, from the statistics it
    already reports as feedback (pure): ``True`` plausible, ``False`` implausible,
    ``None`` no judgement.

    Implausible when the log-ratio statistics fail the feedback plausibility rule
    (``|mean_log_ratio| > log_ratio_tolerance``, ``filtered_frac > filtered_frac_limit``
    or a one-sided shift, :func:`shift_detected`). Plausible only when that rule passes
    on at least one token-aligned completion (``log_ratio_completions`` >= 1): a report
    without log-ratio statistics (cross-tokenizer, older clients, no bundle learned)
    judges nothing. Text-mismatch and invalid-bundle claims are not audit verdicts (the
    coordinator checks text itself; they stay ordinary feedback).
    """
    if f.log_ratio_completions < 1:
        return None
    implausible = (
        abs(f.mean_log_ratio) > cfg.log_ratio_tolerance
        or f.filtered_frac > cfg.filtered_frac_limit
        or shift_detected(f.mean_log_ratio, f.log_ratio_stderr, f.log_ratio_completions, cfg)
    )
    return not implausible


def audit_status(plausible_reporters: int, implausible_reporters: int,
                 cfg: ReputationConfig) -> int:
    """A sender's audit from the distinct established reporters whose latest verdict on
    it is plausible / implausible (pure): :data:`AUDIT_FAILED_STATUS` when at least
    ``audit_reporters`` say implausible (failure wins a tie: both at k), else
    :data:`AUDIT_PASSED` when at least ``audit_reporters`` say plausible, else
    :data:`AUDIT_PENDING`. With ``audit_reporters`` = 0 (off) every node counts as
    passed."""
    k = cfg.audit_reporters
    if k <= 0:
        return AUDIT_PASSED
    if implausible_reporters >= k:
        return AUDIT_FAILED_STATUS
    if plausible_reporters >= k:
        return AUDIT_PASSED
    return AUDIT_PENDING


def audit_passed_by_spot_check(audit: int, spot_checked: bool, cfg: ReputationConfig) -> bool:
    """Whether a bundle that passed the coordinator's own spot check ends its sender's
    pending audit (pure; docs/reputation.md "Audit-based probation", bootstrap).

    A passed spot check recomputed the bundle's log-probs with the weights of the card
    it claims, held by the coordinator, and found them within the tolerance: the
    evidence k receivers' audits give, from the model itself. So with audit-based
    probation on (``audit_reporters`` > 0) it passes a *pending* audit; a failed one
    stays failed (receivers' verdicts are not overruled), and with the rule off there is
    nothing to pass.
    """
    return cfg.audit_reporters > 0 and spot_checked and audit == AUDIT_PENDING


def audit_bootstrap_problem(cfg: ReputationConfig, seed_nodes: int, holds_cards: bool,
                            passed_audits: int) -> str | None:
    """Why audit-based probation could never end for anyone, or ``None`` (pure;
    docs/reputation.md "Audit-based probation", bootstrap).

    An audit passes only by k established receivers' verdicts, by an operator's seed, or
    by a spot check of a card the coordinator holds. A swarm with the rule on
    (``audit_reporters`` > 0) and none of them (no ``seed_nodes``, not ``holds_cards``, no
    node whose audit has passed: ``passed_audits`` = 0) has no established node now and
    can never get one: every node would stay on probation and nothing from any of them
    would be relayed for training. The coordinator refuses to start with such a policy,
    and the admin API refuses to set it.

    Returns:
        a one-line reason naming what to set, or ``None`` (the rule is off, or at least
        one bootstrap exists).
    """
    if cfg.audit_reporters <= 0 or seed_nodes > 0 or holds_cards or passed_audits > 0:
        return None
    return (f"audit-based probation (reputation.audit_reporters = {cfg.audit_reporters}) "
            "has no bootstrap: no audit_seed_nodes, no spot_checks.models and no node whose "
            "audit has passed, so no node could ever leave probation; name seed nodes, hold "
            "a model for spot checks, or set audit_reporters = 0")


def audit_failed_evidence(sender_id: str, implausible: int, bundle_id: str = "") -> Evidence:
    """The one-off negative evidence when a sender's audit turns to failed."""
    return Evidence(AUDIT_FAILED, WEIGHT_AUDIT_FAILED,
                    f"audit failed: {implausible} established receivers judged the "
                    f"log-probs of {sender_id[:64]} implausible", bundle_id=bundle_id)


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
        "LOGPROB_SPOT_CHECK_FAILED": (LOGPROB_SPOT_CHECK, WEIGHT_LOGPROB_SPOT_CHECK),
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


def shift_detected(mean_log_ratio: float, log_ratio_stderr: float, completions: int,
                   cfg: ReputationConfig) -> bool:
    """Whether a receiver's statistics show a sender's sampler log-probs shifted down
    ("shaded", issue 13, class 4; docs/reputation.md "Shaded log-probs").

    For an honest sender every token ``y`` is drawn from the distribution ``q`` whose
    log-prob it reports, so whatever the receiver's model ``p`` (its own drift, another
    checkpoint or temperature of the same tokenizer), the expected per-token log-ratio is
    ``E_q[log p(y) - log q(y)] = -KL(q || p) <= 0`` (Gibbs' inequality). A sender that
    lowers every log-prob by ``d`` nats raises it by ``d``. The test is one-sided:

        completions >= shift_min_completions
        and mean_log_ratio - shift_z * log_ratio_stderr > shift_margin

    Args:
        mean_log_ratio: the sender's mean of ``lp_learner - lp_gen`` over its tokens
            (nats/token).
        log_ratio_stderr: its standard error (nats/token), completions as independent
            draws (the receiver's ``trainer.log_ratio_stderr``).
        completions: token-aligned completions behind the mean (0 from clients that
            predate the statistic: never detected).
        cfg: ``shift_margin`` (nats/token), ``shift_z``, ``shift_min_completions``.

    Returns:
        ``True`` when the shift is detected (the report is negative evidence).
    """
    if cfg.shift_min_completions <= 0 or completions < cfg.shift_min_completions:
        return False
    return mean_log_ratio - cfg.shift_z * log_ratio_stderr > cfg.shift_margin


def feedback_is_negative(
    *,
    text_mismatches: int,
    invalid_bundles: int,
    mean_log_ratio: float,
    filtered_frac: float,
    cfg: ReputationConfig,
    log_ratio_stderr: float = 0.0,
    log_ratio_completions: int = 0,
) -> bool:
    """Whether one receiver report about a sender counts against it: text mismatches,
    invalid bundles, ``|mean_log_ratio| > log_ratio_tolerance``, ``filtered_frac >
    filtered_frac_limit``, or a one-sided shift (:func:`shift_detected`)."""
    return (
        text_mismatches > 0
        or invalid_bundles > 0
        or abs(mean_log_ratio) > cfg.log_ratio_tolerance
        or filtered_frac > cfg.filtered_frac_limit
        or shift_detected(mean_log_ratio, log_ratio_stderr, log_ratio_completions, cfg)
    )


def feedback_weight(negative: bool, reporter_score: float, cfg: ReputationConfig) -> float:
    """``+/- feedback_weight x reporter score`` (before the per-reporter cap)."""
    magnitude = cfg.feedback_weight * reporter_score
    return -magnitude if negative else magnitude


def capped(weight: float, already_used: float, cfg: ReputationConfig,
           corroborated: bool = False) -> float:
    """Clip ``weight`` so that ``|weight| + already_used <= cap`` (same sign), where the
    cap is ``corroborated_cap`` for corroborated negative feedback, else ``feedback_cap``."""
    cap = cfg.corroborated_cap if corroborated else cfg.feedback_cap
    room = max(0.0, cap - already_used)
    return math.copysign(min(abs(weight), room), weight) if weight else 0.0


def reporter_factor(reporter: Standing, verified_bundles: int, registered_at_ms: int,
                    now_ms: int, cfg: ReputationConfig, audit: int = AUDIT_PASSED) -> float:
    """How much a reporter's feedback counts, in [0, 1] (docs/reputation.md "Who may
    report").

    0 while the reporter is on probation (fewer than ``probation_bundles`` verified
    bundles of its own) or quarantined, so fresh identities move nobody; otherwise
    ``min(1, age / reporter_maturity_s)`` with ``age = now - registered_at`` (a
    maturity of 0 means full weight at once). The reporter's score multiplies it in
    :func:`feedback_weight`. With audit-based probation (``audit_reporters`` > 0) a
    reporter whose own ``audit`` has not passed is on probation too.
    """
    if in_probation(verified_bundles, audit, cfg) or reporter.quarantined:
        return 0.0
    if cfg.reporter_maturity_s <= 0:
        return 1.0
    age_s = max(now_ms - registered_at_ms, 0) / 1000.0
    return min(1.0, age_s / cfg.reporter_maturity_s)


# -- decisions on the submit path (pure; the bundles handler writes them) -------------
#: Rejections whose signed envelope is proof of misbehaviour (kept in ``proofs``).
PROOF_CODES = frozenset({"TEXT_MISMATCH", "PROMPT_MISMATCH"})


@dataclass(frozen=True)
class RejectionDecision:
    """What a rejection whose signature verified costs its signer.

    Attributes:
        evidence: the reputation event (see :func:`rejection_evidence`).
        keep_proof: store the signed envelope as proof.
        ban_reason: ban the signer with this reason (``auto_ban_on_proof``), or ``None``.
    """

    evidence: Evidence
    keep_proof: bool
    ban_reason: str | None


def rejection_decision(code_name: str, reason: str, bundle_id: str,
                       cfg: ReputationConfig) -> RejectionDecision:
    """Evidence, proof and ban for a rejection by error code name (docs/reputation.md)."""
    proof = code_name in PROOF_CODES
    event = replace(rejection_evidence(code_name), detail=f"{code_name}: {reason}"[:2000],
                    bundle_id=bundle_id)
    if proof:
        event = replace(event, detail=event.detail + " (signed envelope kept as proof)")
    ban = f"proof: {code_name}" if proof and cfg.auto_ban_on_proof else None
    return RejectionDecision(event, proof, ban)


def disputed(negative_reporters: int, cfg: ReputationConfig) -> bool:
    """Corroborated negative receiver reports on a sender (within one half-life)."""
    return cfg.corroborating_reporters >= 2 and negative_reporters >= cfg.corroborating_reporters


# -- receiver feedback (pure; the feedback handler reads the views and writes) ---------
@dataclass(frozen=True)
class FeedbackEntry:
    """One receiver report about one sender (a decoded ``SenderFeedback``).

    Attributes:
        mean_log_ratio: mean over the sender's tokens of log pi_learner - log pi_gen
            (nats/token).
        filtered_frac, truncated_frac: shares of its completions the F-TIS gate dropped
            and whose importance weight was truncated, in [0, 1].
        log_ratio_completions, log_ratio_stderr: token-aligned completions behind
            ``mean_log_ratio`` and its standard error (nats/token), for
            :func:`shift_detected`.
    """

    sender_id: str
    bundle_ids: tuple[str, ...] = ()
    groups: int = 0
    tokens: int = 0
    mean_log_ratio: float = 0.0
    filtered_frac: float = 0.0
    truncated_frac: float = 0.0
    text_mismatches: int = 0
    invalid_bundles: int = 0
    log_ratio_completions: int = 0
    log_ratio_stderr: float = 0.0


@dataclass(frozen=True)
class SenderView:
    """What the coordinator knows about one reported sender, read before the report.

    Attributes:
        text_verified: the coordinator itself verified text == decode(tokens) on every
            bundle the entry is about (all the sender's bundles when none are named).
        used_positive, used_negative: feedback weight (magnitudes) the reporter already
            put on this sender within one half-life.
        negative_reporters: distinct reporters with negative feedback on the sender
            within one half-life (only weighted feedback is stored, so these are
            established reporters).
        counted_bundles: the entry's bundle ids that count: the sender's, already
            relayed to this reporter, and not reported by it before. An entry with none
            carries no weight.
        sender_quarantined: positive feedback on a quarantined sender carries no weight
            (quarantine is left by the sender's own verified bundles only).
    """

    text_verified: bool
    used_positive: float = 0.0
    used_negative: float = 0.0
    negative_reporters: frozenset[str] = frozenset()
    counted_bundles: int = 1
    sender_quarantined: bool = False


def feedback_evidence(
    reporter_id: str,
    reporter: Standing,
    entries: list[FeedbackEntry],
    views: list[SenderView],
    now_ms: int,
    cfg: ReputationConfig,
    factor: float = 1.0,
) -> list[tuple[str, Evidence]]:
    """Receiver feedback -> ``(node_id, evidence)`` pairs, in report order
    (docs/reputation.md "Receiver feedback"); ``views[i]`` is what the coordinator knew
    about ``entries[i]``'s sender before the report.

    Each entry is negative if it reports text mismatches or invalid bundles,
    ``|mean_log_ratio| > log_ratio_tolerance``, ``filtered_frac > filtered_frac_limit`` or
    a one-sided log-prob shift (:func:`shift_detected`), else positive; weight
    ``feedback_weight x reporter score x factor`` (``factor`` is
    :func:`reporter_factor`), capped per (reporter, sender) and direction at
    ``feedback_cap`` within one half-life, or at ``corroborated_cap`` when at least
    ``corroborating_reporters`` distinct reporters agree on a negative. An entry with no
    counted bundle, and a positive one about a quarantined sender, carries no weight.
    A claim of text mismatches on bundles whose text the coordinator verified itself is
    a false report: -3 for the reporter (its score drops for the rest of the report),
    the claim is ignored. Weight already used by earlier entries of the same report
    counts towards the cap. Entries whose weight comes out 0 produce no evidence (the
    evidence table does not grow with weightless reports).
    """
    good, bad = decayed(reporter, now_ms, cfg.half_life_s)
    used: dict[tuple[str, bool], float] = {}
    out: list[tuple[str, Evidence]] = []
    for f, view in zip(entries, views, strict=True):
        first_bundle = f.bundle_ids[0] if f.bundle_ids else ""
        if f.text_mismatches > 0 and view.text_verified:
            out.append((reporter_id, Evidence(
                FALSE_REPORT, WEIGHT_FALSE_REPORT,
                f"claimed {f.text_mismatches} text mismatches of {f.sender_id} on bundles "
                "whose text the coordinator verified", bundle_id=first_bundle)))
            bad -= WEIGHT_FALSE_REPORT
            continue
        negative = feedback_is_negative(
            text_mismatches=f.text_mismatches, invalid_bundles=f.invalid_bundles,
            mean_log_ratio=f.mean_log_ratio, filtered_frac=f.filtered_frac, cfg=cfg,
            log_ratio_stderr=f.log_ratio_stderr,
            log_ratio_completions=f.log_ratio_completions)
        counts = view.counted_bundles > 0 and not (view.sender_quarantined and not negative)
        raw = feedback_weight(negative, score(good, bad), cfg) * factor if counts else 0.0
        corroborated = negative and disputed(
            len(view.negative_reporters | {reporter_id}), cfg)
        key = (f.sender_id, negative)
        before = used.get(key, 0.0) + (view.used_negative if negative else view.used_positive)
        weight = capped(raw, before, cfg, corroborated)
        used[key] = used.get(key, 0.0) + abs(weight)
        if weight == 0.0:
            continue
        detail = (
            f"{'negative' if negative else 'positive'}: groups={f.groups} "
            f"tokens={f.tokens} mean_log_ratio={f.mean_log_ratio:.3f} "
            f"(stderr {f.log_ratio_stderr:.3f}, {f.log_ratio_completions} completions) "
            f"filtered={f.filtered_frac:.2f} truncated={f.truncated_frac:.2f} "
            f"text_mismatches={f.text_mismatches} invalid_bundles={f.invalid_bundles}"
        )
        if weight != raw:
            detail += f" (capped from {raw:.3f})"
        if corroborated:
            detail += " (corroborated by other reporters: corroborated cap)"
        out.append((f.sender_id, Evidence(FEEDBACK, weight, detail,
                                          reporter_node_id=reporter_id,
                                          bundle_id=first_bundle)))
    return out


def standing_update(events: list[Evidence], now_ms: int,
                    cfg: ReputationConfig) -> Callable[[Standing, int], Standing]:
    """:func:`apply` with its events, time and policy bound: the ``update`` the state
    calls with a node's row locked (``(standing, verified_bundles) -> standing``)."""
    return lambda standing, verified: apply(standing, events, now_ms, verified, cfg)


# -- replay (pure; tests and audits recompute a stored standing from its evidence) -----
#: Evidence kinds written together with a stored bundle (one per bundle, same transaction
#: as the ``bundles_accepted`` increment): the verified-bundle count of a node at any of
#: its evidence rows is the number of these among its rows up to and including that one.
BUNDLE_KINDS = frozenset({BUNDLE_VERIFIED, REWARD_MISMATCH})


def replay_standing(
    events_with_times: Iterable[tuple[int, Evidence | Sequence[Evidence]]],
    cfg: ReputationConfig,
    start: Standing | None = None,
    verified_before: int = 0,
) -> Standing:
    """A node's standing recomputed from its evidence rows, oldest (lowest id) first.

    Each item is ``(at_ms, event)`` or ``(at_ms, events)``, the latter for the events one
    write transaction applied together (:func:`apply` evaluates quarantine once per
    call). Every item is one :func:`apply`: decay from the previous ``updated_at_ms`` to
    ``at_ms`` with the half-life, add the weights, re-evaluate quarantine (with its
    hysteresis) with the verified-bundle count the state passed at that moment, i.e.
    ``bundles_accepted`` as :meth:`State.commit_submission` hands it to ``update``: it
    counts the bundle being stored, so an item holding a :data:`BUNDLE_KINDS` event
    counts it, and a rejection counts only the bundles stored before it. An
    :data:`OPERATOR_RESET` event replays ``reset_bad_evidence``: ``bad = 0``, quarantine
    lifted, no decay, ``updated_at_ms`` kept.

    Args:
        start: the standing before the first event (default ``Standing()``): a node
            registers with ``Standing(updated_at_ms=registered_at_ms)``.
        verified_before: verified bundles stored before the first event.

    The replay is exact (the same floating-point operations in the same order) as long
    as nothing changed the standing without an evidence row, which a reputation policy
    change does (``set_reputation_policy`` decays and re-evaluates every node under the
    new policy without a row, and only the newest policy is stored), and as long as the
    items group events as their transactions did (``apply_evidence_many`` may write
    several rows per node at one time; the rows do not record their transaction).
    """
    standing = start if start is not None else Standing()
    verified = verified_before
    for at_ms, item in events_with_times:
        events = [item] if isinstance(item, Evidence) else list(item)
        if len(events) == 1 and events[0].kind == OPERATOR_RESET:
            standing = replace(standing, bad=0.0, quarantined=False)
            continue
        verified += sum(1 for e in events if e.kind in BUNDLE_KINDS)
        standing = apply(standing, events, at_ms, verified, cfg)
    return standing
