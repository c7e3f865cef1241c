"""The F-TIS learner objective as small pure functions on tensors.

Nothing here does I/O or holds state: every function takes tensors and returns
tensors (or a frozen :class:`LossOutput` of tensors), so the trainer composes them and
the unit tests check them against hand-computed values.

Notation (DESIGN.md section 4). For completion ``i`` of a prompt and its token ``t``:

* ``lp_theta`` -- log pi_theta(a_t | p, a_<t) under the learner being optimised (with grad);
* ``lp_old``   -- the same under the learner's weights at the start of the step (no grad);
* ``lp_gen``   -- the generator's sampler log-prob, shipped in the rollout bundle.

All log-probs are natural-log (nats) and are computed at the sampler's temperature.
``r = exp(lp_old - lp_gen)`` is the learner-over-generator probability ratio of a
sampled token.

Sources cited in the docstrings:

* F-TIS: "F-TIS: Harnessing Diverse Models in Collaborative GRPO", arXiv 2605.22537,
  and its blog post (filtered advantage equation).
* GRPO: Shao et al., "DeepSeekMath", arXiv 2402.03300, section 4.1 (group-relative
  advantage, clipped surrogate, per-sequence mean).
* DAPO: Yu et al., arXiv 2503.14476, section 3.3 (token-level policy-gradient loss).
* TIS: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
  training" (truncated importance sampling, weight min(pi_learner / pi_sampler, C)).
* PPO: Schulman et al., arXiv 1707.06347 (clipped surrogate).
* k1 / k3 estimators: J. Schulman, "Approximating KL divergence" (2020 note).
* OPSM: DeepSeek-AI, "DeepSeek-V3.2" (2025), off-policy sequence masking: a completion
  with negative advantage is masked when the mean over its tokens of
  ``log pi_sampler - log pi_theta`` (the k1 mean) exceeds delta; implemented in TRL as
  ``GRPOConfig.off_policy_mask_threshold`` / ``GRPOTrainer.get_off_policy_mask`` (TRL
  docs, "Paper index", DeepSeek-V3.2 section, where delta = 1.0 is described as an
  average of 1 nat per token).
* GSPO: Zheng et al., arXiv 2507.18071 (sequence-level ratio, length-normalised, eq. 7).

The settings (:class:`LossConfig`) and the enumerations (:data:`METHODS`,
:data:`DIVERGENCES`, :data:`AGGREGATIONS`) are defined once in
:mod:`ftis.client.learner.config` (torch-free, read by the CLI) and re-exported here.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ftis.client.learner.config import (
    AGGREGATIONS,
    DEFAULT_DIVERGENCE,
    DEFAULT_FILTER_THRESHOLD,
    DIVERGENCES,
    METHODS,
    PER_TOKEN_DIVERGENCES,
    SUMMED_DIVERGENCES,
    LossConfig,
)

__all__ = [
    "AGGREGATIONS",
    "DEFAULT_DIVERGENCE",
    "DEFAULT_FILTER_THRESHOLD",
    "DIVERGENCES",
    "METHODS",
    "PER_TOKEN_DIVERGENCES",
    "SUMMED_DIVERGENCES",
    "CompletionStats",
    "LossConfig",
    "LossOutput",
    "Reduction",
    "Stat",
    "completion_logprobs",
    "ftis_filter",
    "group_advantages",
    "importance_weights",
    "policy_loss",
    "selective_log_softmax",
    "sequence_divergence",
    "sequence_importance_weights",
    "sequence_level_divergence",
    "sequence_level_policy_loss",
]

# Log-ratios are clamped to [-_MAX_LOG_RATIO, _MAX_LOG_RATIO] before exp so that no
# weight, ratio or divergence term overflows to inf (exp(20) ~ 4.85e8).
_MAX_LOG_RATIO = 20.0


class Reduction(enum.Enum):
    """How a per-micro-batch statistic combines over micro-batches (declared with it).

    * ``TOKEN_MEAN`` -- a mean over completion tokens: combine weighted by token counts;
    * ``SEQ_MEAN``   -- a mean over completions: combine weighted by completion counts;
    * ``MAX``        -- a maximum: combine by ``max``.
    """

    TOKEN_MEAN = "token_mean"
    SEQ_MEAN = "seq_mean"
    MAX = "max"


@dataclass(frozen=True)
class Stat:
    """One scalar statistic of a loss call and its reduction across micro-batches.

    Attributes:
        value: detached 0-d floating tensor (the loss's dtype).
        reduction: a :class:`Reduction`.
    """

    value: Tensor
    reduction: Reduction


@dataclass(frozen=True)
class CompletionStats:
    """Per-completion statistics of one loss call; every field is a detached ``[B]``.

    Attributes:
        filtered: bool, True where the F-TIS filter zeroed the advantage (``ftis`` only).
        gated: bool, True where the gate would filter (``A < 0`` and ``gate >=``
            threshold) whatever the method: it describes the sample (receiver feedback);
            equal to ``filtered`` under ``ftis``.
        gate: float, the configured gate statistic (``LossConfig.divergence``): nats per
            token for ``k1_mean``/``k3_mean``, summed nats for the legacy estimators.
        k1_mean: float, mean over the completion's tokens of ``lp_gen - lp_old`` (nats
            per token); cross-tokenizer: ``(S_gen - S_old) / n``. 0 for an empty row.
        divergence: float, legacy summed ``kl_learner_gen`` D (nats), always computed.
        tokens: int64, completion tokens (mask count; the learner's tokens).
        truncated_tokens: int64, tokens whose raw weight ``exp(lp_old - lp_gen)`` (the
            sequence weight, broadcast, for cross-tokenizer) exceeds C, counted for every
            method: it describes the sample (receiver feedback), not the update.
        log_ratio_sum: float, sum over tokens of ``lp_old - lp_gen`` (nats);
            cross-tokenizer: ``S_old - S_gen``.
    """

    filtered: Tensor
    gated: Tensor
    gate: Tensor
    k1_mean: Tensor
    divergence: Tensor
    tokens: Tensor
    truncated_tokens: Tensor
    log_ratio_sum: Tensor


@dataclass(frozen=True)
class LossOutput:
    """What :func:`policy_loss` and :func:`sequence_level_policy_loss` return.

    Attributes:
        loss: scalar loss to minimise (with grad through ``lp_theta``).
        stats: name -> :class:`Stat`, scalar statistics of the micro-batch, each with the
            reduction that combines it over micro-batches (see :func:`policy_loss`).
        per_completion: :class:`CompletionStats`.
    """

    loss: Tensor
    stats: dict[str, Stat]
    per_completion: CompletionStats

    @property
    def values(self) -> dict[str, Tensor]:
        """``stats`` without the reductions: name -> 0-d tensor."""
        return {k: s.value for k, s in self.stats.items()}


# --------------------------------------------------------------------------- helpers


def _float_dtype(*tensors: Tensor) -> torch.dtype:
    """Promote the inputs' dtypes to a floating dtype of at least float32."""
    dtype = torch.float32
    for t in tensors:
        if t.dtype == torch.float64:
            dtype = torch.float64
    return dtype


def _check_same_shape(ndim: int, **tensors: Tensor) -> torch.Size:
    """Raise ValueError unless every tensor has ``ndim`` dims and all shapes agree."""
    shape: torch.Size | None = None
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
        if shape is None:
            shape = t.shape
        elif t.shape != shape:
            shapes = {k: tuple(v.shape) for k, v in tensors.items()}
            raise ValueError(f"shape mismatch: {shapes}")
    assert shape is not None
    return shape


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


def _check_truncation(truncation: float) -> None:
    if not (isinstance(truncation, (int, float)) and math.isfinite(truncation)):
        raise ValueError(f"truncation C must be a finite number, got {truncation!r}")
    if truncation <= 0:
        raise ValueError(f"truncation C must be > 0, got {truncation!r}")


def _check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number, got {temperature!r}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over ``mask`` (bool); 0 when the mask is empty."""
    n = mask.sum()
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / n.clamp(min=1).to(values.dtype)


def _masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max of ``values`` over ``mask`` (bool); 0 when the mask is empty."""
    if not bool(mask.any()):
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return values[mask].max()


# ------------------------------------------------------------------------- log-probs


def _selective_log_softmax(logits: Tensor, index: Tensor, scale: float) -> Tensor:
    if not isinstance(logits, Tensor) or not isinstance(index, Tensor):
        raise TypeError("logits and index must be torch.Tensor")
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if index.shape != logits.shape[:2]:
        raise ValueError(
            f"index must be [B, T] = {tuple(logits.shape[:2])}, got {tuple(index.shape)}"
        )
    if index.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"index must be an integer tensor, got {index.dtype}")
    vocab = logits.shape[-1]
    if index.numel() and (bool((index < 0).any()) or bool((index >= vocab).any())):
        raise ValueError(f"index out of range for vocabulary of size {vocab}")
    out_dtype = _float_dtype(logits)
    index = index.long()
    rows = []
    # One row of the batch at a time: only a [T, V] float32 copy is live at once.
    for row_logits, row_index in zip(logits, index, strict=True):
        row = row_logits.to(out_dtype)
        if scale != 1.0:
            row = row * scale
        picked = row.gather(-1, row_index.unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(row, dim=-1))
    if not rows:
        return logits.new_zeros(index.shape, dtype=out_dtype)
    return torch.stack(rows)


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """Log-softmax of ``logits`` evaluated only at ``index`` (memory-efficient).

    Equal to ``torch.log_softmax(logits, -1).gather(-1, index[..., None])[..., 0]`` but
    never materialises the full ``[B, T, V]`` log-softmax: it loops over the batch rows
    and computes ``logit[index] - logsumexp(logit)`` in at least float32 (the style of
    TRL's ``selective_log_softmax``). Differentiable w.r.t. ``logits``.

    Args:
        logits: ``[B, T, V]`` floating tensor (any float dtype, incl. bf16/fp16).
        index: ``[B, T]`` integer tensor of token ids in ``[0, V)``.

    Returns:
        ``[B, T]`` log-probs (nats), float32 (float64 if ``logits`` is float64).

    Raises:
        TypeError: if an argument is not a tensor.
        ValueError: on wrong ranks/shapes, a non-integer ``index``, or ids out of range.
    """
    return _selective_log_softmax(logits, index, 1.0)


def completion_logprobs(logits: Tensor, completion_ids: Tensor, temperature: float) -> Tensor:
    """Per-token log-probs of the completion tokens at the sampler's temperature.

    ``logits`` must already be aligned so that ``logits[:, t]`` predicts
    ``completion_ids[:, t]`` (i.e. the caller has dropped the prompt positions and
    shifted by one). The logits are divided by ``temperature`` -- the same temperature
    the sampler used, so that ``lp_theta``/``lp_old`` are comparable with ``lp_gen``
    (F-TIS §3: the importance ratio is between the two sampling distributions) -- and
    then :func:`selective_log_softmax` is applied. The division is done row by row, so
    no extra ``[B, T, V]`` copy is made.

    Args:
        logits: ``[B, T, V]`` floating tensor.
        completion_ids: ``[B, T]`` integer tensor.
        temperature: sampler temperature, finite and ``> 0``.

    Returns:
        ``[B, T]`` log-probs (nats), float32 (float64 for float64 logits).

    Raises:
        ValueError: if ``temperature`` is not finite or ``<= 0``, or as
            :func:`selective_log_softmax`.
    """
    _check_temperature(temperature)
    return _selective_log_softmax(logits, completion_ids, 1.0 / float(temperature))


# ------------------------------------------------------------------------ advantages


def group_advantages(rewards: Tensor, scale_by_std: bool = True, eps: float = 1e-4) -> Tensor:
    """Group-relative advantages, GRPO outcome supervision (GRPO §4.1.2; F-TIS §2).

    ``A[n, g] = (r[n, g] - mean_g r[n]) / (std_g r[n] + eps)``, or without the division
    when ``scale_by_std`` is False (Dr. GRPO-style option). ``std`` is the *population*
    standard deviation (``unbiased=False``, divide by G): it is defined for G = 1 and
    matches the paper's ``sigma_r``; with it, rewards ``[1, 0, 0, 1]`` give
    ``+-0.5 / (0.5 + eps)``. A group whose rewards are all equal gets exact zeros (it
    carries no learning signal), independent of floating-point rounding in the mean.

    Args:
        rewards: ``[N, G]`` tensor, one row per prompt, one column per completion
            (integer or float; non-float is promoted to float32).
        scale_by_std: divide by ``std + eps`` (default True).
        eps: non-negative stabiliser added to the std.

    Returns:
        ``[N, G]`` advantages, float32 (float64 for float64 rewards), no grad.

    Raises:
        ValueError: if ``rewards`` is not 2-D or has non-finite entries, or ``eps < 0``.
    """
    if not isinstance(rewards, Tensor):
        raise TypeError("rewards must be a torch.Tensor")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, G], got shape {tuple(rewards.shape)}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    r = rewards.detach().to(_float_dtype(rewards))
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite")
    if r.numel() == 0:
        return r.clone()
    centred = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        std = r.std(dim=1, unbiased=False, keepdim=True)
        centred = centred / (std + eps)
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(centred), centred)


# ---------------------------------------------------------------- importance weights


def importance_weights(
    lp_old: Tensor, lp_gen: Tensor, method: str, truncation: float = 2.0
) -> Tensor:
    """Per-token stop-gradient importance weight ``w`` of a method (DESIGN.md §4 table).

    * ``on_policy``, ``nois``: ``w = 1``.
    * ``vis``: ``w = exp(lp_old - lp_gen)`` (F-TIS §3, vanilla IS).
    * ``tis``, ``ftis``: ``w = min(exp(lp_old - lp_gen), C)`` (TIS, Yao et al. 2025;
      F-TIS §3 with C = 2).

    The log-ratio is clamped (to ``[-20, 20]``, and to ``log C`` from above for the
    truncated methods) before ``exp``, so no weight is inf; for TIS
    ``exp(min(x, log C)) == min(exp(x), C)`` exactly in value.

    Args:
        lp_old: ``[B, T]`` learner log-probs at the start of the step.
        lp_gen: ``[B, T]`` generator (sampler) log-probs.
        method: one of :data:`METHODS`.
        truncation: C, finite and ``> 0`` (checked for every method).

    Returns:
        ``[B, T]`` detached weights, float32 (float64 for float64 inputs). Padding
        positions get whatever their values imply; the caller masks them.

    Raises:
        ValueError: on an unknown method, ``C <= 0`` or non-finite, or shape mismatch.
    """
    _check_method(method)
    _check_truncation(truncation)
    _check_same_shape(2, lp_old=lp_old, lp_gen=lp_gen)
    dtype = _float_dtype(lp_old, lp_gen)
    return _method_weight(lp_old.detach().to(dtype) - lp_gen.detach().to(dtype), method,
                          truncation)


def _method_weight(log_ratio: Tensor, method: str, truncation: float) -> Tensor:
    """``w`` of ``method`` from a detached log-ratio: 1 (on_policy/nois), ``exp`` (vis),
    ``min(exp, C)`` (tis/ftis); clamped to ``[-20, 20]`` (and ``log C``) before ``exp``."""
    if method in ("on_policy", "nois"):
        return torch.ones_like(log_ratio)
    log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if method in ("tis", "ftis"):
        log_ratio = log_ratio.clamp(max=math.log(truncation))
    return torch.exp(log_ratio)


# ------------------------------------------------------------------------ divergence


def _divergence_terms(log_r: Tensor, estimator: str) -> Tensor:
    """Per-token term of ``estimator`` from ``log r = lp_old - lp_gen`` (no masking).

    ``k1_mean``: ``-log r`` (not clamped). ``k3_mean``/``kl_gen_learner``:
    ``(r - 1) - log r`` with ``r = exp(min(log r, 20))``; only the exponential is
    clamped (against overflow), so the term keeps growing like ``-log r`` as r -> 0.
    ``kl_learner_gen``: ``r log r - r + 1`` with ``log r`` clamped to ``[-20, 20]`` (its
    value tends to 1 as r -> 0 anyway). Rounding negatives of k3 / kl are clamped to 0.
    """
    if estimator == "k1_mean":
        return -log_r
    if estimator in ("k3_mean", "kl_gen_learner"):
        r = torch.exp(log_r.clamp(max=_MAX_LOG_RATIO))
        return ((r - 1.0) - log_r).clamp(min=0.0)
    clamped = log_r.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    r = torch.exp(clamped)
    return (r * clamped - r + 1.0).clamp(min=0.0)


def _check_divergence(estimator: str) -> None:
    if estimator not in DIVERGENCES:
        raise ValueError(f"unknown divergence {estimator!r}; expected one of {DIVERGENCES}")


def sequence_divergence(
    lp_old: Tensor, lp_gen: Tensor, mask: Tensor, estimator: str = DEFAULT_DIVERGENCE
) -> Tensor:
    """Per-completion learner-generator divergence statistic ``D_i`` (the F-TIS gate).

    The generator ships only the sampled tokens' log-probs, so ``D_i`` is estimated from
    those samples (tokens drawn from pi_gen). With ``log r_t = lp_old_t - lp_gen_t``
    (learner over generator probability of the sampled token):

    Per-token statistics (nats per token; mean over the completion's tokens, so a
    threshold does not depend on the completion's length -- DESIGN.md section 4):

    * ``k1_mean``: mean of k1 = ``-log r_t = lp_gen - lp_old``. Its expectation under
      the generator is KL(pi_gen || pi_learner) per token (Schulman's k1); it is the
      statistic of DeepSeek-V3.2's off-policy sequence mask (TRL
      ``off_policy_mask_threshold``). Unbounded as pi_learner / pi_gen -> 0; a single
      sample can be negative (the learner prefers the completion).
    * ``k3_mean``: mean of Schulman's k3 of KL(pi_gen || pi_learner), ``(r - 1) - log r``
      (>= 0, unbiased). Grows like ``-log r`` as r -> 0 and like ``r`` as r -> inf, so
      it also gates tokens the learner prefers much more than the generator.

    Legacy summed statistics (nats per sequence; the scale of the paper's g = 50):

    * ``kl_learner_gen``: sum of ``r log r - r + 1`` (>= 0), an unbiased estimate of
      the summed per-token KL(pi_learner || pi_gen) -- the direction written in the
      F-TIS filter. Bounded by 1 nat per token as r -> 0 and growing like ``r log r``
      as r -> inf: it keeps the very negatives the learner finds unlikely and drops the
      ones it likes, and a fixed g in summed nats depends on length.
    * ``kl_gen_learner``: sum of k3.

    ``lp_old`` (no grad) is used rather than ``lp_theta`` so the filter decision is
    fixed for the whole optimisation step. Only ``exp`` arguments are clamped (to
    ``<= 20``, and ``>= -20`` for ``kl_learner_gen``); masked tokens never contribute
    (even if they hold inf/NaN). A completion with no tokens gets 0.

    Args:
        lp_old: ``[B, T]`` learner log-probs at the start of the step.
        lp_gen: ``[B, T]`` generator log-probs.
        mask: ``[B, T]`` bool or numeric; non-zero marks a completion token.
        estimator: one of :data:`DIVERGENCES` (default :data:`DEFAULT_DIVERGENCE`).

    Returns:
        ``[B]`` detached statistics, float32 (float64 for float64 inputs): nats per token
        for :data:`PER_TOKEN_DIVERGENCES`, nats for :data:`SUMMED_DIVERGENCES`. All but
        ``k1_mean`` are >= 0.

    Raises:
        ValueError: on an unknown estimator or shape mismatch.
    """
    _check_divergence(estimator)
    _check_same_shape(2, lp_old=lp_old, lp_gen=lp_gen, mask=mask)
    dtype = _float_dtype(lp_old, lp_gen)
    m = mask != 0
    zero = torch.zeros((), dtype=dtype, device=lp_old.device)
    log_r = torch.where(m, lp_old.detach().to(dtype) - lp_gen.detach().to(dtype), zero)
    total = torch.where(m, _divergence_terms(log_r, estimator), zero).sum(dim=-1)
    if estimator in PER_TOKEN_DIVERGENCES:
        return total / m.sum(dim=-1).clamp(min=1).to(dtype)
    return total


def ftis_filter(
    advantages: Tensor, divergence: Tensor, threshold: float = DEFAULT_FILTER_THRESHOLD
) -> tuple[Tensor, Tensor]:
    """The F-TIS advantage filter (F-TIS §3; blog eq. for the filtered advantage).

    ``A_i`` is kept if ``A_i >= 0`` or ``D_i < g``, and set to 0 otherwise, i.e. a
    completion is dropped exactly when its advantage is negative **and** the learner
    finds it unlikely (``D_i >= g``): pushing down what the learner would not produce
    anyway mostly distorts it (DESIGN.md section 4; DeepSeek-V3.2's OPSM masks the same
    set with ``>``). (The blog keeps ``A > 0``; zeroing an ``A = 0`` completion is a
    no-op, so only ``A < 0`` is reported as filtered.) A NaN divergence counts as far
    (conservative).

    Args:
        advantages: ``[B]`` per-completion advantages.
        divergence: ``[B]`` per-completion statistics, e.g. :func:`sequence_divergence`.
        threshold: g (or delta), ``> 0``, in the statistic's unit (``math.inf`` disables
            the filter); default :data:`DEFAULT_FILTER_THRESHOLD` (nats per token).

    Returns:
        ``(filtered_advantages, filtered)``: ``[B]`` advantages (input dtype, detached)
        and a ``[B]`` bool mask, True where the completion's advantage was zeroed.

    Raises:
        ValueError: on shape mismatch or ``threshold`` NaN or ``<= 0``.
    """
    _check_same_shape(1, advantages=advantages, divergence=divergence)
    if math.isnan(threshold) or threshold <= 0:
        raise ValueError(f"filter threshold g must be > 0, got {threshold!r}")
    a = advantages.detach()
    near = divergence.detach() < threshold
    filtered = (a < 0) & ~near
    return torch.where(filtered, torch.zeros_like(a), a), filtered


# ----------------------------------------------------------------------------- loss


@dataclass(frozen=True)
class _Gate:
    """Per-completion ``[B]`` divergence statistics handed to the shared tail."""

    gate: Tensor
    k1_mean: Tensor
    divergence: Tensor
    log_ratio_sum: Tensor


def policy_loss(
    lp_theta: Tensor,
    lp_old: Tensor,
    lp_gen: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
) -> LossOutput:
    """The (F-)TIS-weighted clipped GRPO surrogate loss (to minimise).

    Per completion token (GRPO eq. 3 / PPO with an off-policy weight, F-TIS §3)::

        rho  = exp(lp_theta - lp_old)
        surr = min(rho * A_i, clip(rho, 1 - eps_low, 1 + eps_high) * A_i)
        loss_t = -w_t * surr,   w = importance_weights(lp_old, lp_gen, method, C)  (no grad)

    For ``ftis`` the advantages are first filtered:
    ``A = ftis_filter(A, sequence_divergence(lp_old, lp_gen, mask, divergence), threshold)``
    (default: k1 mean >= 1 nat/token and A < 0). ``on_policy`` uses ``w = 1``: the caller
    passes only the learner's local rollouts (the method's definition); ``nois`` also
    uses ``w = 1`` but on all rollouts.

    Aggregation:

    * ``token`` (DAPO §3.3, default): sum over all completion tokens divided by the
      number of completion tokens in the batch. Filtered completions still count in the
      denominator (their advantage is 0, like an all-equal-reward group).
    * ``sequence`` (GRPO eq. 3): mean over tokens within each completion, then mean over
      completions that have at least one token.

    Padding (``mask == 0``) never contributes to the loss, the gradient or the stats,
    whatever it holds (inf/NaN included): inputs are replaced by 0 there before any
    arithmetic. An empty mask gives a zero loss that still has a ``grad_fn`` (when
    ``lp_theta`` requires grad) and zero gradients. ``log rho`` is clamped to
    ``[-20, 20]`` (no gradient beyond, where the update is degenerate anyway).

    Args:
        lp_theta: ``[B, T]`` learner log-probs with grad (:func:`completion_logprobs`).
        lp_old: ``[B, T]`` learner log-probs at the step start (detached here).
        lp_gen: ``[B, T]`` sampler log-probs from the bundle (detached here).
        advantages: ``[B]`` per-completion advantages (e.g. a flattened
            :func:`group_advantages`), detached here.
        mask: ``[B, T]`` bool or numeric; non-zero = completion token, 0 = padding.
        config: :class:`LossConfig`.

    Returns:
        :class:`LossOutput`: ``loss``, a scalar in ``lp_theta``'s dtype (at least
        float32); ``per_completion`` (:class:`CompletionStats`); and ``stats``, detached
        scalars, each declared with its :class:`Reduction` (empty means and maxima 0):

        * ``is_weight_mean`` (token mean) / ``is_weight_max`` (max): w over completion
          tokens, after truncation (1 for on_policy/nois);
        * ``is_weight_raw_max`` (max): max of exp(lp_old - lp_gen) before truncation;
        * ``truncated_frac`` (token mean): share of tokens whose raw weight exceeds C
          (tis/ftis; 0 otherwise);
        * ``filtered_frac`` (sequence mean): share of the B completions zeroed by the
          filter (ftis only);
        * ``divergence_mean`` (sequence mean): mean of the legacy summed
          ``kl_learner_gen`` D_i (nats), whatever the gate;
        * ``k1_mean`` (sequence mean): mean over completions of their k1 means (nats per
          token), whatever the gate;
        * ``gate_mean`` (sequence mean) / ``gate_max`` (max): the configured gate
          statistic over completions (computed for every method);
        * ``clip_frac`` (token mean): share of tokens where the clipped branch is active
          (rho < 1 - eps_low with A < 0, or rho > 1 + eps_high with A > 0);
        * ``logratio_gen_mean`` (token mean): mean of lp_old - lp_gen over tokens.

    Raises:
        TypeError: if ``config`` is not a :class:`LossConfig` or an input not a tensor.
        ValueError: on shape mismatch (``[B, T]`` inputs, ``[B]`` advantages).
    """
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig, got {type(config).__name__}")
    shape = _check_same_shape(2, lp_theta=lp_theta, lp_old=lp_old, lp_gen=lp_gen, mask=mask)
    _check_same_shape(1, advantages=advantages)
    if advantages.shape[0] != shape[0]:
        raise ValueError(f"advantages must be [B] = [{shape[0]}], got {tuple(advantages.shape)}")

    dtype = _float_dtype(lp_theta)
    m = mask != 0
    zero = torch.zeros((), dtype=dtype, device=lp_theta.device)
    # Sanitise padding first: torch.where routes no gradient to masked lp_theta entries.
    theta = torch.where(m, lp_theta.to(dtype), zero)
    old = torch.where(m, lp_old.detach().to(dtype), zero)
    gen = torch.where(m, lp_gen.detach().to(dtype), zero)
    adv = advantages.detach().to(dtype)

    method = config.method
    log_r = old - gen
    w = _method_weight(log_r, method, config.truncation)
    raw_w = _method_weight(log_r, "vis", config.truncation)
    over_cap = (raw_w > config.truncation) & m
    stat = {name: sequence_divergence(old, gen, m, name)
            for name in {config.divergence, "k1_mean", "kl_learner_gen"}}
    gate = _Gate(stat[config.divergence], stat["k1_mean"], stat["kl_learner_gen"],
                 log_r.sum(dim=-1))
    return _weighted_surrogate(theta, old, w, raw_w, over_cap, log_r, gate, adv, m, config)


def _weighted_surrogate(
    theta: Tensor,
    old: Tensor,
    w: Tensor,
    raw_w: Tensor,
    over_cap: Tensor,
    log_ratio_gen: Tensor,
    gate: _Gate,
    adv: Tensor,
    m: Tensor,
    config: LossConfig,
) -> LossOutput:
    """Shared tail of the token- and sequence-level losses: F-TIS filter, clipped
    surrogate weighted by ``w``, aggregation and statistics (inputs already sanitised;
    ``w``/``raw_w``/``over_cap``/``log_ratio_gen`` are ``[B, T]``, per token, with
    ``over_cap`` the completion tokens whose raw weight exceeds C; ``gate`` holds ``[B]``
    per-completion statistics)."""
    dtype = theta.dtype
    zero = torch.zeros((), dtype=dtype, device=theta.device)
    truncated = over_cap if config.method in ("tis", "ftis") else torch.zeros_like(over_cap)
    gated_adv, gated = ftis_filter(adv, gate.gate, config.filter_threshold)
    if config.method == "ftis":
        adv, filtered = gated_adv, gated
    else:
        filtered = torch.zeros_like(gated)

    log_rho = (theta - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    rho = torch.exp(log_rho)
    a_tok = adv.unsqueeze(-1)
    lo, hi = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
    surrogate = torch.minimum(rho * a_tok, rho.clamp(lo, hi) * a_tok)
    per_token = torch.where(m, -w * surrogate, zero)

    n_tokens = m.sum()
    lengths = m.sum(dim=-1)
    if config.aggregation == "token":
        loss = per_token.sum() / n_tokens.clamp(min=1).to(dtype)
    else:
        per_seq = per_token.sum(dim=-1) / lengths.clamp(min=1).to(dtype)
        loss = per_seq.sum() / (lengths > 0).sum().clamp(min=1).to(dtype)

    with torch.no_grad():
        r = rho.detach()
        clipped = ((r < lo) & (a_tok < 0)) | ((r > hi) & (a_tok > 0))
        n_seq = max(m.shape[0], 1)
        tok, seq, mx = Reduction.TOKEN_MEAN, Reduction.SEQ_MEAN, Reduction.MAX
        # Each statistic is declared here, once, with its reduction over micro-batches.
        stats = {
            "is_weight_mean": Stat(_masked_mean(w, m), tok),
            "is_weight_max": Stat(_masked_max(w, m), mx),
            "is_weight_raw_max": Stat(_masked_max(raw_w, m), mx),
            "truncated_frac": Stat(_masked_mean(truncated.to(dtype), m), tok),
            "filtered_frac": Stat(filtered.to(dtype).sum() / n_seq, seq),
            "divergence_mean": Stat(gate.divergence.to(dtype).sum() / n_seq, seq),
            "k1_mean": Stat(gate.k1_mean.to(dtype).sum() / n_seq, seq),
            "gate_mean": Stat(gate.gate.to(dtype).sum() / n_seq, seq),
            "gate_max": Stat(_masked_max(gate.gate.to(dtype), lengths > 0), mx),
            "clip_frac": Stat(_masked_mean(clipped.to(dtype), m), tok),
            "logratio_gen_mean": Stat(_masked_mean(log_ratio_gen, m), tok),
        }
        stats = {k: Stat(s.value.detach().to(dtype), s.reduction) for k, s in stats.items()}
        per_completion = CompletionStats(
            filtered=filtered.detach(),
            gated=gated.detach(),
            gate=gate.gate.detach(),
            k1_mean=gate.k1_mean.detach(),
            divergence=gate.divergence.detach(),
            tokens=lengths.to(torch.int64),
            truncated_tokens=(over_cap & m).sum(dim=-1).to(torch.int64),
            log_ratio_sum=gate.log_ratio_sum.detach(),
        )
    return LossOutput(loss, stats, per_completion)


# ------------------------------------------------------- cross-tokenizer (sequence level)


def sequence_importance_weights(
    seq_lp_old: Tensor,
    seq_lp_gen: Tensor,
    method: str,
    truncation: float = 2.0,
    lengths: Tensor | None = None,
) -> Tensor:
    """Per-completion stop-gradient weight when tokens do not align (DESIGN.md section 6).

    A receiver whose tokenizer differs from the generator's cannot pair per-token
    log-probs; it re-tokenizes the completion text and compares whole-sequence
    log-likelihoods ``S_old = sum_t lp_old_t`` (its own tokens) and ``S_gen = sum_t
    lp_gen_t`` (the generator's tokens) -- both estimate log P(text | question) under
    each model, so ``exp(S_old - S_gen)`` is the sequence-level importance ratio
    pi_learner(y) / pi_gen(y) (sequence-level IS as in GSPO, Zheng et al. 2025,
    arXiv 2507.18071, without its length normalisation), truncated like TIS:

    * ``on_policy``, ``nois``: ``w = 1``;
    * ``vis``: ``w = exp(S_old - S_gen)``;
    * ``tis``, ``ftis``: ``w = min(exp(S_old - S_gen), C)``.

    With ``lengths`` (the length-normalised, "geometric" variant) the log-ratio is
    divided by the completion's length first, ``exp((S_old - S_gen) / n)``: the
    per-token geometric mean ratio that GSPO (arXiv 2507.18071, eq. 7) uses. Between
    model families ``S_old - S_gen`` is typically tens of nats (docs/heterogeneity.md),
    which makes the plain sequence weight vanish; the geometric one stays usable.

    The log-ratio is clamped to ``[-20, 20]`` (and to ``log C`` for truncated methods)
    before ``exp``.

    Args:
        seq_lp_old: ``[B]`` learner sequence log-likelihoods (nats, summed over tokens).
        seq_lp_gen: ``[B]`` generator sequence log-probs (nats, summed over its tokens).
        method: one of :data:`METHODS`.
        truncation: C, finite and ``> 0``.
        lengths: optional ``[B]`` positive token counts ``n`` (the learner's tokens).

    Returns:
        ``[B]`` detached weights, float32 (float64 for float64 inputs).

    Raises:
        ValueError: on an unknown method, invalid C or shape mismatch.
    """
    _check_method(method)
    _check_truncation(truncation)
    _check_same_shape(1, seq_lp_old=seq_lp_old, seq_lp_gen=seq_lp_gen)
    dtype = _float_dtype(seq_lp_old, seq_lp_gen)
    log_ratio = seq_lp_old.detach().to(dtype) - seq_lp_gen.detach().to(dtype)
    if lengths is not None:
        _check_same_shape(1, seq_lp_old=seq_lp_old, lengths=lengths)
        log_ratio = log_ratio / lengths.detach().to(dtype).clamp(min=1.0)
    return _method_weight(log_ratio, method, truncation)


def sequence_level_divergence(
    seq_lp_old: Tensor,
    seq_lp_gen: Tensor,
    estimator: str = DEFAULT_DIVERGENCE,
    lengths: Tensor | None = None,
) -> Tensor:
    """Per-completion gate statistic when tokens do not align (DESIGN.md section 6).

    Only the two sequence log-likelihoods are comparable across tokenizers: ``S_old`` (the
    learner's summed log-probs of its re-tokenization, ``n`` tokens) and ``S_gen`` (the
    generator's summed sampler log-probs). With ``x = (S_old - S_gen) / n``, the
    length-normalised log-ratio (GSPO eq. 7's per-token geometric mean, in nats/token):

    * ``k1_mean``: ``-x = (S_gen - S_old) / n``, the k1 mean of :func:`sequence_divergence`
      with the per-token ratios replaced by their geometric mean (equal when the two
      tokenizations coincide). **Not clamped**: a cross-family completion the learner
      finds unlikely has a large value and is gated like a same-family one.
    * ``k3_mean``: ``(e^x - 1) - x``, k3 applied to the geometric-mean ratio (an
      approximation: the per-token ratios are not observable across tokenizers); only
      ``e^x`` is clamped (``x <= 20``).

    The legacy summed estimators apply the per-token formula once to the whole sequence,
    ``R = exp(S_old - S_gen)``: ``kl_learner_gen`` ``R log R - R + 1`` (log R clamped to
    ``[-20, 20]``; at most 1 nat as R -> 0, which makes cross-family F-TIS plain TIS),
    ``kl_gen_learner`` ``(R - 1) - log R`` (only the ``exp`` clamped). Both are
    single-sample estimates of the KL between the models' distributions over completion
    texts (by the chain rule, the summed per-token KLs: the scale of g = 50).

    Args:
        seq_lp_old: ``[B]`` learner sequence log-likelihoods (nats).
        seq_lp_gen: ``[B]`` generator sequence log-probs (nats).
        estimator: one of :data:`DIVERGENCES` (default ``k1_mean``).
        lengths: ``[B]`` the learner's token counts ``n`` (>= 0); required for
            :data:`PER_TOKEN_DIVERGENCES`, ignored by the summed ones. A row with
            ``n = 0`` gets 0.

    Returns:
        ``[B]`` detached statistics (nats per token, or nats for the summed estimators),
        float32 (float64 for float64 inputs).

    Raises:
        ValueError: on an unknown estimator, shape mismatch, or missing ``lengths`` for a
            per-token estimator.
    """
    _check_divergence(estimator)
    _check_same_shape(1, seq_lp_old=seq_lp_old, seq_lp_gen=seq_lp_gen)
    dtype = _float_dtype(seq_lp_old, seq_lp_gen)
    log_r = seq_lp_old.detach().to(dtype) - seq_lp_gen.detach().to(dtype)
    if estimator in PER_TOKEN_DIVERGENCES:
        if lengths is None:
            raise ValueError(f"{estimator} needs the learner's token counts (lengths)")
        _check_same_shape(1, seq_lp_old=seq_lp_old, lengths=lengths)
        n = lengths.detach().to(dtype)
        x = log_r / n.clamp(min=1.0)
        d = _divergence_terms(x, estimator)
        return torch.where(n > 0, d, torch.zeros_like(d))
    return _divergence_terms(log_r, estimator)


def sequence_level_policy_loss(
    lp_theta: Tensor,
    lp_old: Tensor,
    seq_lp_gen: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    length_normalized: bool = False,
) -> LossOutput:
    """:func:`policy_loss` for completions from a generator with another tokenizer.

    Identical to :func:`policy_loss` (clipped surrogate, aggregation, F-TIS filter)
    except that the generator is known only through its sequence log-prob ``S_gen``:
    every token of completion ``i`` gets the same weight
    ``w_i = sequence_importance_weights(S_old_i, S_gen_i, method, C)`` with
    ``S_old_i = sum_t lp_old_it``, and the gate statistic is
    :func:`sequence_level_divergence` with ``n_i`` the learner's token count (default
    ``k1_mean``: ``(S_gen - S_old) / n``, unclamped, against the same delta as
    same-tokenizer samples). ``nois`` gives ``w = 1`` (DESIGN.md section 6: the fallback
    when configured). Statistics are those of :func:`policy_loss`, with the sequence
    weight broadcast to the completion's tokens, ``logratio_gen_mean`` the
    token-weighted mean of ``S_old - S_gen``, ``k1_mean`` the length-normalised
    ``(S_gen - S_old) / n`` and ``divergence_mean`` the sequence-level ``kl_learner_gen``.

    Args:
        lp_theta: ``[B, T]`` learner log-probs of the re-tokenized completion, with grad.
        lp_old: ``[B, T]`` the same at the step start (detached here).
        seq_lp_gen: ``[B]`` generator sequence log-probs (nats).
        advantages: ``[B]`` advantages (detached here).
        mask: ``[B, T]`` non-zero on completion tokens.
        config: :class:`LossConfig`.
        length_normalized: weight ``exp((S_old - S_gen) / n_i)`` (the geometric variant
            of :func:`sequence_importance_weights`); the gate is unchanged.

    Returns:
        :class:`LossOutput` as :func:`policy_loss`; ``is_weight_raw_max`` and
        ``truncated_frac`` refer to the weight actually used (plain or geometric);
        ``per_completion.log_ratio_sum`` is ``S_old - S_gen``.

    Raises:
        TypeError: if ``config`` is not a :class:`LossConfig`.
        ValueError: on shape mismatch.
    """
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig, got {type(config).__name__}")
    shape = _check_same_shape(2, lp_theta=lp_theta, lp_old=lp_old, mask=mask)
    _check_same_shape(1, advantages=advantages, seq_lp_gen=seq_lp_gen)
    if advantages.shape[0] != shape[0]:
        raise ValueError(f"advantages and seq_lp_gen must be [B] = [{shape[0]}], got "
                         f"{tuple(advantages.shape)}")
    dtype = _float_dtype(lp_theta)
    m = mask != 0
    zero = torch.zeros((), dtype=dtype, device=lp_theta.device)
    theta = torch.where(m, lp_theta.to(dtype), zero)
    old = torch.where(m, lp_old.detach().to(dtype), zero)
    s_old = old.sum(dim=-1)
    s_gen = seq_lp_gen.detach().to(dtype)
    adv = advantages.detach().to(dtype)
    method = config.method
    n = m.sum(dim=-1).to(dtype)
    w_lengths = n if length_normalized else None
    w_seq = sequence_importance_weights(s_old, s_gen, method, config.truncation, w_lengths)
    raw_seq = sequence_importance_weights(s_old, s_gen, "vis", config.truncation, w_lengths)
    stat = {name: sequence_level_divergence(s_old, s_gen, name, n)
            for name in {config.divergence, "k1_mean", "kl_learner_gen"}}
    gate = _Gate(stat[config.divergence], stat["k1_mean"], stat["kl_learner_gen"],
                 s_old - s_gen)
    per_tok = torch.ones_like(old)
    over_cap = (raw_seq > config.truncation).unsqueeze(-1) & m
    return _weighted_surrogate(
        theta, old, w_seq.unsqueeze(-1) * per_tok, raw_seq.unsqueeze(-1) * per_tok,
        over_cap, (s_old - s_gen).unsqueeze(-1) * per_tok, gate, adv, m, config,
    )
