"""MERIT's one-shot merge: the token-weighted average of the branches' weights (issue 16;
MERIT, arXiv 2606.01717, step 5).

Every branch starts from the same initialisation ``W0`` and trains without
communication; the merge is ``W = W0 + sum_k w_k (W_k - W0)`` with ``w_k`` the branch's
share of the training tokens. For full fine-tunes that equals ``sum_k w_k W_k``.

For LoRA the average is taken over the **merged deltas** ``ΔW_k = s_k B_k A_k`` (``s_k``
the adapter's ``alpha / r``), not over ``A`` and ``B`` separately: averaging the factors
gives ``(Σ w_k B_k)(Σ w_k A_k)``, which holds cross terms ``B_j A_k`` that no branch
trained. peft's ``add_weighted_adapter`` offers both: ``combination_type="linear"``
averages the factors (only exact when the adapters share ``A``), while ``"cat"``
concatenates them into one adapter of rank ``Σ r_k`` whose delta is exactly
``Σ w_k ΔW_k``. This module does the explicit average of deltas: exact, the same
formula for full and LoRA branches, and its result is an ordinary model that any
volunteer can load (a ``"cat"`` adapter would be exact too, at K times the rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def token_weights(tokens: Sequence[float]) -> list[float]:
    """Each branch's share of the training tokens (sums to 1).

    Raises:
        ValueError: no branch or a non-positive count.
    """
    if not tokens or any(t <= 0 for t in tokens):
        raise ValueError("token counts must be positive and at least one")
    total = float(sum(tokens))
    return [float(t) / total for t in tokens]


def merge_deltas(base: Mapping[str, Tensor], deltas: Sequence[Mapping[str, Tensor]],
                 weights: Sequence[float]) -> dict[str, Tensor]:
    """``base + sum_k weights[k] * deltas[k]`` per parameter name.

    Args:
        base: parameter name -> ``W0`` (any float dtype).
        deltas: per branch, parameter name -> ``W_k - W0`` (a name missing from a
            branch counts as a zero delta).
        weights: per branch, e.g. :func:`token_weights`.

    Returns:
        Parameter name -> merged tensor, in ``base``'s dtypes.

    Raises:
        ValueError: counts differ, or a delta names a parameter ``base`` lacks or has
            another shape.
    """
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} deltas vs {len(weights)} weights")
    out = {name: w.detach().to(torch.float64).clone() for name, w in base.items()}
    for delta, weight in zip(deltas, weights, strict=True):
        for name, d in delta.items():
            if name not in out or out[name].shape != d.shape:
                raise ValueError(f"delta {name!r} does not match the base")
            out[name] += float(weight) * d.detach().to(torch.float64)
    return {name: out[name].to(base[name].dtype) for name in out}


def full_delta(base: Mapping[str, Tensor], trained: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``trained - base`` for every parameter of ``base`` (a full fine-tune's delta)."""
    return {name: trained[name].detach().to(torch.float64) - w.detach().to(torch.float64)
            for name, w in base.items()}


def lora_delta(lora_a: Tensor, lora_b: Tensor, scaling: float) -> Tensor:
    """A LoRA adapter's merged weight delta ``scaling * B @ A``.

    Args:
        lora_a: ``[r, in]``.
        lora_b: ``[out, r]``.
        scaling: ``alpha / r``.

    Returns:
        ``[out, in]`` float64.
    """
    if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_b.shape[1] != lora_a.shape[0]:
        raise ValueError(f"B {tuple(lora_b.shape)} @ A {tuple(lora_a.shape)} does not chain")
    return float(scaling) * (lora_b.to(torch.float64) @ lora_a.to(torch.float64))
