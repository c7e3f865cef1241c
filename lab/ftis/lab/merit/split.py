"""MERIT's conflict-aware split of a task mix into branches (issue 16; MERIT, arXiv
2606.01717, "Decentralized Instruction Tuning: Conflict-Aware Splitting and Weight
Merging"; summary in ../shared/REFERENCE.md).

The recipe, on F task families with per-family gradients at the shared initialisation:

1. :func:`conflict_matrix`: the cosine similarity of every pair of family gradients,
   ``C[i, j] = <g_i, g_j> / (|g_i| |g_j|)``; negative entries are conflicts.
2. :func:`principal_scores`: each family's coordinate on the first principal component
   of the rows of ``C`` (families that conflict with the same others land on the same
   side).
3. :func:`median_split`: cut the families, ordered by that score, at the token-weighted
   median, so that both halves carry about the same training tokens.
4. :func:`conflict_aware_split`: repeat 2-3 inside each half, ``r`` times, for
   ``K = 2^r`` branches (a branch of one family is not split further).

:func:`random_split` is the control the experiment compares against: the same branch
sizes in tokens, families assigned at random. Everything here is pure (tensors and
lists in, lists out); the gradients come from :mod:`ftis.lab.merit.gradients`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def conflict_matrix(grads: Tensor) -> Tensor:
    """Cosine similarity of per-family gradients (MERIT step 1).

    Args:
        grads: ``[F, P]`` float tensor, one flattened gradient per family.

    Returns:
        ``[F, F]`` float64, symmetric, ones on the diagonal, entries in ``[-1, 1]``.

    Raises:
        ValueError: not two-dimensional, fewer than 2 families, or a zero gradient
            (its direction is undefined).
    """
    if grads.dim() != 2 or grads.shape[0] < 2:
        raise ValueError(f"grads must be [F >= 2, P], got {tuple(grads.shape)}")
    g = grads.to(torch.float64)
    norms = g.norm(dim=1)
    if bool((norms == 0).any()):
        raise ValueError("a family has a zero gradient")
    unit = g / norms[:, None]
    return (unit @ unit.T).clamp(-1.0, 1.0)


def principal_scores(matrix: Tensor) -> Tensor:
    """Each row's coordinate on the first principal component of the rows (MERIT
    step 2). The sign is fixed so that the largest-magnitude loading is positive, which
    makes the split deterministic.

    Args:
        matrix: ``[F, F]`` conflict matrix (any ``[F, D]`` works).

    Returns:
        ``[F]`` float64 scores (zeros when the rows do not vary).
    """
    x = matrix.to(torch.float64)
    centred = x - x.mean(dim=0, keepdim=True)
    if float(centred.abs().max()) == 0.0:
        return torch.zeros(x.shape[0], dtype=torch.float64)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    direction = vh[0]
    if float(direction[direction.abs().argmax()]) < 0:
        direction = -direction
    return centred @ direction


def median_split(scores: Sequence[float], tokens: Sequence[float]) -> tuple[list[int], list[int]]:
    """Split item indices, ordered by score, at the token-weighted median (MERIT step 3).

    The low side takes items in score order (ties by index) while its tokens stay at or
    below half of the total, and at least one item; the high side gets the rest (at least
    one item). With one item the high side is empty.

    Args:
        scores: ``[F]`` one score per item.
        tokens: ``[F]`` positive training tokens per item.

    Returns:
        ``(low, high)`` lists of indices, each in score order.

    Raises:
        ValueError: lengths differ, no items, or a non-positive token count.
    """
    if len(scores) != len(tokens) or not scores:
        raise ValueError("scores and tokens must be non-empty and of equal length")
    if any(t <= 0 for t in tokens):
        raise ValueError("token counts must be positive")
    order = sorted(range(len(scores)), key=lambda i: (float(scores[i]), i))
    if len(order) == 1:
        return order, []
    half = sum(tokens) / 2.0
    low: list[int] = []
    acc = 0.0
    for i in order[:-1]:  # the high side keeps at least one item
        if low and acc + tokens[i] > half:
            break
        low.append(i)
        acc += tokens[i]
    return low, order[len(low):]


def conflict_aware_split(grads: Tensor, tokens: Sequence[float], rounds: int
                         ) -> list[list[int]]:
    """``2^rounds`` branches of family indices (MERIT steps 1-4): each branch is split
    again on the principal component of its own sub-matrix of the conflict matrix.

    Args:
        grads: ``[F, P]`` per-family gradients at the shared initialisation.
        tokens: ``[F]`` training tokens per family (the median's weights).
        rounds: ``r >= 0`` levels of splitting.

    Returns:
        Branches (lists of family indices, each sorted), at most ``2^rounds`` (fewer when
        a branch of one family cannot be split), together a partition of ``range(F)``.

    Raises:
        ValueError: as :func:`conflict_matrix` and :func:`median_split`, or ``rounds < 0``.
    """
    if len(tokens) != grads.shape[0]:
        raise ValueError("one token count per family")
    full = conflict_matrix(grads)
    return _split_recursively(
        grads.shape[0], tokens, rounds,
        lambda branch: principal_scores(full[branch][:, branch]).tolist())


def random_split(n_families: int, tokens: Sequence[float], rounds: int,
                 rng: random.Random) -> list[list[int]]:
    """The control: the same recursive token-weighted median cut as
    :func:`conflict_aware_split`, on a random order of the families instead of the
    principal-component order."""
    return _split_recursively(n_families, tokens, rounds,
                              lambda branch: [rng.random() for _ in branch])


def _split_recursively(n: int, tokens: Sequence[float], rounds: int,
                       scores: Callable[[list[int]], list[float]]) -> list[list[int]]:
    """``rounds`` levels of :func:`median_split` of every branch of two or more items,
    each ordered by ``scores(branch)`` (one score per item of the branch)."""
    if rounds < 0:
        raise ValueError("rounds must be >= 0")
    branches: list[list[int]] = [list(range(n))]
    for _ in range(rounds):
        nxt: list[list[int]] = []
        for branch in branches:
            if len(branch) < 2:
                nxt.append(branch)
                continue
            low, high = median_split(scores(branch), [tokens[i] for i in branch])
            nxt += [sorted(branch[i] for i in low), sorted(branch[i] for i in high)]
        branches = nxt
    return branches
