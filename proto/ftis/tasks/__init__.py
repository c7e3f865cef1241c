"""ReasoningGYM tasks shared by coordinator and client: task generation, prompt
rendering and answer scoring. Both sides import these so a reward means the same
thing everywhere."""

from ftis.tasks.prompt import (
    PLAIN_STOP_STRINGS,
    SYSTEM_PROMPT,
    render_messages,
    render_plain_prompt,
)
from ftis.tasks.scoring import extract_answer, score_completion
from ftis.tasks.source import REWARDS, TaskEntry, TaskSource, TaskSpec
from ftis.tasks.split import HeldoutSplit, operand_key

__all__ = [
    "PLAIN_STOP_STRINGS",
    "REWARDS",
    "SYSTEM_PROMPT",
    "HeldoutSplit",
    "TaskEntry",
    "TaskSource",
    "TaskSpec",
    "extract_answer",
    "operand_key",
    "render_messages",
    "render_plain_prompt",
    "score_completion",
]
