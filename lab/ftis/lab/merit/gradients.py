"""MERIT step 1's inputs: per-family policy gradients at the shared initialisation
(issue 16; MERIT, arXiv 2606.01717).

For each task family, sample ``groups`` groups of G completions with the policy, score
them with the family's own reward (ReasoningGYM, through :class:`ftis.tasks.TaskEntry`),
and take the gradient of the GRPO loss the learner would step on
(:meth:`ftis.client.learner.trainer.Learner.policy_gradient`) with respect to the
trainable parameters (the LoRA adapters, or every weight of a full fine-tune). Groups
whose rewards are all equal carry no advantage and contribute nothing, as in training.

This module runs the model (it is not pure); the split itself is
:mod:`ftis.lab.merit.split`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ftis.client.learner.trainer import Learner
from ftis.client.models.loader import Policy
from ftis.client.rollout.groups import RolloutGroup
from ftis.client.rollout.sampler import SamplingSettings, sample_groups
from ftis.tasks import TaskSource, TaskSpec, render_messages


@dataclass(frozen=True)
class FamilyGradient:
    """One family's gradient and what it was computed from.

    Attributes:
        dataset: the family's ReasoningGYM dataset name.
        gradient: ``[P]`` float32 flattened gradient (zeros if no group had variance).
        tokens: completion tokens sampled (the token weight of the split's median).
        informative_groups: groups with reward variance (the ones that carry gradient).
        mean_reward: mean reward of the sampled completions, in [0, 1].
    """

    dataset: str
    gradient: torch.Tensor
    tokens: int
    informative_groups: int
    mean_reward: float


def family_gradients(policy: Policy, learner: Learner, families: list[TaskSpec], *,
                     groups: int, group_size: int, sampling: SamplingSettings,
                     seed: int = 0) -> list[FamilyGradient]:
    """Per-family GRPO gradients of ``learner``'s loss at the policy's current weights.

    Args:
        policy: the shared initialisation (not modified: no optimizer step is taken).
        learner: a learner over ``policy.model`` (its loss settings define the gradient).
        families: one task spec per family.
        groups: prompts per family; ``group_size`` completions each.
        sampling: temperature and ``max_new_tokens`` of the rollouts.
        seed: task draws (family ``k`` uses ``seed + k``) and sampling.

    Returns:
        One :class:`FamilyGradient` per family, in ``families`` order.
    """
    generator = torch.Generator().manual_seed(seed)
    out = []
    for k, spec in enumerate(families):
        source = TaskSource([spec], seed=seed + k)
        entries = [source.draw() for _ in range(groups)]
        prompts = [policy.prompt_token_ids(render_messages(e.question))[0] for e in entries]
        result = sample_groups(policy.model, prompts, group_size, sampling,
                               policy.eos_token_ids, policy.tokenizer.pad_token_id,
                               generator, stop_strings=policy.stop_strings,
                               decode=policy.decode)
        rollouts, tokens, rewards = [], 0, []
        for entry, prompt, group in zip(entries, prompts, result.completions, strict=True):
            scores = [entry.score(policy.decode(c.token_ids)) for c in group]
            rewards += scores
            tokens += sum(len(c.token_ids) for c in group)
            rollouts.append(RolloutGroup(prompt_ids=prompt,
                                         completions=[c.token_ids for c in group],
                                         gen_logprobs=[c.logprobs for c in group],
                                         rewards=scores, local=True))
        out.append(FamilyGradient(
            dataset=spec.dataset, gradient=learner.policy_gradient(rollouts), tokens=tokens,
            informative_groups=sum(not g.reward_variance_zero for g in rollouts),
            mean_reward=sum(rewards) / max(len(rewards), 1)))
    return out
