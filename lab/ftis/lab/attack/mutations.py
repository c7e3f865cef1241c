"""Pure forgeries of bundles, envelopes and receiver feedback.

Every function returns a new message and leaves its input untouched, so each attack is
unit-testable on a synthetic bundle (``tests/unit/test_attacks_unit.py``).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterable

from ftis.protocol.auth import sign_request
from ftis.protocol.envelope import seal, signing_digest
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import bundle_pb2, swarm_pb2

#: Log-prob of a token the attacker claims it sampled "with certainty" (inflate floor).
INFLATE_CEILING = -1e-6


def _leased_bundle(lease: swarm_pb2.TaskLease, node_id: str, card: bundle_pb2.ModelCard,
                   prompt_ids: list[int], prompt_text: str,
                   completions: list[bundle_pb2.Completion]) -> bundle_pb2.Bundle:
    """A bundle answering ``lease`` with ``completions`` (sampling T = 1, top-p 1)."""
    return bundle_pb2.Bundle(
        task_id=lease.task_id, lease_id=lease.lease_id, node_id=node_id, model_card=card,
        sampling=bundle_pb2.SamplingParams(temperature=1.0, top_p=1.0,
                                           max_new_tokens=lease.max_new_tokens),
        prompt_token_ids=prompt_ids, prompt_text=prompt_text, completions=completions)


def _copy(bundle: bundle_pb2.Bundle) -> bundle_pb2.Bundle:
    out = bundle_pb2.Bundle()
    out.CopyFrom(bundle)
    return out


def lie_rewards(bundle: bundle_pb2.Bundle, reward: float = 1.0) -> bundle_pb2.Bundle:
    """``reward_liar``: claim ``reward`` for every completion."""
    out = _copy(bundle)
    for c in out.completions:
        c.claimed_reward = reward
    return out


def scale_logprobs(bundle: bundle_pb2.Bundle, factor: float = 0.05) -> bundle_pb2.Bundle:
    """``logprob_inflate``: every sampler log-prob ``lp`` becomes ``lp * factor`` (close to 0,
    i.e. the sender claims it was nearly certain of each token). Stays finite and <= 0."""
    if not 0 <= factor < 1:
        raise ValueError("factor must be in [0, 1)")
    out = _copy(bundle)
    for c in out.completions:
        lps = [min(lp * factor, 0.0) for lp in c.logprobs]
        del c.logprobs[:]
        c.logprobs.extend(lps)
    return out


def shift_logprobs(bundle: bundle_pb2.Bundle, nats: float = 5.0) -> bundle_pb2.Bundle:
    """``logprob_deflate``: every sampler log-prob becomes ``lp - nats``: receivers see
    ``lp_learner - lp_gen`` grow by ``nats`` per token, so IS weights hit the cap C."""
    if nats <= 0:
        raise ValueError("nats must be > 0")
    out = _copy(bundle)
    for c in out.completions:
        lps = [lp - nats for lp in c.logprobs]
        del c.logprobs[:]
        c.logprobs.extend(lps)
    return out


def shade_logprobs(bundle: bundle_pb2.Bundle, truncation: float = 2.0) -> bundle_pb2.Bundle:
    """``logprob_shade`` (issue 13, class 4): every sampler log-prob lowered by
    ``ln truncation`` nats, so a receiver whose model agrees with the sender's sees a
    per-token importance weight of exactly C = ``truncation`` (the learner's cap), with a
    mean log-ratio of ln C (0.693 for C = 2), inside the old 1.5-nat tolerance.

    Raises:
        ValueError: if ``truncation`` is not finite and > 1.
    """
    if not (math.isfinite(truncation) and truncation > 1.0):
        raise ValueError(f"truncation C must be finite and > 1, got {truncation!r}")
    return shift_logprobs(bundle, math.log(truncation))


def computed_answer(dataset: str, question: str) -> str | None:
    """The answer of an arithmetic task computed from its question alone
    (``answer_computer``, issue 13, class 1: the lease carries no answer): ``gcd``
    (``... numbers: a, b. ...``), ``products`` (``... a * b ...``) and ``chain_sum``
    (``...: a + b - c =``). ``None`` for other datasets or a question it cannot parse."""
    try:
        if dataset == "gcd":
            numbers = re.findall(r"\d+", question.split(":", 1)[1])
            return str(math.gcd(*(int(n) for n in numbers))) if numbers else None
        if dataset == "products":
            found = re.findall(r"(-?\d+) \* (-?\d+)", question)
            return str(int(found[0][0]) * int(found[0][1])) if found else None
        if dataset == "chain_sum":
            tokens = question.rsplit(":", 1)[-1].strip().rstrip("=").split()
            total = int(tokens[0])
            for op, number in zip(tokens[1::2], tokens[2::2], strict=True):
                if op not in ("+", "-"):
                    return None
                total = total + int(number) if op == "+" else total - int(number)
            return str(total)
    except (ValueError, IndexError):
        return None
    return None


def computed_bundle(lease: swarm_pb2.TaskLease, node_id: str, card: bundle_pb2.ModelCard,
                    prompt_ids: list[int], prompt_text: str, answer: str,
                    encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                    rng: random.Random, eos_ids: tuple[int, ...] = ()) -> bundle_pb2.Bundle:
    """``answer_computer``: a bundle made with no model. Completion ``i`` is a little text
    ending in ``<answer>X</answer>`` with X the computed ``answer`` for even ``i`` and
    ``answer + 1`` for odd ``i`` (so the group has reward variance and is relayed),
    encoded with the real tokenizer (``encode``; then ``eos_ids``), text = ``decode``;
    made-up log-probs drawn uniformly from [-1.5, -0.05] nats per token; no claims."""
    comps = []
    for i in range(max(lease.group_size, 1)):
        value = answer if i % 2 == 0 or not answer.lstrip("-").isdigit() else str(int(answer) + 1)
        ids = [*encode(f"Working it out step by step. <answer>{value}</answer>"), *eos_ids]
        comps.append(bundle_pb2.Completion(
            token_ids=ids, logprobs=[rng.uniform(-1.5, -0.05) for _ in ids], text=decode(ids),
            finish_reason=bundle_pb2.FINISH_REASON_STOP))
    return _leased_bundle(lease, node_id, card, prompt_ids, prompt_text, comps)


def answer_text(answer: str) -> str:
    """A completion text that every scorer reads as ``answer``."""
    return f"The final answer is <answer>{answer}</answer>"


def replace_text(bundle: bundle_pb2.Bundle, text: str,
                 claimed_reward: float = 1.0) -> bundle_pb2.Bundle:
    """``text_mismatch``: keep the tokens, replace every completion's text by ``text`` (an
    answer the attacker guessed or computed; the lease carries no answer) and claim
    ``claimed_reward`` for it."""
    out = _copy(bundle)
    for c in out.completions:
        c.text = text
        c.claimed_reward = claimed_reward
    return out


def fabricate_prompt(bundle: bundle_pb2.Bundle, prompt_ids: list[int],
                     prompt_text: str) -> bundle_pb2.Bundle:
    """``fabricated_prompt``: the bundle claims it was conditioned on a made-up prompt."""
    out = _copy(bundle)
    del out.prompt_token_ids[:]
    out.prompt_token_ids.extend(prompt_ids)
    out.prompt_text = prompt_text
    return out


def copy_under_lease(stolen: bundle_pb2.Bundle, lease: swarm_pb2.TaskLease, node_id: str,
                     card: bundle_pb2.ModelCard, policy_version: int, created_at_ms: int,
                     prompt: tuple[list[int], str] | None = None) -> bundle_pb2.Bundle:
    """``replay``: another node's completions passed off under the attacker's own lease.

    Args:
        stolen: the victim's bundle (as relayed).
        prompt: ``(ids, text)`` to claim instead of the victim's prompt (the attacker's own
            rendering of the leased question), or ``None`` to copy the victim's verbatim.

    The group is cut or cycled to the lease's group size. Reward claims are dropped (the
    attacker cannot score for its own lease: the answers stay on the coordinator).
    """
    out = _copy(stolen)
    out.task_id, out.lease_id, out.node_id = lease.task_id, lease.lease_id, node_id
    out.model_card.CopyFrom(card)
    out.policy_version = policy_version
    out.created_at_ms = created_at_ms
    if prompt is not None:
        del out.prompt_token_ids[:]
        out.prompt_token_ids.extend(prompt[0])
        out.prompt_text = prompt[1]
    g = lease.group_size or len(stolen.completions)
    comps = [stolen.completions[i % len(stolen.completions)] for i in range(g)]
    del out.completions[:]
    for c in comps:
        new = out.completions.add()
        new.CopyFrom(c)
        new.ClearField("claimed_reward")
    return out


def false_feedback(received: dict[str, list[str]], group_size: int, tokens_per_group: int = 64,
                   log_ratio: float = 25.0) -> list[swarm_pb2.SenderFeedback]:
    """``false_reporter``: for every sender whose bundles were received
    (``{sender: [bundle ids]}``) claim the worst: every completion's text mismatched, every
    bundle invalid, a huge log-ratio, everything filtered and truncated."""
    out = []
    for sender, bundle_ids in sorted(received.items()):
        n = max(len(bundle_ids), 1)
        out.append(swarm_pb2.SenderFeedback(
            sender_node_id=sender, groups=n, tokens=n * tokens_per_group,
            mean_log_ratio=log_ratio, filtered_frac=1.0, truncated_frac=1.0,
            text_mismatches=n * group_size, invalid_bundles=n, bundle_ids=list(bundle_ids)))
    return out


def sybil_reports(identities: list[NodeIdentity], received: dict[str, list[str]],
                  group_size: int, step: int, now_ms: int,
                  log_ratio: float = 25.0) -> list[swarm_pb2.ReportMetricsRequest]:
    """``sybil_feedback`` (issue 13, class 3): one signed ReportMetrics request per ring
    identity, each blaming every sender whose relayed bundles the attacking node received
    (``{sender: [bundle ids]}``, the node's own pulled ids) with the worst statistics
    (:func:`false_feedback`). Senders that are ring members are left out."""
    ring = {ident.node_id for ident in identities}
    honest = {s: ids for s, ids in received.items() if s not in ring}
    out = []
    for ident in identities:
        request = swarm_pb2.ReportMetricsRequest(
            node_id=ident.node_id, step=step, values={"loss": 0.0},
            feedback=false_feedback(honest, group_size, log_ratio=log_ratio))
        out.append(sign_request(request, "ReportMetrics", ident, now_ms=now_ms))
    return out


def oversized_bundle(lease: swarm_pb2.TaskLease, node_id: str, card: bundle_pb2.ModelCard,
                     size_bytes: int) -> bundle_pb2.Bundle:
    """A bundle for ``lease`` whose prompt text pads the payload past ``size_bytes``."""
    return bundle_pb2.Bundle(
        task_id=lease.task_id, lease_id=lease.lease_id, node_id=node_id, model_card=card,
        sampling=bundle_pb2.SamplingParams(temperature=1.0, top_p=1.0,
                                           max_new_tokens=lease.max_new_tokens),
        prompt_token_ids=[1], prompt_text="A" * size_bytes,
        completions=[bundle_pb2.Completion(token_ids=[1], logprobs=[-1.0], text="x")
                     for _ in range(max(lease.group_size, 1))])


def random_tokens_bundle(lease: swarm_pb2.TaskLease, node_id: str, card: bundle_pb2.ModelCard,
                         prompt_ids: list[int], prompt_text: str,
                         decode: Callable[[list[int]], str], rng: random.Random,
                         low_token: int = 3) -> bundle_pb2.Bundle:
    """``flooder``: a structurally valid bundle of uniformly random tokens (no model run),
    log-probs ``-log(V)``, text = decode, no reward claims. Cheap to make in bulk."""
    vocab = int(card.vocab_size)
    lp = -math.log(max(vocab, 2))
    comps = []
    for _ in range(max(lease.group_size, 1)):
        n = rng.randint(1, max(lease.max_new_tokens, 1))
        ids = [rng.randrange(low_token, vocab) for _ in range(n)]
        text = decode(ids)
        comps.append(bundle_pb2.Completion(
            token_ids=ids, logprobs=[lp] * n, text=text,
            finish_reason=bundle_pb2.FINISH_REASON_LENGTH))
    return _leased_bundle(lease, node_id, card, prompt_ids, prompt_text, comps)


# -- malformed envelopes (``garbage``) ------------------------------------------------------
def garbage_envelopes(bundle: bundle_pb2.Bundle, identity: NodeIdentity,
                      rng: random.Random) -> Iterable[tuple[str, bundle_pb2.SignedEnvelope]]:
    """``(label, envelope)`` pairs of malformed bundle envelopes for SubmitBundle, from a
    well-formed ``bundle``: bad signature, truncated key, undecodable but correctly
    signed payload, wrong payload type, a registration payload, non-finite and positive
    log-probs, out-of-vocabulary tokens, empty completions."""
    good = seal("bundle", bundle, identity)

    bad_sig = bundle_pb2.SignedEnvelope()
    bad_sig.CopyFrom(good)
    bad_sig.signature = bytes(64)
    yield "bad_signature", bad_sig

    short_key = bundle_pb2.SignedEnvelope()
    short_key.CopyFrom(good)
    short_key.public_key = good.public_key[:16]
    yield "short_public_key", short_key

    junk = rng.randbytes(512)
    yield "signed_random_payload", bundle_pb2.SignedEnvelope(
        payload_type="bundle", payload=junk, public_key=identity.public_key,
        signature=identity.sign(signing_digest("bundle", junk)))

    wrong_type = bundle_pb2.SignedEnvelope()
    wrong_type.CopyFrom(good)
    wrong_type.payload_type = "tensor"
    yield "unknown_payload_type", wrong_type

    reg = swarm_pb2.RegisterPayload(model_card=bundle.model_card, client_version="x",
                                    timestamp_ms=bundle.created_at_ms)
    yield "register_payload_as_bundle", seal("register", reg, identity)

    def mutated(fn: Callable[[bundle_pb2.Bundle], None]) -> bundle_pb2.SignedEnvelope:
        b = _copy(bundle)
        fn(b)
        return seal("bundle", b, identity)

    def nan_lp(b: bundle_pb2.Bundle) -> None:
        b.completions[0].logprobs[0] = float("nan")

    def pos_lp(b: bundle_pb2.Bundle) -> None:
        b.completions[0].logprobs[0] = 3.0

    def oov(b: bundle_pb2.Bundle) -> None:
        b.completions[0].token_ids[0] = int(b.model_card.vocab_size) + 7

    def empty(b: bundle_pb2.Bundle) -> None:
        del b.completions[0].token_ids[:]
        del b.completions[0].logprobs[:]

    def count(b: bundle_pb2.Bundle) -> None:
        b.completions[0].logprobs.append(-1.0)

    yield "nan_logprob", mutated(nan_lp)
    yield "positive_logprob", mutated(pos_lp)
    yield "token_out_of_vocab", mutated(oov)
    yield "empty_completion", mutated(empty)
    yield "logprob_count_mismatch", mutated(count)
