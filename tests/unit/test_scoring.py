"""Lenient answer extraction and ReasoningGYM scoring, shared by both sides."""

import pytest

from ftis.tasks import TaskSource, TaskSpec, extract_answer, render_messages, score_completion
from ftis.tasks.source import DEFAULT_TASKS

ENTRY = {"question": "2 + 5 =", "answer": "7", "metadata": {}}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I think <answer>7</answer> is right", "7"),
        ("<answer>3</answer> no wait <answer> 7 </answer>", "7"),
        ("so \\boxed{7}.", "7"),
        ("2 + 5 = 7.", "7"),
        ("The sum is 1,234 in total", "1234"),
        ("minus: -4<|im_end|>", "-4"),
        ("no digits here", None),
    ],
)
def test_extract_answer_numeric(text, expected):
    assert extract_answer(text, "7") == expected


def test_extract_answer_text_oracle_takes_last_line():
    assert extract_answer("thinking...\n\n  True \n", "True") == "True"
    assert extract_answer("   ", "True") is None


def test_score_completion_values():
    assert score_completion("chain_sum", "2 + 5 = 7", ENTRY) == 1.0
    assert score_completion("chain_sum", "2 + 5 = 8", ENTRY) == 0.0
    assert score_completion("chain_sum", "", ENTRY) == 0.0
    assert score_completion("chain_sum", "<answer>7</answer> and then 9", ENTRY) == 1.0


def test_task_source_is_seeded_and_resumable():
    a, b = TaskSource(DEFAULT_TASKS, seed=4), TaskSource(DEFAULT_TASKS, seed=4)
    first = [a.draw() for _ in range(5)]
    assert first == [b.draw() for _ in range(5)]
    c = TaskSource(DEFAULT_TASKS, seed=4)
    c.skip(a.cursors)
    assert c.draw() == a.draw()
    for t in first:
        assert score_completion(t.dataset, f"= {t.answer}", t.as_entry()) == 1.0
        assert render_messages(t.question)[-1] == {"role": "user", "content": t.question}


def test_task_spec_rejects_unknown_dataset():
    with pytest.raises(ValueError, match="unknown ReasoningGYM dataset"):
        TaskSpec(dataset="no_such_task")
    with pytest.raises(ValueError, match="bad config"):
        TaskSource([TaskSpec(dataset="chain_sum", config={"min_digits": 5, "max_digits": 1})])


def test_base_model_completion_ending_at_the_plain_stop_string():
    # Gemma-3-270M (a base model) on a plain prompt: answers, then starts the next question;
    # the sampler keeps the stop string, the last number is still the answer
    from ftis.tasks import PLAIN_STOP_STRINGS

    text = " 3 + 4 = 7" + PLAIN_STOP_STRINGS[0]
    assert extract_answer(text, "7") == "7"
    assert score_completion("chain_sum", text, {"question": "3 + 4 =", "answer": "7",
                                                "metadata": {}}) == 1.0
    assert extract_answer(" The answer is 12.\nQuestion:", "12") == "12"
