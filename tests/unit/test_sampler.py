"""Sampler log-probs are those of the distribution the tokens were drawn from."""

import pytest
import torch

from ftis.client.rollout.sampler import SamplingSettings, filter_logits, sample_groups
from ftis.v1 import bundle_pb2


def _full_forward_logprobs(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_match_a_full_forward_pass(tiny_policy_factory, temperature):
    pol = tiny_policy_factory()
    prompts = [[1, 5, 6, 7, 8], [1, 9, 10]]  # different lengths: left padding is exercised
    res = sample_groups(pol.model, prompts, 3, SamplingSettings(temperature, max_new_tokens=12),
                        pol.eos_token_ids, pol.tokenizer.pad_token_id,
                        torch.Generator().manual_seed(0))
    assert len(res.completions) == 2 and all(len(g) == 3 for g in res.completions)
    for prompt, group in zip(prompts, res.completions, strict=True):
        for c in group:
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= 12
            expected = _full_forward_logprobs(pol.model, prompt, c.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=2e-4, rtol=0)
            assert all(lp <= 0 for lp in c.logprobs)
    assert res.generated_tokens == sum(len(c.token_ids) for g in res.completions for c in g)


def test_finish_reason_and_eos_cut(tiny_policy_factory):
    pol = tiny_policy_factory()
    # every token is "eos": completions stop after exactly one token
    res = sample_groups(pol.model, [[1, 5]], 4, SamplingSettings(max_new_tokens=5),
                        list(range(pol.card.vocab_size)), pol.tokenizer.pad_token_id)
    for c in res.completions[0]:
        assert len(c.token_ids) == 1 and c.finish_reason == bundle_pb2.FINISH_REASON_STOP
    res = sample_groups(pol.model, [[1, 5]], 2, SamplingSettings(max_new_tokens=3), [],
                        pol.tokenizer.pad_token_id)
    for c in res.completions[0]:
        assert len(c.token_ids) == 3 and c.finish_reason == bundle_pb2.FINISH_REASON_LENGTH


def test_same_seed_same_samples(tiny_policy_factory):
    pol = tiny_policy_factory()
    runs = [sample_groups(pol.model, [[1, 5, 6]], 4, SamplingSettings(max_new_tokens=8),
                          pol.eos_token_ids, 0, torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert [c.token_ids for c in runs[0].completions[0]] == \
        [c.token_ids for c in runs[1].completions[0]]


def test_filter_logits_top_k_and_top_p():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k2 = filter_logits(scores, top_k=2, top_p=1.0)
    assert torch.isinf(k2[0, 2:]).all() and torch.isfinite(k2[0, :2]).all()
    # nucleus 0.7: keep 0.5 and 0.3 (cumulative 0.8 is the first to reach 0.7)
    p = filter_logits(scores, top_k=0, top_p=0.7)
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()
    torch.testing.assert_close(filter_logits(scores, 0, 1.0), scores)


def test_invalid_settings_raise():
    with pytest.raises(ValueError):
        SamplingSettings(temperature=0)
    with pytest.raises(ValueError):
        SamplingSettings(top_p=1.5)
