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


def test_merge_command_averages_two_trained_branches_by_tokens(tiny_model_dir, tmp_path) -> None:
    """Two full fine-tune branches (checkpoints of one step each, as ftis-client writes
    them) merged 1 : 3 by tokens: every merged weight is W0 + 0.25 d1 + 0.75 d2."""
    from typer.testing import CliRunner

    from ftis.client.learner.checkpoint import save_checkpoint
    from ftis.client.models.loader import load_policy
    from ftis.lab.cli.main import app

    base = load_policy(str(tiny_model_dir))
    w0 = {k: v.detach().clone() for k, v in base.model.state_dict().items()}
    trained = []
    for i, scale in enumerate((1e-2, -2e-2)):
        policy = load_policy(str(tiny_model_dir))
        learner = _learner(policy)
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(scale)
        save_checkpoint(tmp_path / f"b{i}" / "checkpoints", 1, policy.model, learner.optimizer,
                        {})
        trained.append({k: v.detach().clone() for k, v in policy.model.state_dict().items()})
    result = CliRunner().invoke(app, [
        "merit", "merge", "--base", str(tiny_model_dir), "--peft", "none",
        "--branch", f"{tmp_path / 'b0'}:100", "--branch", f"{tmp_path / 'b1'}:300",
        "--out", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    merged = load_policy(str(tmp_path / "merged")).model.state_dict()
    name = next(k for k in w0 if k.endswith("q_proj.weight"))
    expected = (w0[name] + 0.25 * (trained[0][name] - w0[name])
                + 0.75 * (trained[1][name] - w0[name]))
    assert torch.allclose(merged[name], expected, atol=1e-6)
    # 0.25 * 1e-2 + 0.75 * -2e-2 = -0.0125 on every trainable weight
    assert torch.allclose(merged[name] - w0[name], torch.full_like(w0[name], -0.0125), atol=1e-6)
    # a branch without a checkpoint is a usage error, not a traceback
    bad = CliRunner().invoke(app, ["merit", "merge", "--base", str(tiny_model_dir),
                                   "--peft", "none", "--branch", f"{tmp_path}:1",
                                   "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "no checkpoint" in bad.output


def test_plan_refuses_families_without_gradient(tiny_model_dir) -> None:
    from ftis.lab.merit.run import MeritError, plan

    # a tiny random model never solves 2-digit products: no reward variance
    with pytest.raises(MeritError, match="no reward variance"):
        plan(str(tiny_model_dir), ["products", "chain_sum"], peft="lora", groups=1,
             group_size=2, max_new_tokens=4)


def test_merge_of_lora_branches_is_the_token_weighted_sum_of_their_deltas(
        tiny_model_dir, tmp_path) -> None:
    from ftis.client.learner.checkpoint import save_checkpoint
    from ftis.client.models.loader import load_policy
    from ftis.lab.merit.run import Branch, merge

    w0 = load_policy(str(tiny_model_dir)).model.state_dict()
    deltas = []
    for i, value in enumerate((0.01, 0.03)):
        policy = load_policy(str(tiny_model_dir), peft="lora")
        learner = _learner(policy)
        (a_name, a), = [(n, p) for n, p in policy.model.named_parameters()
                        if "layers.0.self_attn.q_proj.lora_A" in n]
        (b,) = [p for n, p in policy.model.named_parameters()
                if "layers.0.self_attn.q_proj.lora_B" in n]
        with torch.no_grad():
            b.fill_(value)  # B starts at 0: give each branch its own delta
        module = policy.model.get_submodule(a_name.rsplit(".lora_A", 1)[0])
        deltas.append(lora_delta(a.detach(), b.detach(), module.scaling["default"]))
        save_checkpoint(tmp_path / f"b{i}" / "checkpoints", 1, policy.model,
                        learner.optimizer, {})
    record = merge(str(tiny_model_dir), [Branch(tmp_path / "b0", 100.0),
                                         Branch(tmp_path / "b1", 300.0)],
                   tmp_path / "merged", peft="lora")
    assert record["weights"] == [0.25, 0.75]
    merged = load_policy(str(tmp_path / "merged")).model.state_dict()
    name = next(k for k in w0 if k.endswith("layers.0.self_attn.q_proj.weight"))
    expected = w0[name].double() + 0.25 * deltas[0] + 0.75 * deltas[1]
    assert torch.allclose(merged[name].double(), expected, atol=1e-6)
    other = next(k for k in w0 if k.endswith("layers.0.self_attn.k_proj.weight"))
    assert torch.allclose(merged[other], w0[other])  # untouched adapters: no change


def test_plan_command_reads_task_specs_and_refuses_bad_ones(tiny_model_dir, tmp_path) -> None:
    from typer.testing import CliRunner

    from ftis.lab.cli.main import app

    bad = tmp_path / "families.json"
    bad.write_text('[{"dataset": "products", "config": {"min_digits": "many"}}]')
    result = CliRunner().invoke(app, ["merit", "plan", "--model", str(tiny_model_dir),
                                      "--families", str(bad), "--groups", "1",
                                      "--group-size", "2", "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "merit plan:" in result.output
    assert not (tmp_path / "p.json").exists()
