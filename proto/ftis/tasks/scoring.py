"""Answer extraction and scoring with ReasoningGYM's own ``score_answer``.

Extraction is lenient because small models rarely follow answer tags (SmolLM2-135M
scores 0 on 1-digit ``chain_sum`` with strict ``<answer>`` tags). In order:

1. the content of the last ``<answer>...</answer>`` pair, if any;
2. the content of the last ``\\boxed{...}``, if any;
3. if the oracle answer is a number: the last number in the text (``-?\\d+(\\.\\d+)?``,
   thousands separators removed);
4. otherwise the last non-empty line, stripped.

The extracted string is passed to the dataset's ``score_answer(answer, entry)``, so the
reward is ReasoningGYM's (in [0, 1]); or, with the ``exact`` reward, compared with the
oracle answer for a binary reward (no partial credit).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Any, Literal

#: Reward functions of :func:`score_completion`: ``gym`` is the dataset's own
#: ``score_answer`` (partial credit on some datasets), ``exact`` is 1 for an extracted
#: answer equal to the oracle answer and 0 otherwise.
REWARDS: tuple[str, ...] = ("gym", "exact")
Reward = Literal["gym", "exact"]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text.replace(",", "").strip()))
    except ValueError:
        return False


def extract_answer(text: str, oracle_answer: str | None = None) -> str | None:
    """Extract the final answer from a completion (rules in the module docstring).

    Args:
        text: completion text.
        oracle_answer: the task's reference answer, used only to decide whether the
            answer is numeric (rule 3).

    Returns:
        The extracted answer string, or ``None`` if nothing could be extracted.
    """
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    if oracle_answer is not None and _is_number(oracle_answer):
        numbers = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
        return numbers[-1] if numbers else None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


@functools.cache
def _score_fn(dataset: str) -> Callable[[str | None, dict[str, Any]], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset)


def exact_match(answer: str | None, oracle: str) -> bool:
    """True when an extracted answer equals the oracle answer: numerically (``"12.0"``
    equals ``"12"``, thousands separators ignored) when both are numbers, otherwise as
    strings after stripping whitespace and case-folding."""
    if answer is None:
        return False
    if _is_number(answer) and _is_number(oracle):
        return float(answer.replace(",", "")) == float(oracle.replace(",", ""))
    return answer.strip().casefold() == oracle.strip().casefold()


def score_completion(dataset: str, text: str, entry: dict[str, Any],
                     reward: str = "gym") -> float:
    """Reward in [0, 1] of a completion for a ReasoningGYM entry.

    Args:
        dataset: ReasoningGYM dataset name (e.g. ``"chain_sum"``).
        text: completion text.
        entry: the dataset entry (``question``, ``answer``, ``metadata``).
        reward: ``gym`` -- the dataset's ``score_answer`` (partial credit where the
            dataset gives it, e.g. 0.5 for "15" against "5" on decimal scorers);
            ``exact`` -- binary: 1.0 when :func:`exact_match` holds, else 0.0.

    Raises:
        ValueError: if the dataset is not registered in ReasoningGYM or ``reward`` is
            unknown.
    """
    answer = extract_answer(text, str(entry.get("answer")))
    if reward not in REWARDS:
        raise ValueError(f"unknown reward {reward!r}; expected one of {REWARDS}")
    if reward == "exact":
        return 1.0 if exact_match(answer, str(entry.get("answer"))) else 0.0
    try:
        value = float(_score_fn(dataset)(answer, entry))
    except Exception:  # noqa: BLE001 - a scorer crash on odd input means "wrong"
        return 0.0
    if not math.isfinite(value):
        return 0.0
    return min(max(value, 0.0), 1.0)
