"""Learner step: micro-batching is exact, the gradient is the weighted log-likelihood one."""

import copy

import pytest
import torch

from ftis.client.learner.batch import RolloutGroup, pack
from ftis.client.learner.loss import LossConfig, group_advantages
from ftis.client.learner.trainer import Learner, LearnerConfig, groups_to_samples


def _groups():
    local = RolloutGroup([1, 5, 6], [[7, 8, 2], [9, 2], [10, 11, 12, 2]],
                         [[-1.0, -2.0, -0.5], [-3.0, -0.1], [-1.0, -1.0, -1.0, -1.0]],
                         [1.0, 0.0, 0.0], local=True)
    external = RolloutGroup([1, 5], [[7, 8, 2, 4], [9, 2]],
                            [[-5.0, -6.0, -5.5, -5.0], [-5.0, -5.1]], [0.0, 1.0], local=False)
    flat = RolloutGroup([1, 6], [[7, 2], [8, 2]], [[-1.0, -1.0], [-1.0, -1.0]], [1.0, 1.0],
                        local=True)
    return [local, external, flat]


def _grads_after_backward(policy, groups, micro_batch_size, method="tis"):
    model = copy.deepcopy(policy.model)
    config = LearnerConfig(loss=LossConfig(method=method), learning_rate=0.0,
                           max_grad_norm=1e9, micro_batch_size=micro_batch_size)
    learner = Learner(model, config, 0)
    # reproduce step() up to backward without the optimizer touching the weights
    learner.optimizer.step = lambda: None  # type: ignore[method-assign]
    grads = {}
    orig = learner.optimizer.zero_grad
    def capture(set_to_none=True):
        for n, p in model.named_parameters():
            if p.grad is not None:
                grads[n] = p.grad.clone()
        orig(set_to_none=set_to_none)
    learner.optimizer.zero_grad = capture  # type: ignore[method-assign]
    metrics = learner.step(groups)
    return metrics, grads


def _unpadded_logprobs(model, sample):
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    logits = model(input_ids=ids).logits[0, len(sample.prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(
        -1, torch.tensor(sample.completion_ids)[:, None])[:, 0]


def test_packing_aligns_completions_and_matches_unpadded_forward(tiny_policy_factory):
    pol = tiny_policy_factory()
    samples = groups_to_samples(_groups()[:2], scale_by_std=True)
    batch = pack(samples, 0)
    assert batch.targets.shape == batch.completion_mask.shape == (5, 4)
    assert batch.logits_to_keep == 5
    assert batch.completion_mask.sum(-1).tolist() == [3, 2, 4, 4, 2]
    assert batch.targets[1, :2].tolist() == [9, 2] and batch.gen_logprobs[1, 2] == 0.0
    with torch.no_grad():
        lp = Learner(pol.model, LearnerConfig(), 0)._forward_logprobs(batch)
        for i, s in enumerate(samples):
            n = len(s.completion_ids)
            torch.testing.assert_close(lp[i, :n], _unpadded_logprobs(pol.model, s),
                                       atol=1e-5, rtol=0)


def test_micro_batching_does_not_change_loss_or_gradient(tiny_policy_factory):
    pol = tiny_policy_factory()
    m1, g1 = _grads_after_backward(pol, _groups(), micro_batch_size=1)
    m8, g8 = _grads_after_backward(pol, _groups(), micro_batch_size=8)
    assert m1["loss"] == pytest.approx(m8["loss"], rel=1e-5)
    assert g1.keys() == g8.keys() and g1
    for n in g1:
        torch.testing.assert_close(g1[n], g8[n], atol=1e-6, rtol=1e-4)


def test_zero_variance_groups_dropped_and_on_policy_ignores_external(tiny_policy_factory):
    samples = groups_to_samples(_groups(), scale_by_std=True)
    assert len(samples) == 5  # 3 local + 2 external; the all-equal group adds nothing
    pol = tiny_policy_factory()
    m, _ = _grads_after_backward(pol, _groups(), 8, method="on_policy")
    assert m["groups_external"] == 0 and m["samples"] == 3


def test_gradient_equals_weighted_log_likelihood_gradient(tiny_policy_factory):
    """With one update per batch (rho = 1, no clipping) the loss gradient must equal the
    gradient of  -(1/N) sum_i sum_t w_it * A_i * log pi(a_it)  (token aggregation)."""
    pol = tiny_policy_factory()
    groups = _groups()[:2]
    metrics, grads = _grads_after_backward(pol, groups, 8, method="tis")

    model = copy.deepcopy(pol.model)
    samples = groups_to_samples(groups, scale_by_std=True)
    # closed form, one unpadded sequence at a time (no batching, no padding, no masks)
    objective, n_tokens = 0.0, sum(len(s.completion_ids) for s in samples)
    for s in samples:
        lp = _unpadded_logprobs(model, s)
        w = torch.exp(lp.detach() - torch.tensor(s.gen_logprobs)).clamp(max=2.0)  # TIS, C = 2
        objective = objective - (w * s.advantage * lp).sum() / n_tokens
    objective.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-4)
    # advantages are the hand-checkable GRPO ones: [1,0,0] -> [sqrt2, -1/sqrt2, -1/sqrt2]
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0]]), eps=0.0)[0]
    torch.testing.assert_close(adv, torch.tensor([2**0.5, -(0.5**0.5), -(0.5**0.5)]))


def test_step_updates_weights_and_reports(tiny_policy_factory):
    pol = tiny_policy_factory("lora")
    before = {n: p.detach().clone() for n, p in pol.model.named_parameters() if p.requires_grad}
    learner = Learner(pol.model, LearnerConfig(learning_rate=1e-2), 0)
    m = learner.step(_groups())
    assert m["updated"] == 1.0 and learner.updates == 1
    assert m["external_samples_counted"] == 2 and 0 < m["is_weight_max"] <= 2.0
    changed = [n for n, p in pol.model.named_parameters()
               if p.requires_grad and not torch.equal(p, before[n])]
    assert changed
    frozen = [p for n, p in pol.model.named_parameters() if "lora_" not in n]
    assert all(not p.requires_grad for p in frozen)


def test_sender_statistics_for_receiver_feedback(tiny_policy_factory):
    pol = tiny_policy_factory()
    groups = _groups()
    groups[1].sender = "peer"
    learner = Learner(copy.deepcopy(pol.model), LearnerConfig(learning_rate=0.0), 0)
    learner.step(groups)
    (st,) = learner.sender_stats.values()
    assert list(learner.sender_stats) == ["peer"]
    assert st.completions == 2 and st.tokens == 6
    # recompute lp_learner - lp_gen for the external group by hand
    samples = [s for s in groups_to_samples(groups, True) if not s.local]
    with torch.no_grad():
        expected = sum((_unpadded_logprobs(learner.model, s) - torch.tensor(s.gen_logprobs)).sum()
                       for s in samples) / 6
    assert st.mean_log_ratio == pytest.approx(float(expected), abs=1e-4)
    # generator log-probs of -5 per token vs a ~uniform tiny model (-log 300 = -5.7): no cap
    assert st.truncated_tokens == 0 and st.filtered == 0
