"""Seeded ReasoningGYM task generation with per-task generator settings."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field, field_validator

from ftis.tasks.scoring import REWARDS, Reward, score_completion
from ftis.tasks.split import HeldoutSplit, SplitPart

__all__ = ["DEFAULT_TASKS", "REWARDS", "TaskEntry", "TaskSource", "TaskSpec"]


class TaskSpec(BaseModel):
    """One ReasoningGYM dataset in the task mix.

    Attributes:
        dataset: registered ReasoningGYM name, e.g. ``"chain_sum"``.
        weight: relative sampling weight (> 0).
        config: keyword arguments for the dataset's config class
            (e.g. ``{"min_digits": 1, "max_digits": 1}``).
        reward: ``gym`` (ReasoningGYM's ``score_answer``; its decimal scorers give 0.5
            to "15" or "-5" when the answer is "5") or ``exact`` (binary exact match).
    """

    dataset: str
    weight: float = Field(default=1.0, gt=0)
    config: dict[str, Any] = Field(default_factory=dict)
    reward: Reward = "gym"

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
    #: reward function, one of :data:`REWARDS`
    reward: str = "gym"

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
                "reward": self.reward,
            },
            default=str,
        )

    @classmethod
    def from_json(cls, text: str) -> TaskEntry:
        d = json.loads(text)
        return cls(d["dataset"], int(d["index"]), d["question"], str(d["answer"]), d["metadata"],
                   d.get("reward", "gym"))

    def score(self, text: str) -> float:
        """Reward in [0, 1] of a completion's text under this entry's reward function."""
        return score_completion(self.dataset, text, self.as_entry(), self.reward)


class TaskSource:
    """Draws tasks from a weighted mix of seeded ReasoningGYM datasets.

    Dataset ``k`` of the mix is created with seed ``seed + k`` and ``size`` entries;
    draws are sequential per dataset (index 0, 1, ...) and wrap around, so the same
    seed and order of draws reproduce the same tasks. With a ``split``, entries of the
    other ``part`` are passed over (:mod:`ftis.tasks.split`): a coordinator with a
    held-out fraction never leases an entry whose operands are held out.

    Raises:
        ValueError: on an empty mix or an invalid dataset config.
    """

    def __init__(self, specs: list[TaskSpec], seed: int = 0, size: int = 100_000,
                 split: HeldoutSplit | None = None, part: SplitPart = "train") -> None:
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
        self.split = split if split is not None and split.fraction > 0 else None
        self.part = part
        self._seed = seed
        # per dataset: indices of the part's entries found so far, and how far scanned
        self._part_indices: list[list[int]] = [[] for _ in self.specs]
        self._scanned = [0] * len(self.specs)
        self._scan_lock = threading.Lock()

    def draw(self) -> TaskEntry:
        """Next task (of this source's split part) from a dataset chosen by weight.

        Raises:
            ValueError: if a whole pass over a dataset finds no entry of the part.
        """
        k = self._rng.choices(range(len(self.specs)), weights=[s.weight for s in self.specs])[0]
        return self._next_of(k)

    def _next_of(self, k: int) -> TaskEntry:
        for _ in range(self._size):
            index = self._next[k] % self._size
            self._next[k] += 1
            entry = self.get(k, index)
            if self.split is None or self.split.part(
                    entry.dataset, entry.question, entry.metadata) == self.part:
                return entry
        raise ValueError(f"no {self.part} entry in {self.specs[k].dataset}")

    def at(self, number: int, among: Sequence[int] | None = None) -> tuple[int, TaskEntry]:
        """Task number ``number`` (0, 1, ...) of this source's part: ``(k, entry)`` with
        ``k`` the mix position of its dataset. Random access and deterministic in
        ``(seed, number, among)``, so worker processes that reserve numbers from one
        shared counter hand out the same tasks in the same order as one process would.

        The dataset is chosen by weight with a generator seeded by ``(seed, number)``;
        within it, task number ``n`` is the ``n``-th entry of the part (wrapping around
        after the part's last entry).

        Args:
            number: the task number, >= 0.
            among: mix positions to choose the dataset from (a MERIT branch's sub-mix),
                by their weights in the mix; ``None``: the whole mix. The entry is the
                ``number``-th of the chosen dataset either way, so distinct numbers
                still give distinct ``(k, entry)`` pairs (up to wrapping around), and the
                held-out split is the same.

        Raises:
            ValueError: for a negative number, an empty ``among`` or a position outside
                the mix, or a dataset with no entry of the part.
        """
        if number < 0:
            raise ValueError(f"task number {number} < 0")
        rng = random.Random(f"{self._seed}:{number}")
        if among is None:
            k = rng.choices(range(len(self.specs)), weights=[s.weight for s in self.specs])[0]
        else:
            if not among or not all(0 <= i < len(self.specs) for i in among):
                raise ValueError(f"sub-mix {list(among)!r} is empty or outside the mix of "
                                 f"{len(self.specs)} datasets")
            k = rng.choices(list(among), weights=[self.specs[i].weight for i in among])[0]
        with self._scan_lock:
            index = self._part_index(k, number)
        return k, self.get(k, index)

    def _part_index(self, k: int, n: int) -> int:
        """Dataset index of the ``n``-th entry of this source's part in dataset ``k``."""
        if self.split is None:
            return n % self._size
        found = self._part_indices[k]
        while len(found) <= n and self._scanned[k] < self._size:
            index = self._scanned[k]
            self._scanned[k] += 1
            entry = self.get(k, index)
            if self.split.part(entry.dataset, entry.question, entry.metadata) == self.part:
                found.append(index)
        if not found:
            raise ValueError(f"no {self.part} entry in {self.specs[k].dataset}")
        return found[n % len(found)] if len(found) <= n else found[n]

    def distinct(self, count: int, max_draws: int = 100_000) -> list[TaskEntry]:
        """Up to ``count`` entries with pairwise different questions, in draw order
        (fewer when the part holds fewer distinct questions within ``max_draws``)."""
        seen: set[str] = set()
        out: list[TaskEntry] = []
        for _ in range(max_draws):
            if len(out) >= count:
                break
            e = self.draw()
            if e.question not in seen:
                seen.add(e.question)
                out.append(e)
        return out

    def get(self, k: int, index: int) -> TaskEntry:
        """Entry ``index`` of dataset ``k`` of the mix."""
        item = self._datasets[k][index]
        return TaskEntry(
            dataset=self.specs[k].dataset,
            index=index,
            question=item["question"],
            answer=str(item["answer"]),
            metadata=dict(item.get("metadata", {})),
            reward=self.specs[k].reward,
        )

    def skip(self, counts: list[int]) -> None:
        """Pass over ``counts[k]`` issued entries of dataset ``k`` (resume after a restart);
        with a split the passed-over entries of the other part are skipped too."""
        if self.split is None:
            self._next = [max(a, b) for a, b in zip(self._next, counts, strict=True)]
            return
        for k, n in enumerate(counts):
            for _ in range(n):
                self._next_of(k)

    @property
    def cursors(self) -> list[int]:
        return list(self._next)
