"""The learner's forward pass: per-token log-probs of a packed batch's completions.

A group's G completions share one prompt, often longer than the completions (the demo:
a 53-token chat prompt, at most 32 new tokens). When every row of a batch has the same
prompt (:attr:`PackedBatch.shared_prompt_len` > 0), the prompt runs once, with
gradients, and its key/value cache is repeated for the rows
(``DynamicCache.batch_repeat_interleave``); the completions then run on that cache. The
log-probs are those of the full sequences (the same attention, positions and masks);
the prompt's share of the gradient is summed over the rows by autograd through the
repeated cache instead of being computed once per row. Otherwise every row runs whole.
"""

from __future__ import annotations

import torch

from ftis.client.learner.batch import PackedBatch
from ftis.client.learner.loss import completion_logprobs


def batch_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float,
                   share_prompt: bool = True) -> torch.Tensor:
    """``[B, K]`` log-probs (the model's float dtype) of ``batch.targets`` under ``model``
    at ``temperature`` (:func:`~ftis.client.learner.loss.completion_logprobs`); entries
    past a completion's end are not meaningful (``batch.completion_mask`` marks the real
    ones).

    A model that returns no cache although asked for one (transformers turns the cache
    off under activation checkpointing while training) runs every row whole.

    Args:
        model: a causal LM (transformers, or a peft model around one) that accepts
            ``logits_to_keep``, ``position_ids`` and ``past_key_values``.
        batch: from :func:`~ftis.client.learner.batch.pack`.
        temperature: the sampler's temperature, > 0.
        share_prompt: run a shared prompt once (``batch.shared_prompt_len`` > 0 and more
            than one row); False always runs every row whole.
    """
    p = batch.shared_prompt_len
    rows = batch.input_ids.shape[0]
    if not share_prompt or p == 0 or rows == 1:
        return _whole_rows(model, batch, temperature)
    head = model(input_ids=batch.input_ids[:1, :p], use_cache=True, logits_to_keep=1)
    k = batch.targets.shape[1]
    first = head.logits[:, -1:, :].expand(rows, 1, head.logits.shape[-1])
    if k == 1:  # the prompt's last position predicts the only completion token
        return completion_logprobs(first, batch.targets, temperature)
    cache = head.past_key_values
    if cache is None:
        return _whole_rows(model, batch, temperature)
    cache.batch_repeat_interleave(rows)
    # completion position t predicts token t + 1; the last one predicts nothing
    tail = model(input_ids=batch.input_ids[:, p:], attention_mask=batch.attention_mask,
                 position_ids=batch.position_ids[:, p:], past_key_values=cache,
                 use_cache=True,
                 logits_to_keep=torch.arange(k - 1, device=batch.input_ids.device))
    return completion_logprobs(torch.cat([first, tail.logits], dim=1), batch.targets,
                               temperature)


def _whole_rows(model: torch.nn.Module, batch: PackedBatch, temperature: float) -> torch.Tensor:
    """Every row with its prompt, logits of the last ``K + 1`` positions only."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, logits_to_keep=batch.logits_to_keep,
                use_cache=False)
    return completion_logprobs(out.logits[:, :-1, :], batch.targets, temperature)
