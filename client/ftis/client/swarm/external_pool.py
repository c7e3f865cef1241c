"""External rollout groups: pulled from the relay, re-checked locally, sampled for learning.

Receivers do not trust the relay blindly: each relayed envelope's Ed25519 signature is
verified again and the bundle's structure is checked against the receiver's own
vocabulary before it can reach the learner. Groups whose rewards are all equal carry
no learning signal and are dropped on arrival (SAPO as written). Groups are used at
most once; the J groups of a round are drawn from the unused ones with probability
proportional to the sender's reputation as reported by the relay (uniform, as in SAPO,
when all senders are equally trusted); the oldest groups are dropped when the pool
exceeds its capacity.
Where the receiver shares the sender's tokenizer it also checks
``text == decode(token_ids)``. Bundles from another tokenizer are accepted only with a
:class:`~ftis.client.swarm.cross_tokenizer.Retokenizer`: their text is re-tokenized under
the receiver's own prompt for the relayed task question, and the group carries the
generator's sequence log-probs (DESIGN.md section 6). Per-sender rejections are kept for
receiver feedback. Rejections carry the coordinator's :class:`ErrorCode` where the check is
one of its own, and a :class:`LocalErrorCode` (17x) for the receiver's own checks.
"""

from __future__ import annotations

import logging
import random
from collections import Counter, deque
from collections.abc import Callable

from ftis.client.rollout.groups import RolloutGroup
from ftis.client.swarm.cross_tokenizer import Retokenized, Retokenizer, retokenize_bundle
from ftis.protocol.bundles import MAX_BUNDLE_BYTES, BundleLimits, check_structure
from ftis.protocol.envelope import open_envelope
from ftis.protocol.errors import ErrorCode, FtisError, LocalErrorCode
from ftis.v1 import bundle_pb2, swarm_pb2

log = logging.getLogger(__name__)

#: Rejections that are no evidence against the sender: the relay's own doing, another
#: tokenizer this receiver cannot use, or TEXT_MISMATCH (counted separately).
NOT_SENDER_EVIDENCE = frozenset({
    LocalErrorCode.RELAY_OWN_BUNDLE,
    LocalErrorCode.RELAY_REWARDS_MISMATCH,
    LocalErrorCode.TOKENIZER_FOREIGN,
    LocalErrorCode.RETOKENIZE_FAILED,
    ErrorCode.TEXT_MISMATCH,
})


class ExternalPool:
    """Buffer of verified external groups.

    Args:
        own_node_id: never accept our own bundles (the relay should not send them).
        vocab_size: receiver's vocabulary size; token ids must be below it.
        fingerprint: receiver's tokenizer fingerprint; other fingerprints are skipped.
        capacity: most groups kept (oldest dropped first).
        max_policy_lag: drop groups whose policy version is older than the newest seen
            from the same sender by more than this many steps (``None`` = keep all).
        decode: ``token_ids -> text`` with the receiver's tokenizer (same fingerprint as the
            sender's), used to check each completion's text; ``None`` skips the check.
        retokenizer: accept bundles of other tokenizer fingerprints by re-tokenizing their
            text (``None``: such bundles are dropped with ``TOKENIZER_FOREIGN``).
    """

    def __init__(self, own_node_id: str, vocab_size: int, fingerprint: str,
                 capacity: int = 256, max_policy_lag: int | None = None,
                 rng: random.Random | None = None,
                 decode: Callable[[list[int]], str] | None = None,
                 retokenizer: Retokenizer | None = None) -> None:
        self.own_node_id = own_node_id
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self.groups: deque[RolloutGroup] = deque(maxlen=capacity)
        self.cursor = 0
        self.rejected = 0
        #: rejected relayed bundles by code (ErrorCode or LocalErrorCode)
        self.rejected_by_code: Counter[int] = Counter()
        self.max_policy_lag = max_policy_lag
        self.rng = rng or random.Random(0)
        self.decode = decode
        self.retokenizer = retokenizer
        #: relayed bundles kept through the cross-tokenizer path
        self.cross_tokenizer_accepted = 0
        #: valid relayed bundles dropped because all their rewards are equal
        self.zero_variance_dropped = 0
        #: per sender: relayed bundles that failed local re-verification / text checks
        self.invalid_by_sender: Counter[str] = Counter()
        self.text_mismatch_by_sender: Counter[str] = Counter()
        #: per sender: ids of the relayed bundles counted above (feedback names them: the
        #: coordinator counts feedback only for bundles it relayed to the reporter)
        self.rejected_ids_by_sender: dict[str, list[str]] = {}
        self.weights: dict[str, float] = {}
        #: groups relayed for audit only (``RelayedBundle.audit_only``: the sender is on
        #: the coordinator's audit-based probation): never drawn by :meth:`take` (never
        #: trained on), handed to the learner's audit by :meth:`take_audits`
        self.audits: deque[RolloutGroup] = deque(maxlen=capacity)

    def add(self, relayed: swarm_pb2.RelayedBundle) -> bool:
        """Verify and buffer one relayed bundle; returns whether it was kept."""
        self.cursor = max(self.cursor, relayed.sequence)
        sender = ""
        try:
            bundle, sender = open_envelope(relayed.envelope, "bundle", bundle_pb2.Bundle,
                                           MAX_BUNDLE_BYTES)
            if sender == self.own_node_id:
                raise FtisError(LocalErrorCode.RELAY_OWN_BUNDLE, "relayed our own bundle")
            if bundle.node_id != sender:
                raise FtisError(ErrorCode.NODE_MISMATCH,
                                "bundle node id does not match the signing key")
            cross = bundle.model_card.tokenizer_fingerprint != self.fingerprint
            if cross and self.retokenizer is None:
                raise FtisError(LocalErrorCode.TOKENIZER_FOREIGN,
                                "tokenizer fingerprint differs and cross-tokenizer is off")
            # token ids are bounded by the vocabulary of the tokenizer that made them
            vocab = int(bundle.model_card.vocab_size) if cross else self.vocab_size
            limits = BundleLimits(len(bundle.completions), bundle.sampling.max_new_tokens,
                                  vocab)
            check_structure(bundle, limits)
            if len(relayed.verified_rewards) != len(bundle.completions):
                raise FtisError(LocalErrorCode.RELAY_REWARDS_MISMATCH,
                                "verified rewards do not match the completions")
            retokenized: Retokenized | None = None
            if cross:
                assert self.retokenizer is not None  # TOKENIZER_FOREIGN above otherwise
                try:
                    retokenized = retokenize_bundle(bundle, relayed.task_question,
                                                    self.retokenizer)
                except ValueError as exc:
                    raise FtisError(LocalErrorCode.RETOKENIZE_FAILED,
                                    f"cannot re-tokenize: {exc}") from exc
            elif self.decode is not None:
                bad = sum(self.decode(list(c.token_ids)) != c.text for c in bundle.completions)
                if bad:
                    self.text_mismatch_by_sender[sender] += bad
                    raise FtisError(ErrorCode.TEXT_MISMATCH,
                                    f"{bad} completions' text differs from their tokens")
        except FtisError as exc:
            self.rejected += 1
            self.rejected_by_code[exc.code] += 1
            if sender and exc.code not in NOT_SENDER_EVIDENCE:
                self.invalid_by_sender[sender] += 1
            if sender and (exc.code not in NOT_SENDER_EVIDENCE
                           or exc.code == ErrorCode.TEXT_MISMATCH):
                self.rejected_ids_by_sender.setdefault(sender, []).append(relayed.bundle_id)
            log.warning("dropping relayed bundle %s: %s", relayed.bundle_id, exc)
            return False
        meta: dict[str, object] = {"bundle_id": relayed.bundle_id,
                                   "base_model": bundle.model_card.base_model}
        if relayed.audit_only:
            meta["audit_only"] = True
        group = RolloutGroup.from_bundle(bundle, relayed.verified_rewards, local=False,
                                         meta=meta, retokenized=retokenized)
        if relayed.audit_only:
            # audits compare log-probs, whatever the rewards; only token-aligned groups
            # can be audited (the coordinator relays them to the sender's tokenizer only)
            if cross:
                return False
            self.audits.append(group)
            return True
        if group.reward_variance_zero:
            # SAPO as written: only informative groups are shared and drawn, so the J
            # external groups of a round are never spent on zero-advantage groups
            self.zero_variance_dropped += 1
            return False
        self.cross_tokenizer_accepted += int(cross)
        if self.groups.maxlen is not None and len(self.groups) == self.groups.maxlen:
            self.weights.pop(self.groups[0].meta.get("bundle_id", ""), None)
        self.weights[relayed.bundle_id] = max(relayed.sender_reputation, 0.0)
        self.groups.append(group)
        return True

    def take(self, count: int, max_per_sender: int | None = None) -> list[RolloutGroup]:
        """Remove and return up to ``count`` groups, drawn without replacement with
        probability proportional to the sender's reputation (uniform when all are equal).

        ``max_per_sender`` caps the groups any one sender contributes (issue 13, class
        4: a sender that shades its log-probs to raise its importance weights must not
        also fill the batch); the draw goes on down the key order past a sender at its
        cap, so fewer than ``count`` groups come back only when the others run out.

        Only informative groups are in the pool (:meth:`add` drops groups whose rewards
        are all equal), so every returned group has non-zero reward variance.
        """
        if self.max_policy_lag is not None and self.groups:
            # per sender: policy versions of different nodes are not comparable, and a
            # sender claiming a huge version must only make its own groups look stale
            newest: dict[str, int] = {}
            for g in self.groups:
                newest[g.sender] = max(newest.get(g.sender, g.policy_version), g.policy_version)
            fresh = [g for g in self.groups
                     if newest[g.sender] - g.policy_version <= self.max_policy_lag]
            self.groups = deque(fresh, maxlen=self.groups.maxlen)
            kept = {g.meta.get("bundle_id", "") for g in self.groups}
            self.weights = {k: v for k, v in self.weights.items() if k in kept}
        count = min(count, len(self.groups))
        if count <= 0:
            return []
        # reputation-weighted sampling without replacement (Efraimidis-Spirakis keys);
        # a missing reputation (old coordinator) counts as 1, i.e. uniform sampling
        weights = [self.weights.get(g.meta.get("bundle_id", ""), 1.0) or 1e-6
                   for g in self.groups]
        keys = [self.rng.random() ** (1.0 / w) for w in weights]
        chosen: set[int] = set()
        per_sender: Counter[str] = Counter()
        for i in sorted(range(len(keys)), key=keys.__getitem__, reverse=True):
            if len(chosen) >= count:
                break
            sender = self.groups[i].sender
            if max_per_sender is not None and per_sender[sender] >= max_per_sender:
                continue
            per_sender[sender] += 1
            chosen.add(i)
        picked = [g for i, g in enumerate(self.groups) if i in chosen]
        keep = [g for i, g in enumerate(self.groups) if i not in chosen]
        self.groups = deque(keep, maxlen=self.groups.maxlen)
        for g in picked:
            self.weights.pop(g.meta.get("bundle_id", ""), None)
        return picked

    def take_audits(self, count: int) -> list[RolloutGroup]:
        """Remove and return up to ``count`` audit-only groups, oldest first (never
        trained on: :meth:`Learner.audit` computes their log-ratio statistics)."""
        out: list[RolloutGroup] = []
        while self.audits and len(out) < count:
            out.append(self.audits.popleft())
        return out

    def drain_rejections(self) -> tuple[Counter[str], Counter[str]]:
        """Per-sender (invalid bundles, text mismatches) since the last call (the bundle
        ids are drained by :meth:`drain_rejected_ids`)."""
        out = (self.invalid_by_sender, self.text_mismatch_by_sender)
        self.invalid_by_sender, self.text_mismatch_by_sender = Counter(), Counter()
        return out

    def drain_rejected_ids(self) -> dict[str, list[str]]:
        """Per-sender ids of the relayed bundles rejected since the last call."""
        out, self.rejected_ids_by_sender = self.rejected_ids_by_sender, {}
        return out
