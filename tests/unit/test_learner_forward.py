"""The learner's forward pass with a shared prompt (``learner/forward.py``) gives the
log-probs and the gradient of running every completion with its prompt, on the two
families FTIS embeds (Llama: SmolLM2; Gemma 3, whose sliding-window layers keep their
own cache), in float64 so that only the kernels' rounding separates the two paths."""

from __future__ import annotations

import pytest
import torch

from ftis.client.learner.batch import Sample, micro_batches, pack
from ftis.client.learner.forward import batch_logprobs
from ftis.client.learner.loss import completion_logprobs


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # layer 0 slides over 4 positions (fewer than prompt + completion), layer 1 is full
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64))


def _samples(prompt: list[int], lengths: tuple[int, ...]) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n in lengths:
        ids = torch.randint(1, 97, (n,), generator=g).tolist()
        out.append(Sample(prompt, ids, [-1.0] * n, 1.0, True))
    return out


def _whole_rows(model, samples, temperature):
    """Each completion run with its own prompt, one row at a time (no padding at all)."""
    rows = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        logits = model(input_ids=ids, use_cache=False).logits[:, len(s.prompt_ids) - 1 : -1]
        rows.append(completion_logprobs(logits, torch.tensor([s.completion_ids]),
                                        temperature)[0])
    return rows


@pytest.mark.parametrize("make", [_llama, _gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("lengths", [(5, 3, 6), (1, 1), (4,)], ids=["ragged", "k1", "one-row"])
def test_a_shared_prompt_gives_the_log_probs_and_gradient_of_whole_rows(make, lengths):
    torch.manual_seed(0)
    model = make().double().train()
    samples = _samples([11, 12, 13, 14, 15, 16, 17], lengths)
    batch = pack(samples, 0)
    assert batch.shared_prompt_len == 7
    temperature = 0.7
    weights = torch.linspace(0.5, 1.5, batch.targets.numel(), dtype=torch.float64).view_as(
        batch.targets)

    def loss_and_grads(share: bool):
        model.zero_grad(set_to_none=True)
        lp = batch_logprobs(model, batch, temperature, share_prompt=share)
        loss = (lp * weights * batch.completion_mask).sum()
        loss.backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters()]

    shared, g_shared = loss_and_grads(True)
    whole, g_whole = loss_and_grads(False)
    expected = _whole_rows(model, samples, temperature)
    for i, s in enumerate(samples):
        n = len(s.completion_ids)
        torch.testing.assert_close(shared[i, :n], expected[i], atol=1e-10, rtol=0)
        torch.testing.assert_close(whole[i, :n], expected[i], atol=1e-10, rtol=0)
    scale = max(float(g.abs().max()) for g in g_whole)
    for a, b in zip(g_shared, g_whole, strict=True):
        # float64; the attention kernels differ between the two paths (about 1e-8
        # relative measured), far below float32's resolution
        torch.testing.assert_close(a, b, atol=1e-6 * scale, rtol=0)


def test_prompts_that_differ_run_whole():
    a = _samples([11, 12, 13], (2,)) + _samples([11, 12, 14], (3,))
    assert pack(a, 0).shared_prompt_len == 0
    assert pack(_samples([11, 12], (2,)) + _samples([11, 12, 13], (2,)), 0).shared_prompt_len == 0


def test_micro_batches_keep_one_prompt_each_by_completion_length():
    p, q = [1, 2, 3], [4, 5]
    s = (_samples(p, (3, 1, 2)) + _samples(q, (5, 4)) + _samples(p, (6,)))
    by = micro_batches(s, 2, by_prompt=True)
    # p's four samples in two batches by length, then q's two; first appearance order
    assert [[len(x.completion_ids) for x in mb] for mb in by] == [[1, 2], [3, 6], [4, 5]]
    assert all(len({tuple(x.prompt_ids) for x in mb}) == 1 for mb in by)
    assert all(pack(mb, 0).shared_prompt_len > 0 for mb in by)
    flat = micro_batches(s, 4, by_prompt=False)  # sorted by prompt + completion length
    assert [[len(x.prompt_ids) + len(x.completion_ids) for x in mb] for mb in flat] == [
        [4, 5, 6, 6], [7, 9]]
    with pytest.raises(ValueError, match="micro-batch size 0"):
        micro_batches(s, 0, by_prompt=True)


def test_a_model_that_keeps_no_cache_runs_whole_rows():
    """Under activation checkpointing transformers returns no cache while training; the
    forward then runs every row with its prompt and still gives the whole rows' values."""
    torch.manual_seed(0)
    model = _llama().double().train()
    model.gradient_checkpointing_enable()
    samples = _samples([11, 12, 13, 14], (3, 5))
    batch = pack(samples, 0)
    got = batch_logprobs(model, batch, 1.0, share_prompt=True)
    expected = _whole_rows(model, samples, 1.0)
    for i, s in enumerate(samples):
        torch.testing.assert_close(got[i, : len(s.completion_ids)], expected[i],
                                   atol=1e-10, rtol=0)
