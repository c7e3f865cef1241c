"""Finite-difference checks of the learner losses' gradients w.r.t. lp_theta.

``torch.autograd.gradcheck`` compares the analytic gradient with central differences in
float64, for every method x aggregation, token-level (:func:`policy_loss`) and
cross-tokenizer (:func:`sequence_level_policy_loss`, plain and length-normalised).

The point is chosen away from every kink: ``log rho = lp_theta - lp_old`` takes the
values below, none within 0.04 of the clip edges log(0.8) = -0.2231 and
log(1.2) = +0.1823 (so a gradcheck step of 1e-6 never crosses one), and both clip
branches occur for both advantage signs:

    log rho  -0.60 (rho 0.549, below 1 - eps)   -0.10 (inside)   +0.05 (inside)
             +0.45 (rho 1.568, above 1 + eps)   -0.35 (below)    +0.30 (above)

With A > 0 the clipped (zero-gradient) branch is active above 1 + eps, with A < 0 below
1 - eps; the other out-of-range tokens stay on the unclipped branch. ``lp_old - lp_gen``
is away from 0 and from log C, and one negative-advantage completion is far enough from
the generator (k1 mean >= 1) to be filtered by ``ftis`` (the filter uses lp_old only,
so it is constant in lp_theta). One padding position holds garbage.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ftis.client.learner.loss import (
    AGGREGATIONS,
    METHODS,
    LossConfig,
    policy_loss,
    sequence_level_policy_loss,
)

F64 = torch.float64

# B = 4 completions, T = 3 ; lengths 3, 3, 2, 3
MASK = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
LP_OLD = torch.tensor([[-1.0, -2.0, -0.5],
                       [-0.7, -1.5, -2.5],
                       [-1.2, -0.3, 0.0],
                       [-2.0, -1.0, -0.8]], dtype=F64)
LOG_RHO = torch.tensor([[-0.60, -0.10, 0.45],
                        [0.30, -0.35, 0.05],
                        [0.45, -0.60, 0.0],
                        [-0.10, 0.30, -0.35]], dtype=F64)
# lp_old - lp_gen: rows 0-1 moderate (raw weights around 0.5 to 1.6 and one 2.7 > C = 2),
# row 2 = -1.5 per token (k1 mean 1.5 >= 1: row 2 is filtered under ftis, A < 0)
LOG_R_GEN = torch.tensor([[0.3, -0.4, 1.0],
                          [-0.2, 0.5, -0.6],
                          [-1.5, -1.5, 0.0],
                          [0.2, -0.3, 0.4]], dtype=F64)
ADV = torch.tensor([1.0, -0.8, -1.2, 0.6], dtype=F64)
CASES = list(itertools.product(METHODS, AGGREGATIONS))


def _theta() -> torch.Tensor:
    theta = (LP_OLD + LOG_RHO).clone()
    theta[2, 2] = 7.0  # padding: must receive no gradient and change nothing
    return theta.requires_grad_()


def test_the_point_exercises_both_clip_branches_and_the_filter():
    cfg = LossConfig(method="ftis")
    out = policy_loss(_theta(), LP_OLD, LP_OLD - LOG_R_GEN, ADV, MASK, cfg)
    assert out.per_completion.filtered.tolist() == [False, False, True, False]
    assert 0 < float(out.stats["clip_frac"].value) < 1
    assert out.per_completion.truncated_tokens.tolist() == [1, 0, 0, 0]  # e > C = 2
    edges = torch.tensor([0.8, 1.2], dtype=F64).log()
    assert (LOG_RHO[MASK].unsqueeze(-1) - edges).abs().min() > 0.04


@pytest.mark.parametrize(("method", "aggregation"), CASES)
def test_policy_loss_gradcheck(method, aggregation):
    cfg = LossConfig(method=method, aggregation=aggregation)
    gen = LP_OLD - LOG_R_GEN

    def f(theta: torch.Tensor) -> torch.Tensor:
        return policy_loss(theta, LP_OLD, gen, ADV, MASK, cfg).loss

    assert torch.autograd.gradcheck(f, (_theta(),), eps=1e-6, atol=1e-7, rtol=1e-5)
    theta = _theta()
    (grad,) = torch.autograd.grad(f(theta), theta)
    assert grad[2, 2] == 0  # padding
    if method == "ftis":
        assert (grad[2] == 0).all()  # the filtered completion
    else:
        # row 2 (A < 0): token 0 (rho 1.57) unclipped, token 1 (rho 0.55) clipped
        assert grad[2, 0] != 0 and grad[2, 1] == 0


@pytest.mark.parametrize(("method", "aggregation"), CASES)
@pytest.mark.parametrize("length_normalized", [False, True])
def test_sequence_level_policy_loss_gradcheck(method, aggregation, length_normalized):
    cfg = LossConfig(method=method, aggregation=aggregation)
    # S_gen: S_old - S_gen per row = 0.4, -0.3, -5.0 (k1 mean 2.5: filtered), 0.2
    s_old = torch.where(MASK, LP_OLD, torch.zeros((), dtype=F64)).sum(-1)
    s_gen = s_old - torch.tensor([0.4, -0.3, -5.0, 0.2], dtype=F64)

    def f(theta: torch.Tensor) -> torch.Tensor:
        return sequence_level_policy_loss(theta, LP_OLD, s_gen, ADV, MASK, cfg,
                                          length_normalized=length_normalized).loss

    assert torch.autograd.gradcheck(f, (_theta(),), eps=1e-6, atol=1e-7, rtol=1e-5)
    theta = _theta()
    (grad,) = torch.autograd.grad(f(theta), theta)
    assert grad[2, 2] == 0
    if method == "ftis":
        out = sequence_level_policy_loss(theta, LP_OLD, s_gen, ADV, MASK, cfg,
                                         length_normalized=length_normalized)
        assert out.per_completion.filtered.tolist() == [False, False, True, False]
        assert (grad[2] == 0).all()
