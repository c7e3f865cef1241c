"""MERIT's plan and merge on real files (the I/O around :mod:`ftis.lab.merit.split`,
:mod:`~ftis.lab.merit.merge` and :mod:`~ftis.lab.merit.gradients`): ``ftis-lab merit
plan`` and ``ftis-lab merit merge``.

* :func:`plan`: per-family gradients at the shared initialisation, the conflict matrix,
  and two splits of the same shape (conflict-aware and random), written as JSON.
* :func:`merge`: branches trained from the same initialisation (each an ``ftis-client``
  output folder with ``checkpoints/``), merged one-shot by training tokens into a model
  directory any volunteer can load (``--model DIR``). LoRA branches are merged into
  their base first (``merge_and_unload``: ``W0 + (alpha / r) B A``), so full and LoRA
  branches meet as deltas of the same base (:mod:`ftis.lab.merit.merge`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ftis.client.models.peft import PeftKind
from ftis.lab.merit.merge import merge_deltas, token_weights
from ftis.lab.merit.split import conflict_aware_split, conflict_matrix, random_split
from ftis.tasks import TaskSpec

if TYPE_CHECKING:
    from ftis.client.models.loader import Policy


class MeritError(ValueError):
    """Input MERIT cannot work with (a family without gradient, a missing checkpoint)."""


def plan(model: str, datasets: list[str | TaskSpec], *, peft: PeftKind = "lora",
         groups: int = 4,
         group_size: int = 8, rounds: int = 1, temperature: float = 0.7,
         max_new_tokens: int = 32, seed: int = 0) -> dict[str, Any]:
    """The split plan of ``datasets`` (ReasoningGYM names, or task specs with their
    configs) for ``model`` (JSON-ready).

    Raises:
        MeritError: a family had no group with reward variance, so no gradient
            direction (raise ``groups`` or ``temperature``, or drop the family).
    """
    from ftis.client.learner.config import LearnerConfig
    from ftis.client.learner.trainer import Learner
    from ftis.client.models.loader import load_policy
    from ftis.client.rollout.settings import SamplingSettings
    from ftis.lab.merit.gradients import family_gradients
    torch.manual_seed(seed)
    policy = load_policy(model, peft=peft)
    learner = Learner(policy.model, LearnerConfig(), int(policy.tokenizer.pad_token_id or 0))
    specs = [d if isinstance(d, TaskSpec) else TaskSpec(dataset=d) for d in datasets]
    grads = family_gradients(policy, learner, specs,
                             groups=groups, group_size=group_size,
                             sampling=SamplingSettings(temperature=temperature,
                                                       max_new_tokens=max_new_tokens),
                             seed=seed)
    silent = [g.dataset for g in grads if g.informative_groups == 0]
    if silent:
        raise MeritError(f"no reward variance, so no gradient, for {', '.join(silent)}: "
                         "sample more groups, raise the temperature or drop them")
    stacked = torch.stack([g.gradient for g in grads])
    tokens = [float(g.tokens) for g in grads]
    conflict = conflict_matrix(stacked)
    names = [g.dataset for g in grads]

    def named(branches: list[list[int]]) -> list[list[str]]:
        return [[names[i] for i in b] for b in branches]

    return {
        "model": model, "peft": peft, "seed": seed, "groups": groups,
        "group_size": group_size, "temperature": temperature,
        "families": [{"dataset": g.dataset, "config": spec.config, "tokens": g.tokens,
                      "informative_groups": g.informative_groups,
                      "mean_reward": g.mean_reward} for g, spec in zip(grads, specs,
                                                                       strict=True)],
        "conflict_matrix": [[round(float(x), 6) for x in row] for row in conflict],
        "rounds": rounds,
        "branches": {
            "conflict_aware": named(conflict_aware_split(stacked, tokens, rounds)),
            "random": named(random_split(len(names), tokens, rounds, random.Random(seed))),
        },
    }


@dataclass(frozen=True)
class Branch:
    """A trained branch: an ``ftis-client start --out`` folder and its training tokens."""

    out: Path
    tokens: float


def trained_policy(base_model: str, peft: PeftKind, out: Path) -> Policy:
    """A fresh policy of ``base_model`` (of the PEFT kind the branch trained) with the
    newest checkpoint of ``ftis-client --out`` folder ``out`` loaded into it.

    Raises:
        MeritError: ``out/checkpoints`` holds no checkpoint.
    """
    from ftis.client.learner.checkpoint import load_checkpoint
    from ftis.client.learner.config import LearnerConfig
    from ftis.client.learner.trainer import Learner
    from ftis.client.models.loader import load_policy

    policy = load_policy(base_model, peft=peft)
    learner = Learner(policy.model, LearnerConfig(), 0)
    if load_checkpoint(out / "checkpoints", policy.model, learner.optimizer) is None:
        raise MeritError(f"no checkpoint under {out / 'checkpoints'}")
    return policy


def _merged_state(base_model: str, peft: PeftKind, out: Path) -> dict[str, torch.Tensor]:
    """The full weights of branch folder ``out``: its newest checkpoint loaded into a
    fresh policy (of the PEFT kind it was trained with), LoRA merged into the base."""
    model = trained_policy(base_model, peft, out).model
    if peft != "none":
        model = model.merge_and_unload()  # type: ignore[operator]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def merge(base_model: str, branches: list[Branch], out: Path, *, peft: PeftKind = "lora"
          ) -> dict[str, Any]:
    """Merge ``branches`` by training tokens into a model directory ``out``.

    Returns:
        ``{"weights": [...], "branches": [...]}`` (also written as ``out/merit.json``).

    Raises:
        MeritError: no branch, or a branch without a checkpoint.
    """
    from ftis.client.models.loader import load_policy

    if not branches:
        raise MeritError("no branch to merge")
    base = load_policy(base_model)
    base_state = {k: v.detach().clone() for k, v in base.model.state_dict().items()}
    deltas = []
    for b in branches:
        trained = _merged_state(base_model, peft, b.out)
        deltas.append({k: trained[k].double() - base_state[k].double() for k in base_state})
    weights = token_weights([b.tokens for b in branches])
    merged = merge_deltas(base_state, deltas, weights)
    base.model.load_state_dict(merged)
    out.mkdir(parents=True, exist_ok=True)
    base.model.save_pretrained(str(out))
    base.tokenizer.save_pretrained(str(out))
    record = {"base_model": base_model, "peft": peft, "weights": weights,
              "branches": [str(b.out) for b in branches]}
    (out / "merit.json").write_text(json.dumps(record, indent=1))
    return record
