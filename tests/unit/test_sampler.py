"""Sampler log-probs are those of the distribution the tokens were drawn from."""

import pytest
import torch

from ftis.client.rollout.sampler import (
    SamplingSettings,
    StopChecker,
    filter_logits,
    sample_groups,
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
