"""Attacking volunteers, one class per attack kind, each wrapping an honest node.

An attacker is not a :class:`VolunteerNode` subclass: it owns one (``self.node``) and is
injected into it as its :class:`~ftis.client.node.runner.NodeHooks` (composition), so the
node generates, learns and checkpoints as a volunteer's would while the attacker decides
what each bundle becomes (:meth:`AttackNode.bundle`), how it is submitted
(:meth:`AttackNode.submit`) and what feedback is reported (:meth:`AttackNode.feedback`).
Attackers that run no model (flooder, garbage, sybil_burst, answer_computer) replace the
round with their own :meth:`AttackNode.run_round` and drive the connection directly.

Every attacker (the ``honest`` control included) seals and submits its bundles itself so
it can record, per submission, what it sent and the code it got back, and whether the
coordinator had it quarantined just before (from a heartbeat); it also records the
relayed bundles its learner used (``received`` events), so an experiment can tell
exactly which attacker bundles reached honest learners.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ftis.client.learner.loss import LossConfig
from ftis.client.node.runner import RoundResult, VolunteerNode
from ftis.client.rollout.groups import RolloutGroup
from ftis.lab.attack import mutations
from ftis.protocol.bundles import MAX_BUNDLE_BYTES, MAX_GRPC_MESSAGE_BYTES
from ftis.protocol.envelope import open_envelope, seal
from ftis.protocol.errors import ErrorCode, FtisError, code_name
from ftis.protocol.identity import NodeIdentity
from ftis.tasks import render_messages
from ftis.v1 import bundle_pb2, swarm_pb2

log = logging.getLogger(__name__)


@dataclass
class AttackOptions:
    """Kind-specific knobs (``ftis-lab attack`` options)."""

    inflate_factor: float = 0.05
    deflate_nats: float = 5.0
    fake_question: str = "How many times does the letter z appear in 'pizzazz'?"
    flood_seconds: float = 3.0
    flood_lease_count: int = 16
    oversized_bytes: int = MAX_BUNDLE_BYTES + 64 * 1024
    sybils: int = 60
    false_log_ratio: float = 25.0
    seed: int = 0
    wait_for: str = ""  # start the first round only once this file exists
    replay_foreign: int = 8  # replay: victim envelopes resubmitted as-is per round
    frame_per_round: int = 40  # replay_frame: victim envelopes resubmitted per round
    #: logprob_shade: log-probs lowered by ln C, C = the learner's truncation default
    shade_truncation: float = LossConfig().truncation
    sybil_ring: int = 2  # sybil_feedback: fresh identities in the ring


class AttackLog:
    """Append-only JSONL log (``OUT/attack.jsonl``); thread-safe, flushed per line."""

    def __init__(self, path: Path, kind: str, node_id: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.kind, self.node_id = kind, node_id
        self._lock = threading.Lock()

    def write(self, event: str, round_: int, **fields: Any) -> None:
        rec = {"time": time.time(), "kind": self.kind, "node_id": self.node_id,
               "round": round_, "event": event, **fields}
        with self._lock, open(self.path, "a") as fh:
            fh.write(json.dumps(rec, default=str) + "\n")


def read_attack_log(path: Path) -> list[dict]:
    """Records of an ``attack.jsonl`` file (missing file: empty list)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def call_code(fn: Any, *args: Any, **kwargs: Any) -> tuple[int | str, str, Any]:
    """Run one RPC; ``(code, reason, result)`` where ``code`` is 0 on success, the
    ``ErrorCode`` of an in-band rejection, or ``"grpc:STATUS"`` for a transport error;
    ``result`` is ``None`` unless ``code`` is 0 (a coded reply the connection returned as
    an acknowledgement, BUNDLE_REPLAYED with the stored rewards, is no acceptance)."""
    try:
        result = fn(*args, **kwargs)
    except FtisError as exc:
        return exc.code, exc.reason, None
    except grpc.RpcError as exc:
        return f"grpc:{exc.code().name}", str(exc.details())[:200], None
    error = getattr(result, "error", None)
    if error is not None and error.code:  # a coded reply taken as success (a replayed
        return int(error.code), error.reason, None  # payload's stored acknowledgement)
    return 0, "", result


def code_label(code: int | str) -> str:
    return code if isinstance(code, str) else ("OK" if code == 0 else code_name(code))


class AttackNode:
    """The honest client plus logging; subclasses override :meth:`mutate` (or more).

    Owns a :class:`VolunteerNode` built with this object as its hooks; ``conn``,
    ``policy``, ``config``, ``pool`` and ``round`` read through to that node.

    Args:
        config: the client settings (a ``ClientConfig``).
        policy: the loaded model, tokenizer and card.
        connection: a registered ``SwarmConnection``.
        attack_log: where events go.
        options: kind-specific knobs.
    """

    kind = "honest"

    def __init__(self, config: Any, policy: Any, connection: Any, attack_log: AttackLog,
                 options: AttackOptions | None = None) -> None:
        self.attack_log = attack_log
        self.options = options or AttackOptions()
        self.rng = random.Random(self.options.seed)
        self.accepted_envelopes: list[bundle_pb2.SignedEnvelope] = []
        self.lease_index = 0  # leases seen in the current round
        self._variant = "own"
        self.node = VolunteerNode(config, policy, connection, hooks=self)

    # -- the wrapped node ----------------------------------------------------------------
    @property
    def conn(self) -> Any:
        return self.node.conn

    @property
    def policy(self) -> Any:
        return self.node.policy

    @property
    def config(self) -> Any:
        return self.node.config

    @property
    def pool(self) -> Any:
        return self.node.pool

    @property
    def round(self) -> int:
        """Rounds done (the node's counter)."""
        return self.node.round

    # -- helpers ---------------------------------------------------------------------
    def log(self, event: str, **fields: Any) -> None:
        self.attack_log.write(event, self.round + 1, **fields)

    def quarantined_now(self) -> bool | None:
        """The coordinator's view of this node (heartbeat); ``None`` if refused."""
        code, _, beat = call_code(self.conn.heartbeat, self.round)
        return bool(beat.quarantined) if code == 0 else None

    def send(self, envelope: bundle_pb2.SignedEnvelope, variant: str, task_id: str = ""
             ) -> swarm_pb2.SubmitBundleResponse | None:
        """Submit ``envelope`` and log the outcome."""
        quarantined = self.quarantined_now()
        code, reason, reply = call_code(self.conn.submit_envelope, envelope)
        self.log("submit", variant=variant, task_id=task_id, code=code,
                 code_name=code_label(code), reason=reason,
                 bundle_id=reply.bundle_id if reply is not None else "",
                 reward_mismatches=int(reply.reward_mismatches) if reply is not None else 0,
                 quarantined_before=quarantined,
                 quarantined_after=self.quarantined_now() if reply is not None else None,
                 payload_bytes=len(envelope.payload))
        if reply is not None:
            self.accepted_envelopes = [*self.accepted_envelopes[-63:], envelope]
        return reply

    def mutate(self, bundle: bundle_pb2.Bundle, lease: swarm_pb2.TaskLease,
               prompt_ids: list[int], prompt_text: str) -> bundle_pb2.Bundle:
        """The attack on one honest bundle (identity for ``honest``)."""
        return bundle

    # -- NodeHooks (injected into self.node) ---------------------------------------------
    def bundle(self, honest: bundle_pb2.Bundle, lease: swarm_pb2.TaskLease,
               prompt_ids: list[int], prompt_text: str) -> bundle_pb2.Bundle:
        """The node's honest bundle for ``lease`` through :meth:`mutate`."""
        self._variant = self.kind
        out = self.mutate(honest, lease, prompt_ids, prompt_text)
        self.lease_index += 1
        return out

    def submit(self, bundle: bundle_pb2.Bundle) -> swarm_pb2.SubmitBundleResponse | None:
        return self.send(seal("bundle", bundle, self.conn.identity), self._variant,
                         bundle.task_id)

    def feedback(self, external: list[RolloutGroup],
                 honest: list[swarm_pb2.SenderFeedback]) -> list[swarm_pb2.SenderFeedback]:
        """Logs the relayed bundles the learner used; reports the honest feedback."""
        self.log("received", bundle_ids=[g.meta.get("bundle_id", "") for g in external],
                 senders=[g.sender for g in external])
        return honest

    # -- rounds ------------------------------------------------------------------------
    def run_round(self) -> RoundResult:
        """One round of the wrapped node (attackers without a model override this)."""
        self.lease_index = 0
        return self.node.run_round()


class RewardLiarNode(AttackNode):
    """Claims reward 1.0 for every completion."""

    kind = "reward_liar"

    def mutate(self, bundle: bundle_pb2.Bundle, lease: swarm_pb2.TaskLease,
               prompt_ids: list[int], prompt_text: str) -> bundle_pb2.Bundle:
        return mutations.lie_rewards(bundle, 1.0)


class LogprobInflateNode(AttackNode):
    """Sampler log-probs ``lp * factor`` (near 0)."""

    kind = "logprob_inflate"

    def mutate(self, bundle: bundle_pb2.Bundle, lease: swarm_pb2.TaskLease,
               prompt_ids: list[int], prompt_text: str) -> bundle_pb2.Bundle:
        return mutations.scale_logprobs(bundle, self.options.inflate_factor)


class LogprobDeflateNode(AttackNode):
    """Sampler log-probs ``lp - nats``: receivers' IS weights explode up to C."""

    kind = "logprob_deflate"

    def mutate(self, bundle: bundle_pb2.Bundle, lease: swarm_pb2.TaskLease,
               prompt_ids: list[int], prompt_text: str) -> bundle_pb2.Bundle:
        return mutations.shift_logprobs(bundle, self.options.deflate_nats)


class LogprobShadeNode(AttackNode):
    """Sampler log-probs lowered by ln C (C = ``shade_truncation``, the learner's cap):
    every token of its groups gets the largest importance weight a receiver allows, while
    the mean log-ratio (0.693 for C = 2) stays inside the old 1.5-nat tolerance (issue 13,
    class 4)."""

    kind = "logprob_shade"

    def mutate(self, bundle: bundle_pb2.Bundle, lease: swarm_pb2.TaskLease,
               prompt_ids: list[int], prompt_text: str) -> bundle_pb2.Bundle:
        return mutations.shade_logprobs(bundle, self.options.shade_truncation)


class TextMismatchNode(AttackNode):
    """Text replaced by an answer string claiming reward 1; tokens unchanged. The lease
    carries no answer, so the attacker writes a guess (``GUESS``)."""

    kind = "text_mismatch"
    GUESS = "42"

    def mutate(self, bundle: bundle_pb2.Bundle, lease: swarm_pb2.TaskLease,
               prompt_ids: list[int], prompt_text: str) -> bundle_pb2.Bundle:
        return mutations.replace_text(bundle, mutations.answer_text(self.GUESS))


class FabricatedPromptNode(AttackNode):
    """prompt_token_ids of a made-up prompt instead of the leased one."""

    kind = "fabricated_prompt"

    def mutate(self, bundle: bundle_pb2.Bundle, lease: swarm_pb2.TaskLease,
               prompt_ids: list[int], prompt_text: str) -> bundle_pb2.Bundle:
        ids, text = self.policy.prompt_token_ids(render_messages(self.options.fake_question))
        return mutations.fabricate_prompt(bundle, ids, text)


class ReplayNode(AttackNode):
    """Replays and copies.

    Per round, by lease index:
      0. ``own``: the honest bundle; afterwards its own last accepted envelopes are
         resubmitted byte for byte (``replay_own``), and up to ``replay_foreign``
         relayed envelopes of one victim are submitted exactly as the victim signed them
         (``replay_foreign``: anyone can do this, and the signer is the victim);
      1. ``copy_own_prompt``: another node's completions under the attacker's own prompt
         for its lease, claims re-scored for that lease (self-consistent stolen work);
      2+. ``copy_verbatim`` (from round 3 on; ``copy_own_prompt`` before): a relayed
         bundle of another node, prompt included, re-signed under the attacker's lease.
    """

    kind = "replay"
    #: own envelopes resubmitted per round
    REPLAY_OWN = 3

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steal_cursor = 0
        self.stolen: list[tuple[swarm_pb2.RelayedBundle, bundle_pb2.Bundle]] = []

    def _steal(self) -> None:
        code, _, resp = call_code(self.conn.pull_bundles, self.steal_cursor, 64,
                                  self.policy.card.tokenizer_fingerprint)
        if code != 0:
            return
        for relayed in resp.bundles:
            try:
                bundle, sender = open_envelope(relayed.envelope, "bundle", bundle_pb2.Bundle,
                                               MAX_BUNDLE_BYTES)
            except FtisError:
                continue
            if sender != self.conn.node_id:
                self.stolen.append((relayed, bundle))
        self.steal_cursor = max(self.steal_cursor, resp.next_cursor)
        self.stolen = self.stolen[-64:]

    def run_round(self) -> RoundResult:
        self._steal()
        return super().run_round()

    def variant(self, lease_index: int) -> str:
        if lease_index == 0 or not self.stolen:
            return "own"
        if lease_index >= 2 and self.round >= 2:
            return "copy_verbatim"
        return "copy_own_prompt"

    def bundle(self, honest: bundle_pb2.Bundle, lease: swarm_pb2.TaskLease,
               prompt_ids: list[int], prompt_text: str) -> bundle_pb2.Bundle:
        variant = self.variant(self.lease_index)
        self.lease_index += 1
        self._variant = variant
        if variant == "own":
            return honest
        _, victim = self.rng.choice(self.stolen)
        prompt = (prompt_ids, prompt_text) if variant == "copy_own_prompt" else None
        return mutations.copy_under_lease(
            victim, lease, self.conn.node_id, self.policy.card, self.round,
            int(time.time() * 1000), prompt=prompt)

    def submit(self, bundle: bundle_pb2.Bundle) -> swarm_pb2.SubmitBundleResponse | None:
        earlier = self.accepted_envelopes[-self.REPLAY_OWN:]
        reply = super().submit(bundle)
        if self._variant == "own":
            for env in earlier:
                self.send(env, "replay_own")
            if self.stolen:
                victim = Counter(b.node_id for _, b in self.stolen).most_common(1)[0][0]
                mine = [(r, b) for r, b in self.stolen if b.node_id == victim]
                for relayed, b in mine[-self.options.replay_foreign:]:
                    self.send(relayed.envelope, "replay_foreign", b.task_id)
        return reply


class ReplayFrameNode(ReplayNode):
    """Framing by replay: honest bundles under its own leases (it stays in good
    standing), plus, every round, up to ``frame_per_round`` of one victim's relayed
    envelopes resubmitted exactly as the victim signed them. The coordinator cannot
    tell who sent an envelope, only who signed it."""

    kind = "replay_frame"

    def variant(self, lease_index: int) -> str:
        return "own"

    def submit(self, bundle: bundle_pb2.Bundle) -> swarm_pb2.SubmitBundleResponse | None:
        reply = AttackNode.submit(self, bundle)
        if self.lease_index == 1 and self.stolen:  # once per round, after the first lease
            victim = Counter(b.node_id for _, b in self.stolen).most_common(1)[0][0]
            mine = [(r, b) for r, b in self.stolen if b.node_id == victim]
            for i in range(self.options.frame_per_round):
                relayed, b = mine[-1 - i % len(mine)]
                self.send(relayed.envelope, "replay_foreign", b.task_id)
        return reply


class FalseReporterNode(AttackNode):
    """Honest bundles; feedback claims every sender it heard from is a cheat."""

    kind = "false_reporter"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.heard: dict[str, list[str]] = {}

    def feedback(self, external: list[RolloutGroup],
                 honest: list[swarm_pb2.SenderFeedback]) -> list[swarm_pb2.SenderFeedback]:
        super().feedback(external, honest)  # logs (the node drained the pool's counters)
        received: dict[str, list[str]] = {}
        for g in [*external, *self.pool.groups]:
            received.setdefault(g.sender, []).append(g.meta.get("bundle_id", ""))
        fb = mutations.false_feedback(
            {s: [b for b in ids if b] for s, ids in received.items()},
            self.config.group_size, log_ratio=self.options.false_log_ratio)
        self.log("feedback", feedback=[{"sender": f.sender_node_id, "groups": f.groups,
                                        "text_mismatches": f.text_mismatches,
                                        "mean_log_ratio": f.mean_log_ratio,
                                        "bundle_ids": list(f.bundle_ids)} for f in fb])
        return fb


class SybilFeedbackNode(AttackNode):
    """Honest bundles and feedback of its own; in addition a ring of ``sybil_ring`` fresh
    identities (registered on the first round with the node's card, no bundles of their
    own) each send, every round, negative feedback on every other sender whose relayed
    bundles this node received, naming the bundle ids the node pulled (issue 13, class 3).
    """

    kind = "sybil_feedback"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ring: list[NodeIdentity] = []

    def _register_ring(self) -> None:
        codes: Counter[str] = Counter()
        for _ in range(self.options.sybil_ring):
            ident = NodeIdentity.generate()
            payload = swarm_pb2.RegisterPayload(
                model_card=self.policy.card, client_version="ftis-client/0.1.0",
                timestamp_ms=int(time.time() * 1000), display_name="sybil")
            code, reason, resp = call_code(self.conn.stub.Register, swarm_pb2.RegisterRequest(
                envelope=seal("register", payload, ident)), timeout=30)
            code, _ = GarbageNode._in_band(code, reason, resp)
            codes[code_label(code)] += 1
            if code == 0:
                self.ring.append(ident)
        self.log("sybil_ring", registered=[i.node_id for i in self.ring],
                 register_codes=dict(codes))

    def feedback(self, external: list[RolloutGroup],
                 honest: list[swarm_pb2.SenderFeedback]) -> list[swarm_pb2.SenderFeedback]:
        own = super().feedback(external, honest)
        if not self.ring:
            self._register_ring()
        received: dict[str, list[str]] = {}
        for g in [*external, *self.pool.groups]:
            if g.meta.get("bundle_id"):
                received.setdefault(g.sender, []).append(g.meta["bundle_id"])
        received = {s: ids[-64:] for s, ids in received.items()}  # the coordinator's bound
        for request in mutations.sybil_reports(self.ring, received, self.config.group_size,
                                               self.round, int(time.time() * 1000),
                                               log_ratio=self.options.false_log_ratio):
            code, reason, resp = call_code(self.conn.stub.ReportMetrics, request, timeout=30)
            code, reason = GarbageNode._in_band(code, reason, resp)
            self.log("sybil_report", reporter=request.node_id, code=code,
                     code_name=code_label(code), reason=reason,
                     senders=[f.sender_node_id for f in request.feedback],
                     bundle_ids=sum(len(f.bundle_ids) for f in request.feedback),
                     dropped=len(resp.dropped_feedback) if resp is not None else None)
        return own


# -- attackers that drive the connection directly -------------------------------------------
class FlooderNode(AttackNode):
    """Leases and submits random-token bundles as fast as it can for ``flood_seconds`` a
    round, then sends an envelope over the size limit and one over gRPC's message limit."""

    kind = "flooder"
    #: concurrent submissions
    THREADS = 8

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from concurrent.futures import ThreadPoolExecutor

        self.flood_pool = ThreadPoolExecutor(self.THREADS)

    def run_round(self) -> RoundResult:
        opts, cfg, pol = self.options, self.config, self.policy
        lease_codes: Counter[str] = Counter()
        submit_codes: Counter[str] = Counter()
        prompt_cache: dict[str, tuple[list[int], str]] = {}
        t0 = time.monotonic()
        while time.monotonic() - t0 < opts.flood_seconds:
            code, _, leases = call_code(self.conn.lease_tasks, opts.flood_lease_count,
                                        cfg.group_size, cfg.max_new_tokens)
            lease_codes[code_label(code)] += 1
            if code == ErrorCode.NODE_BANNED:
                break
            if code != 0:
                time.sleep(0.02)
                continue
            bundles = []
            for lease in leases:
                key = lease.question
                if key not in prompt_cache:
                    prompt_cache[key] = pol.prompt_token_ids(
                        [{"role": m.role, "content": m.content} for m in lease.messages])
                ids, text = prompt_cache[key]
                bundles.append(mutations.random_tokens_bundle(
                    lease, self.conn.node_id, pol.card, ids, text, pol.decode, self.rng))
            for b, (code, _, reply) in zip(bundles, self.flood_pool.map(
                    lambda b: call_code(self.conn.submit_bundle, b), bundles), strict=True):
                submit_codes[code_label(code)] += 1
                if reply is not None:
                    self.log("submit", variant="flood", task_id=b.task_id, code=0,
                             code_name="OK", bundle_id=reply.bundle_id)
        self.log("flood", seconds=opts.flood_seconds, lease_codes=dict(lease_codes),
                 submit_codes=dict(submit_codes))
        self._oversized()
        self.node.round += 1
        return RoundResult(self.round, {"submitted": float(sum(submit_codes.values()))})

    def _oversized(self) -> None:
        cfg, pol = self.config, self.policy
        code, reason, leases = call_code(self.conn.lease_tasks, 1, cfg.group_size,
                                         cfg.max_new_tokens)
        if code != 0:
            self.log("submit", variant="oversized_no_lease", code=code,
                     code_name=code_label(code), reason=reason)
            return
        big = mutations.oversized_bundle(leases[0], self.conn.node_id, pol.card,
                                         self.options.oversized_bytes)
        env = seal("bundle", big, self.conn.identity)
        code, reason, _ = call_code(self.conn.submit_envelope, env)
        self.log("submit", variant="oversized", code=code, code_name=code_label(code),
                 reason=reason, payload_bytes=len(env.payload))
        # beyond gRPC's message limit: a raw channel that is allowed to send it
        huge = mutations.oversized_bundle(leases[0], self.conn.node_id, pol.card,
                                          MAX_GRPC_MESSAGE_BYTES + 1024)
        env = seal("bundle", huge, self.conn.identity)
        channel = grpc.insecure_channel(self.conn.target, options=[
            ("grpc.max_send_message_length", 4 * MAX_GRPC_MESSAGE_BYTES)])
        try:
            stub = channel.unary_unary("/ftis.v1.Swarm/SubmitBundle",
                                       request_serializer=swarm_pb2.SubmitBundleRequest.SerializeToString,
                                       response_deserializer=swarm_pb2.SubmitBundleResponse.FromString)
            code, reason, resp = call_code(stub, swarm_pb2.SubmitBundleRequest(envelope=env),
                                           timeout=30)
            if resp is not None and resp.error.code:
                code, reason = resp.error.code, resp.error.reason
        finally:
            channel.close()
        self.log("submit", variant="over_grpc_limit", code=code, code_name=code_label(code),
                 reason=reason, payload_bytes=len(env.payload))


class AnswerComputerNode(AttackNode):
    """A model-less node (issue 13, class 1): for each leased arithmetic task (chain_sum,
    products, gcd) it computes the answer from the question, writes a little text ending
    in ``<answer>X</answer>`` (half the group with a wrong X, for reward variance),
    encodes it with the real tokenizer and makes up log-probs; other tasks are skipped.
    It never runs its model and does not learn."""

    kind = "answer_computer"

    def run_round(self) -> RoundResult:
        cfg, pol = self.config, self.policy
        submitted = skipped = 0
        code, reason, leases = call_code(self.conn.lease_tasks, cfg.local_groups,
                                         cfg.group_size, cfg.max_new_tokens)
        if code != 0:
            self.log("lease", code=code, code_name=code_label(code), reason=reason)
            leases = []
        eos = (pol.tokenizer.eos_token_id,) if pol.tokenizer.eos_token_id is not None else ()

        def encode(text: str) -> list[int]:
            return list(pol.tokenizer(text, add_special_tokens=False)["input_ids"])

        for lease in leases:
            answer = mutations.computed_answer(lease.dataset, lease.question)
            if answer is None:
                skipped += 1
                self.log("skip", dataset=lease.dataset, task_id=lease.task_id)
                continue
            ids, text = pol.prompt_token_ids([{"role": m.role, "content": m.content}
                                              for m in lease.messages])
            bundle = mutations.computed_bundle(lease, self.conn.node_id, pol.card, ids, text,
                                               answer, encode, pol.decode, self.rng, eos)
            bundle.policy_version = self.round
            bundle.created_at_ms = int(time.time() * 1000)
            reply = self.send(seal("bundle", bundle, self.conn.identity), self.kind,
                              lease.task_id)
            submitted += reply is not None
        self.node.round += 1
        return RoundResult(self.round, {"submitted": float(submitted),
                                        "skipped": float(skipped)})


class GarbageNode(AttackNode):
    """Random bytes, malformed protobuf and wrong payload types to SubmitBundle and Register,
    plus malformed signed bundles under a real lease and badly signed requests."""

    kind = "garbage"

    def _raw(self, method: str, data: bytes, response_cls: Any) -> tuple[int | str, str]:
        stub: grpc.UnaryUnaryMultiCallable[bytes, Any]  # raw bytes out, no serializer
        stub = self.conn.channel.unary_unary(f"/ftis.v1.Swarm/{method}",
                                             request_serializer=None,
                                             response_deserializer=response_cls.FromString)
        code, reason, resp = call_code(stub, data, timeout=30)
        if resp is not None and resp.error.code:
            return resp.error.code, resp.error.reason
        return code, reason

    def _log(self, target: str, label: str, code: int | str, reason: str) -> None:
        self.log("garbage", target=target, variant=label, code=code,
                 code_name=code_label(code), reason=reason)

    def run_round(self) -> RoundResult:
        cfg, pol, rng = self.config, self.policy, self.rng
        ident = self.conn.identity
        # 1. raw random bytes / truncated protobuf to both envelope-carrying RPCs
        for method, resp_cls in (("SubmitBundle", swarm_pb2.SubmitBundleResponse),
                                 ("Register", swarm_pb2.RegisterResponse)):
            for label, data in (("random_bytes", rng.randbytes(rng.randint(1, 4096))),
                                ("truncated_protobuf", b"\x0a\xff\xff\xff\x0f\x0a\x05bund"),
                                ("huge_length_prefix", b"\x0a\x80\x80\x80\x80\x10" + b"\0" * 16)):
                self._log(method, label, *self._raw(method, data, resp_cls))
        # 2. a bundle envelope sent to Register, random payload as a registration
        code, _, leases = call_code(self.conn.lease_tasks, 1, cfg.group_size, cfg.max_new_tokens)
        if code == ErrorCode.NODE_BANNED:
            self._log("LeaseTasks", "lease", code, "")
            self.node.round += 1
            return RoundResult(self.round, {})
        if code == 0:
            lease = leases[0]
            ids, text = pol.prompt_token_ids(
                [{"role": m.role, "content": m.content} for m in lease.messages])
            bundle = mutations.random_tokens_bundle(lease, ident.node_id, pol.card, ids, text,
                                                    pol.decode, rng)
            bundle.created_at_ms = int(time.time() * 1000)
            env = seal("bundle", bundle, ident)
            code, reason, resp = call_code(self.conn.stub.Register,
                                           swarm_pb2.RegisterRequest(envelope=env), timeout=30)
            self._log("Register", "bundle_envelope_as_registration",
                      *self._in_band(code, reason, resp))
            for label, bad in mutations.garbage_envelopes(bundle, ident, rng):
                code, reason, _ = call_code(self.conn.submit_envelope, bad)
                self._log("SubmitBundle", label, code, reason)
        # 3. requests with a missing, forged or stale signature
        req = swarm_pb2.LeaseTasksRequest(node_id=ident.node_id, count=1,
                                          group_size=cfg.group_size,
                                          max_new_tokens=cfg.max_new_tokens)
        self._log("LeaseTasks", "unsigned", *self._stub_call(self.conn.stub.LeaseTasks, req))
        from ftis.protocol.auth import sign_request

        other = NodeIdentity.generate()
        sign_request(req, "LeaseTasks", other)
        self._log("LeaseTasks", "signed_by_other_key",
                  *self._stub_call(self.conn.stub.LeaseTasks, req))
        sign_request(req, "LeaseTasks", ident, now_ms=int(time.time() * 1000) - 3_600_000)
        self._log("LeaseTasks", "stale_timestamp",
                  *self._stub_call(self.conn.stub.LeaseTasks, req))
        sign_request(req, "Heartbeat", ident)  # signature for another method
        self._log("LeaseTasks", "signature_for_other_method",
                  *self._stub_call(self.conn.stub.LeaseTasks, req))
        # 4. non-finite feedback
        fb = swarm_pb2.SenderFeedback(sender_node_id="0" * 32, groups=1,
                                      mean_log_ratio=float("nan"))
        code, reason, _ = call_code(self.conn.report_metrics, self.round + 1,
                                    {"x": float("inf")}, [fb])
        self._log("ReportMetrics", "nan_feedback_unknown_sender", code, reason)
        self.node.round += 1
        return RoundResult(self.round, {})

    @staticmethod
    def _in_band(code: int | str, reason: str, resp: Any) -> tuple[int | str, str]:
        if resp is not None and resp.error.code:
            return resp.error.code, resp.error.reason
        return code, reason

    @staticmethod
    def _stub_call(fn: Any, req: Any) -> tuple[int | str, str]:
        code, reason, resp = call_code(fn, req, timeout=30)
        return GarbageNode._in_band(code, reason, resp)


class SybilBurstNode(AttackNode):
    """Each round registers ``sybils`` fresh identities within seconds; each tries to lease."""

    kind = "sybil_burst"

    def run_round(self) -> RoundResult:
        from ftis.protocol.auth import sign_request

        cfg, pol = self.config, self.policy
        reg_codes: Counter[str] = Counter()
        lease_codes: Counter[str] = Counter()
        admitted, leased = [], []
        t0 = time.monotonic()
        for _ in range(self.options.sybils):
            ident = NodeIdentity.generate()
            payload = swarm_pb2.RegisterPayload(
                model_card=pol.card, client_version="ftis-client/0.1.0",
                timestamp_ms=int(time.time() * 1000), display_name="sybil")
            code, _, resp = call_code(self.conn.stub.Register, swarm_pb2.RegisterRequest(
                envelope=seal("register", payload, ident)), timeout=30)
            code, _ = self._in_band(code, "", resp)
            reg_codes[code_label(code)] += 1
            if code != 0:
                continue
            admitted.append(ident.node_id)
            req = swarm_pb2.LeaseTasksRequest(node_id=ident.node_id, count=cfg.local_groups,
                                              group_size=cfg.group_size,
                                              max_new_tokens=cfg.max_new_tokens)
            sign_request(req, "LeaseTasks", ident)
            code, _, resp = call_code(self.conn.stub.LeaseTasks, req, timeout=30)
            code, _ = self._in_band(code, "", resp)
            lease_codes[code_label(code)] += 1
            if code == 0:
                leased.append(ident.node_id)
        self.log("sybil", attempted=self.options.sybils, seconds=time.monotonic() - t0,
                 register_codes=dict(reg_codes), lease_codes=dict(lease_codes),
                 admitted=admitted, leased=leased)
        self.node.round += 1
        return RoundResult(self.round, {"admitted": float(len(admitted))})

    _in_band = staticmethod(GarbageNode._in_band)


NODE_CLASSES: dict[str, type[AttackNode]] = {cls.kind: cls for cls in (
    AttackNode, RewardLiarNode, LogprobInflateNode, LogprobDeflateNode, TextMismatchNode,
    ReplayNode, ReplayFrameNode, FabricatedPromptNode, FlooderNode, GarbageNode,
    SybilBurstNode, FalseReporterNode, LogprobShadeNode, SybilFeedbackNode,
    AnswerComputerNode)}
