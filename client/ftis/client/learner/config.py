"""The learner's settings: every enumeration and default of the loss and the optimiser,
defined once (issue 14, section 5).

:class:`LossConfig` and :class:`LearnerConfig` are frozen pydantic models, not dataclasses
built from a pydantic twin: the maths (:mod:`ftis.client.learner.loss`,
:mod:`ftis.client.learner.trainer`) reads them by attribute exactly as it read the
dataclasses, while each field's default, bounds and description live in one
``Field(...)`` that :class:`~ftis.client.node.config.ClientConfig` copies and
``ftis-client start`` turns into a flag (default and help included). A twin would keep
two lists of fields that must agree; here there is one.

The module imports neither torch nor transformers, so that the CLI can read the fields
without loading them. The enumerations are ``Literal`` aliases; their tuples
(:data:`METHODS`, :data:`DIVERGENCES`, ...) are derived with :func:`typing.get_args`.

Sources: F-TIS, arXiv 2605.22537 (C = 2, g = 50, eps = 0.2, lr 1e-6 full fine-tune); DAPO,
Yu et al., arXiv 2503.14476 (section 3.1 clip-higher: eps_high > eps_low; section 3.3
token-level loss); GRPO, arXiv 2402.03300 (sequence-level mean); DeepSeek-V3.2 OPSM and
TRL's ``off_policy_mask_threshold`` (the k1-mean gate, delta = 1 nat/token).
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "AGGREGATIONS",
    "CROSS_TOKENIZER_MODES",
    "DEFAULT_DIVERGENCE",
    "DEFAULT_FILTER_THRESHOLD",
    "DIVERGENCES",
    "LORA_LEARNING_RATE",
    "SMALL_MODEL_LEARNING_RATE",
    "SMALL_MODEL_PARAMETERS",
    "default_learning_rate",
    "METHODS",
    "PER_TOKEN_DIVERGENCES",
    "SUMMED_DIVERGENCES",
    "SUMMED_FILTER_THRESHOLD",
    "Aggregation",
    "CrossTokenizer",
    "Divergence",
    "LearnerConfig",
    "LossConfig",
    "Method",
    "PerTokenDivergence",
    "SummedDivergence",
    "default_filter_threshold",
]

Method = Literal["on_policy", "nois", "vis", "tis", "ftis"]
"""Learner objectives (DESIGN.md section 4 table; F-TIS §3 baselines).

* ``on_policy`` -- w = 1; the caller passes only the learner's own (local) rollouts.
* ``nois``      -- w = 1 on every rollout, shared ones included (SAPO as published).
* ``vis``       -- w = exp(lp_old - lp_gen), vanilla importance sampling.
* ``tis``       -- w = min(exp(lp_old - lp_gen), C), truncated importance sampling (TIS).
* ``ftis``      -- TIS weights plus the F-TIS advantage filter (``loss.ftis_filter``).
"""
METHODS: tuple[str, ...] = get_args(Method)

PerTokenDivergence = Literal["k1_mean", "k3_mean"]
"""Gate statistics in **nats per token** (a mean over the completion's tokens), so their
threshold does not depend on the completion's length (``loss.sequence_divergence``).

* ``k1_mean`` -- mean of k1 = lp_gen - lp_old = -log r (DeepSeek-V3.2 OPSM, TRL's
  ``off_policy_mask_threshold``). Grows without bound as pi_theta / pi_gen -> 0 and is
  negative where the learner prefers the tokens.
* ``k3_mean`` -- mean of Schulman's k3 of KL(pi_gen || pi_theta), (r - 1) - log r >= 0.
  Grows as r -> 0 (like -log r) **and** as r -> inf (like r).
"""
PER_TOKEN_DIVERGENCES: tuple[str, ...] = get_args(PerTokenDivergence)

SummedDivergence = Literal["kl_learner_gen", "kl_gen_learner"]
"""Legacy statistics in **nats per sequence** (summed over tokens; threshold g, paper 50).

* ``kl_learner_gen`` -- per-token r log r - r + 1, estimates KL(pi_learner || pi_gen),
  the direction written in the F-TIS filter. Bounded by 1 nat/token as r -> 0, so it
  keeps exactly the negatives the learner finds most unlikely: the wrong gate.
* ``kl_gen_learner`` -- per-token k3, (r - 1) - log r, estimates KL(pi_gen || pi_learner).
"""
SUMMED_DIVERGENCES: tuple[str, ...] = get_args(SummedDivergence)

Divergence = Literal[PerTokenDivergence, SummedDivergence]
"""Every accepted ``LossConfig.divergence`` (the F-TIS gate statistic)."""
DIVERGENCES: tuple[str, ...] = get_args(Divergence)

Aggregation = Literal["token", "sequence"]
"""Loss aggregation: ``token`` (DAPO §3.3, the default) or ``sequence`` (GRPO eq. 3)."""
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)

CrossTokenizer = Literal["off", "sequence", "geometric", "nois"]
"""How a node learns from bundles of another tokenizer (DESIGN.md section 6): ``off``
ignores them; the others re-tokenize the text and use the method's sequence-level weight
(``sequence``), the same weight length-normalised, GSPO-style (``geometric``), or
weight 1 (``nois``)."""
CROSS_TOKENIZER_MODES: tuple[str, ...] = get_args(CrossTokenizer)

DEFAULT_DIVERGENCE: Divergence = "k1_mean"
"""Default gate statistic (DESIGN.md section 4: per-token mean, grows as r -> 0)."""

DEFAULT_FILTER_THRESHOLD = 1.0
"""Default gate threshold delta, in nats per token, for the per-token statistics.

Reasoning. ``k1_mean >= 1`` means the learner gives the completion's tokens, on
geometric average, at most 1/e ~ 0.37 of the generator's probability. The learner's own
samples have k1 mean 0; same-base partners measured in docs/results.md (full vs LoRA:
~0.005 nat/token; 4-bit NF4 vs float32: ~0.06-0.4 nat/token, from the legacy summed D
over 32 tokens) are well below 1, so they are never gated; a negative sample with
log r = -3 on every token (k1 mean 3: the learner would produce each token with ~5% of
the generator's probability) is gated at every length. TRL
suggests starting at delta = 0.5 for within-run staleness; collaborative partners are
more diverse by design, hence the looser 1.0. The legacy summed statistics need their
own threshold (:data:`SUMMED_FILTER_THRESHOLD`, the paper's g = 50 summed nats).
"""

SUMMED_FILTER_THRESHOLD = 50.0
"""The paper's g = 50 summed nats: the client's threshold for the legacy summed
statistics (:data:`SUMMED_DIVERGENCES`) when none is given."""

LORA_LEARNING_RATE = 2e-4
"""The client's learning rate for LoRA and QLoRA adapters when none is given (a full
fine-tune uses ``LearnerConfig``'s default, the paper's 1e-6).

2e-4 is the low end of the range that moves the embedded 135M model's adapters in tens
of steps (DESIGN.md §4: 2e-4 to 5e-4; the demo's LoRA client learns at 3e-4,
docs/demo.md) and the learning rate the QLoRA paper (Dettmers et al. 2023) used for 7B
and 13B models. It was 1e-5 until 2026-11-24, under which 12-24 GRPO steps changed none
or 1-2 of 116 held-out answers of any LoRA model (docs/merit.md, "The first run")."""


SMALL_MODEL_PARAMETERS = 1_000_000_000
"""Below this many base-model parameters a full fine-tune defaults to
:data:`SMALL_MODEL_LEARNING_RATE` instead of ``LearnerConfig``'s (the paper's) 1e-6."""

SMALL_MODEL_LEARNING_RATE = 1e-5
"""The full fine-tune learning rate for models under :data:`SMALL_MODEL_PARAMETERS`.

The F-TIS paper's 1e-6 is for 1.5B-3B models over 50 iterations. On the embedded
SmolLM2-135M it does not move the policy in tens of steps (DESIGN.md §4; issue 11: at 2e-6
the largest learner/generator ratio after 10 rounds was 1.08-1.12), while 1e-5 does: the
demo's full client goes from sampled held-out pass@1 0.258 to 0.748 in 20 rounds, p =
5e-05 (docs/demo.md), and the 1e-5 learners of docs/results.md E learn too."""


def default_learning_rate(peft: str, parameter_count: int | None) -> float:
    """The learning rate a client uses when none is given.

    Args:
        peft: ``"none"`` (full fine-tune), ``"lora"`` or ``"qlora"``.
        parameter_count: the base model's parameters (``ModelCard.parameter_count``),
            or ``None`` when not known yet.

    Returns:
        :data:`LORA_LEARNING_RATE` for LoRA and QLoRA; for a full fine-tune
        :data:`SMALL_MODEL_LEARNING_RATE` below :data:`SMALL_MODEL_PARAMETERS` parameters,
        else (or when the size is not known) ``LearnerConfig``'s default, the paper's 1e-6.
    """
    if peft in ("lora", "qlora"):
        return LORA_LEARNING_RATE
    if parameter_count is not None and 0 < parameter_count < SMALL_MODEL_PARAMETERS:
        return SMALL_MODEL_LEARNING_RATE
    return float(LearnerConfig.model_fields["learning_rate"].default)


def default_filter_threshold(divergence: str) -> float:
    """The gate threshold in ``divergence``'s unit: :data:`DEFAULT_FILTER_THRESHOLD`
    nats/token for the per-token statistics, :data:`SUMMED_FILTER_THRESHOLD` summed nats
    for the legacy ones."""
    return (DEFAULT_FILTER_THRESHOLD if divergence in PER_TOKEN_DIVERGENCES
            else SUMMED_FILTER_THRESHOLD)


class LossConfig(BaseModel):
    """Hyper-parameters of ``loss.policy_loss`` (defaults: F-TIS paper, DESIGN.md §4).

    Frozen; invalid fields raise ``pydantic.ValidationError`` (a ``ValueError``).
    ``filter_threshold`` defaults to :data:`DEFAULT_FILTER_THRESHOLD` whatever the
    divergence; with a legacy summed divergence set it explicitly (the client does, via
    :func:`default_filter_threshold`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Method = Field("ftis", description="learner objective")
    truncation: float = Field(2.0, gt=0, allow_inf_nan=False,
                              description="C: importance-weight cap (the paper's 2)")
    filter_threshold: float = Field(
        DEFAULT_FILTER_THRESHOLD, gt=0, allow_inf_nan=False,
        description="F-TIS gate threshold in the divergence's unit: delta in nats/token "
        "for the per-token statistics, g in summed nats for the legacy summed ones")
    divergence: Divergence = Field(
        DEFAULT_DIVERGENCE, description="F-TIS gate statistic: k1_mean = mean of log "
        "pi_gen - log pi_learner over the completion's tokens; k3_mean = mean of "
        "Schulman's k3; kl_* = legacy summed estimators")
    clip_eps_low: float = Field(
        0.2, ge=0, lt=1, description="PPO lower clip: the ratio is clipped below at "
        "1 - eps_low (GRPO/F-TIS: 0.2)")
    clip_eps_high: float = Field(
        0.2, ge=0, allow_inf_nan=False, description="PPO upper clip: the ratio is clipped "
        "above at 1 + eps_high (0.2; larger than eps_low is DAPO's clip-higher, "
        "arXiv 2503.14476 section 3.1, e.g. 0.28)")
    aggregation: Aggregation = Field(
        "token", description="loss aggregation: token (DAPO section 3.3) or sequence "
        "(GRPO eq. 3)")
    temperature: float = Field(
        1.0, gt=0, allow_inf_nan=False,
        description="sampler temperature; the learner's log-probs use the same")


class LearnerConfig(BaseModel):
    """Optimisation settings. Defaults follow the F-TIS paper (lr 1e-6 full fine-tune)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    loss: LossConfig = Field(default_factory=LossConfig)
    learning_rate: float = Field(
        1e-6, ge=0, description="AdamW learning rate (the paper's 1e-6 for a full fine-tune)")
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = Field(
        8, ge=1, description="completions per learner forward/backward (memory; same update)")
    share_prompt: bool = Field(
        True, description="run a group's prompt once per micro-batch and its completions "
        "on the repeated key/value cache (same log-probs; micro-batches then hold one "
        "prompt each); false: every completion runs with its prompt")
    scale_advantages_by_std: bool = True
    adam_betas: tuple[float, float] = (0.9, 0.999)
    cross_tokenizer: CrossTokenizer = Field(
        "sequence", description="bundles from another tokenizer: off = ignore; sequence = "
        "re-tokenize the text, sequence-level truncated IS weight; geometric = the same "
        "weight length-normalised (GSPO-style); nois = re-tokenize, weight 1")
