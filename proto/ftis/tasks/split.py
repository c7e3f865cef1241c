"""Train / held-out split of a task mix, disjoint by operands.

A held-out set only measures generalisation if no training prompt shares its operands:
``3 * 4`` held out and ``4 * 3`` trained on would measure memorisation. Every task entry
gets an **operand key** -- its dataset plus the sorted multiset of the integers in its
expression (ReasoningGYM's ``metadata["expression"]`` where present, else the question) --
and the key, not the entry, is assigned to one side by a salted SHA-256 hash. Entries
whose text has no integer fall back to the whole question as their key (disjoint by
prompt). The coordinator leases only ``train`` entries; evaluation draws only
``heldout`` ones, so the two sets are disjoint by construction, not by sampling luck.

Pure functions: no I/O, deterministic across processes and platforms.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["HeldoutSplit", "SplitPart", "operand_key"]

SplitPart = Literal["train", "heldout"]

_INTEGER = re.compile(r"(?<![\w.])-?\d+")


def operand_key(dataset: str, question: str, metadata: dict[str, Any] | None = None) -> str:
    """The key that decides an entry's side of the split.

    Args:
        dataset: ReasoningGYM dataset name.
        question: the task question.
        metadata: the entry's metadata; its ``expression`` (if a string) is read instead
            of the question, so boilerplate numbers in the wording do not count.

    Returns:
        ``"<dataset>:<sorted integers>"``, e.g. ``"products:-9,7"`` for ``7 * -9``, or
        ``"<dataset>:q:<question>"`` when the text holds no integer.
    """
    expression = (metadata or {}).get("expression")
    text = expression if isinstance(expression, str) and expression else question
    numbers = sorted(int(x) for x in _INTEGER.findall(text))
    if not numbers:
        return f"{dataset}:q:{question}"
    return f"{dataset}:" + ",".join(str(n) for n in numbers)


@dataclass(frozen=True)
class HeldoutSplit:
    """Assigns operand keys to ``train`` or ``heldout``.

    Attributes:
        fraction: share of operand keys held out, in ``[0, 1)`` (0 = no held-out part).
        salt: hash salt; another salt gives another split of the same keys.

    Raises:
        ValueError: if ``fraction`` is outside ``[0, 1)``.
    """

    fraction: float
    salt: str = "ftis-heldout-v1"

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction < 1.0:
            raise ValueError(f"held-out fraction must be in [0, 1), got {self.fraction!r}")

    def part_of_key(self, key: str) -> SplitPart:
        """``heldout`` when the key's hash, read as a number in [0, 1), is below
        ``fraction``; ``train`` otherwise."""
        digest = hashlib.sha256(f"{self.salt}\x00{key}".encode()).digest()
        u = int.from_bytes(digest[:8], "big") / 2**64
        return "heldout" if u < self.fraction else "train"

    def part(self, dataset: str, question: str, metadata: dict[str, Any] | None = None
             ) -> SplitPart:
        """The side of one entry (see :func:`operand_key`)."""
        return self.part_of_key(operand_key(dataset, question, metadata))
