"""Answer extraction and scoring with ReasoningGYM's own ``score_answer``.

Extraction is lenient because small models rarely follow answer tags (SmolLM2-135M
scores 0 on 1-digit ``chain_sum`` with strict ``<answer>`` tags). In order:

1. the content of the last ``<answer>...</answer>`` pair, if any (tags matched
   case-insensitively; pairs are taken left to right, each ``<answer>`` closed by the
   first ``</answer>`` after it, as ``re.findall(r"<answer>(.*?)</answer>", re.I | re.S)``);
2. the content of the last ``\\boxed{...}`` whose content holds no brace, if any;
3. if the oracle answer is a number: the last number in the text (``-?\\d+(\\.\\d+)?``
   after removing thousands separators: a comma between a digit and three digits that
   end a word);
4. otherwise the last non-empty line, stripped.

The extracted string is passed to the dataset's ``score_answer(answer, entry)``, so the
reward is ReasoningGYM's (in [0, 1]); or, with the ``exact`` reward, compared with the
oracle answer for a binary reward (no partial credit).

Cost: every completion is scored by the coordinator in a request thread, so extraction
is linear in the text length whatever the text (a node chooses it, and with its own
tokenizer a single token may be a long run of tags; the tag regex above took 5.4 s on
65,536 characters of unclosed tags): rules 1 and 4 are ``str.find`` / ``str.rfind``
scans over disjoint ranges; rules 2 and 3 use patterns that never backtrack
(possessive quantifiers, a one-character lookahead), rule 2 in one pass, rule 3 only
over the run of number characters that ends at the text's last digit. Under 10 ms
for 65,536 characters of any kind.

:func:`score_completion` also bounds its inputs: a text longer than
:data:`MAX_SCORED_TEXT_CHARS` scores 0, and an extracted answer longer than
:data:`MAX_ANSWER_CHARS` counts as no answer (ReasoningGYM's ``score_answer`` is then
never called on it). Both sides score with this function, so the bounds never turn
into a reward mismatch.
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

#: Longest completion text (characters) that is scored at all; a longer one scores 0,
#: on the coordinator (``verify.rescore``) and on clients alike. The structure check
#: bounds text at 64 characters per token (65,536 at the default 1024-token lease
#: limit), but that bound grows with the operator's ``max_new_tokens_limit``; this one
#: does not. Honest text runs at 3-5 characters per token, so 131,072 characters leave
#: room for 32k-token completions; scoring that much adversarial text takes < 10 ms.
MAX_SCORED_TEXT_CHARS = 1 << 17
#: Longest extracted answer passed to a scorer; a longer one counts as no answer (0).
#: ReasoningGYM's answers are at most a few hundred characters (762 the longest seen
#: over all datasets at default settings); the scorers of the datasets we lease
#: (``compute_decimal_reward``: ``Decimal`` and ``in``; the default ``==`` and ``in``)
#: are linear, but other datasets' scorers parse their answer.
MAX_ANSWER_CHARS = 4096

_OPEN_TAG, _CLOSE_TAG = "<answer>", "</answer>"
#: Rule 2: possessive, so a box that is not closed before the next brace fails at once.
_BOXED = re.compile(r"\\boxed\{([^{}]*+)\}")
#: Case folding for the tag scan, exactly ``re.IGNORECASE`` on the tags' characters
#: (``<answer/>``): ASCII letters, and U+017F LATIN SMALL LETTER LONG S, which ``re``
#: equates with "s". One character to one, so positions in the folded text are
#: positions in the text (see :func:`_fold_tags`).
_FOLD = {**{c: c + 32 for c in range(ord("A"), ord("Z") + 1)}, 0x17F: ord("s")}
#: Rule 3 on the raw text: ``-?\d+(\.\d+)?`` where each digit run may continue with
#: ``,ddd`` when the three digits end a word (the comma that rule removes). Possessive
#: quantifiers and a one-character lookahead: every attempt is O(length of its match).
_NUMBER = re.compile(r"-?\d++(?:,\d{3}(?!\w))*+(?:\.\d++(?:,\d{3}(?!\w))*+)?+")
#: A character that can be in no number (nor be a removed thousands separator).
_NOT_NUMERIC = re.compile(r"[^\d.,\-]")
_DIGIT = re.compile(r"\d")
#: How far back from the last digit :data:`_FRESH_BACKWARDS` is looked for.
_FRESH_SEARCH_CHARS = 64
#: In the reversed text: a character before which a scan may start afresh inside a run
#: of number characters, because it starts every match it is in (``-``) or is in no
#: match (``.`` not between two digits; ``,`` not between a digit and three digits that
#: end a word, i.e. not a thousands separator). Without it, a run like ``1,1,1,...``
#: would be scanned whole; only chains like ``1.1.1...``, whose pairing depends on
#: where they begin, and long numbers still are (2-4 ms for 65,536 characters).
_FRESH_BACKWARDS = re.compile(r"-|\.(?!\d)|(?<!\d)\.|,(?!\d)|(?<!\W\d{3})(?<!^\d{3}),")
#: ``str.splitlines`` boundaries (all of them whitespace).
_LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text.replace(",", "").strip()))
    except ValueError:
        return False


def _fold_tags(text: str) -> str:
    """``text`` with every character that ``re.IGNORECASE`` equates with a character of
    ``<answer/>`` replaced by that character, and the same length.

    ``str.lower`` does that (only ASCII capitals lower-case to those characters) except
    for U+017F, and keeps the length unless the text holds a character whose lower case
    is longer (U+0130); :data:`_FOLD` is exact but ~20x slower on non-ASCII text.
    """
    if text.isascii():
        return text.lower()
    folded = text.lower()
    if len(folded) != len(text):
        return text.translate(_FOLD)
    return folded.replace("\u017f", "s")


def _last_tag_content(text: str) -> str | None:
    """Rule 1: the content of the last ``<answer>...</answer>`` pair, pairs taken left
    to right (each search starts where the last one ended: O(len(text)))."""
    folded = _fold_tags(text)
    last = None
    pos = 0
    while (start := folded.find(_OPEN_TAG, pos)) >= 0:
        end = folded.find(_CLOSE_TAG, start + len(_OPEN_TAG))
        if end < 0:
            break  # no close after this open, so none after any later open either
        last = (start + len(_OPEN_TAG), end)
        pos = end + len(_CLOSE_TAG)
    return None if last is None else text[last[0]:last[1]]


def _last_boxed_content(text: str) -> str | None:
    """Rule 2: the content of the last ``\\boxed{`` whose first brace after it is ``}``
    (one pass: each attempt scans only to the next brace, and a box holds no ``{``)."""
    boxes = _BOXED.findall(text)
    return boxes[-1] if boxes else None


def _last_number(text: str) -> str | None:
    """Rule 3: the last number, thousands separators removed.

    Every digit is in some match and every match ends with a digit, so the last match
    ends at the last digit, inside the run of number characters (digits ``.,-``) that
    holds it. Matches never span a character outside that set, so scanning that run
    alone (and the character after it, which the lookahead reads) finds exactly the
    matches a scan of the whole text finds there; so does scanning from the run's last
    :data:`_FRESH_BACKWARDS` character, when there is one near its end. All are found
    by scanning the reversed text: O(length of the run + characters after it).
    """
    n = len(text)
    backwards = text[::-1]
    digit = _DIGIT.search(backwards)
    if digit is None:
        return None
    last = n - 1 - digit.start()
    before = _NOT_NUMERIC.search(backwards, digit.start())
    run_end = n if before is None else before.start()  # in the reversed text
    limit = digit.start() + _FRESH_SEARCH_CHARS
    if run_end <= limit:
        fresh = _FRESH_BACKWARDS.search(backwards, digit.start(), run_end)
    else:  # one character more for the lookaheads, which must not see an early end
        fresh = _FRESH_BACKWARDS.search(backwards, digit.start(), limit + 1)
        if fresh is not None and fresh.start() >= limit:
            fresh = None
    start = n - (fresh.start() + 1 if fresh is not None else run_end)
    numbers = _NUMBER.findall(text, start, last + 2)
    return numbers[-1].replace(",", "")


def _last_line(text: str) -> str | None:
    """Rule 4: the last line (``str.splitlines``) that is not blank, stripped."""
    body = text.rstrip()
    if not body:
        return None
    start = max(body.rfind(b) for b in _LINE_BREAKS) + 1
    return body[start:].strip()


def extract_answer(text: str, oracle_answer: str | None = None) -> str | None:
    """Extract the final answer from a completion (rules in the module docstring), in
    time linear in ``len(text)``.

    Args:
        text: completion text.
        oracle_answer: the task's reference answer, used only to decide whether the
            answer is numeric (rule 3).

    Returns:
        The extracted answer string, or ``None`` if nothing could be extracted.
    """
    tag = _last_tag_content(text)
    if tag is not None:
        return tag.strip()
    boxed = _last_boxed_content(text)
    if boxed is not None:
        return boxed.strip()
    if oracle_answer is not None and _is_number(oracle_answer):
        return _last_number(text)
    return _last_line(text)


@functools.cache
def _score_fn(dataset: str) -> Callable[[str | None, dict[str, Any]], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset)


#: Datasets (besides those with ReasoningGYM's default ``score_answer``, ``==`` and
#: ``in``) whose ``score_answer`` is ``compute_decimal_reward`` (``Decimal`` and ``in``):
#: linear in the answer. ``test_linear_scoring_matches_the_installed_reasoning_gym``
#: checks this against the installed package.
DECIMAL_SCORERS = frozenset({"chain_sum", "products"})


@functools.cache
def linear_scoring(dataset: str, reward: str = "gym") -> bool:
    """True when :func:`score_completion` of ``dataset`` under ``reward`` takes time
    linear in the text: the extraction always does (module docstring), and then the
    ``exact`` comparison, ReasoningGYM's default ``score_answer`` (``==`` and ``in``)
    and ``compute_decimal_reward`` (:data:`DECIMAL_SCORERS`) are linear in the answer
    too. False for every other scorer (some parse their answer, e.g. with sympy) and
    for unknown datasets. Used by the coordinator to decide which re-scores may run
    without a worker process's time budget (``rescoring.RescoringPool``)."""
    if reward == "exact":
        return True
    if reward != "gym":
        return False
    if dataset in DECIMAL_SCORERS:
        return True
    from reasoning_gym.dataset import ProceduralDataset
    from reasoning_gym.factory import DATASETS

    if dataset not in DATASETS:
        return False
    return DATASETS[dataset][0].score_answer is ProceduralDataset.score_answer


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
        text: completion text; longer than :data:`MAX_SCORED_TEXT_CHARS` scores 0.
        entry: the dataset entry (``question``, ``answer``, ``metadata``).
        reward: ``gym`` -- the dataset's ``score_answer`` (partial credit where the
            dataset gives it, e.g. 0.5 for "15" against "5" on decimal scorers);
            ``exact`` -- binary: 1.0 when :func:`exact_match` holds, else 0.0. An
            extracted answer longer than :data:`MAX_ANSWER_CHARS` counts as none.

    Raises:
        ValueError: if the dataset is not registered in ReasoningGYM or ``reward`` is
            unknown.
    """
    if reward not in REWARDS:
        raise ValueError(f"unknown reward {reward!r}; expected one of {REWARDS}")
    if len(text) > MAX_SCORED_TEXT_CHARS:
        return 0.0
    answer = extract_answer(text, str(entry.get("answer")))
    if answer is not None and len(answer) > MAX_ANSWER_CHARS:
        answer = None
    if reward == "exact":
        return 1.0 if exact_match(answer, str(entry.get("answer"))) else 0.0
    try:
        value = float(_score_fn(dataset)(answer, entry))
    except Exception:  # noqa: BLE001 - a scorer crash on odd input means "wrong"
        return 0.0
    if not math.isfinite(value):
        return 0.0
    return min(max(value, 0.0), 1.0)
