"""Held-out split disjoint by operands, and the exact-match reward."""

import pytest

from ftis.tasks import HeldoutSplit, TaskEntry, TaskSource, TaskSpec, operand_key
from ftis.tasks.scoring import exact_match, score_completion

ONE_DIGIT = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
MIX = [TaskSpec(dataset="products", config=ONE_DIGIT, reward="exact"),
       TaskSpec(dataset="chain_sum", config=ONE_DIGIT, reward="exact")]


def test_operand_key_ignores_order_and_wording():
    assert operand_key("products", "Solve: 3 * 4. Give only the result.") == "products:3,4"
    assert operand_key("products", "x", {"expression": "4 * 3"}) == "products:3,4"
    assert operand_key("products", "x", {"expression": "7 * -9"}) == "products:-9,7"
    assert operand_key("chain_sum", "8 - 0 =") == "chain_sum:0,8"
    assert operand_key("letter_counting", "How many r?") == "letter_counting:q:How many r?"


def test_split_fraction_bounds_and_determinism():
    with pytest.raises(ValueError):
        HeldoutSplit(1.0)
    with pytest.raises(ValueError):
        HeldoutSplit(-0.1)
    s = HeldoutSplit(0.4)
    keys = [f"products:{a},{b}" for a in range(10) for b in range(a, 10)]
    parts = [s.part_of_key(k) for k in keys]
    assert parts == [HeldoutSplit(0.4).part_of_key(k) for k in keys]
    share = parts.count("heldout") / len(parts)
    assert 0.2 < share < 0.6  # 55 keys, expected 0.4
    assert all(HeldoutSplit(0.0).part_of_key(k) == "train" for k in keys)
    assert [HeldoutSplit(0.4, salt="x").part_of_key(k) for k in keys] != parts


def test_train_and_heldout_sources_share_no_operands():
    split = HeldoutSplit(0.4)
    held = TaskSource(MIX, seed=10_007, split=split, part="heldout").distinct(500)
    train = TaskSource(MIX, seed=3, split=split, part="train").distinct(500)
    held_keys = {operand_key(e.dataset, e.question, e.metadata) for e in held}
    train_keys = {operand_key(e.dataset, e.question, e.metadata) for e in train}
    assert not held_keys & train_keys
    # 1-digit products (100 prompts) + chain_sum (+/-, 200 prompts) = 300 in all
    assert len(held) + len(train) == 300
    assert len(held) >= 100
    assert len({e.question for e in held}) == len(held)
    assert all(e.reward == "exact" for e in held + train)


def test_skip_with_split_resumes_after_issued_entries():
    split = HeldoutSplit(0.4)
    a = TaskSource(MIX[:1], seed=1, split=split)
    first = [a.draw() for _ in range(7)]
    b = TaskSource(MIX[:1], seed=1, split=split)
    b.skip([5])
    assert b.draw() == first[5]


def test_exact_reward_has_no_partial_credit():
    entry = TaskEntry("products", 0, "Solve the following multiplication: 1 * 5.", "5",
                      {"expression": "1 * 5"}, reward="exact")
    gym = TaskEntry("products", 0, entry.question, "5", entry.metadata)
    assert gym.score("The answer is 15.") == 0.5  # ReasoningGYM's partial credit
    assert gym.score("The answer is -5.") == 0.5
    assert entry.score("The answer is 15.") == 0.0
    assert entry.score("The answer is -5.") == 0.0
    assert entry.score("The answer is 5.") == 1.0
    assert entry.score("<answer>5.0</answer>") == 1.0
    assert exact_match("1,234", "1234") and not exact_match(None, "3")
    assert exact_match(" True ", "true")
    with pytest.raises(ValueError):
        score_completion("products", "5", entry.as_entry(), reward="fuzzy")


def test_entry_json_round_trip_keeps_reward():
    e = TaskEntry("chain_sum", 3, "2 + 5 =", "7", {}, reward="exact")
    back = TaskEntry.from_json(e.to_json())
    assert back == e
    legacy = '{"dataset": "chain_sum", "index": 1, "question": "q", "answer": "7", "metadata": {}}'
    assert TaskEntry.from_json(legacy).reward == "gym"


def test_task_spec_rejects_unknown_reward():
    with pytest.raises(ValueError):
        TaskSpec(dataset="products", reward="partial")
