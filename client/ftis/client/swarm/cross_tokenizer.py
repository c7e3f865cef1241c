"""Re-tokenizing another family's completions for a receiver (DESIGN.md section 6).

A generator whose tokenizer fingerprint differs from the receiver's ships token ids the
receiver's model cannot read and per-token log-probs that align with nothing on the
receiver's side. What both sides share is the text: the leased question (relayed by the
coordinator from its own records, not from the sender) and each completion's text
(checked by the coordinator against ``decode(token_ids)`` with the sender's uploaded
tokenizer). The receiver therefore

1. renders its **own** prompt for the question (its chat template, or the plain
   format of :func:`ftis.tasks.render_plain_prompt`);
2. splits each completion text into its content and its termination: a completion that
   ended with ``FINISH_REASON_STOP`` ends in the generator's end-of-sequence token (a
   special token such as ``<|im_end|>``, ``<eos>``, ``</s>``) or a plain-format stop
   string (``"\\nQuestion:"``); that suffix is replaced by the receiver's own
   termination (its EOS token, or its own stop string when it uses the plain format);
3. tokenizes the content with its own tokenizer.

The learner then compares sequence log-likelihoods -- the generator's summed sampler
log-probs against its own summed log-probs of the re-tokenized completion -- in
:func:`ftis.client.learner.loss.sequence_level_policy_loss`.

Approximations (documented in docs/heterogeneity.md): each side's sequence probability
is that of its canonical tokenization of the text (other tokenizations of the same text
are ignored), and "stopped" is identified across families by the termination rule above.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ftis.tasks.prompt import PLAIN_STOP_STRINGS, render_messages
from ftis.v1 import bundle_pb2

#: A trailing special token as written by ``decode(..., skip_special_tokens=False)`` in
#: the common families: ``<|im_end|>``, ``<|endoftext|>``, ``<|eot_id|>``, ``<eos>``,
#: ``<end_of_turn>``, ``</s>``.
SPECIAL_TOKEN_TAIL = re.compile(r"(?:<\|[^<>|\s]{1,40}\|>|</?[A-Za-z][A-Za-z0-9_\-]{0,39}>)\Z")

#: Longest re-tokenized completion accepted (tokens); longer ones drop the bundle.
MAX_RETOKENIZED_TOKENS = 4096


def split_termination(
    text: str, finish_reason: int, stop_strings: Sequence[str] = PLAIN_STOP_STRINGS
) -> tuple[str, bool]:
    """Content of a completion text and whether the generator stopped by itself.

    Args:
        text: completion text with special tokens kept (the bundle's ``Completion.text``).
        finish_reason: ``bundle_pb2.FINISH_REASON_*``.
        stop_strings: plain-format stop strings; the text is cut at the first one.

    Returns:
        ``(content, stopped)``. For a length-limited completion the text is returned
        unchanged with ``stopped=False``; for a stopped one, the trailing special token
        (repeated trailing special tokens included) or everything from the first stop
        string on is removed.
    """
    if finish_reason != bundle_pb2.FINISH_REASON_STOP:
        return text, False
    cut = [text.find(s) for s in stop_strings if s and s in text]
    if cut:
        return text[: min(cut)], True
    content = text
    while True:
        m = SPECIAL_TOKEN_TAIL.search(content)
        if m is None:
            return content, True
        content = content[: m.start()]


@dataclass(frozen=True)
class Retokenizer:
    """A receiver's view of foreign completions.

    Attributes:
        prompt_ids: ``question -> prompt token ids`` in the receiver's own format.
        encode: ``text -> token ids`` with no special tokens added.
        eos_token_id: the receiver's end-of-sequence id, appended to stopped completions
            when ``stop_text`` is ``None``.
        stop_text: the receiver's own plain-format stop string (models without a chat
            template), appended as text to stopped completions before encoding.
    """

    prompt_ids: Callable[[str], list[int]]
    encode: Callable[[str], list[int]]
    eos_token_id: int | None
    stop_text: str | None = None

    def completion_ids(self, content: str, stopped: bool) -> list[int]:
        """Receiver token ids of a completion's content plus, if stopped, its own
        termination."""
        if stopped and self.stop_text is not None:
            return list(self.encode(content + self.stop_text))
        ids = list(self.encode(content)) if content else []
        if stopped and self.eos_token_id is not None:
            ids.append(int(self.eos_token_id))
        return ids


def retokenizer_for(policy) -> Retokenizer:
    """The :class:`Retokenizer` of a loaded :class:`ftis.client.models.loader.Policy`."""
    tok = policy.tokenizer

    def prompt_ids(question: str) -> list[int]:
        return policy.prompt_token_ids(render_messages(question))[0]

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    chat = bool(getattr(tok, "chat_template", None))
    return Retokenizer(
        prompt_ids=prompt_ids,
        encode=encode,
        eos_token_id=tok.eos_token_id,
        stop_text=None if chat else PLAIN_STOP_STRINGS[0],
    )


class Retokenized(NamedTuple):
    """A foreign bundle as the receiver sees it (:func:`retokenize_bundle`).

    Attributes:
        prompt_ids: the receiver's own prompt ids for the relayed question.
        completions: receiver token ids of each completion (content + own termination).
        seq_logprobs: ``sum(bundle.completions[i].logprobs)``, the generator's sequence
            log-prob of each completion (nats, float).
    """

    prompt_ids: list[int]
    completions: list[list[int]]
    seq_logprobs: list[float]


def retokenize_bundle(
    bundle: bundle_pb2.Bundle, question: str, retokenizer: Retokenizer
) -> Retokenized:
    """Receiver prompt ids, re-tokenized completions and generator sequence log-probs.

    Returns:
        :class:`Retokenized` ``(prompt_ids, completions, seq_logprobs)`` (a named tuple):
        ``completions[i]`` are receiver ids; ``seq_logprobs[i] =
        sum(bundle.completions[i].logprobs)`` (nats, float). It feeds
        :meth:`ftis.client.rollout.groups.RolloutGroup.from_bundle`.

    Raises:
        ValueError: empty question, a completion that re-tokenizes to nothing or to
            more than :data:`MAX_RETOKENIZED_TOKENS` tokens.
    """
    if not question:
        raise ValueError("no task question relayed (coordinator too old?)")
    prompt = retokenizer.prompt_ids(question)
    completions: list[list[int]] = []
    seq: list[float] = []
    for i, c in enumerate(bundle.completions):
        content, stopped = split_termination(c.text, c.finish_reason)
        ids = retokenizer.completion_ids(content, stopped)
        if not ids or len(ids) > MAX_RETOKENIZED_TOKENS:
            raise ValueError(f"completion {i} re-tokenizes to {len(ids)} tokens")
        completions.append(ids)
        seq.append(float(sum(c.logprobs)))
    return Retokenized(prompt, completions, seq)
