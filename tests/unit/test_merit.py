"""MERIT's split and merge (lab/ftis/lab/merit), against hand-computed values."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ftis.lab.merit.merge import full_delta, lora_delta, merge_deltas, token_weights
from ftis.lab.merit.split import (
    conflict_aware_split,
    conflict_matrix,
    median_split,
    principal_scores,
    random_split,
)


def test_conflict_matrix_by_hand() -> None:
    g = torch.tensor([[2.0, 0.0], [0.0, 1.0], [-3.0, 0.0]])
    expected = torch.tensor([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0], [-1.0, 0.0, 1.0]],
                            dtype=torch.float64)
    assert torch.allclose(conflict_matrix(g), expected)
    with pytest.raises(ValueError, match="zero gradient"):
        conflict_matrix(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError):
        conflict_matrix(torch.ones(1, 3))


def test_principal_scores_by_hand() -> None:
    # centred rows: [1, -1/3, -1], [0, 2/3, 0], [-1, -1/3, 1]; the first principal
    # direction is [1, 0, -1] / sqrt(2) (variance 4/3 along it, 2/9 across), with its
    # largest loading made positive: scores sqrt(2), 0, -sqrt(2)
    c = torch.tensor([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0], [-1.0, 0.0, 1.0]])
    s = principal_scores(c)
    assert torch.allclose(s, torch.tensor([math.sqrt(2), 0.0, -math.sqrt(2)],
                                          dtype=torch.float64), atol=1e-9)
    assert torch.equal(principal_scores(torch.ones(3, 3)), torch.zeros(3, dtype=torch.float64))


def test_median_split_by_hand() -> None:
    # score order 2, 1, 0; half of 3 tokens is 1.5: the low side stops before 1.5
    assert median_split([1.4, 0.0, -1.4], [1, 1, 1]) == ([2], [1, 0])
    # weights decide, not counts: family 2 alone carries half of the tokens
    assert median_split([1.4, 0.0, -1.4], [1, 1, 2]) == ([2], [1, 0])
    assert median_split([0.0, 1.0, 2.0, 3.0], [1, 1, 1, 1]) == ([0, 1], [2, 3])
    # the first item always goes low, and the high side always keeps one
    assert median_split([0.0, 1.0], [10, 1]) == ([0], [1])
    assert median_split([0.0, 1.0], [1, 10]) == ([0], [1])
    assert median_split([5.0], [3]) == ([0], [])
    with pytest.raises(ValueError):
        median_split([0.0], [0])


def test_conflict_aware_split_separates_conflicting_pairs() -> None:
    # families 0, 1 pull one way, 2, 3 the other
    g = torch.tensor([[1.0, 0.1, 0.0], [1.0, -0.1, 0.0], [-1.0, 0.0, 0.1],
                      [-1.0, 0.0, -0.1]])
    assert sorted(conflict_aware_split(g, [1, 1, 1, 1], 1)) == [[0, 1], [2, 3]]
    two = conflict_aware_split(g, [1, 1, 1, 1], 2)
    assert sorted(two) == [[0], [1], [2], [3]]
    assert conflict_aware_split(g, [1, 1, 1, 1], 0) == [[0, 1, 2, 3]]
    # a single family is not split further: 3 levels still give 4 branches
    assert len(conflict_aware_split(g, [1, 1, 1, 1], 3)) == 4


def test_random_split_is_a_partition_of_the_same_shape() -> None:
    rng = random.Random(0)
    for _ in range(20):
        branches = random_split(6, [1] * 6, 2, rng)
        assert sorted(i for b in branches for i in b) == list(range(6))
        assert sorted(len(b) for b in branches) == [1, 1, 2, 2]


def test_merge_by_hand() -> None:
    base = {"w": torch.tensor([1.0, 2.0])}
    deltas = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 2.0])}]
    assert token_weights([100, 300]) == [0.25, 0.75]
    merged = merge_deltas(base, deltas, token_weights([100, 300]))
    assert torch.allclose(merged["w"], torch.tensor([1.25, 3.5]))
    assert merged["w"].dtype == torch.float32
    # a full fine-tune's merge equals the weighted average of the branch weights
    trained = [{"w": torch.tensor([2.0, 2.0])}, {"w": torch.tensor([1.0, 4.0])}]
    via_deltas = merge_deltas(base, [full_delta(base, t) for t in trained], [0.25, 0.75])
    assert torch.allclose(via_deltas["w"], 0.25 * trained[0]["w"] + 0.75 * trained[1]["w"])
    with pytest.raises(ValueError):
        merge_deltas(base, [{"v": torch.zeros(2)}], [1.0])
    with pytest.raises(ValueError):
        token_weights([1, 0])


def test_lora_deltas_are_averaged_not_their_factors() -> None:
    a = torch.tensor([[1.0, 2.0]])          # r = 1, in = 2
    b = torch.tensor([[3.0], [4.0]])        # out = 2
    assert torch.allclose(lora_delta(a, b, 0.5),
                          torch.tensor([[1.5, 3.0], [2.0, 4.0]], dtype=torch.float64))
    # two branches with different A: the average of the deltas is not the product of
    # the averaged factors (that one holds the untrained cross terms B1 A2 and B2 A1)
    a2, b2 = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0], [0.0]])
    deltas = (lora_delta(a, b, 1.0) + lora_delta(a2, b2, 1.0)) / 2
    factors = lora_delta((a + a2) / 2, (b + b2) / 2, 1.0)
    assert torch.allclose(deltas, torch.tensor([[1.5, 3.5], [2.0, 4.0]], dtype=torch.float64))
    assert not torch.allclose(deltas, factors)
    with pytest.raises(ValueError):
        lora_delta(a, torch.ones(2, 2), 1.0)


def _learner(policy):  # noqa: ANN001, ANN202
    from ftis.client.learner.trainer import Learner, LearnerConfig

    return Learner(policy.model, LearnerConfig(), pad_token_id=0)


def test_policy_gradient_is_the_step_direction_without_the_step(tiny_policy_factory) -> None:
    from ftis.client.rollout.groups import RolloutGroup

    policy = tiny_policy_factory()
    learner = _learner(policy)
    before = [p.detach().clone() for p in learner.params]
    varied = RolloutGroup(prompt_ids=[5, 6, 7], completions=[[8, 9], [10, 11, 12]],
                          gen_logprobs=[[-1.0, -2.0], [-1.5, -0.5, -2.5]],
                          rewards=[1.0, 0.0], local=True)
    flat = learner.policy_gradient([varied])
    assert flat.shape == (sum(p.numel() for p in learner.params),)
    assert bool(torch.isfinite(flat).all()) and float(flat.norm()) > 0
    # nothing moved, and no gradient is left behind
    assert all(torch.equal(a, p) for a, p in zip(before, learner.params, strict=True))
    assert all(p.grad is None for p in learner.params)
    # equal rewards: no advantage, no gradient
    flat_rewards = RolloutGroup(prompt_ids=[5, 6, 7], completions=[[8, 9], [10, 11, 12]],
                                gen_logprobs=[[-1.0, -2.0], [-1.5, -0.5, -2.5]],
                                rewards=[1.0, 1.0], local=True)
    assert float(learner.policy_gradient([flat_rewards]).norm()) == 0.0
    # the same groups give the same gradient (deterministic, no state carried over)
    assert torch.equal(learner.policy_gradient([varied]), flat)


def test_family_gradients_on_a_tiny_model(tiny_policy_factory) -> None:
    from ftis.client.rollout.sampler import SamplingSettings
    from ftis.lab.merit.gradients import family_gradients
    from ftis.tasks import TaskSpec

    policy = tiny_policy_factory()
    families = [TaskSpec(dataset="letter_counting"), TaskSpec(dataset="chain_sum")]
    out = family_gradients(policy, _learner(policy), families, groups=2, group_size=4,
                           sampling=SamplingSettings(temperature=1.0, max_new_tokens=6))
    assert [f.dataset for f in out] == ["letter_counting", "chain_sum"]
    for f in out:
        assert f.gradient.shape == (sum(p.numel() for p in policy.model.parameters()
                                        if p.requires_grad),)
        assert 0 < f.tokens <= 2 * 4 * 6 and 0.0 <= f.mean_reward <= 1.0
        # a gradient exactly where some group had reward variance
        assert (float(f.gradient.norm()) > 0) == (f.informative_groups > 0)
