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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ftis.v1 import bundle_pb2


@dataclass(frozen=True)
class SamplingSettings:
    """Sampler settings; ``top_k = 0`` disables top-k, ``top_p = 1`` disables nucleus."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 96

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError("temperature must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError("top_k must be >= 0 and max_new_tokens >= 1")

    def to_proto(self) -> bundle_pb2.SamplingParams:
        return bundle_pb2.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
        )


@dataclass
class SampledCompletion:
    """One completion: token ids, sampler log-probs (nats, float32), finish reason."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: int  # bundle_pb2.FinishReason


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

    Args:
        model: a causal LM (``transformers`` or a PEFT wrapper) in eval mode.
        prompts: token ids per prompt (lengths may differ).
        group_size: G completions per prompt (a vertical group).
        settings: temperature, top-p, top-k, max_new_tokens.
        eos_token_ids: ids that end a completion (included in the completion).
        pad_token_id: id used for left padding and finished rows.
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
    stopper = StopChecker(stop_strings, decode) if stop_strings else None
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    rows = [p for p in prompts for _ in range(group_size)]
    batch, width = len(rows), max(len(p) for p in rows)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for i, p in enumerate(rows):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    eos = torch.tensor(eos_token_ids, dtype=torch.long, device=device)

    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                use_cache=True, logits_to_keep=1)  # the LM head runs on the last position only
    cache, logits = out.past_key_values, out.logits[:, -1, :]
    next_pos = positions[:, -1:] + 1
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    generated_ids: list[list[int]] = [[] for _ in range(batch)]  # only used with stop strings
    stop_end: dict[int, int] = {}  # row -> completion length at its stop string
    tokens: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    for step in range(settings.max_new_tokens):
        scores = filter_logits(logits.float() / settings.temperature, settings.top_k,
                               settings.top_p)
        logp = torch.log_softmax(scores, dim=-1)
        draw = torch.multinomial(logp.exp().cpu(), 1, generator=generator).to(device)
        lp = logp.gather(-1, draw).squeeze(-1)
        draw = draw.squeeze(-1).masked_fill(finished, pad_token_id)
        tokens.append(draw)
        logprobs.append(lp.masked_fill(finished, 0.0))
        if stopper is not None:
            was_finished = finished.tolist()
            for i, t in enumerate(draw.tolist()):
                if not was_finished[i]:
                    generated_ids[i].append(t)
                    if stopper.hit(generated_ids[i]):
                        stop_end[i] = step + 1
            if stop_end:
                finished = finished | torch.tensor(
                    [i in stop_end for i in range(batch)], dtype=torch.bool, device=device)
        finished = finished | torch.isin(draw, eos)
        if bool(finished.all()) or step == settings.max_new_tokens - 1:
            break
        attention = torch.cat([attention, torch.ones((batch, 1), dtype=attention.dtype,
                                                     device=device)], dim=-1)
        out = model(input_ids=draw[:, None], attention_mask=attention, position_ids=next_pos,
                    past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1, :]
        next_pos = next_pos + 1
    model.train(was_training)

    tok = torch.stack(tokens, dim=1).cpu()
    lps = torch.stack(logprobs, dim=1).float().cpu()
    eos_set = set(eos_token_ids)
    groups: list[list[SampledCompletion]] = []
    generated = 0
    for p in range(len(prompts)):
        group = []
        for g in range(group_size):
            i = p * group_size + g
            ids, lp_row = tok[i].tolist(), lps[i].tolist()
            end = next((t + 1 for t, x in enumerate(ids) if x in eos_set), None)
            if i in stop_end:
                end = min(end or stop_end[i], stop_end[i])
            reason = bundle_pb2.FINISH_REASON_STOP if end else bundle_pb2.FINISH_REASON_LENGTH
            end = end or len(ids)
            group.append(SampledCompletion(ids[:end], lp_row[:end], reason))
            generated += end
        groups.append(group)
    return SamplingResult(groups, generated, time.perf_counter() - start)
