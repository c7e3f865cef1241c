"""Random access to the task mix by task number (shared draw counter across workers)."""

from __future__ import annotations

import pytest

from ftis.tasks import HeldoutSplit, TaskSource
from ftis.tasks.source import TaskSpec

MIX = [TaskSpec(dataset="chain_sum", weight=3.0), TaskSpec(dataset="products", weight=1.0)]


def test_task_numbers_are_deterministic_and_order_free():
    a = TaskSource(MIX, seed=5, split=HeldoutSplit(0.4))
    b = TaskSource(MIX, seed=5, split=HeldoutSplit(0.4))
    forward = [a.at(n) for n in range(40)]
    backward = [b.at(n) for n in reversed(range(40))][::-1]  # another process, other order
    assert forward == backward


def test_task_numbers_follow_the_weights_and_stay_in_the_train_part():
    split = HeldoutSplit(0.4)
    src = TaskSource(MIX, seed=0, split=split)
    drawn = [src.at(n) for n in range(400)]
    share = sum(k == 0 for k, _ in drawn) / len(drawn)
    assert 0.68 < share < 0.82  # weight 3:1 -> 0.75
    assert all(split.part(e.dataset, e.question, e.metadata) == "train" for _, e in drawn)
    assert all(e.dataset == MIX[k].dataset for k, e in drawn)


def test_without_a_split_number_n_is_entry_n_of_its_dataset():
    src = TaskSource([MIX[0]], seed=2, size=50)
    assert [src.at(n)[1].index for n in (0, 1, 7, 49, 50, 51)] == [0, 1, 7, 49, 0, 1]
    with pytest.raises(ValueError, match="< 0"):
        src.at(-1)


MIX3 = [TaskSpec(dataset="chain_sum", weight=3.0), TaskSpec(dataset="products", weight=1.0),
        TaskSpec(dataset="gcd", weight=1.0)]


def test_a_sub_mix_draws_only_its_datasets_by_their_weights_and_keeps_the_split():
    split = HeldoutSplit(0.4)
    src = TaskSource(MIX3, seed=0, split=split)
    drawn = [src.at(n, among=[0, 2]) for n in range(400)]
    assert {k for k, _ in drawn} == {0, 2}
    share = sum(k == 0 for k, _ in drawn) / len(drawn)
    assert 0.68 < share < 0.82  # weights 3:1 within the branch -> 0.75
    assert all(split.part(e.dataset, e.question, e.metadata) == "train" for _, e in drawn)
    # the entry is the number-th of its dataset, as for the whole mix: a number drawn
    # for a branch gives the same entry as the whole mix would if it picked that dataset
    whole = [src.at(n) for n in range(400)]
    same_k = [(a, b) for a, b in zip(drawn, whole, strict=True) if a[0] == b[0]]
    assert same_k and all(a == b for a, b in same_k)
    # distinct numbers, distinct tasks (no wrapping in 400 numbers)
    assert len({(k, e.index) for k, e in drawn}) == 400
    # the whole mix as a sub-mix is the whole mix
    assert [src.at(n, among=[0, 1, 2]) for n in range(50)] == whole[:50]


def test_a_sub_mix_must_name_positions_of_the_mix():
    src = TaskSource(MIX3, seed=0)
    for bad in ([], [3], [-1]):
        with pytest.raises(ValueError, match="sub-mix"):
            src.at(0, among=bad)
