"""Samples (one completion with its advantage) and their packing into right-padded
training batches. The groups they come from are
:class:`ftis.client.rollout.groups.RolloutGroup`."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class Sample:
    """One completion with its per-completion advantage, ready to batch."""

    prompt_ids: list[int]
    completion_ids: list[int]
    #: sampler log-probs aligned with ``completion_ids``; ``None`` for cross-tokenizer
    gen_logprobs: list[float] | None
    advantage: float
    local: bool
    sender: str = ""
    #: generator's summed log-prob (nats) when its tokenizer differs, else ``None``
    gen_sequence_logprob: float | None = None


@dataclass
class PackedBatch:
    """Batch aligned at the prompt/completion boundary, for next-token log-probs.

    Prompts are left-padded so that every completion starts at the same column ``P``;
    completions are right-padded. Only the ``K`` positions that predict completion tokens
    need logits, so the model is asked for its last ``K + 1`` positions
    (``logits_to_keep``) and the LM head never runs over prompt positions.

    Attributes:
        input_ids: ``[B, S]`` long, left-padded prompt + right-padded completion.
        attention_mask: ``[B, S]`` long.
        position_ids: ``[B, S]`` long, counting from each row's first real token.
        targets: ``[B, K]`` long, the completion tokens (``input_ids[:, P:]``).
        completion_mask: ``[B, K]`` bool, True on real completion tokens.
        gen_logprobs: ``[B, K]`` float32 sampler log-probs, 0 on padding; ``None`` for a
            cross-tokenizer batch (no per-token generator log-probs exist).
        advantages: ``[B]`` float32.
        logits_to_keep: ``K + 1``: logits of the last K + 1 positions; dropping the last
            one aligns ``logits[:, t]`` with ``targets[:, t]``.
        gen_sequence_logprobs: ``[B]`` float32 generator sequence log-probs when every
            sample is cross-tokenizer, else ``None`` (batches never mix the two).
        shared_prompt_len: ``P`` when every row has the same ``P`` prompt ids (no left
            padding, ``input_ids[:, :P]`` equal on every row), else 0; then the prompt
            can be run once for all rows (:mod:`ftis.client.learner.forward`).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    completion_mask: torch.Tensor
    gen_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    logits_to_keep: int
    gen_sequence_logprobs: torch.Tensor | None = None
    shared_prompt_len: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def to(self, device: torch.device | str) -> PackedBatch:
        """This batch with every tensor on ``device`` (the learner's model's, e.g.
        ``"cuda"``); :func:`pack` builds batches on the CPU. Tensors already there are
        not copied."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(
            self, input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            position_ids=self.position_ids.to(device), targets=self.targets.to(device),
            completion_mask=self.completion_mask.to(device),
            gen_logprobs=move(self.gen_logprobs), advantages=self.advantages.to(device),
            gen_sequence_logprobs=move(self.gen_sequence_logprobs))


def pack(samples: list[Sample], pad_token_id: int) -> PackedBatch:
    """Pack samples into a :class:`PackedBatch` (see its shapes).

    Raises:
        ValueError: no samples, an empty prompt or completion, a batch mixing
            cross-tokenizer and token-aligned samples, or a token-aligned sample whose
            log-probs do not match its completion.
    """
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    if any(not s.prompt_ids or not s.completion_ids for s in samples):
        raise ValueError("every sample needs at least one prompt and one completion token")
    cross = {s.gen_sequence_logprob is not None for s in samples}
    if len(cross) > 1:
        raise ValueError("a batch cannot mix cross-tokenizer and token-aligned samples")
    p_max = max(len(s.prompt_ids) for s in samples)
    k = max(len(s.completion_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, p_max + k), pad_token_id, dtype=torch.long)
    attention = torch.zeros((b, p_max + k), dtype=torch.long)
    mask = torch.zeros((b, k), dtype=torch.bool)
    lp_gen = None if cross == {True} else torch.zeros((b, k), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, p_max - p : p_max + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        attention[i, p_max - p : p_max + c] = 1
        mask[i, :c] = True
        if lp_gen is not None:
            if s.gen_logprobs is None or len(s.gen_logprobs) != c:
                raise ValueError("a token-aligned sample needs one log-prob per token")
            lp_gen[i, :c] = torch.tensor(s.gen_logprobs, dtype=torch.float32)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    seq_gen = (torch.tensor([s.gen_sequence_logprob for s in samples], dtype=torch.float32)
               if cross == {True} else None)
    shared = p_max if all(s.prompt_ids == samples[0].prompt_ids for s in samples) else 0
    return PackedBatch(input_ids, attention, positions, input_ids[:, p_max:], mask, lp_gen,
                       advantages, k + 1, seq_gen, shared)


def micro_batches(samples: list[Sample], size: int, by_prompt: bool) -> list[list[Sample]]:
    """Split ``samples`` into micro-batches of at most ``size``.

    ``by_prompt``: the samples of one prompt (a group's completions) go together and
    never share a micro-batch with another prompt's, so each micro-batch's prompt runs
    once (:attr:`PackedBatch.shared_prompt_len`); prompts in order of first appearance,
    each one's samples by completion length. Otherwise all samples sorted by prompt +
    completion length (least padding), then cut. The loss is the same either way: the
    trainer weights each micro-batch by its share of tokens or completions.

    Raises:
        ValueError: ``size`` < 1.
    """
    if size < 1:
        raise ValueError(f"micro-batch size {size} < 1")
    if not by_prompt:
        ordered = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.completion_ids))
        return [ordered[i : i + size] for i in range(0, len(ordered), size)]
    by: dict[tuple[int, ...], list[Sample]] = {}
    for s in samples:
        by.setdefault(tuple(s.prompt_ids), []).append(s)
    out: list[list[Sample]] = []
    for same in by.values():
        same.sort(key=lambda s: len(s.completion_ids))
        out += [same[i : i + size] for i in range(0, len(same), size)]
    return out
