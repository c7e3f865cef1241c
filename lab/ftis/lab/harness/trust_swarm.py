"""A real coordinator over loopback gRPC with honest nodes alongside, for the trust tests
(issue 13): :class:`Node` is a volunteer talking real gRPC with the shared test tokenizer,
:class:`Swarm` an in-process :class:`CoordinatorServer` (SQLite file, tokenizer required)
with an honest sender A whose bundles are relayed to an honest receiver B.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ftis.coordinator import reputation
from ftis.coordinator.server.app import CoordinatorServer
from ftis.lab.harness.coordinator import (
    VOCAB,
    answer_text,
    chat_prompt,
    load_tokenizer,
    make_config,
    model_card,
    register_envelope,
    signed,
    tokenizer_fp,
    tokenizer_gz,
)
from ftis.protocol.envelope import seal
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import bundle_pb2, swarm_pb2, swarm_pb2_grpc

G = 2
MAX_NEW_TOKENS = 32
TIMEOUT_S = 30


def now_ms() -> int:
    return int(time.time() * 1000)


def answer_of(lease: swarm_pb2.TaskLease) -> str:
    """The answer computed from the question alone (chain_sum ``... a + b - c =``, gcd
    ``... numbers: a, b. ...``, products ``... : a * b. ...``): what an answer-computing
    node can do, since the lease carries no answer (issue 13, class 1)."""
    if lease.dataset == "gcd":
        numbers = re.findall(r"\d+", lease.question.split(":", 1)[1])
        return str(math.gcd(*(int(n) for n in numbers)))
    if lease.dataset == "products":
        a, b = re.findall(r"(-?\d+) \* (-?\d+)", lease.question)[0]
        return str(int(a) * int(b))
    tokens = lease.question.rsplit(":", 1)[-1].strip().rstrip("=").split()
    total = int(tokens[0])
    for op, number in zip(tokens[1::2], tokens[2::2], strict=True):
        total = total + int(number) if op == "+" else total - int(number)
    return str(total)


@dataclass
class Node:
    """A volunteer talking real gRPC: its key, its model card, the stub."""

    identity: NodeIdentity
    stub: swarm_pb2_grpc.SwarmStub
    card: bundle_pb2.ModelCard
    #: the node's ``tokenizers.Tokenizer`` (``None``: the shared test tokenizer)
    tokenizer: Any = None

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    def register(self) -> swarm_pb2.RegisterResponse:
        envelope = register_envelope(self.identity, self.card, now_ms())
        return self.stub.Register(swarm_pb2.RegisterRequest(envelope=envelope), timeout=TIMEOUT_S)

    def upload(self, gz: bytes | None = None) -> swarm_pb2.UploadTokenizerResponse:
        request = swarm_pb2.UploadTokenizerRequest(
            node_id=self.node_id, fingerprint=self.card.tokenizer_fingerprint,
            tokenizer_json_gz=gz if gz is not None else tokenizer_gz())
        return self.stub.UploadTokenizer(
            signed(request, "UploadTokenizer", self.identity, now_ms()), timeout=TIMEOUT_S)

    def lease(self, count: int = 1) -> list[swarm_pb2.TaskLease]:
        request = swarm_pb2.LeaseTasksRequest(node_id=self.node_id, count=count, group_size=G,
                                              max_new_tokens=MAX_NEW_TOKENS)
        reply = self.stub.LeaseTasks(signed(request, "LeaseTasks", self.identity, now_ms()),
                                     timeout=TIMEOUT_S)
        assert reply.error.code == 0, reply.error
        return list(reply.leases)

    def submit(self, envelope: bundle_pb2.SignedEnvelope) -> swarm_pb2.SubmitBundleResponse:
        return self.stub.SubmitBundle(swarm_pb2.SubmitBundleRequest(envelope=envelope),
                                      timeout=TIMEOUT_S)

    def submit_bundle(self, bundle: bundle_pb2.Bundle) -> swarm_pb2.SubmitBundleResponse:
        return self.submit(seal("bundle", bundle, self.identity))

    def pull(self, cursor: int = 0) -> swarm_pb2.PullBundlesResponse:
        request = swarm_pb2.PullBundlesRequest(node_id=self.node_id, cursor=cursor,
                                               max_bundles=64)
        reply = self.stub.PullBundles(signed(request, "PullBundles", self.identity, now_ms()),
                                      timeout=TIMEOUT_S)
        assert reply.error.code == 0, reply.error
        return reply

    def report(self, *feedback: swarm_pb2.SenderFeedback) -> swarm_pb2.ReportMetricsResponse:
        request = swarm_pb2.ReportMetricsRequest(node_id=self.node_id, step=1,
                                                 values={"loss": 0.5}, feedback=list(feedback))
        return self.stub.ReportMetrics(signed(request, "ReportMetrics", self.identity, now_ms()),
                                       timeout=TIMEOUT_S)

    def heartbeat(self) -> swarm_pb2.HeartbeatResponse:
        """A signed Heartbeat; asserts the node is served (known, not banned)."""
        request = swarm_pb2.HeartbeatRequest(node_id=self.node_id, policy_version=1)
        reply = self.stub.Heartbeat(signed(request, "Heartbeat", self.identity, now_ms()),
                                    timeout=TIMEOUT_S)
        assert reply.error.code == 0, reply.error
        return reply

    def honest_bundle(self, lease: swarm_pb2.TaskLease) -> bundle_pb2.Bundle:
        """What an honest client sends: ids encoded with the node's tokenizer, text
        exactly their decoding, correct claims, sane log-probs."""
        tok = self.tokenizer if self.tokenizer is not None else load_tokenizer()
        answer = answer_of(lease)
        completions = []
        for correct in (True, False):
            ids = tok.encode(answer_text(correct, answer)).ids
            completions.append(bundle_pb2.Completion(
                token_ids=ids, logprobs=[-0.7] * len(ids),
                text=tok.decode(ids, skip_special_tokens=False),
                claimed_reward=1.0 if correct else 0.0,
                finish_reason=bundle_pb2.FINISH_REASON_STOP))
        return bundle_pb2.Bundle(
            task_id=lease.task_id, lease_id=lease.lease_id, node_id=self.node_id,
            model_card=self.card, policy_version=1,
            sampling=bundle_pb2.SamplingParams(temperature=1.0, top_p=1.0,
                                               max_new_tokens=MAX_NEW_TOKENS),
            prompt_token_ids=tok.encode(chat_prompt(lease.question)).ids,
            prompt_text=chat_prompt(lease.question), completions=completions)


@dataclass
class Swarm:
    server: CoordinatorServer
    stub: swarm_pb2_grpc.SwarmStub
    honest_a: Node
    honest_b: Node
    stored: list[str]  # bundle ids of A's accepted bundles, in relay order

    def node(self, card: bundle_pb2.ModelCard | None = None) -> Node:
        return Node(NodeIdentity.generate(), self.stub, card or model_card(tokenizer_fp(), VOCAB))

    def attacker(self) -> Node:
        """A registered node with an honest-looking card (the shared tokenizer, known)."""
        node = self.node()
        reply = node.register()
        assert reply.error.code == 0 and reply.tokenizer_known, reply
        return node

    def honest_round(self) -> None:
        """A submits one honest bundle; B pulls everything and reports positive feedback
        about A on the bundles it pulled (what an honest receiver does)."""
        (lease,) = self.honest_a.lease()
        reply = self.honest_a.submit_bundle(self.honest_a.honest_bundle(lease))
        assert reply.error.code == 0 and reply.reward_mismatches == 0, reply.error
        self.stored.append(reply.bundle_id)
        pulled = self.honest_b.pull()
        ids = [b.bundle_id for b in pulled.bundles if b.bundle_id in self.stored]
        assert ids == self.stored, "the relay must carry A's verified bundles"
        report = self.honest_b.report(swarm_pb2.SenderFeedback(
            sender_node_id=self.honest_a.node_id, groups=1, tokens=20, mean_log_ratio=-0.2,
            filtered_frac=0.0, truncated_frac=0.0, bundle_ids=[ids[-1]]))
        assert report.error.code == 0 and not report.dropped_feedback, report

    def stored_by(self, node: Node) -> list[str]:
        """Bundle ids the coordinator stored for ``node``."""
        return sorted(b.bundle_id for b in self.server.state.list_bundles(node.node_id, 1000))

    def assert_relay_unchanged(self, accepted: list[str] | tuple[str, ...] = ()) -> None:
        """The relay carries A's bundles and, at most, the attacker's ``accepted`` ones
        (a quarantined sender's are stored, not relayed): nothing that was refused."""
        relayed = [b.bundle_id for b in self.honest_b.pull().bundles]
        assert [b for b in relayed if b in self.stored] == self.stored
        assert set(relayed) - set(self.stored) <= set(accepted), relayed

    def standing(self, node: Node) -> tuple[float, bool]:
        """``(reputation now, quarantined)`` as stored (Heartbeat answers from a record
        cached for up to a second, so the test reads the database of the server it runs);
        the node must still be served over gRPC."""
        node.heartbeat()
        record = self.server.state.get_node(node.node_id)
        assert record is not None and not record.banned, record
        score = reputation.current_score(record.standing, now_ms(),
                                         self.server.ctx.policy.half_life_s)
        return score, record.quarantined

    def honest_standing(self) -> dict[str, tuple[float, bool]]:
        return {"A": self.standing(self.honest_a), "B": self.standing(self.honest_b)}

    def assert_honest_kept_their_reputation(self, before: dict[str, tuple[float, bool]]) -> None:
        """Nobody honest lost reputation, was quarantined or banned, and both still work
        (A's next bundle is accepted and relayed to B, B's feedback is applied)."""
        self.honest_round()
        after = self.honest_standing()
        for name, (score, quarantined) in after.items():
            assert not quarantined, (name, after)
            assert score >= before[name][0] - 1e-9, (name, before, after)
        assert after["A"][0] > before["A"][0]  # A still earns reputation


@contextlib.contextmanager
def running_swarm(tmp_path: Path, **config: Any) -> Iterator[Swarm]:
    """A coordinator (``make_config(**config)``, tokenizer required) with honest A and B
    registered, A's tokenizer uploaded and one honest round played."""
    server = CoordinatorServer(make_config(db=str(tmp_path / "coordinator.db"),
                                           require_tokenizer=True, **config))
    server.start()
    channel = grpc.insecure_channel(server.address)
    stub = swarm_pb2_grpc.SwarmStub(channel)
    try:
        card = model_card(tokenizer_fp(), VOCAB)
        a, b = Node(NodeIdentity.generate(), stub, card), Node(NodeIdentity.generate(), stub, card)
        assert a.register().error.code == 0 and a.upload().error.code == 0
        assert b.register().tokenizer_known
        world = Swarm(server, stub, a, b, [])
        world.honest_round()
        yield world
    finally:
        channel.close()
        server.stop(grace=1.0)


def card_model() -> Any:
    """The weights of the trust tests' model card: a tiny random Llama (1 layer, hidden
    size 32, seed 0) over the shared test vocabulary (:data:`VOCAB`), in eval mode; a
    ``torch.nn.Module``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True)).eval()


def model_bundle(node: Node, lease: swarm_pb2.TaskLease, model: Any,
                 shade: float = 0.0) -> bundle_pb2.Bundle:
    """``node``'s honest bundle for ``lease`` whose per-token log-probs are ``model``'s
    (nats, float32 log-softmax of the token after each prefix), each lowered by
    ``shade`` nats (a log-prob shader's forgery; 0 for an honest sender)."""
    import torch

    bundle = node.honest_bundle(lease)
    prompt = list(bundle.prompt_token_ids)
    for c in bundle.completions:
        ids = list(c.token_ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])
        del c.logprobs[:]
        c.logprobs.extend(float(x) - shade for x in lp[:, 0])
    return bundle
