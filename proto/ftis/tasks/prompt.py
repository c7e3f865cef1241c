"""Prompt rendering. The coordinator renders chat messages; clients apply their own
tokenizer's chat template, or, for models without one (base models such as Gemma-3-270M),
the plain prompt of :func:`render_plain_prompt` with :data:`PLAIN_STOP_STRINGS`."""

from __future__ import annotations

SYSTEM_PROMPT = (
    "You are a helpful assistant. Solve the problem. "
    "End your reply with the final answer."
)


def render_messages(question: str) -> list[dict[str, str]]:
    """Chat messages (``[{"role", "content"}]``) for a task question."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]


PLAIN_STOP_STRINGS: tuple[str, ...] = ("\nQuestion:",)
"""Where a completion of a plain prompt ends (see :func:`render_plain_prompt`).

A base model has no end-of-turn token: after answering it usually writes the next
``Question:`` of an imagined exam (Gemma-3-270M: ``" 3 + 4 = 7\nQuestion: What"``). The
client's sampler stops a row once its decoded text contains one of these strings and keeps
the tokens up to and including the one that completed it, so the text still equals the
decoded token ids. Only used when the tokenizer has no chat template.
"""


#: The worked example of the plain format (one-shot prompting, Brown et al. 2020,
#: arXiv 2005.14165 section 2): it shows a base model the shape of an answer. Measured on
#: Gemma-3-270M (1-digit chain_sum, 32 samples at temperature 1): mean reward 0.000
#: without it, 0.125 with it.
PLAIN_EXAMPLE = "Question: What is 2 + 3?\nAnswer: 5"


def render_plain_prompt(messages: list[dict[str, str]]) -> str:
    """Plain-text prompt for models without a chat template (e.g. base models).

    No chat template means no roles and no special tokens beyond the tokenizer's own BOS:
    the prompt is plain text, and says so by its shape. Format: the system text, a blank
    line, the worked example :data:`PLAIN_EXAMPLE`, a blank line,
    ``Question: <user text>``, a newline and ``Answer:`` (no trailing space; the model
    writes the space). Completions end at :data:`PLAIN_STOP_STRINGS`.
    """
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    user = "\n".join(m["content"] for m in messages if m["role"] == "user")
    head = f"{system}\n\n" if system else ""
    return f"{head}{PLAIN_EXAMPLE}\n\nQuestion: {user}\nAnswer:"
