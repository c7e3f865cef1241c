"""The forward pass of a spot check, run inside a worker process
(:class:`~ftis.coordinator.spot_check_pool.SpotChecker`).

Loads the held models once per process (with the volunteer client's own loader, so that
a held alias means exactly the weights and model card a volunteer gets) and recomputes
the sampler log-probs of a bundle's completions. Needs torch and ``ftis-client``: the
``ftis-coordinator[spot-checks]`` extra. The decision is not made here
(:mod:`ftis.coordinator.spot_check`).
"""

from __future__ import annotations

from typing import Any

from ftis.coordinator.spot_check import HeldModel

#: Loaded policies of this process, by held model.
_POLICIES: dict[HeldModel, Any] = {}


def load_models(names: list[str], threads: int = 1) -> list[HeldModel]:
    """Load every model in ``names`` (idempotent) and return their checkable keys.

    Args:
        names: model aliases, ``.gguf`` files or directories (``load_policy``).
        threads: torch intra-op threads of this worker.

    Raises:
        ModelNotFoundError: a name that cannot be found locally.
    """
    import torch

    from ftis.client.models.loader import load_policy
    from ftis.v1 import bundle_pb2

    torch.set_num_threads(threads)
    keys = []
    for name in names:
        policy = load_policy(name)
        policy.model.eval()
        card = bundle_pb2.ModelCard()
        card.CopyFrom(policy.card)
        key = HeldModel.of_card(card)
        _POLICIES.setdefault(key, policy)
        keys.append(key)
    return keys


def recompute_logprobs(key: HeldModel, prompt_ids: list[int], completions: list[list[int]],
                       temperature: float, top_p: float, top_k: int) -> list[list[float]]:
    """Sampler log-probs of each completion given the prompt under the held weights.

    ``log softmax(filter_logits(logits / temperature, top_k, top_p))[token]`` at every
    completion position, the rule ``ftis.client.rollout.sampler.sample_groups`` records:
    the prompt is run once and its KV cache repeated for the G right-padded completion
    rows (as the sampler does), so a check costs about one prompt plus G completions.

    Args:
        key: a model :func:`load_models` loaded in this process.
        prompt_ids: ``[P]`` prompt token ids.
        completions: ``[G][T_i]`` completion token ids (``T_i >= 1``).
        temperature, top_p, top_k: the bundle's sampling settings.

    Returns:
        ``[G][T_i]`` log-probs, nats, float32 values as Python floats; a token the held
        weights' top-k/top-p filter excludes gets its unfiltered log-prob (finite).

    Raises:
        KeyError: ``key`` is not loaded here.
    """
    import torch

    from ftis.client.rollout.sampler import _select_rows, filter_logits

    policy = _POLICIES[key]
    model = policy.model
    device = next(model.parameters()).device
    g, p, width = len(completions), len(prompt_ids), max(len(c) for c in completions)
    pad = int(policy.tokenizer.pad_token_id or 0)
    ids = torch.full((g, width), pad, dtype=torch.long)
    mask = torch.zeros((g, p + width), dtype=torch.long)
    mask[:, :p] = 1
    for i, comp in enumerate(completions):
        ids[i, : len(comp)] = torch.tensor(comp)
        mask[i, p : p + len(comp)] = 1
    with torch.no_grad():
        # the prompt once (as the sampler does), its KV cache repeated for the G rows
        first = model(input_ids=torch.tensor([list(prompt_ids)], device=device),
                      use_cache=True, logits_to_keep=1)
        cache = _select_rows(first.past_key_values, torch.zeros(g, dtype=torch.long,
                                                                device=device))
        rest = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                     position_ids=torch.arange(p, p + width, device=device).expand(g, -1),
                     past_key_values=cache, use_cache=False)
    # [G, width, V]: position t predicts completion token t
    logits = torch.cat([first.logits[:, -1:].expand(g, -1, -1), rest.logits[:, :-1]], dim=1)
    out: list[list[float]] = []
    for i, comp in enumerate(completions):
        rows = logits[i, : len(comp)].float() / temperature
        target = torch.tensor(comp, dtype=torch.long, device=rows.device)[:, None]
        filtered = torch.log_softmax(filter_logits(rows, top_k, top_p), dim=-1).gather(-1, target)
        # a token the held weights' top-k/top-p would exclude (drift at the nucleus
        # border) is compared unfiltered instead of at -inf: off by the log of the kept
        # mass, not infinitely
        plain = torch.log_softmax(rows, dim=-1).gather(-1, target)
        lp = torch.where(torch.isfinite(filtered), filtered, plain)[:, 0]
        out.append(lp.cpu().tolist())
    return out
