"""Held-out evaluation: greedy and sampled pass@1 on fixed task sets (F-TIS paper
protocol: validation pass@1 with greedy decoding, plus an out-of-distribution set).

The sets are generated from ReasoningGYM with their own seeds once per client start, so
every evaluation of a run sees the same prompts. With ``heldout_fraction`` (the same
value the coordinator leases with, :mod:`ftis.tasks.split`) the in-distribution set is
drawn only from held-out operand keys and has pairwise different questions: no training
prompt shares its operands.

Two metrics per set:

* greedy pass@1 -- one top-1 completion per prompt (the paper's protocol);
* sampled pass@1 -- the mean reward of ``samples`` completions per prompt at
  ``temperature`` (the policy as it is trained and used). Its sampler is seeded with
  ``sample_seed`` at every evaluation, so before/after comparisons share their random
  numbers.

Per-prompt results are returned too, so that paired tests (McNemar for greedy, a
sign-flip test for sampled; :mod:`ftis.lab.experiment.stats`) can compare two
evaluations of the same prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, Field

from ftis.client.models.loader import Policy
from ftis.client.rollout.sampler import SamplingSettings, sample_groups
from ftis.tasks import HeldoutSplit, TaskEntry, TaskSource, TaskSpec, render_messages
from ftis.tasks.source import DEFAULT_TASKS

DEFAULT_OOD = [TaskSpec(dataset="basic_arithmetic",
                        config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})]


class EvalConfig(BaseModel):
    """Which held-out sets to evaluate, and how (``--eval-config FILE`` as JSON)."""

    in_distribution: list[TaskSpec] = Field(default_factory=lambda: list(DEFAULT_TASKS))
    out_of_distribution: list[TaskSpec] = Field(default_factory=lambda: list(DEFAULT_OOD))
    size: int = Field(32, ge=1, description="prompts per set (at most; see heldout_fraction)")
    seed: int = Field(10_007, description="generator seed of the held-out sets")
    max_new_tokens: int = Field(48, ge=1)
    batch_size: int = Field(16, ge=1, description="prompts per generation batch")
    heldout_fraction: float = Field(
        0.0, ge=0, lt=1, description="draw the in-distribution set from held-out operand "
        "keys only, distinct questions (use the coordinator's heldout_fraction)")
    samples: int = Field(0, ge=0, description="sampled completions per prompt (0: greedy only)")
    temperature: float = Field(1.0, gt=0, description="temperature of the sampled metric")
    sample_seed: int = Field(0, description="sampler seed, the same at every evaluation")


@dataclass(frozen=True)
class EvalSet:
    name: str
    entries: list[TaskEntry]


@dataclass(frozen=True)
class SetResult:
    """Per-prompt results of one set, in the set's order.

    Attributes:
        greedy: ``[n]`` reward of the greedy completion.
        sampled: ``[n]`` mean reward of the sampled completions (empty when
            ``samples`` is 0).
    """

    greedy: list[float]
    sampled: list[float]


def build_eval_sets(cfg: EvalConfig) -> list[EvalSet]:
    """The fixed in-distribution ("heldout") and out-of-distribution ("ood") sets.

    Raises:
        ValueError: if the held-out part of the mix is empty.
    """
    sets = []
    if cfg.in_distribution:
        if cfg.heldout_fraction > 0:
            src = TaskSource(cfg.in_distribution, seed=cfg.seed, size=100_000,
                             split=HeldoutSplit(cfg.heldout_fraction), part="heldout")
            entries = src.distinct(cfg.size)
            if not entries:
                raise ValueError("the held-out part of the task mix is empty")
        else:
            src = TaskSource(cfg.in_distribution, seed=cfg.seed, size=max(cfg.size, 1000))
            entries = [src.draw() for _ in range(cfg.size)]
        sets.append(EvalSet("heldout", entries))
    if cfg.out_of_distribution:
        src = TaskSource(cfg.out_of_distribution, seed=cfg.seed + 1000,
                         size=max(cfg.size, 1000))
        sets.append(EvalSet("ood", [src.draw() for _ in range(cfg.size)]))
    return sets


def _rewards(policy: Policy, entries: list[TaskEntry], settings: SamplingSettings,
             samples: int, batch_size: int, generator: torch.Generator | None) -> list[float]:
    """Mean reward over ``samples`` completions of each entry."""
    out: list[float] = []
    for i in range(0, len(entries), batch_size):
        chunk = entries[i : i + batch_size]
        prompts = [policy.prompt_token_ids(render_messages(e.question))[0] for e in chunk]
        res = sample_groups(policy.model, prompts, samples, settings, policy.eos_token_ids,
                            policy.tokenizer.pad_token_id, generator,
                            stop_strings=policy.stop_strings, decode=policy.decode)
        for e, group in zip(chunk, res.completions, strict=True):
            out.append(sum(e.score(policy.decode(c.token_ids)) for c in group) / len(group))
    return out


@torch.no_grad()
def evaluate_sets(policy: Policy, sets: list[EvalSet], cfg: EvalConfig) -> dict[str, SetResult]:
    """Per-prompt greedy and sampled rewards of every set (see :class:`SetResult`).

    Greedy decoding is top-k = 1 sampling (the argmax token each step).
    """
    greedy = SamplingSettings(temperature=1.0, top_k=1, max_new_tokens=cfg.max_new_tokens)
    sampled = SamplingSettings(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    results: dict[str, SetResult] = {}
    for s in sets:
        g = _rewards(policy, s.entries, greedy, 1, cfg.batch_size, None)
        smp: list[float] = []
        if cfg.samples:
            gen = torch.Generator().manual_seed(cfg.sample_seed)
            smp = _rewards(policy, s.entries, sampled, cfg.samples,
                           max(1, cfg.batch_size // cfg.samples), gen)
        results[s.name] = SetResult(g, smp)
    return results


def summarize(results: dict[str, SetResult]) -> dict[str, float]:
    """``{"eval_<set>": greedy pass@1, "eval_<set>_sampled": sampled pass@1}`` (means)."""
    out: dict[str, float] = {}
    for name, r in results.items():
        out[f"eval_{name}"] = sum(r.greedy) / max(len(r.greedy), 1)
        if r.sampled:
            out[f"eval_{name}_sampled"] = sum(r.sampled) / len(r.sampled)
    return out


def evaluate(policy: Policy, sets: list[EvalSet], cfg: EvalConfig) -> dict[str, float]:
    """Mean greedy (and sampled) pass@1 per set, see :func:`summarize`."""
    return summarize(evaluate_sets(policy, sets, cfg))
