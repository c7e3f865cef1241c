"""The demo's conclusion from eval.jsonl records, against hand-computed values."""

import pytest

from ftis.lab.experiment.demo_report import (
    client_comparison,
    demo_conclusion,
    first_and_last_eval,
    moving_average,
)


def _eval(round_, greedy, sampled):
    return {"round": round_, "per_prompt": {"heldout": {"greedy": greedy, "sampled": sampled}}}


def test_moving_average_hand_computed():
    assert moving_average([0, 1, 0, 1], 2) == [0.0, 0.5, 0.5, 0.5]
    assert moving_average([3, 6, 9], 5) == [3.0, 4.5, 6.0]
    with pytest.raises(ValueError):
        moving_average([1], 0)


def test_first_and_last_eval_needs_both_ends():
    with pytest.raises(ValueError):
        first_and_last_eval([_eval(5, [1.0], [])])
    with pytest.raises(ValueError):
        first_and_last_eval([_eval(0, [1.0], [])])
    b, a = first_and_last_eval([_eval(10, [0.0], []), _eval(0, [1.0], []), _eval(4, [1.0], [])])
    assert (b["round"], a["round"]) == (0, 10)


def test_client_comparison_and_conclusion():
    # 10 prompts: greedy 8 gained, 1 lost -> McNemar p = 2 * (1 + 9) / 2**9
    greedy_b = [0.0] * 8 + [1.0, 1.0]
    greedy_a = [1.0] * 8 + [0.0, 1.0]
    # sampled: every prompt +0.25 -> the exact sign-flip p is 2 / 2**10
    sampled_b = [0.25] * 10
    sampled_a = [0.5] * 10
    c = client_comparison([_eval(0, greedy_b, sampled_b), _eval(30, greedy_a, sampled_a)])
    assert c["rounds"] == [0, 30]
    assert (c["greedy"]["gained"], c["greedy"]["lost"]) == (8, 1)
    assert c["greedy"]["p_value"] == pytest.approx(20 / 512)
    assert c["greedy"]["before"] == pytest.approx(0.2)
    assert c["greedy"]["after"] == pytest.approx(0.9)
    assert c["sampled"]["diff"] == pytest.approx(0.25)
    assert c["sampled"]["p_value"] == pytest.approx(2 / 2**10)
    assert c["sampled"]["ci_low"] == pytest.approx(0.25)
    concl = demo_conclusion({"full": c}, "full", 4, 0.7)
    assert concl["n_prompts"] == 10 and concl["significant"] is True
    assert concl["before"] == pytest.approx(0.25) and concl["after"] == pytest.approx(0.5)
    # a significant *drop* is not an improvement
    worse = client_comparison([_eval(0, greedy_a, sampled_a), _eval(30, greedy_b, sampled_b)])
    assert demo_conclusion({"full": worse}, "full", 4, 0.7)["significant"] is False


def test_client_comparison_refuses_different_prompt_sets():
    with pytest.raises(ValueError):
        client_comparison([_eval(0, [1.0, 0.0], []), _eval(3, [1.0], [])])
