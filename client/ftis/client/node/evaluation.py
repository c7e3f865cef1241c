"""Held-out evaluation: greedy pass@1 on fixed task sets (F-TIS paper protocol:
validation pass@1 with greedy decoding, plus an out-of-distribution set).

The sets are generated from ReasoningGYM with their own seeds (disjoint from the
coordinator's training seed by default), once per client start, so every evaluation of
a run sees the same prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, Field

from ftis.client.models.loader import Policy
from ftis.client.rollout.sampler import SamplingSettings, sample_groups
from ftis.tasks import TaskEntry, TaskSource, TaskSpec, render_messages, score_completion
from ftis.tasks.source import DEFAULT_TASKS

DEFAULT_OOD = [TaskSpec(dataset="basic_arithmetic",
                        config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})]


class EvalConfig(BaseModel):
    """Which held-out sets to evaluate (``--eval-config FILE`` as JSON)."""

    in_distribution: list[TaskSpec] = Field(default_factory=lambda: list(DEFAULT_TASKS))
    out_of_distribution: list[TaskSpec] = Field(default_factory=lambda: list(DEFAULT_OOD))
    size: int = Field(32, ge=1, description="prompts per set")
    seed: int = Field(10_007, description="generator seed of the held-out sets")
    max_new_tokens: int = Field(48, ge=1)
    batch_size: int = Field(16, ge=1)


@dataclass(frozen=True)
class EvalSet:
    name: str
    entries: list[TaskEntry]


def build_eval_sets(cfg: EvalConfig) -> list[EvalSet]:
    """The fixed in-distribution ("heldout") and out-of-distribution ("ood") sets."""
    sets = []
    for name, specs, offset in (("heldout", cfg.in_distribution, 0),
                                ("ood", cfg.out_of_distribution, 1000)):
        if specs:
            src = TaskSource(specs, seed=cfg.seed + offset, size=max(cfg.size, 1000))
            sets.append(EvalSet(name, [src.draw() for _ in range(cfg.size)]))
    return sets


@torch.no_grad()
def evaluate(policy: Policy, sets: list[EvalSet], cfg: EvalConfig) -> dict[str, float]:
    """Greedy pass@1 (mean reward, [0, 1]) per set: ``{"eval_heldout": .., "eval_ood": ..}``.

    Greedy decoding is top-k = 1 sampling (the argmax token each step).
    """
    greedy = SamplingSettings(temperature=1.0, top_k=1, max_new_tokens=cfg.max_new_tokens)
    out: dict[str, float] = {}
    for s in sets:
        rewards = []
        for i in range(0, len(s.entries), cfg.batch_size):
            chunk = s.entries[i : i + cfg.batch_size]
            prompts = [policy.prompt_token_ids(render_messages(e.question))[0] for e in chunk]
            res = sample_groups(policy.model, prompts, 1, greedy, policy.eos_token_ids,
                                policy.tokenizer.pad_token_id,
                                stop_strings=policy.stop_strings, decode=policy.decode)
            for e, (c,) in zip(chunk, res.completions, strict=True):
                rewards.append(score_completion(e.dataset, policy.decode(c.token_ids),
                                                e.as_entry()))
        out[f"eval_{s.name}"] = sum(rewards) / max(len(rewards), 1)
    return out
