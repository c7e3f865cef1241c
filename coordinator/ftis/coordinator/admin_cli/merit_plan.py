"""Reading an ``ftis-lab merit plan`` file for ``ftis-admin branches plan``.

The plan (``lab/ftis/lab/merit/run.py``, e.g. ``experiments/results/merit-plans-*/``)
is JSON with, among other keys::

    {"model": "smollm2-135m", "seed": 0,
     "families": [{"dataset": "products", "tokens": 1153, ...}, ...],
     "branches": {"conflict_aware": [["chain_sum", "gcd"], ["products", ...]],
                  "random": [[...], [...]]}}

Each split is a list of branches, each a list of family names. Branch ``i`` of the
chosen split is named ``b<i>``; its ``tokens`` are the sum of its families' ``tokens``
(the split's balancing weight, and MERIT's merge weight basis), or 0 when a family has
no token count. Pure parsing: nothing here talks to the coordinator, which checks the
families against its task mix when the branches are applied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The splits ``ftis-lab merit plan`` writes, the default first.
SPLITS = ("conflict_aware", "random")


class PlanError(ValueError):
    """The file is not a usable MERIT plan (one line: what is wrong)."""


@dataclass(frozen=True)
class PlannedBranch:
    """One branch of a plan's split.

    Attributes:
        name: ``b0``, ``b1``, ... in the split's order.
        families: ReasoningGYM dataset names.
        tokens: the plan's token count of these families (0 if not given).
        share: ``tokens`` over the split's total (0 if no token counts).
    """

    name: str
    families: tuple[str, ...]
    tokens: float
    share: float


@dataclass(frozen=True)
class Plan:
    """A split read from a plan file, with the plan's provenance for display."""

    split: str
    branches: list[PlannedBranch]
    model: str
    seed: int | None


def parse_plan(data: Any, split: str = SPLITS[0]) -> Plan:
    """The branches of ``split`` in a decoded plan.

    Raises:
        PlanError: not a plan object, no such split (the message lists those present),
            an empty split or branch, a family name that is not a non-empty string, a
            family in two branches, or a family token count that is not a number >= 0.
    """
    if not isinstance(data, dict) or not isinstance(data.get("branches"), dict):
        raise PlanError("not an `ftis-lab merit plan` file: no \"branches\" object")
    splits = data["branches"]
    if split not in splits:
        raise PlanError(f"no split {split!r} in the plan (it has: "
                        f"{', '.join(map(str, splits)) or 'none'})")
    raw = splits[split]
    if not isinstance(raw, list) or not raw:
        raise PlanError(f"split {split!r} is not a non-empty list of branches")
    tokens: dict[str, float] = {}
    for family in data.get("families") or []:
        if isinstance(family, dict) and isinstance(family.get("dataset"), str):
            value = family.get("tokens")
            if value is None:
                continue
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not 0 <= value < float("inf")):
                raise PlanError(f"family {family['dataset']!r}: tokens {value!r} is not a "
                                "number >= 0")
            tokens[family["dataset"]] = float(value)
    seen: dict[str, int] = {}
    lists: list[tuple[str, ...]] = []
    for i, branch in enumerate(raw):
        if not isinstance(branch, list) or not branch:
            raise PlanError(f"split {split!r}, branch {i}: not a non-empty list of families")
        for family in branch:
            if not isinstance(family, str) or not family:
                raise PlanError(f"split {split!r}, branch {i}: family {family!r} is not a "
                                "dataset name")
            if family in seen:
                raise PlanError(f"split {split!r}: family {family!r} is in branches "
                                f"{seen[family]} and {i}")
            seen[family] = i
        lists.append(tuple(branch))
    counted = all(f in tokens for f in seen)
    sums = [sum(tokens[f] for f in b) if counted else 0.0 for b in lists]
    total = sum(sums)
    branches = [PlannedBranch(name=f"b{i}", families=b, tokens=t,
                              share=t / total if total > 0 else 0.0)
                for i, (b, t) in enumerate(zip(lists, sums, strict=True))]
    seed = data.get("seed")
    return Plan(split=split, branches=branches, model=str(data.get("model", "")),
                seed=seed if isinstance(seed, int) else None)


def read_plan(path: Path, split: str = SPLITS[0]) -> Plan:
    """:func:`parse_plan` of the JSON file at ``path``.

    Raises:
        PlanError: unreadable file, invalid JSON, or see :func:`parse_plan`.
    """
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise PlanError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"{path} is not JSON: {exc}") from None
    return parse_plan(data, split)
