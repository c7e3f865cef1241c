"""Prompt rendering. The coordinator renders chat messages; clients apply their own
tokenizer's chat template, or :func:`render_plain_prompt` for models without one."""

from __future__ import annotations

SYSTEM_PROMPT = (
    "You are a helpful assistant. Solve the problem. "
    "End your reply with the final answer."
)


#: Stop strings of the plain format: a base model answering "Question: ...\nAnswer:"
#: tends to go on with a new "Question:"; a completion ends once it produces one.
PLAIN_STOP_STRINGS: tuple[str, ...] = ("\nQuestion:",)


def render_messages(question: str) -> list[dict[str, str]]:
    """Chat messages (``[{"role", "content"}]``) for a task question."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]


def render_plain_prompt(messages: list[dict[str, str]]) -> str:
    """Plain-text prompt for models without a chat template (e.g. base models).

    Format: the system text, a blank line, ``Question: ...`` and ``Answer:``.
    """
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    user = "\n".join(m["content"] for m in messages if m["role"] == "user")
    head = f"{system}\n\n" if system else ""
    return f"{head}Question: {user}\nAnswer:"
