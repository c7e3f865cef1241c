"""Rollout groups: what the learner receives, from its own bundles or relayed ones.

A :class:`RolloutGroup` is one *vertical* group (DESIGN.md section 3): the G completions
one generator sampled for one prompt, with the coordinator-verified rewards. The same
builder, :meth:`RolloutGroup.from_bundle`, serves the learner's own bundles (``local``)
and relayed ones, so both paths read the bundle the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ftis.client.swarm.cross_tokenizer import Retokenized
    from ftis.v1 import bundle_pb2

__all__ = ["RolloutGroup"]


@dataclass
class RolloutGroup:
    """A vertical group: G completions of one prompt by one generator.

    Attributes:
        prompt_ids: prompt token ids the learner conditions on (the generator's for a
            same-tokenizer group, the receiver's own rendering for a cross-tokenizer one).
        completions: G lists of completion token ids (receiver ids).
        gen_logprobs: G lists of sampler log-probs (nats), aligned with ``completions``;
            ``None`` for a cross-tokenizer group (no per-token alignment exists).
        rewards: G verified rewards.
        local: True for the learner's own rollouts, False for external (relayed) ones.
        sender: node id of the generator.
        policy_version: the generator's step when sampling.
        task_id: coordinator task id.
        meta: free-form (e.g. ``bundle_id``, ``base_model`` of relayed bundles).
        gen_sequence_logprobs: for a generator with another tokenizer (DESIGN.md section
            6): G summed sampler log-probs (nats) of the generator's own tokens; the
            ``completions`` are then the receiver's re-tokenization of the text.

    Raises:
        ValueError: from ``__post_init__``: no completions, rows of different counts,
            token ids and log-probs of different lengths, or a cross-tokenizer group
            with per-token log-probs / a same-tokenizer group without them.
    """

    prompt_ids: list[int]
    completions: list[list[int]]
    gen_logprobs: list[list[float]] | None
    rewards: list[float]
    local: bool
    sender: str = ""
    policy_version: int = 0
    task_id: str = ""
    meta: dict = field(default_factory=dict)
    gen_sequence_logprobs: list[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.completions)
        if n == 0 or len(self.rewards) != n:
            raise ValueError("a group needs G >= 1 completions and one reward per completion")
        if self.gen_sequence_logprobs is not None:
            if len(self.gen_sequence_logprobs) != n:
                raise ValueError(
                    "a cross-tokenizer group needs one sequence log-prob per completion")
            if self.gen_logprobs:
                raise ValueError("a cross-tokenizer group carries no per-token log-probs")
            self.gen_logprobs = None
            return
        if self.gen_logprobs is None or len(self.gen_logprobs) != n:
            raise ValueError("a group needs one log-prob row per completion")
        for ids, lps in zip(self.completions, self.gen_logprobs, strict=True):
            if len(ids) != len(lps):
                raise ValueError("token ids and log-probs differ in length")

    @classmethod
    def from_bundle(
        cls,
        bundle: bundle_pb2.Bundle,
        rewards: Sequence[float],
        *,
        local: bool,
        meta: dict | None = None,
        retokenized: Retokenized | None = None,
    ) -> RolloutGroup:
        """The group of a bundle with its verified rewards (own or relayed).

        ``sender``, ``policy_version`` and ``task_id`` are read from the bundle
        (``node_id``, ``policy_version``, ``task_id``). Without ``retokenized`` the
        bundle's own prompt ids, completion ids and per-token log-probs are used; with it
        (a bundle from another tokenizer, see
        :func:`ftis.client.swarm.cross_tokenizer.retokenize_bundle`) the receiver's
        prompt ids, re-tokenized completions and the generator's sequence log-probs are,
        and the group carries no per-token log-probs.

        Args:
            bundle: the (verified) bundle.
            rewards: the coordinator's verified rewards, one per completion.
            local: True for the learner's own bundle.
            meta: stored as :attr:`meta` (default ``{}``).
            retokenized: the receiver's re-tokenization, for a cross-tokenizer bundle.

        Raises:
            ValueError: as ``__post_init__`` (e.g. rewards not matching the completions).
        """
        common: dict[str, Any] = dict(rewards=[float(r) for r in rewards], local=local,
                      sender=bundle.node_id, policy_version=int(bundle.policy_version),
                      task_id=bundle.task_id, meta=dict(meta or {}))
        if retokenized is not None:
            return cls(prompt_ids=list(retokenized.prompt_ids),
                       completions=[list(ids) for ids in retokenized.completions],
                       gen_logprobs=None,
                       gen_sequence_logprobs=list(retokenized.seq_logprobs), **common)
        return cls(prompt_ids=list(bundle.prompt_token_ids),
                   completions=[list(c.token_ids) for c in bundle.completions],
                   gen_logprobs=[list(c.logprobs) for c in bundle.completions], **common)

    @property
    def cross_tokenizer(self) -> bool:
        """True when the generator's tokens do not align with the receiver's."""
        return self.gen_sequence_logprobs is not None

    @property
    def reward_variance_zero(self) -> bool:
        """All rewards equal: GRPO advantages are exactly 0 (no learning signal)."""
        return max(self.rewards) == min(self.rewards)
