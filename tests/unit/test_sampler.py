"""Sampler log-probs are those of the distribution the tokens were drawn from."""

import pytest
import torch

from ftis.client.rollout import sampler
from ftis.client.rollout.sampler import (
    SamplingSettings,
    StopChecker,
    filter_logits,
    sample_groups,
    sample_inverse_cdf,
)
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
    settings = SamplingSettings(temperature=temperature, max_new_tokens=12)
    res = sample_groups(pol.model, prompts, 3, settings,
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


def test_no_prompts_no_completions(tiny_policy_factory):
    pol = tiny_policy_factory()
    res = sample_groups(pol.model, [], 4, SamplingSettings(max_new_tokens=4), [2], 0)
    assert res.completions == [] and res.generated_tokens == 0


def test_same_seed_same_samples(tiny_policy_factory):
    pol = tiny_policy_factory()
    runs = [sample_groups(pol.model, [[1, 5, 6]], 4, SamplingSettings(max_new_tokens=8),
                          pol.eos_token_ids, 0, torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert [c.token_ids for c in runs[0].completions[0]] == \
        [c.token_ids for c in runs[1].completions[0]]



def test_rows_that_finish_early_leave_the_batch_without_changing_any_sample(
        tiny_policy_factory, monkeypatch):
    """Finished rows are dropped from the batch and KV cache: every row's tokens, log-probs
    and finish reason, and the generator's state afterwards, are the same as when all rows
    run to the end; the log-probs are those of a fresh teacher-forced forward pass."""
    pol = tiny_policy_factory()
    eos = list(range(3, pol.card.vocab_size, 12))  # ~8 % of the vocabulary ends a row
    prompts = [[1, 5, 6, 7, 8, 9, 10], [1, 9], [1, 11, 12, 13]]  # left padding of 0 to 5
    settings = SamplingSettings(temperature=0.7, max_new_tokens=16)

    def run(prune):
        monkeypatch.setattr(sampler, "PRUNE_FINISHED_ROWS", prune)
        gen = torch.Generator().manual_seed(5)
        res = sample_groups(pol.model, prompts, 4, settings, eos, pol.tokenizer.pad_token_id,
                            gen)
        return res, gen.get_state()

    (pruned, state), (kept, kept_state) = run(True), run(False)
    assert torch.equal(state, kept_state)
    early = ran_out = 0
    for prompt, group, ref in zip(prompts, pruned.completions, kept.completions, strict=True):
        for c, r in zip(group, ref, strict=True):
            assert (c.token_ids, c.finish_reason) == (r.token_ids, r.finish_reason)
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(r.logprobs),
                                       atol=1e-5, rtol=0)
            assert len(c.token_ids) == len(c.logprobs)
            assert not set(c.token_ids[:-1]) & set(eos)
            if c.finish_reason == bundle_pb2.FINISH_REASON_STOP:
                assert c.token_ids[-1] in eos  # the EOS token is kept in the completion
                early += len(c.token_ids) < settings.max_new_tokens
            else:
                assert c.finish_reason == bundle_pb2.FINISH_REASON_LENGTH
                assert len(c.token_ids) == settings.max_new_tokens
                assert c.token_ids[-1] not in eos
                ran_out += 1
            expected = _full_forward_logprobs(pol.model, prompt, c.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
    assert early >= 3 and ran_out >= 2  # both kinds of rows are exercised
    assert pruned.generated_tokens == sum(len(c.token_ids) for g in pruned.completions
                                          for c in g)


def test_inverse_cdf_sampling_follows_the_distribution_and_never_draws_a_zero():
    g = torch.Generator().manual_seed(0)
    v = 700  # three blocks of 256, the last one padded
    weights = torch.rand(v, generator=g) ** 4 * 3.0  # unnormalised
    weights[torch.rand(v, generator=g) < 0.3] = 0.0  # filtered entries
    weights[256:512] = 0.0  # a whole block of zeros
    n = 5000
    grid = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # evenly spaced uniforms
    draws = sample_inverse_cdf(weights.expand(n, v), grid)
    counts = torch.bincount(draws, minlength=v).double()
    expected = weights.double() / weights.double().sum() * n
    assert (counts - expected).abs().max() <= 1.0 + 1e-6  # the grid is exact up to one draw
    assert counts[weights == 0].sum() == 0
    # the extreme uniforms land on the first and the last entry of positive probability
    ends = sample_inverse_cdf(weights.expand(2, v),
                              torch.tensor([0.0, 1.0 - 2.0 ** -53], dtype=torch.float64))
    positive = (weights > 0).nonzero()[:, 0]
    assert ends.tolist() == [positive[0].item(), positive[-1].item()]
    # one-hot rows (greedy decoding through top_k = 1) always give the arg-max
    one_hot = torch.zeros(3, v)
    one_hot[0, 0], one_hot[1, 255], one_hot[2, v - 1] = 1.0, 1.0, 1.0
    assert sample_inverse_cdf(one_hot, torch.rand(3, dtype=torch.float64)).tolist() == \
        [0, 255, v - 1]
    for bad in (torch.zeros(1, v), torch.full((1, v), float("nan"))):
        with pytest.raises(ValueError):
            sample_inverse_cdf(bad, torch.zeros(1, dtype=torch.float64))


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


# ------------------------------------------------------------------ stop strings
PIECES = {0: "a", 1: "\n", 2: "Quest", 3: "ion", 4: ":", 5: " 7", 6: "\nQuestion:"}


def _decode(ids):
    return "".join(PIECES[i] for i in ids)


def test_stop_checker_finds_the_completing_token():
    stop = StopChecker(["\nQuestion:"], _decode)
    ids = [5, 1, 2, 3, 4, 0]
    hits = [stop.hit(ids[:t]) for t in range(1, len(ids) + 1)]
    assert hits == [False, False, False, False, True, True]
    assert stop.hit([0] * 50 + [6])  # one token holding the whole stop string
    assert stop.hit([0] * 50 + [1, 2, 3, 4])  # beyond the window: tail decode suffices
    assert not stop.hit([0] * 50)
    assert not StopChecker([], _decode).hit([6])
    with pytest.raises(ValueError):
        StopChecker([""], _decode)


def test_stop_checker_confirms_window_hits_on_the_whole_text():
    # a decoder whose first token reads differently (like a stripped leading space): the
    # tail alone would see a stop string that the completion's text does not contain
    def decode(ids):
        return "".join("\nQuestion:" if (k == 0 and i == 0) else PIECES[i]
                       for k, i in enumerate(ids))

    stop = StopChecker(["\nQuestion:"], decode)
    assert stop.window < 30
    ids = [5] * 30 + [0] + [5] * (stop.window - 1)  # the tail starts with token 0
    assert "\nQuestion:" in decode(ids[-stop.window :]) and not stop.hit(ids)


def test_sampler_stops_at_stop_strings_and_keeps_the_completing_token(tiny_policy_factory):
    pol = tiny_policy_factory()
    settings = SamplingSettings(max_new_tokens=16)
    prompts = [[1, 5, 6, 7], [1, 9]]

    def run(**kw):
        return sample_groups(pol.model, prompts, 3, settings, [], pol.tokenizer.pad_token_id,
                             torch.Generator().manual_seed(3), **kw)

    base = run()
    texts = [pol.decode(c.token_ids) for g in base.completions for c in g]
    stop_string = texts[0][3:5]  # a short piece that occurs in the first completion
    assert len(stop_string) == 2
    stopped = run(stop_strings=[stop_string], decode=pol.decode)
    n_stopped = 0
    for g_base, g_stop in zip(base.completions, stopped.completions, strict=True):
        for b, s in zip(g_base, g_stop, strict=True):
            end = next((t for t in range(1, len(b.token_ids) + 1)
                        if stop_string in pol.decode(b.token_ids[:t])), None)
            if end is None:
                assert s.token_ids == b.token_ids
                assert s.finish_reason == bundle_pb2.FINISH_REASON_LENGTH
                continue
            n_stopped += 1
            assert s.token_ids == b.token_ids[:end]  # up to and including the completing token
            assert s.finish_reason == bundle_pb2.FINISH_REASON_STOP
            text = pol.decode(s.token_ids)
            assert stop_string in text and stop_string not in pol.decode(s.token_ids[:-1])
            torch.testing.assert_close(torch.tensor(s.logprobs),
                                       torch.tensor(b.logprobs[:end]), atol=1e-5, rtol=0)
    assert n_stopped >= 1
    assert stopped.generated_tokens == sum(len(c.token_ids) for g in stopped.completions
                                           for c in g)


def test_stop_strings_need_a_decoder(tiny_policy_factory):
    pol = tiny_policy_factory()
    with pytest.raises(ValueError):
        sample_groups(pol.model, [[1, 5]], 1, SamplingSettings(max_new_tokens=2), [], 0,
                      stop_strings=["x"])


def test_policy_stop_strings_only_without_a_chat_template(tiny_policy_factory):
    from ftis.tasks import PLAIN_STOP_STRINGS, render_messages

    pol = tiny_policy_factory()
    assert pol.stop_strings == []
    pol.tokenizer.chat_template = None
    assert pol.stop_strings == list(PLAIN_STOP_STRINGS) == ["\nQuestion:"]
    _, text = pol.prompt_token_ids(render_messages("3 + 4 ="))
    assert text.endswith("Question: 3 + 4 =\nAnswer:")
