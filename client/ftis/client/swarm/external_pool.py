"""External rollout groups: pulled from the relay, re-checked locally, sampled for learning.

Receivers do not trust the relay blindly: each relayed envelope's Ed25519 signature is
verified again and the bundle's structure is checked against the receiver's own
vocabulary before it can reach the learner. Groups are used at most once; the J groups
of a round are drawn uniformly from the unused ones (SAPO), preferring the newest when
the pool exceeds its capacity.
"""

from __future__ import annotations

import logging
import random
from collections import deque

from ftis.client.learner.batch import RolloutGroup
from ftis.protocol.bundles import MAX_BUNDLE_BYTES, BundleLimits, check_structure
from ftis.protocol.envelope import open_envelope
from ftis.protocol.errors import FtisError
from ftis.v1 import bundle_pb2, swarm_pb2

log = logging.getLogger(__name__)


class ExternalPool:
    """Buffer of verified external groups.

    Args:
        own_node_id: never accept our own bundles (the relay should not send them).
        vocab_size: receiver's vocabulary size; token ids must be below it.
        fingerprint: receiver's tokenizer fingerprint; other fingerprints are skipped.
        capacity: most groups kept (oldest dropped first).
        max_policy_lag: drop groups whose sender's policy version is older than the
            newest seen by more than this many steps (``None`` = keep all).
    """

    def __init__(self, own_node_id: str, vocab_size: int, fingerprint: str,
                 capacity: int = 256, max_policy_lag: int | None = None,
                 rng: random.Random | None = None) -> None:
        self.own_node_id = own_node_id
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self.groups: deque[RolloutGroup] = deque(maxlen=capacity)
        self.cursor = 0
        self.rejected = 0
        self.max_policy_lag = max_policy_lag
        self.rng = rng or random.Random(0)

    def add(self, relayed: swarm_pb2.RelayedBundle) -> bool:
        """Verify and buffer one relayed bundle; returns whether it was kept."""
        self.cursor = max(self.cursor, relayed.sequence)
        try:
            bundle, sender = open_envelope(relayed.envelope, "bundle", bundle_pb2.Bundle,
                                           MAX_BUNDLE_BYTES)
            if sender == self.own_node_id or bundle.node_id != sender:
                raise FtisError(112, "own bundle or node id not matching the signing key")
            if bundle.model_card.tokenizer_fingerprint != self.fingerprint:
                raise FtisError(113, "tokenizer fingerprint differs")
            limits = BundleLimits(len(bundle.completions), bundle.sampling.max_new_tokens,
                                  self.vocab_size)
            check_structure(bundle, limits)
            if len(relayed.verified_rewards) != len(bundle.completions):
                raise FtisError(103, "verified rewards do not match the completions")
        except FtisError as exc:
            self.rejected += 1
            log.warning("dropping relayed bundle %s: %s", relayed.bundle_id, exc)
            return False
        group = RolloutGroup(
            prompt_ids=list(bundle.prompt_token_ids),
            completions=[list(c.token_ids) for c in bundle.completions],
            gen_logprobs=[list(c.logprobs) for c in bundle.completions],
            rewards=list(relayed.verified_rewards),
            local=False,
            sender=sender,
            policy_version=bundle.policy_version,
            task_id=bundle.task_id,
            meta={"bundle_id": relayed.bundle_id, "base_model": bundle.model_card.base_model},
        )
        if group.reward_variance_zero:
            return False
        self.groups.append(group)
        return True

    def take(self, count: int) -> list[RolloutGroup]:
        """Remove and return up to ``count`` groups drawn uniformly from the pool."""
        if self.max_policy_lag is not None and self.groups:
            newest = max(g.policy_version for g in self.groups)
            fresh = [g for g in self.groups if newest - g.policy_version <= self.max_policy_lag]
            self.groups = deque(fresh, maxlen=self.groups.maxlen)
        count = min(count, len(self.groups))
        if count <= 0:
            return []
        chosen = self.rng.sample(range(len(self.groups)), count)
        picked = [self.groups[i] for i in chosen]
        keep = [g for i, g in enumerate(self.groups) if i not in set(chosen)]
        self.groups = deque(keep, maxlen=self.groups.maxlen)
        return picked
