"""Spot checks (issue 13, class 1): the statistic, the decision and the keyed draw by
hand; the worker's recomputation against the sampler's own recording on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from ftis.coordinator import reputation
from ftis.coordinator.spot_check import (
    HeldModel,
    LogprobDiscrepancy,
    SpotCheckSettings,
    check_rate,
    logprob_discrepancy,
    pearson,
    selected,
    spot_check_failed,
    tolerance,
)
from ftis.v1 import bundle_pb2


def test_discrepancy_by_hand() -> None:
    # diffs: +0.5, -1.0 | +2.0  -> mean |d| = 3.5 / 3, signed = 1.5 / 3, max 2.0
    d = logprob_discrepancy([[-1.0, -2.0], [-0.5]], [[-1.5, -1.0], [-2.5]])
    assert d.tokens == 3
    assert d.mean_abs == pytest.approx(3.5 / 3)
    assert d.mean_signed == pytest.approx(1.5 / 3)
    assert d.max_abs == pytest.approx(2.0)


def test_correlation_by_hand() -> None:
    # claimed = 2 * recomputed: perfectly correlated, off by |y| per token
    d = logprob_discrepancy([[-2.0, -4.0, -6.0]], [[-1.0, -2.0, -3.0]])
    assert d.correlation == pytest.approx(1.0) and d.mean_abs == pytest.approx(2.0)
    # x - 2 = [-1, 0, 1], y - 2 = [-1, 1, 0]: sxy = 1, sxx = syy = 2 -> 1 / 2
    assert pearson([1.0, 2.0, 3.0], [1.0, 3.0, 2.0]) == pytest.approx(0.5)
    assert pearson([1.0, 2.0], [-1.0, -2.0]) == pytest.approx(-1.0)
    assert pearson([-0.7, -0.7, -0.7], [-0.1, -3.0, -0.5]) == 0.0  # a constant claim
    assert pearson([-0.1, -3.0, -0.5], [-0.7, -0.7, -0.7]) == 1.0  # nothing to follow


def test_discrepancy_refuses_misaligned_or_non_finite_input() -> None:
    with pytest.raises(ValueError, match="completions"):
        logprob_discrepancy([[-1.0]], [])
    with pytest.raises(ValueError, match="tokens"):
        logprob_discrepancy([[-1.0, -2.0]], [[-1.0]])
    with pytest.raises(ValueError, match="non-finite"):
        logprob_discrepancy([[-math.inf]], [[-1.0]])
    assert logprob_discrepancy([[]], [[]]) == LogprobDiscrepancy(0, 0.0, 0.0, 0.0)


def test_decision_needs_both_enough_tokens_and_a_mean_over_the_tolerance() -> None:
    assert spot_check_failed(LogprobDiscrepancy(8, 0.51, 0.0, 3.0), 0.5, 8)
    assert not spot_check_failed(LogprobDiscrepancy(8, 0.49, 0.0, 30.0), 0.5, 8)  # mean
    assert not spot_check_failed(LogprobDiscrepancy(7, 5.0, 5.0, 5.0), 0.5, 8)  # few tokens


def test_tolerance_grows_with_the_training_a_node_can_have_done() -> None:
    s = SpotCheckSettings(models=["m"], tolerance_nats=0.1, drift_per_version_nats=0.1,
                          reduced_precision_nats=0.05)
    assert tolerance(s, 0, 0, "float32") == pytest.approx(0.1)
    assert tolerance(s, 3, 10, "float32") == pytest.approx(0.4)  # 0.1 + 3 x 0.1
    # a claimed version is capped by the verified bundles behind it: a new node's first
    # bundle is judged against the held weights themselves, whatever it claims
    assert tolerance(s, 1_000_000, 0, "float32") == pytest.approx(0.1)
    assert tolerance(s, 1_000_000, 2, "float32") == pytest.approx(0.3)
    assert tolerance(s, 0, 0, "bfloat16") == pytest.approx(0.15)
    assert tolerance(s, -5, 3, "") == pytest.approx(0.1)


def test_the_draw_is_deterministic_keyed_and_hits_its_rate() -> None:
    ids = [f"{i:064x}" for i in range(4000)]
    hits = sum(selected(b, b"k1", 0.25) for b in ids)
    # binomial(4000, 0.25): sd 27.4; 5 sd either side
    assert 1000 - 137 < hits < 1000 + 137
    assert [selected(b, b"k1", 0.25) for b in ids[:50]] == [
        selected(b, b"k1", 0.25) for b in ids[:50]]
    # another key draws another sample (they agree on about 1/4 + 3/4 * 3/4... not all)
    other = [selected(b, b"k2", 0.25) for b in ids]
    assert other != [selected(b, b"k1", 0.25) for b in ids]
    assert all(selected(b, b"", 1.0) for b in ids[:10])
    assert not any(selected(b, b"k1", 0.0) for b in ids[:10])


def test_probation_sets_the_rate() -> None:
    s = SpotCheckSettings(models=["m"], probation_rate=1.0, established_rate=0.01)
    assert check_rate(True, s) == 1.0 and check_rate(False, s) == 0.01
    assert not SpotCheckSettings().enabled and s.enabled


def test_held_model_ignores_peft_and_dtype_but_not_quantization() -> None:
    card = bundle_pb2.ModelCard(base_model="b", quantization="q", tokenizer_fingerprint="f",
                                peft="none", dtype="float32")
    lora = bundle_pb2.ModelCard(base_model="b", quantization="q", tokenizer_fingerprint="f",
                                peft="lora", dtype="bfloat16")
    nf4 = bundle_pb2.ModelCard(base_model="b", quantization="q+bnb-nf4",
                               tokenizer_fingerprint="f")
    assert HeldModel.of_card(card) == HeldModel.of_card(lora) != HeldModel.of_card(nf4)


def test_a_failed_spot_check_quarantines_a_node_on_probation_without_a_ban() -> None:
    cfg = reputation.ReputationConfig()
    decision = reputation.rejection_decision("LOGPROB_SPOT_CHECK_FAILED", "r", "b" * 64, cfg)
    assert decision.evidence.weight == -4.0
    assert not decision.keep_proof and decision.ban_reason is None
    # E = (0 + 1) / (0 + 4 + 2) = 1/6 < probation threshold 0.45
    assert (0 + 1) / (0 + 4 + 2) < cfg.probation_threshold


@pytest.mark.parametrize(("temperature", "top_p", "top_k"),
                         [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.3, 0.9, 0), (0.8, 1.0, 20)])
def test_recompute_equals_the_samplers_recording(tiny_model_dir, temperature: float,
                                                 top_p: float, top_k: int) -> None:
    """The worker's one-pass recomputation gives the log-probs the KV-cached sampler
    recorded, for every sampling setting a bundle can carry."""
    from ftis.client.rollout.sampler import SamplingSettings, sample_groups
    from ftis.coordinator import spot_check_worker

    (key,) = spot_check_worker.load_models([str(tiny_model_dir)])
    policy = spot_check_worker._POLICIES[key]  # noqa: SLF001
    prompt, _ = policy.prompt_token_ids([{"role": "user", "content": "What is 4 + 3?"}])
    settings = SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k,
                                max_new_tokens=12)
    result = sample_groups(policy.model, [prompt], 4, settings, policy.eos_token_ids,
                           policy.tokenizer.pad_token_id, torch.Generator().manual_seed(3))
    group = result.completions[0]
    recomputed = spot_check_worker.recompute_logprobs(
        key, prompt, [c.token_ids for c in group], temperature, top_p, top_k)
    d = logprob_discrepancy([c.logprobs for c in group], recomputed)
    assert d.tokens == sum(len(c.token_ids) for c in group) > 0
    assert d.max_abs < 1e-4, d
    # and a uniform shift of the claims shows up as exactly that shift
    shaded = [[x + 1.0 for x in c.logprobs] for c in group]
    assert logprob_discrepancy(shaded, recomputed).mean_signed == pytest.approx(1.0, abs=1e-4)
