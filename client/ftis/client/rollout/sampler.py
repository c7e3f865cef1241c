"""Batched autoregressive sampling that records the sampler's own log-probs.

For every generated token we keep ``log softmax(filter(logits / T))[token]``: the
log-probability under the distribution the token was actually drawn from (DESIGN.md
section 3, step 2). With ``top_p = 1`` and ``top_k = 0`` (the defaults for training
rollouts) this is the policy's temperature-scaled distribution, which is what the
learner's importance weights need. Written as an explicit loop over a KV cache rather
than ``generate()`` so that exactly this distribution is recorded, whatever the
model's ``generation_config`` says.

Optional stop strings (for models without a chat template, whose completions do not end
with an EOS token; see :data:`ftis.tasks.PLAIN_STOP_STRINGS`) end a row once its decoded
text contains one of them; the tokens up to and including the one that completed the stop
string are kept, so ``text == decode(token_ids)`` and the log-probs stay aligned.

Speed (docs/benchmarks.md): each prompt is prefilled once and its KV cache repeated for
its G rows; tokens are drawn by inverse-CDF sampling from one uniform per row (a
``torch.multinomial`` draw costs an exponential variate per vocabulary entry); rows that
finished leave the batch and its KV cache. A row's tokens depend only on its own uniforms,
which are drawn for every row at every step, so dropping finished rows changes no sample.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ftis.client.rollout.settings import SamplingSettings
from ftis.v1 import bundle_pb2


@dataclass
class SampledCompletion:
    """One completion: token ids, sampler log-probs (nats, float32), finish reason."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: bundle_pb2.FinishReason


@dataclass
class SamplingResult:
    completions: list[list[SampledCompletion]]  # [num_prompts][group_size]
    generated_tokens: int
    seconds: float


def filter_logits(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside top-k / nucleus top-p with ``-inf``.

    Args:
        scores: ``[B, V]`` float temperature-scaled logits.
    Returns:
        ``[B, V]`` with removed entries set to ``-inf`` (input unchanged when disabled).
    """
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        probs = sorted_scores.softmax(-1)
        cum = probs.cumsum(-1)
        remove_sorted = (cum - probs) > top_p  # keep the smallest set reaching top_p
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


class StopChecker:
    """Detects stop strings in a growing completion at the cost of a short decode per step.

    Called after every new token of a row, :meth:`hit` decodes only the last ``window``
    tokens: enough to hold the longest stop string (every token decodes to at least one
    byte) plus a margin for effects at the start of a decode (a split multi-byte
    character, a stripped leading space). A hit in the window is confirmed on the whole
    completion, so a window artefact never stops a row.

    Args:
        stop_strings: non-empty strings.
        decode: token ids -> text, the same decoding as the completion's text.
    """

    MARGIN = 4

    def __init__(self, stop_strings: Sequence[str], decode: Callable[[list[int]], str]):
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.stop_strings = tuple(stop_strings)
        self.decode = decode
        self.window = max((len(s.encode()) for s in self.stop_strings), default=0) + self.MARGIN

    def contains_stop(self, text: str) -> bool:
        return any(s in text for s in self.stop_strings)

    def hit(self, token_ids: list[int]) -> bool:
        """True if ``decode(token_ids)`` contains a stop string (checked on a tail first)."""
        if not self.stop_strings:
            return False
        if not self.contains_stop(self.decode(token_ids[-self.window :])):
            return False
        return len(token_ids) <= self.window or self.contains_stop(self.decode(token_ids))


#: Drop finished rows from the decoding batch (and its KV cache). The sampled tokens do not
#: depend on it (each row draws its own uniform at every step); tests switch it off to
#: check exactly that.
PRUNE_FINISHED_ROWS = True

_CDF_BLOCK = 256


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one index per row with probability ``probs[i, k] / probs[i].sum()``.

    Inverse-CDF sampling in float64 at the cost of one pass over ``probs`` (block sums,
    then a cumulative sum inside the one block that holds the draw), and of one uniform
    per row: unlike ``torch.multinomial`` (which draws an exponential variate for every
    entry of ``[N, V]``), a row's draw depends on its own uniform only. Entries of
    probability 0 (filtered by top-k / top-p) are never drawn.

    Args:
        probs: ``[N, V]`` non-negative weights, each row with a positive sum.
        uniforms: ``[N]`` uniform variates in ``[0, 1)``.
    Returns:
        ``[N]`` long indices into ``V``.
    Raises:
        ValueError: a row's weights sum to 0, inf or NaN (e.g. a model that diverged).
    """
    n, v = probs.shape
    n_blocks = -(-v // _CDF_BLOCK)
    padded = torch.nn.functional.pad(probs, (0, n_blocks * _CDF_BLOCK - v))
    blocks = padded.view(n, n_blocks, _CDF_BLOCK)
    cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [N, n_blocks]
    total = cdf[:, -1]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise ValueError("sampling weights must be finite, with a positive sum per row")
    target = uniforms.to(cdf)[:, None] * total[:, None]  # [N, 1], in [0, total)
    block = torch.searchsorted(cdf, target, right=True).clamp_(max=n_blocks - 1)
    below = torch.where(block > 0, cdf.gather(-1, (block - 1).clamp(min=0)), 0.0)
    inner = blocks.gather(1, block[:, :, None].expand(n, 1, _CDF_BLOCK))[:, 0]
    inner_cdf = inner.to(torch.float64).cumsum(-1)  # [N, block]
    offset = torch.searchsorted(inner_cdf, target - below, right=True).clamp_(
        max=_CDF_BLOCK - 1)
    index = (block * _CDF_BLOCK + offset)[:, 0]
    # float rounding at a block edge (probability ~1e-16) could pick a zero entry
    bad = padded.gather(-1, index[:, None])[:, 0] <= 0
    if bool(bad.any()):
        index = torch.where(bad, probs.argmax(-1), index)
    return index


def _select_rows(cache: Any, rows: torch.Tensor) -> Any:  # any transformers cache
    """Keep (or repeat) batch ``rows`` of a KV cache, in that order."""
    if hasattr(cache, "batch_select_indices"):  # transformers Cache (DynamicCache, ...)
        cache.batch_select_indices(rows)
        return cache
    if isinstance(cache, tuple | list):  # legacy tuple of per-layer (key, value)
        return type(cache)(tuple(t[rows] for t in layer) for layer in cache)
    raise TypeError(f"cannot select rows of a {type(cache).__name__}")


@torch.no_grad()
def sample_groups(
    model: torch.nn.Module,
    prompts: list[list[int]],
    group_size: int,
    settings: SamplingSettings,
    eos_token_ids: list[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
    *,
    stop_strings: Sequence[str] = (),
    decode: Callable[[list[int]], str] | None = None,
) -> SamplingResult:
    """Sample ``group_size`` completions for each prompt in one left-padded batch.

    Each prompt is run through the model once (the prefill); its KV cache is then repeated
    for the ``group_size`` rows of its group. At every step each row draws its token from
    one uniform of its own (:func:`sample_inverse_cdf`; a full batch of uniforms is drawn
    every step, so the stream does not depend on which rows are still running), and rows
    that finished (EOS or stop string) leave the batch and its KV cache, so a step costs
    what the running rows cost. Same generator state in, same completions out.

    Args:
        model: a causal LM (``transformers`` or a PEFT wrapper) in eval mode.
        prompts: token ids per prompt (lengths may differ).
        group_size: G completions per prompt (a vertical group).
        settings: temperature, top-p, top-k, max_new_tokens.
        eos_token_ids: ids that end a completion (included in the completion).
        pad_token_id: id used for left padding.
        generator: CPU RNG for reproducible sampling.
        stop_strings: a row also finishes (``FINISH_REASON_STOP``) at the first token
            after which its decoded completion contains one of these; that token is kept.
        decode: token ids -> completion text (``Policy.decode``); required with
            ``stop_strings``.

    Returns:
        ``SamplingResult`` with ``completions[p][g]`` for prompt p, sample g.
    """
    start = time.perf_counter()
    if stop_strings and decode is None:
        raise ValueError("stop_strings need a decode function")
    stopper = StopChecker(stop_strings, decode) if stop_strings and decode is not None else None
    if not prompts:
        return SamplingResult([], 0, time.perf_counter() - start)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    n_prompts, width = len(prompts), max(len(p) for p in prompts)
    batch = n_prompts * group_size
    input_ids = torch.full((n_prompts, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n_prompts, width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
        attention[i, width - len(prompt) :] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    eos = torch.tensor(eos_token_ids, dtype=torch.long, device=device)

    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                use_cache=True, logits_to_keep=1)  # the LM head runs on the last position only
    # row i of the batch is sample i % G of prompt i // G
    expand = torch.arange(n_prompts, device=device).repeat_interleave(group_size)
    cache = _select_rows(out.past_key_values, expand)
    logits = out.logits[:, -1, :][expand]
    attention, next_pos = attention[expand], positions[expand, -1:] + 1
    rows = torch.arange(batch, device=device)  # batch row -> row of the result
    running = torch.ones(batch, dtype=torch.bool, device=device)  # rows still sampling
    tokens = torch.full((batch, settings.max_new_tokens), pad_token_id, dtype=torch.long,
                        device=device)
    logprobs = torch.zeros((batch, settings.max_new_tokens), dtype=torch.float32,
                           device=device)
    ends = [0] * batch
    reasons = [bundle_pb2.FINISH_REASON_LENGTH] * batch
    generated_ids: list[list[int]] = [[] for _ in range(batch)]  # only used with stop strings
    for step in range(settings.max_new_tokens):
        uniforms = torch.rand(batch, generator=generator, dtype=torch.float64).to(device)
        scores = filter_logits(logits.float() / settings.temperature, settings.top_k,
                               settings.top_p)
        logp = torch.log_softmax(scores, dim=-1)
        draw = sample_inverse_cdf(logp.exp(), uniforms[rows])
        lp = logp.gather(-1, draw[:, None])[:, 0]
        live = rows[running]  # result rows that take this step's token
        tokens[live, step] = draw[running]
        logprobs[live, step] = lp[running].float()
        done = torch.isin(draw, eos) & running
        if stopper is not None:
            hits = []
            for i, t, r, d in zip(rows.tolist(), draw.tolist(), running.tolist(),
                                  done.tolist(), strict=True):
                if r and not d:
                    generated_ids[i].append(t)
                hits.append(bool(r and not d and stopper.hit(generated_ids[i])))
            done = done | torch.tensor(hits, dtype=torch.bool, device=device)
        for i in rows[done].tolist():
            ends[i], reasons[i] = step + 1, bundle_pb2.FINISH_REASON_STOP
        running = running & ~done
        if not bool(running.any()) or step == settings.max_new_tokens - 1:
            break
        if PRUNE_FINISHED_ROWS and bool(done.any()):
            keep = running.nonzero()[:, 0]
            cache = _select_rows(cache, keep)
            attention, next_pos, draw = attention[keep], next_pos[keep], draw[keep]
            rows, running = rows[keep], running[keep]
        attention = torch.cat([attention, torch.ones((len(rows), 1), dtype=attention.dtype,
                                                     device=device)], dim=-1)
        out = model(input_ids=draw[:, None], attention_mask=attention, position_ids=next_pos,
                    past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1, :]
        next_pos = next_pos + 1
    model.train(was_training)

    tok, lps = tokens.cpu().tolist(), logprobs.cpu().tolist()
    groups: list[list[SampledCompletion]] = []
    generated = 0
    for p in range(n_prompts):
        group = []
        for g in range(group_size):
            i = p * group_size + g
            end = ends[i] or settings.max_new_tokens
            group.append(SampledCompletion(tok[i][:end], lps[i][:end], reasons[i]))
            generated += end
        groups.append(group)
    return SamplingResult(groups, generated, time.perf_counter() - start)
