"""Seeded ReasoningGYM task generation with per-task generator settings."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field, field_validator


class TaskSpec(BaseModel):
    """One ReasoningGYM dataset in the task mix.

    Attributes:
        dataset: registered ReasoningGYM name, e.g. ``"chain_sum"``.
        weight: relative sampling weight (> 0).
        config: keyword arguments for the dataset's config class
            (e.g. ``{"min_digits": 1, "max_digits": 1}``).
    """

    dataset: str
    weight: float = Field(default=1.0, gt=0)
    config: dict[str, Any] = Field(default_factory=dict)

    @field_validator("dataset")
    @classmethod
    def _known(cls, name: str) -> str:
        from reasoning_gym.factory import DATASETS

        if name not in DATASETS:
            raise ValueError(f"unknown ReasoningGYM dataset {name!r}")
        return name


DEFAULT_TASKS = [
    TaskSpec(
        dataset="chain_sum",
        config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    )
]


@dataclass(frozen=True)
class TaskEntry:
    """One generated task: ReasoningGYM entry plus where it came from."""

    dataset: str
    index: int
    question: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def as_entry(self) -> dict[str, Any]:
        """The dict ReasoningGYM's ``score_answer`` expects."""
        return {"question": self.question, "answer": self.answer, "metadata": self.metadata}

    def to_json(self) -> str:
        return json.dumps(
            {
                "dataset": self.dataset,
                "index": self.index,
                "question": self.question,
                "answer": self.answer,
                "metadata": self.metadata,
            },
            default=str,
        )

    @classmethod
    def from_json(cls, text: str) -> TaskEntry:
        d = json.loads(text)
        return cls(d["dataset"], int(d["index"]), d["question"], str(d["answer"]), d["metadata"])


class TaskSource:
    """Draws tasks from a weighted mix of seeded ReasoningGYM datasets.

    Dataset ``k`` of the mix is created with seed ``seed + k`` and ``size`` entries;
    draws are sequential per dataset (index 0, 1, ...) and wrap around, so the same
    seed and order of draws reproduce the same tasks.

    Raises:
        ValueError: on an empty mix or an invalid dataset config.
    """

    def __init__(self, specs: list[TaskSpec], seed: int = 0, size: int = 100_000) -> None:
        import reasoning_gym

        if not specs:
            raise ValueError("task mix is empty")
        self.specs = list(specs)
        self._datasets = []
        for k, spec in enumerate(self.specs):
            try:
                ds = reasoning_gym.create_dataset(
                    spec.dataset, seed=seed + k, size=size, **spec.config
                )
            except (TypeError, AssertionError, ValueError) as exc:
                raise ValueError(f"bad config for {spec.dataset}: {exc}") from exc
            self._datasets.append(ds)
        self._next = [0] * len(self.specs)
        self._rng = random.Random(seed)
        self._size = size

    def draw(self) -> TaskEntry:
        """Next task from a dataset chosen by weight."""
        k = self._rng.choices(range(len(self.specs)), weights=[s.weight for s in self.specs])[0]
        index = self._next[k] % self._size
        self._next[k] += 1
        return self.get(k, index)

    def get(self, k: int, index: int) -> TaskEntry:
        """Entry ``index`` of dataset ``k`` of the mix."""
        item = self._datasets[k][index]
        return TaskEntry(
            dataset=self.specs[k].dataset,
            index=index,
            question=item["question"],
            answer=str(item["answer"]),
            metadata=dict(item.get("metadata", {})),
        )

    def skip(self, counts: list[int]) -> None:
        """Advance the per-dataset cursors (used to resume after a restart)."""
        self._next = [max(a, b) for a, b in zip(self._next, counts, strict=True)]

    @property
    def cursors(self) -> list[int]:
        return list(self._next)
