"""Unit tests for ftis.client.learner.loss against hand-computed values.

Constants used below (computed by hand, 10 digits):
    e        = exp(1)    = 2.7182818285     1/e = exp(-1) = 0.3678794412
    exp(0.5) = 1.6487212707                 exp(-0.5)     = 0.6065306597
    ln 2 = 0.6931471806, ln 3 = 1.0986122887, ln 1.5 = 0.4054651081, ln 0.9 = -0.1053605157
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys
from pathlib import Path

import pydantic
import pytest
import torch
from torch.testing import assert_close

try:
    loss_mod = importlib.import_module("ftis.client.learner.loss")
except ModuleNotFoundError:  # not installed: import from the source tree (PEP 420 namespace)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "client"))
    loss_mod = importlib.import_module("ftis.client.learner.loss")

DIVERGENCES = loss_mod.DIVERGENCES
PER_TOKEN_DIVERGENCES = loss_mod.PER_TOKEN_DIVERGENCES
METHODS = loss_mod.METHODS
LossConfig = loss_mod.LossConfig
LossOutput = loss_mod.LossOutput
Reduction = loss_mod.Reduction
completion_logprobs = loss_mod.completion_logprobs
ftis_filter = loss_mod.ftis_filter
group_advantages = loss_mod.group_advantages
importance_weights = loss_mod.importance_weights
policy_loss = loss_mod.policy_loss
selective_log_softmax = loss_mod.selective_log_softmax
sequence_divergence = loss_mod.sequence_divergence

E = math.e
LN2, LN3 = math.log(2.0), math.log(3.0)


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def scalar(x):
    return torch.tensor(x, dtype=torch.float32)


def run_loss(*args, **kwargs):
    """policy_loss as (loss, {name: value}) for the hand-computed checks below."""
    out = policy_loss(*args, **kwargs)
    assert isinstance(out, LossOutput)
    return out.loss, out.values


# ----------------------------------------------------------------- public constants


def test_public_constants():
    assert METHODS == ("on_policy", "nois", "vis", "tis", "ftis")
    assert DIVERGENCES == ("k1_mean", "k3_mean", "kl_learner_gen", "kl_gen_learner")
    assert PER_TOKEN_DIVERGENCES == ("k1_mean", "k3_mean")
    assert (loss_mod.DEFAULT_DIVERGENCE, loss_mod.DEFAULT_FILTER_THRESHOLD) == ("k1_mean", 1.0)


# ---------------------------------------------------------------------- log-probs


def test_selective_log_softmax_matches_log_softmax_gather():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    index = torch.randint(0, 11, (3, 5), generator=g)
    expected = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    out = selective_log_softmax(logits, index)
    assert out.shape == (3, 5) and out.dtype == torch.float32
    assert_close(out, expected)


def test_selective_log_softmax_hand_example():
    # row 0: logits log[1, 2, 3] -> p = [1/6, 2/6, 3/6]; index 2 -> ln(1/2) = -0.6931471806
    # row 1: logits [0, 0, 0] -> p = 1/3 each; index 0 -> ln(1/3) = -1.0986122887
    logits = t([[[0.0, LN2, LN3], [0.0, 0.0, 0.0]]])
    out = selective_log_softmax(logits, torch.tensor([[2, 0]]))
    assert_close(out, t([[-0.6931471806, -1.0986122887]]))


def test_selective_log_softmax_bf16_returns_float32_and_grad():
    logits = t([[[0.0, LN2, LN3]]]).to(torch.bfloat16).requires_grad_()
    out = selective_log_softmax(logits, torch.tensor([[2]]))
    assert out.dtype == torch.float32
    # bf16 rounds ln2/ln3 slightly; ln(1/2) = -0.6931 to ~1e-2
    assert_close(out, t([[-0.6931471806]]), atol=1e-2, rtol=0)
    out.sum().backward()
    # d/dlogits log p_2 = onehot(2) - p = [-1/6, -2/6, 1/2]
    assert_close(logits.grad.float(), t([[[-1 / 6, -2 / 6, 0.5]]]), atol=1e-2, rtol=0)


def test_selective_log_softmax_shape_errors():
    with pytest.raises(ValueError):
        selective_log_softmax(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError):
        selective_log_softmax(torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError):
        selective_log_softmax(torch.zeros(1, 1, 4), torch.tensor([[4]]))


def test_completion_logprobs_temperature_half():
    # logits log[1, 2, 3] / 0.5 = log[1, 4, 9] -> p = [1/14, 4/14, 9/14]
    # index 1 -> ln(4/14) = ln(2/7) = -1.2527629685 ; T = 1 -> ln(2/6) = -1.0986122887
    logits = t([[[0.0, LN2, LN3]]])
    idx = torch.tensor([[1]])
    assert_close(completion_logprobs(logits, idx, 0.5), t([[-1.2527629685]]))
    assert_close(completion_logprobs(logits, idx, 1.0), t([[-1.0986122887]]))
    # does not modify the caller's logits
    assert_close(logits, t([[[0.0, LN2, LN3]]]))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_completion_logprobs_bad_temperature(bad):
    with pytest.raises(ValueError):
        completion_logprobs(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), bad)


# --------------------------------------------------------------------- advantages


def test_group_advantages_1001():
    # mean 0.5, population std 0.5 -> A = +-0.5 / (0.5 + 1e-4) = +-0.9998000400
    out = group_advantages(t([[1.0, 0.0, 0.0, 1.0]]))
    a = 0.9998000400
    assert_close(out, t([[a, -a, -a, a]]))


def test_group_advantages_population_std():
    # [1, 0, 0, 0], eps 0: mean 0.25, pop. std sqrt(0.25 * 0.75) = 0.4330127019
    # A = [0.75, -0.25, -0.25, -0.25] / 0.4330127019 = [sqrt 3, -1/sqrt 3 x3]
    #   = [1.7320508076, -0.5773502692 x3]   (unbiased std would give [1.5, -0.5 x3])
    out = group_advantages(t([[1.0, 0.0, 0.0, 0.0]]), eps=0.0)
    b = -0.5773502692
    assert_close(out, t([[1.7320508076, b, b, b]]))


def test_group_advantages_all_equal_exact_zeros():
    rewards = t([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    out = group_advantages(rewards, eps=0.0)
    assert torch.equal(out[:2], torch.zeros(2, 3))
    assert torch.equal(group_advantages(rewards[:2], scale_by_std=False), torch.zeros(2, 3))


def test_group_advantages_no_std():
    # r - mean: [1,0,0,1] - 0.5 ; [2, 0] - 1
    out = group_advantages(t([[1.0, 0.0, 0.0, 1.0]]), scale_by_std=False)
    assert_close(out, t([[0.5, -0.5, -0.5, 0.5]]))
    assert_close(group_advantages(t([[2.0, 0.0]]), scale_by_std=False), t([[1.0, -1.0]]))


def test_group_advantages_errors():
    with pytest.raises(ValueError):
        group_advantages(t([1.0, 0.0]))
    with pytest.raises(ValueError):
        group_advantages(t([[1.0, float("nan")]]))
    with pytest.raises(ValueError):
        group_advantages(t([[1.0, 0.0]]), eps=-1.0)


# ------------------------------------------------------------- importance weights

# log-ratios lp_old - lp_gen = [0, 1, -0.5, 0.5]
LP_OLD = t([[0.0, 0.0, -1.0, -0.5]])
LP_GEN = t([[0.0, -1.0, -0.5, -1.0]])


@pytest.mark.parametrize(
    "method, expected",
    [
        ("on_policy", [1.0, 1.0, 1.0, 1.0]),
        ("nois", [1.0, 1.0, 1.0, 1.0]),
        # exp([0, 1, -0.5, 0.5])
        ("vis", [1.0, 2.7182818285, 0.6065306597, 1.6487212707]),
        # min(exp(.), 2): e = 2.718 > 2 is truncated to 2.0
        ("tis", [1.0, 2.0, 0.6065306597, 1.6487212707]),
        ("ftis", [1.0, 2.0, 0.6065306597, 1.6487212707]),
    ],
)
def test_importance_weights_methods(method, expected):
    assert_close(importance_weights(LP_OLD, LP_GEN, method, 2.0), t([expected]))


def test_importance_weights_other_truncation_and_detached():
    lp_old = LP_OLD.clone().requires_grad_()
    w = importance_weights(lp_old, LP_GEN, "tis", 1.5)
    # min([1, e, e^-0.5, e^0.5], 1.5) = [1, 1.5, 0.6065306597, 1.5]
    assert_close(w, t([[1.0, 1.5, 0.6065306597, 1.5]]))
    assert not w.requires_grad


def test_importance_weights_no_overflow():
    w = importance_weights(t([[0.0]]), t([[-1000.0]]), "vis")
    assert torch.isfinite(w).all()
    assert_close(w, t([[math.exp(20.0)]]))


def test_importance_weights_errors():
    with pytest.raises(ValueError):
        importance_weights(LP_OLD, LP_GEN, "ppo")
    for bad in (0.0, -2.0):
        with pytest.raises(ValueError):
            importance_weights(LP_OLD, LP_GEN, "tis", bad)
    with pytest.raises(ValueError):
        importance_weights(LP_OLD, LP_GEN[:, :2], "vis")


# --------------------------------------------------------------------- divergence

# row 0 log-ratios [0, 1, -1, (masked) 5]; row 1 fully masked
DIV_OLD = t([[0.0, 0.0, -1.0, 0.0], [3.0, 3.0, 3.0, 3.0]])
DIV_GEN = t([[0.0, -1.0, 0.0, -5.0], [0.0, 0.0, 0.0, 0.0]])
DIV_MASK = torch.tensor([[True, True, True, False], [False, False, False, False]])


def test_divergence_kl_learner_gen_hand():
    # r log r - r + 1: r=1 -> 0 ; r=e -> e - e + 1 = 1 ; r=1/e -> -1/e - 1/e + 1 = 0.2642411177
    # sum = 1.2642411177 ; masked row -> 0
    d = sequence_divergence(DIV_OLD, DIV_GEN, DIV_MASK, "kl_learner_gen")
    assert_close(d, t([1.2642411177, 0.0]))


def test_divergence_kl_gen_learner_hand():
    # k3 = (r - 1) - log r: r=1 -> 0 ; r=e -> e - 2 = 0.7182818285 ; r=1/e -> 1/e = 0.3678794412
    # sum = 1.0861612696
    d = sequence_divergence(DIV_OLD, DIV_GEN, DIV_MASK.float(), "kl_gen_learner")
    assert_close(d, t([1.0861612696, 0.0]))


def test_divergence_k1_mean_hand():
    # row 0 log r = [0, 1, -1] -> k1 = -log r = [0, -1, 1], mean 0 over 3 tokens
    # row 1 fully masked -> 0
    d = sequence_divergence(DIV_OLD, DIV_GEN, DIV_MASK, "k1_mean")
    assert_close(d, t([0.0, 0.0]))
    # log r = [-2, -1] (learner finds the tokens e^2 and e times less likely): mean 1.5;
    # log r = [0.5, 1]: mean -0.75 (negative: the learner prefers them)
    d = sequence_divergence(t([[-2.0, -1.0], [0.5, 1.0]]), torch.zeros(2, 2), torch.ones(2, 2))
    assert_close(d, t([1.5, -0.75]))


def test_divergence_k3_mean_hand():
    # k3 = (r - 1) - log r: r=1 -> 0 ; r=e -> e - 2 = 0.7182818285 ; r=1/e -> 1/e = 0.3678794412
    # mean over 3 tokens = 1.0861612696 / 3 = 0.3620537565
    d = sequence_divergence(DIV_OLD, DIV_GEN, DIV_MASK, "k3_mean")
    assert_close(d, t([0.3620537565, 0.0]))
    # log r = -30 on one token: k3 = e^-30 - 1 + 30 = 29.0000000000 (not clamped at 20)
    assert_close(sequence_divergence(t([[-30.0]]), t([[0.0]]), t([[1.0]]), "k3_mean"),
                 t([29.0]))


def test_divergence_masked_tokens_ignored_and_nonnegative():
    gen = DIV_GEN.clone()
    gen[0, 3] = float("nan")
    gen[1] = -float("inf")
    for est in DIVERGENCES:
        assert_close(
            sequence_divergence(DIV_OLD, gen, DIV_MASK, est),
            sequence_divergence(DIV_OLD, DIV_GEN, DIV_MASK, est),
        )
        g = torch.Generator().manual_seed(1)
        a, b = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
        d = sequence_divergence(a, b, torch.ones(4, 7), est)
        if est != "k1_mean":  # a k1 sample is negative where the learner prefers the token
            assert (d >= 0).all()
        for far in (-500.0, 500.0):
            huge = sequence_divergence(t([[0.0]]), t([[far]]), t([[1.0]]), est)
            assert torch.isfinite(huge).all()


# ------------------------------------------------------------ gate: length and direction

# every token: lp_old - lp_gen = log r; B = 505 completions of lengths 8, 9, ..., 512
LENGTHS = list(range(8, 513))


def _uniform_log_ratio_batch(log_r: float, advantage: float):
    n = len(LENGTHS)
    mask = torch.arange(512).unsqueeze(0) < t(LENGTHS).unsqueeze(1)
    old = torch.full((n, 512), log_r)
    gen = torch.zeros(n, 512)
    return old.clone(), old, gen, torch.full((n,), advantage), mask


def test_default_gate_filters_log_r_minus_3_at_every_length():
    # k1 mean = -log r = 3 nats/token >= delta = 1 at every length -> all filtered
    theta, old, gen, adv, mask = _uniform_log_ratio_batch(-3.0, -1.0)
    out = policy_loss(theta, old, gen, adv, mask, LossConfig())
    assert out.per_completion.filtered.all()
    assert_close(out.per_completion.k1_mean, torch.full((len(LENGTHS),), 3.0))
    assert_close(out.per_completion.gate, out.per_completion.k1_mean)
    assert_close(out.stats["filtered_frac"].value, scalar(1.0))
    assert_close(out.loss, scalar(0.0))
    # k3 mean = e^-3 - 1 + 3 = 2.0497870684 >= 1: also filtered at every length
    out = policy_loss(theta, old, gen, adv, mask, LossConfig(divergence="k3_mean"))
    assert out.per_completion.filtered.all()
    assert_close(out.per_completion.gate, torch.full((len(LENGTHS),), 2.0497870684))
    # the legacy summed D = n (1 - 4 e^-3) = 0.8008517265 n is length-dependent: with
    # g = 50 it keeps every completion shorter than 50 / 0.8008517265 = 62.43 tokens
    cfg = LossConfig(divergence="kl_learner_gen", filter_threshold=50.0)
    out = policy_loss(theta, old, gen, adv, mask, cfg)
    kept = [n for n, f in zip(LENGTHS, out.per_completion.filtered.tolist(), strict=True)
            if not f]
    assert kept == list(range(8, 63))
    assert_close(out.per_completion.divergence[0], scalar(8 * 0.8008517265))


def test_default_gate_keeps_log_r_plus_3():
    # learner finds the tokens e^3 times MORE likely: k1 mean = -3 < 1 -> kept
    theta, old, gen, adv, mask = _uniform_log_ratio_batch(3.0, -1.0)
    out = policy_loss(theta, old, gen, adv, mask, LossConfig())
    assert not out.per_completion.filtered.any()
    assert_close(out.per_completion.k1_mean, torch.full((len(LENGTHS),), -3.0))
    # the legacy D = n (3 e^3 - e^3 + 1) = n (2 e^3 + 1) = 41.1710738464 n is filtered:
    # the inversion of issue 11 (k3, which also grows as r -> inf, filters it too)
    cfg = LossConfig(divergence="kl_learner_gen", filter_threshold=50.0)
    assert policy_loss(theta, old, gen, adv, mask, cfg).per_completion.filtered.all()
    # and it is still logged whatever the gate: divergence_mean = mean of 41.17 n
    out = policy_loss(theta, old, gen, adv, mask, LossConfig())
    mean_n = sum(LENGTHS) / len(LENGTHS)  # 260
    assert_close(out.stats["divergence_mean"].value, scalar(41.1710738464 * mean_n))


def test_legacy_gate_keeps_very_unlikely_negative():
    # issue 11: log r = -10 per token, 32 tokens -> D = 32 (1 - 11 e^-10) = 31.9840192 < 50
    old = torch.full((1, 32), -10.0)
    gen = torch.zeros(1, 32)
    cfg = LossConfig(divergence="kl_learner_gen", filter_threshold=50.0)
    out = policy_loss(old.clone(), old, gen, t([-1.0]), torch.ones(1, 32), cfg)
    assert_close(out.per_completion.divergence, t([31.9840192]))
    assert not out.per_completion.filtered.any()
    # the default gate: k1 mean 10 >= 1
    out = policy_loss(old.clone(), old, gen, t([-1.0]), torch.ones(1, 32), LossConfig())
    assert out.per_completion.filtered.all()


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_positive_advantage_is_never_filtered(divergence):
    for log_r in (-20.0, -3.0, 0.0, 3.0):
        theta, old, gen, _, mask = _uniform_log_ratio_batch(log_r, 1.0)
        adv = torch.full((len(LENGTHS),), 1.0)
        adv[::2] = 0.0  # zero advantages are not reported as filtered either
        cfg = LossConfig(divergence=divergence, filter_threshold=1e-3)
        out = policy_loss(theta, old, gen, adv, mask, cfg)
        assert not out.per_completion.filtered.any()


def test_divergence_errors():
    with pytest.raises(ValueError):
        sequence_divergence(DIV_OLD, DIV_GEN, DIV_MASK, "tv")
    with pytest.raises(ValueError):
        sequence_divergence(DIV_OLD, DIV_GEN, DIV_MASK[:, :2])


# ------------------------------------------------------------------------- filter


def test_ftis_filter_four_cases_and_boundary():
    # A>0 & far -> kept ; A<0 & far -> 0 ; A<0 & near -> kept ; A>0 & near -> kept ;
    # A<0 & D == g -> 0 (D >= g) ; A=0 & far -> 0 either way, not reported as filtered
    adv = t([1.0, -1.0, -1.0, 1.0, -0.5, 0.0])
    div = t([60.0, 60.0, 10.0, 10.0, 50.0, 60.0])
    out, filtered = ftis_filter(adv, div, 50.0)
    assert_close(out, t([1.0, 0.0, -1.0, 1.0, 0.0, 0.0]))
    assert filtered.dtype == torch.bool
    assert filtered.tolist() == [False, True, False, False, True, False]


def test_ftis_filter_errors():
    with pytest.raises(ValueError):
        ftis_filter(t([1.0]), t([1.0, 2.0]))
    with pytest.raises(ValueError):
        ftis_filter(t([1.0]), t([1.0]), 0.0)


# ------------------------------------------------------------------------- config


def test_loss_config_defaults_and_validation():
    c = LossConfig()
    assert (c.method, c.truncation, c.filter_threshold, c.divergence) == (
        "ftis",
        2.0,
        1.0,
        "k1_mean",
    )
    # the legacy summed estimators stay valid names (old configs with g = 50)
    for name in DIVERGENCES:
        assert LossConfig(divergence=name, filter_threshold=50.0).divergence == name
    assert (c.clip_eps_low, c.clip_eps_high, c.aggregation, c.temperature) == (
        0.2,
        0.2,
        "token",
        1.0,
    )
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        c.method = "tis"  # type: ignore[misc]
    bad = [
        {"method": "ppo"},
        {"truncation": 0.0},
        {"filter_threshold": -1.0},
        {"divergence": "tv"},
        {"clip_eps_low": 1.0},
        {"clip_eps_high": -0.1},
        {"aggregation": "batch"},
        {"temperature": 0.0},
    ]
    for kwargs in bad:
        with pytest.raises(ValueError):
            LossConfig(**kwargs)


# --------------------------------------------------------------------------- loss

# B = 2 completions of lengths 3 and 1 (T = 3); A = [1, -2]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
ADV = t([1.0, -2.0])


def _onpolicy_inputs():
    lp = t([[-0.5, -1.0, -0.2], [-0.3, -7.0, -7.0]])
    return lp.clone().requires_grad_(), lp.clone(), lp.clone()


def test_policy_loss_on_policy_token_aggregation_value_and_grad():
    # rho = 1, w = 1 -> loss = -sum_tokens A / N = -(1 + 1 + 1 - 2) / 4 = -0.25
    # grad = -w A / N : row 0 -> -1/4 = -0.25 ; row 1 token 0 -> 2/4 = 0.5 ; padding 0
    theta, old, gen = _onpolicy_inputs()
    loss, stats = run_loss(theta, old, gen, ADV, MASK, LossConfig(method="on_policy"))
    assert_close(loss, scalar(-0.25))
    loss.backward()
    assert_close(theta.grad, t([[-0.25, -0.25, -0.25], [0.5, 0.0, 0.0]]))
    assert_close(stats["is_weight_mean"], scalar(1.0))
    assert_close(stats["clip_frac"], scalar(0.0))
    assert_close(stats["filtered_frac"], scalar(0.0))
    assert_close(stats["logratio_gen_mean"], scalar(0.0))


def test_policy_loss_sequence_aggregation_value_and_grad():
    # per-sequence means: row 0 -> -1, row 1 -> +2 ; loss = (-1 + 2) / 2 = 0.5
    # (token aggregation gives -0.25 on the same batch, see above)
    # grad = -A / (L_i * B): row 0 -> -1 / 6 = -0.1666666667 ; row 1 -> 2 / 2 = 1.0
    theta, old, gen = _onpolicy_inputs()
    cfg = LossConfig(method="on_policy", aggregation="sequence")
    loss, _ = run_loss(theta, old, gen, ADV, MASK, cfg)
    assert_close(loss, scalar(0.5))
    loss.backward()
    s = -0.1666666667
    assert_close(theta.grad, t([[s, s, s], [1.0, 0.0, 0.0]]))


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_policy_loss_padding_does_not_matter(aggregation):
    cfg = LossConfig(method="ftis", aggregation=aggregation, filter_threshold=1.0)
    theta, old, _ = _onpolicy_inputs()
    gen = old - t([[0.5, 1.0, 0.2], [0.3, 0.0, 0.0]])
    loss1, stats1 = run_loss(theta, old, gen, ADV, MASK, cfg)
    (grad1,) = torch.autograd.grad(loss1, theta)

    theta2 = theta.detach().clone()
    old2, gen2 = old.clone(), gen.clone()
    theta2[1, 1:] = t([5.0, float("nan")])
    old2[1, 1:] = t([-100.0, float("inf")])
    gen2[1, 1:] = t([float("-inf"), 3.0])
    theta2.requires_grad_()
    loss2, stats2 = run_loss(theta2, old2, gen2, ADV, MASK.bool(), cfg)
    (grad2,) = torch.autograd.grad(loss2, theta2)
    assert_close(loss2, loss1)
    assert_close(grad2, grad1)
    assert grad2[1, 1:].eq(0).all()
    for k in stats1:
        assert_close(stats2[k], stats1[k])


def test_policy_loss_all_equal_rewards_zero_gradient():
    adv = group_advantages(t([[1.0, 1.0]])).reshape(-1)  # exact zeros
    theta = t([[-0.5, -1.0, -0.2], [-0.3, -2.0, -2.0]]).requires_grad_()
    old = theta.detach() - 0.1
    gen = old - 0.7
    for method in METHODS:
        loss, _ = run_loss(theta, old, gen, adv, MASK, LossConfig(method=method))
        (grad,) = torch.autograd.grad(loss, theta)
        assert torch.equal(grad, torch.zeros_like(grad))
        assert_close(loss, scalar(0.0))


def test_policy_loss_tis_weights_grad_and_stats():
    # lp_theta = lp_old = 0, lp_gen = [-0.5, -1] -> log-ratios [0.5, 1]
    # w = [min(1.6487212707, 2), min(e, 2)] = [1.6487212707, 2.0] ; A = 1 ; N = 2
    # loss = -(1.6487212707 + 2) / 2 = -1.8243606354 ; grad = -w A / N = [-0.8243606354, -1.0]
    theta = t([[0.0, 0.0]]).requires_grad_()
    old = t([[0.0, 0.0]])
    gen = t([[-0.5, -1.0]])
    loss, stats = run_loss(theta, old, gen, t([1.0]), t([[1.0, 1.0]]), LossConfig(method="tis"))
    assert_close(loss, scalar(-1.8243606354))
    loss.backward()
    assert_close(theta.grad, t([[-0.8243606354, -1.0]]))
    assert_close(stats["is_weight_mean"], scalar(1.8243606354))
    assert_close(stats["is_weight_max"], scalar(2.0))
    assert_close(stats["is_weight_raw_max"], scalar(2.7182818285))
    assert_close(stats["truncated_frac"], scalar(0.5))
    assert_close(stats["logratio_gen_mean"], scalar(0.75))
    assert_close(stats["filtered_frac"], scalar(0.0))
    # D = (1 - 0.5 e^0.5) + 1 = 0.1756393646 + 1 = 1.1756393646
    assert_close(stats["divergence_mean"], scalar(1.1756393646))
    # k1 mean = -(0.5 + 1) / 2 = -0.75 ; it is also the (default) gate statistic
    assert_close(stats["k1_mean"], scalar(-0.75))
    assert_close(stats["gate_mean"], scalar(-0.75))
    assert_close(stats["gate_max"], scalar(-0.75))
    assert_close(stats["clip_frac"], scalar(0.0))
    for v in stats.values():
        assert v.dim() == 0 and not v.requires_grad and v.is_floating_point()


def test_policy_loss_vis_and_nois_values():
    # same batch: vis w = [1.6487212707, e] -> loss = -(1.6487212707 + 2.7182818285)/2
    #   = -2.1835015496 ; nois w = 1 -> loss = -1
    theta = t([[0.0, 0.0]]).requires_grad_()
    args = (t([[0.0, 0.0]]), t([[-0.5, -1.0]]), t([1.0]), t([[1.0, 1.0]]))
    loss_vis, stats = run_loss(theta, *args, LossConfig(method="vis"))
    assert_close(loss_vis, scalar(-2.1835015496))
    assert_close(stats["truncated_frac"], scalar(0.0))
    loss_nois, _ = run_loss(theta, *args, LossConfig(method="nois"))
    assert_close(loss_nois, scalar(-1.0))


def test_policy_loss_ftis_filtered_sample_zero_grad():
    # legacy kl_learner_gen, g = 1. row 0 log-ratios [1, 1] -> D = 1 + 1 = 2 >= 1,
    # A = -1 -> filtered ; row 1 log-ratios [0, 0] -> D = 0, A = -1 kept, w = 1.
    # loss = -(w A) * 2 / N = -(-1 * 2) / 4 = 0.5 ; grad row 1 = -w A / N = 0.25
    theta = t([[0.0, 0.0], [0.0, 0.0]]).requires_grad_()
    old = t([[0.0, 0.0], [0.0, 0.0]])
    gen = t([[-1.0, -1.0], [0.0, 0.0]])
    adv, mask = t([-1.0, -1.0]), torch.ones(2, 2)
    legacy = LossConfig(divergence="kl_learner_gen", filter_threshold=1.0)
    loss, stats = run_loss(theta, old, gen, adv, mask, legacy)
    assert_close(loss, scalar(0.5))
    (grad,) = torch.autograd.grad(loss, theta)
    assert_close(grad, t([[0.0, 0.0], [0.25, 0.25]]))
    assert_close(stats["filtered_frac"], scalar(0.5))
    assert_close(stats["divergence_mean"], scalar(1.0))
    # tis does not filter: row 0 w = min(e, 2) = 2 -> grad -2 * (-1) / 4 = 0.5
    loss, stats = run_loss(theta, old, gen, adv, mask, LossConfig(method="tis"))
    (grad,) = torch.autograd.grad(loss, theta)
    assert_close(grad, t([[0.5, 0.5], [0.25, 0.25]]))
    assert_close(stats["filtered_frac"], scalar(0.0))
    # the default k1 gate keeps row 0: the learner prefers its tokens (k1 mean -1)
    loss, stats = run_loss(theta, old, gen, adv, mask, LossConfig())
    assert_close(stats["filtered_frac"], scalar(0.0))
    assert_close(stats["k1_mean"], scalar(-0.5))  # (-1 + 0) / 2
    # a positive advantage is never filtered
    loss, stats = run_loss(theta, old, gen, t([1.0, 1.0]), mask, legacy)
    (grad,) = torch.autograd.grad(loss, theta)
    assert_close(grad, t([[-0.5, -0.5], [-0.25, -0.25]]))


def test_policy_loss_clip_positive_advantage():
    # A = 1, lp_old = 0, rho = [1.5, 0.9, 0.5] ; eps = 0.2 -> clip range [0.8, 1.2]
    # surrogate = min(rho, clip(rho)) = [1.2 (clipped), 0.9, 0.5] -> loss = -2.6/3 = -0.8666666667
    # d/dlp_theta = -rho A / N where unclipped: [0, -0.3, -0.1666666667]
    theta = t([[math.log(1.5), math.log(0.9), math.log(0.5)]]).requires_grad_()
    old = torch.zeros(1, 3)
    cfg = LossConfig(method="on_policy")
    loss, stats = run_loss(theta, old, old, t([1.0]), torch.ones(1, 3), cfg)
    assert_close(loss, scalar(-0.8666666667))
    loss.backward()
    assert_close(theta.grad, t([[0.0, -0.3, -0.1666666667]]))
    assert_close(stats["clip_frac"], scalar(1 / 3))


def test_policy_loss_clip_negative_advantage():
    # A = -1, rho = [1.5, 0.9, 0.5]: min(-rho, -clip(rho)) = [-1.5, -0.9, -0.8 (clipped)]
    # loss = (1.5 + 0.9 + 0.8) / 3 = 1.0666666667 ; grad = -rho A / N = [0.5, 0.3, 0]
    theta = t([[math.log(1.5), math.log(0.9), math.log(0.5)]]).requires_grad_()
    old = torch.zeros(1, 3)
    cfg = LossConfig(method="on_policy")
    loss, stats = run_loss(theta, old, old, t([-1.0]), torch.ones(1, 3), cfg)
    assert_close(loss, scalar(1.0666666667))
    loss.backward()
    assert_close(theta.grad, t([[0.5, 0.3, 0.0]]))
    assert_close(stats["clip_frac"], scalar(1 / 3))


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_policy_loss_empty_mask(aggregation):
    theta = t([[-1.0, -2.0]]).requires_grad_()
    cfg = LossConfig(aggregation=aggregation)
    lp = theta.detach()
    loss, stats = run_loss(theta, lp, lp, t([1.0]), torch.zeros(1, 2), cfg)
    assert loss.grad_fn is not None
    assert_close(loss, scalar(0.0))
    loss.backward()
    assert torch.equal(theta.grad, torch.zeros(1, 2))
    for v in stats.values():
        assert torch.isfinite(v)


def test_policy_loss_errors():
    theta = torch.zeros(2, 3)
    with pytest.raises(ValueError):
        policy_loss(theta, theta, theta, t([1.0]), torch.ones(2, 3), LossConfig())
    with pytest.raises(ValueError):
        policy_loss(theta, theta[:, :2], theta, t([1.0, 1.0]), torch.ones(2, 3), LossConfig())
    with pytest.raises(TypeError):
        policy_loss(theta, theta, theta, t([1.0, 1.0]), torch.ones(2, 3), {"method": "tis"})


def test_policy_loss_end_to_end_from_logits():
    # on-policy, one step: lp_theta from logits with grad, lp_old = lp_gen = its value.
    # logits log[1, 2, 3] at T = 1, token 2 -> p = 1/2 ; A = 1 ; N = 1
    # loss = -1 ; dloss/dlogits = -(onehot(2) - p) = [1/6, 2/6, -1/2]
    logits = t([[[0.0, LN2, LN3]]]).requires_grad_()
    lp = completion_logprobs(logits, torch.tensor([[2]]), 1.0)
    loss, _ = run_loss(lp, lp.detach(), lp.detach(), t([1.0]), t([[1.0]]), LossConfig())
    assert_close(loss, scalar(-1.0))
    loss.backward()
    assert_close(logits.grad, t([[[1 / 6, 2 / 6, -0.5]]]))


# ------------------------------------------------------------------- typed output


def test_loss_output_per_completion_hand():
    # B = 2, T = 3, lengths 3 and 2 ; log r = lp_old - lp_gen:
    # row 0 [0.5, 1, -1] (raw w e^0.5, e, e^-1: one token above C = 2)
    # row 1 [-2, -2] (k1 mean 2 >= 1 with A < 0 -> filtered)
    old = t([[0.0, 0.0, -1.0], [-2.0, -2.0, 0.0]])
    gen = t([[-0.5, -1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = policy_loss(old.clone(), old, gen, t([1.0, -1.0]), mask, LossConfig())
    pc = out.per_completion
    assert pc.filtered.tolist() == pc.gated.tolist() == [False, True]
    assert pc.tokens.tolist() == [3, 2] and pc.truncated_tokens.tolist() == [1, 0]
    assert pc.tokens.dtype == pc.truncated_tokens.dtype == torch.int64
    # k1 means: -(0.5 + 1 - 1) / 3 = -0.1666666667 ; 2
    assert_close(pc.k1_mean, t([-0.1666666667, 2.0]))
    assert_close(pc.gate, pc.k1_mean)
    assert_close(pc.log_ratio_sum, t([0.5, -4.0]))
    # legacy D: row 0 (1 - 0.5 e^0.5) + 1 + (1 - 2/e) = 0.1756393646 + 1 + 0.2642411177
    #   = 1.4398804823 ; row 1 2 (1 - 3 e^-2) = 2 * 0.5939941503 = 1.1879883006
    assert_close(pc.divergence, t([1.4398804823, 1.1879883006]))
    assert_close(out.stats["filtered_frac"].value, scalar(0.5))
    assert_close(out.stats["gate_max"].value, scalar(2.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.loss = scalar(0.0)  # type: ignore[misc]
    # tis: same per-completion statistics, nothing filtered; vis: truncated_frac 0 but the
    # per-completion count still describes the sample (receiver feedback)
    out = policy_loss(old.clone(), old, gen, t([1.0, -1.0]), mask, LossConfig(method="vis"))
    assert out.per_completion.truncated_tokens.tolist() == [1, 0]
    assert_close(out.stats["truncated_frac"].value, scalar(0.0))
    assert not out.per_completion.filtered.any()
    assert out.per_completion.gated.tolist() == [False, True]  # what ftis would filter


def test_every_stat_declares_its_reduction():
    old = t([[0.0, -1.0], [-2.0, 0.0]])
    out = policy_loss(old.clone(), old, old - 0.3, t([1.0, -1.0]), torch.ones(2, 2),
                      LossConfig())
    expected = {
        "is_weight_mean": Reduction.TOKEN_MEAN, "is_weight_max": Reduction.MAX,
        "is_weight_raw_max": Reduction.MAX, "truncated_frac": Reduction.TOKEN_MEAN,
        "filtered_frac": Reduction.SEQ_MEAN, "divergence_mean": Reduction.SEQ_MEAN,
        "k1_mean": Reduction.SEQ_MEAN, "gate_mean": Reduction.SEQ_MEAN,
        "gate_max": Reduction.MAX, "clip_frac": Reduction.TOKEN_MEAN,
        "logratio_gen_mean": Reduction.TOKEN_MEAN,
    }
    assert {k: s.reduction for k, s in out.stats.items()} == expected
    assert out.values.keys() == expected.keys()
