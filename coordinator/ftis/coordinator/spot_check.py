"""Spot checks of sampler log-probs against weights the coordinator holds (issue 13,
class 1; docs/threat-model.md section 4.1).

Reputation is earned by verified bundles. Verification checks that a bundle is
*consistent* (signature, lease, ids, text, prompt, re-scored rewards), not that a model
produced it: a node with no model can compute the answers of arithmetic tasks, encode
them with the public tokenizer, make up log-probs and pass every other check. What such
a node cannot do is produce the log-probs a real model assigns to its tokens. Where the
coordinator holds the weights of the sender's model card, it recomputes the sampler
log-probs of a bundle's completions,

    log softmax(filter(logits / T))[token]        (the sampler's own recording rule,
                                                   ``ftis.client.rollout.sampler``)

with the bundle's own sampling settings, and compares them with the claimed ones.
A fabricated bundle differs by nats per token; an honest one by float rounding plus the
drift of its few training steps (section "Tolerance" of docs/threat-model.md 4.1).

This module is the pure part: which cards can be checked (:class:`HeldModel`), which
bundles are checked (:func:`selected`, keyed so that a sender cannot grind its payload
out of the sample), the statistic (:func:`logprob_discrepancy`) and the decision
(:func:`tolerance`, :func:`spot_check_failed`). The forward pass runs in a worker process
(:mod:`ftis.coordinator.spot_check_worker`, through :class:`SpotChecker
<ftis.coordinator.spot_check_pool.SpotChecker>`).
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, Field

from ftis.v1 import bundle_pb2


class SpotCheckSettings(BaseModel):
    """The coordinator's ``spot_checks`` section.

    Attributes:
        models: models the coordinator loads and checks against (an alias such as
            ``smollm2-135m``, a ``.gguf`` file or a model directory, as for
            ``ftis-client start --model``). Empty: spot checks are off. Needs the
            ``ftis-coordinator[spot-checks]`` extra (torch and the client's loader).
        probation_rate: share of a probationary node's bundles that are checked (a node
            is on probation until ``reputation.probation_bundles`` verified bundles).
        established_rate: share of other nodes' bundles that are checked. Training moves
            an established node's policy away from the held weights, so a rate above 0
            needs ``tolerance_nats`` above the swarm's drift (docs/threat-model.md 4.1).
        tolerance_nats: largest accepted mean over tokens of
            ``|claimed - recomputed|`` log-prob for a bundle sampled from the held
            weights themselves (policy version 0), nats/token (:func:`tolerance`).
        drift_per_version_nats: added to the tolerance per optimizer step the sender may
            have taken: ``min(policy_version, bundles_accepted)``, so a node can only
            claim as much training as it has verified bundles behind it.
        reduced_precision_nats: added when the card's compute dtype is not float32
            (bfloat16 or float16 sampling on a GPU).
        min_tokens: bundles with fewer completion tokens are not judged (their mean is
            too noisy to call a lie).
        workers: worker processes holding the models (each loads every model once).
        budget_s: seconds one check may take before it is skipped (never charged: a slow
            coordinator is not the sender's fault).
        load_timeout_s: seconds the first check waits for the models to load.
        required: registration refuses (MODEL_NOT_CHECKABLE) a model card whose weights
            the coordinator does not hold, so that standing can only be earned by nodes
            whose log-probs can be checked.
    """

    models: list[str] = Field(default_factory=list)
    probation_rate: float = Field(1.0, ge=0, le=1)
    established_rate: float = Field(0.0, ge=0, le=1)
    tolerance_nats: float = Field(0.1, gt=0)
    drift_per_version_nats: float = Field(0.1, ge=0)
    reduced_precision_nats: float = Field(0.1, ge=0)
    min_tokens: int = Field(8, ge=1)
    workers: int = Field(1, ge=1, le=16)
    budget_s: float = Field(30.0, gt=0, le=600)
    load_timeout_s: float = Field(600.0, gt=0)
    required: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.models)


@dataclass(frozen=True)
class HeldModel:
    """The fields of a model card that decide whether held weights can check it.

    Same base model, same weight quantization and same tokenizer: then the held weights
    are the sender's initial policy. PEFT kind and compute dtype do not enter (a LoRA's
    adapters start at zero; float32 and bfloat16 differ by rounding, within the
    tolerance).
    """

    base_model: str
    quantization: str
    tokenizer_fingerprint: str

    @classmethod
    def of_card(cls, card: bundle_pb2.ModelCard) -> HeldModel:
        return cls(card.base_model, card.quantization, card.tokenizer_fingerprint)


@dataclass(frozen=True)
class LogprobDiscrepancy:
    """Claimed vs recomputed sampler log-probs of one bundle.

    Attributes:
        tokens: completion tokens compared.
        mean_abs: mean over tokens of ``|claimed - recomputed|``, nats/token.
        mean_signed: mean over tokens of ``claimed - recomputed``, nats/token (> 0: the
            sender claims its tokens were likelier than the held weights say).
        max_abs: largest single-token ``|claimed - recomputed|``, nats.
        correlation: Pearson correlation over tokens of claimed and recomputed log-probs,
            in [-1, 1]; 1.0 when the recomputed ones do not vary (nothing to follow),
            0.0 when only the claimed ones do not (a constant claim follows nothing).
    """

    tokens: int
    mean_abs: float
    mean_signed: float
    max_abs: float
    correlation: float = 1.0


def logprob_discrepancy(claimed: Sequence[Sequence[float]],
                        recomputed: Sequence[Sequence[float]]) -> LogprobDiscrepancy:
    """Token-level comparison of per-completion log-prob lists (nats, <= 0).

    Args:
        claimed: ``[G][T_i]`` the bundle's log-probs.
        recomputed: ``[G][T_i]`` the held weights' log-probs of the same tokens.

    Raises:
        ValueError: different numbers of completions or tokens, or a non-finite value.
    """
    if len(claimed) != len(recomputed):
        raise ValueError(f"{len(claimed)} claimed vs {len(recomputed)} recomputed completions")
    xs: list[float] = []
    ys: list[float] = []
    for i, (a, b) in enumerate(zip(claimed, recomputed, strict=True)):
        if len(a) != len(b):
            raise ValueError(f"completion {i}: {len(a)} claimed vs {len(b)} recomputed tokens")
        xs += map(float, a)
        ys += map(float, b)
    if not all(math.isfinite(v) for v in (*xs, *ys)):
        raise ValueError("non-finite log-prob")
    n = len(xs)
    if n == 0:
        return LogprobDiscrepancy(0, 0.0, 0.0, 0.0)
    diffs = [x - y for x, y in zip(xs, ys, strict=True)]
    return LogprobDiscrepancy(n, sum(map(abs, diffs)) / n, sum(diffs) / n,
                              max(map(abs, diffs)), pearson(xs, ys))


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson correlation of two equal-length samples (conventions of
    :attr:`LogprobDiscrepancy.correlation` for zero variance)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if syy <= 1e-12:
        return 1.0
    if sxx <= 1e-12:
        return 0.0
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    return max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))


def tolerance(settings: SpotCheckSettings, policy_version: int, bundles_accepted: int,
              dtype: str) -> float:
    """The largest accepted mean ``|claimed - recomputed|`` (nats/token) for a bundle.

    ``tolerance_nats + drift_per_version_nats * min(policy_version, bundles_accepted)``,
    plus ``reduced_precision_nats`` for a compute dtype other than float32. Training
    moves a policy away from the held weights by about 0.03-0.07 nats/token per step
    (bench/spot_check_margin.py: full fine-tune, lr 1e-5); the version is the sender's
    own claim, so it is capped by the verified bundles the node has, which every
    honest round adds to before its next optimizer step. A new node's first bundle is
    therefore judged at ``tolerance_nats`` whatever version it claims.
    """
    steps = max(0, min(int(policy_version), int(bundles_accepted)))
    extra = settings.reduced_precision_nats if dtype not in ("", "float32") else 0.0
    return settings.tolerance_nats + settings.drift_per_version_nats * steps + extra


def spot_check_failed(d: LogprobDiscrepancy, limit: float, min_tokens: int) -> bool:
    """True when the bundle has at least ``min_tokens`` tokens and its mean absolute
    discrepancy exceeds ``limit`` (:func:`tolerance`)."""
    return d.tokens >= min_tokens and d.mean_abs > limit


def check_rate(on_probation: bool, settings: SpotCheckSettings) -> float:
    """The share of a node's bundles that are checked."""
    return settings.probation_rate if on_probation else settings.established_rate


def selected(bundle_id: str, key: bytes, rate: float) -> bool:
    """Whether bundle ``bundle_id`` is in the checked share ``rate``.

    The draw is ``HMAC-SHA256(key, bundle_id)`` read as a uniform in [0, 1): the same
    bundle always gets the same answer (a retry cannot escape it), and without the
    coordinator's secret ``key`` a sender cannot tell which of its candidate payloads
    would be checked, so grinding ``created_at_ms`` does not help.
    """
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    digest = hmac.new(key, bundle_id.encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < rate


def failure_reason(d: LogprobDiscrepancy, limit: float) -> str:
    """The one-line reason of a LOGPROB_SPOT_CHECK_FAILED rejection."""
    return (f"claimed log-probs differ from the held weights' by {d.mean_abs:.3f} "
            f"nats/token on average over {d.tokens} tokens (mean signed "
            f"{d.mean_signed:+.3f}, max {d.max_abs:.2f}, correlation {d.correlation:.2f}; "
            f"tolerance {limit:.3g})")
