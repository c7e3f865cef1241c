"""Rollout groups and their packing into right-padded training batches."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RolloutGroup:
    """A vertical group: G completions of one prompt by one generator.

    Attributes:
        prompt_ids: prompt token ids the generator conditioned on.
        completions: G lists of completion token ids.
        gen_logprobs: G lists of sampler log-probs (nats), aligned with ``completions``.
        rewards: G verified rewards.
        local: True for the learner's own rollouts, False for external (relayed) ones.
        sender: node id of the generator.
        policy_version: the generator's step when sampling.
    """

    prompt_ids: list[int]
    completions: list[list[int]]
    gen_logprobs: list[list[float]]
    rewards: list[float]
    local: bool
    sender: str = ""
    policy_version: int = 0
    task_id: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.completions)
        if not (len(self.gen_logprobs) == len(self.rewards) == n) or n == 0:
            raise ValueError("a group needs G >= 1 completions, log-prob rows and rewards")
        for ids, lps in zip(self.completions, self.gen_logprobs, strict=True):
            if len(ids) != len(lps):
                raise ValueError("token ids and log-probs differ in length")

    @property
    def reward_variance_zero(self) -> bool:
        return max(self.rewards) == min(self.rewards)


@dataclass
class Sample:
    """One completion with its per-completion advantage, ready to batch."""

    prompt_ids: list[int]
    completion_ids: list[int]
    gen_logprobs: list[float]
    advantage: float
    local: bool


@dataclass
class PackedBatch:
    """Right-padded batch aligned for next-token log-probs.

    Attributes:
        input_ids: ``[B, S]`` long, prompt + completion, right-padded.
        attention_mask: ``[B, S]`` long.
        targets: ``[B, S-1]`` long, ``input_ids[:, 1:]`` (the token each position predicts).
        completion_mask: ``[B, S-1]`` bool, True where ``targets`` is a completion token.
        gen_logprobs: ``[B, S-1]`` float32 sampler log-probs at completion positions, 0 elsewhere.
        advantages: ``[B]`` float32.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    completion_mask: torch.Tensor
    gen_logprobs: torch.Tensor
    advantages: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())


def pack(samples: list[Sample], pad_token_id: int) -> PackedBatch:
    """Pack samples into a :class:`PackedBatch` (see its shapes)."""
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width - 1), dtype=torch.bool)
    lp_gen = torch.zeros((b, width - 1), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        attention[i, : p + c] = 1
        # position t of the shifted layout predicts input_ids[t + 1]
        mask[i, p - 1 : p - 1 + c] = True
        lp_gen[i, p - 1 : p - 1 + c] = torch.tensor(s.gen_logprobs, dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return PackedBatch(input_ids, attention, input_ids[:, 1:], mask, lp_gen, advantages)
