"""Issue 13, class 2 (tokenizer poisoning), played over the real gRPC protocol against a
real in-process coordinator (:class:`CoordinatorServer` on loopback, SQLite file,
tokenizer required), with the real SmolLM2-135M tokenizer as a client loads it.

The attack: a node registers with the honest SmolLM2 fingerprint and uploads, first, a
``tokenizer.json`` whose decoder was changed. Under the earlier fingerprint (model type,
vocab, merges, added tokens) it hashed equal, so the coordinator would have decoded every
honest SmolLM2 node's ids with it, and banned them with a TEXT_MISMATCH proof. Now the
fingerprint covers the decoder and the coordinator recomputes it from the upload: the
upload is refused, and the honest nodes that come next upload their own tokenizer, are
text-verified, gain reputation and are relayed.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from ftis.coordinator import reputation
from ftis.coordinator.server.app import CoordinatorServer
from ftis.coordinator.tokenizer_store import check_upload
from ftis.lab.harness.coordinator import make_config, model_card, signed
from ftis.lab.harness.trust_swarm import Node, now_ms
from ftis.protocol.errors import ErrorCode
from ftis.protocol.fingerprint import tokenizer_fingerprint
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import swarm_pb2, swarm_pb2_grpc

pytestmark = pytest.mark.integration

#: SmolLM2-135M's embedding rows = its tokenizer's ids.
SMOLLM2_VOCAB = 49_152
TIMEOUT_S = 30


def _client_tokenizer_json(alias: str, gguf_too: bool = True) -> tuple[str, str | None]:
    """``(tokenizer.json as a client serializes it, the same from the GGUF)`` for an
    embedded model, as ``load_policy`` loads it (``AutoTokenizer`` on the converted copy,
    ``backend_tokenizer.to_str()``); the GGUF reading is ``None`` when there is no
    converted copy (then the first is read from the GGUF itself) or not ``gguf_too``.
    Skips the test when the model's package is not installed."""
    from transformers import AutoTokenizer

    from ftis.client.models import registry

    try:
        resolved = registry.resolve(alias)
    except registry.ModelNotFoundError as exc:
        pytest.skip(f"{alias} is not installed: {exc}")
    target = registry.converted_dir(resolved)
    converted = target is not None and registry._is_converted(target)
    if converted and not gguf_too:
        return AutoTokenizer.from_pretrained(target).backend_tokenizer.to_str(), None
    gguf = resolved.prepare() if resolved.prepare else Path(resolved.path) / resolved.gguf_file
    from_gguf = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not converted:
        return from_gguf.backend_tokenizer.to_str(), None
    return (AutoTokenizer.from_pretrained(target).backend_tokenizer.to_str(),
            from_gguf.backend_tokenizer.to_str())


@pytest.fixture(scope="module")
def smollm2_json() -> str:
    return _client_tokenizer_json("smollm2-135m", gguf_too=False)[0]


def _poisoned_decoder(tokenizer_json: str) -> str:
    """The same tokenizer with a decoder that writes every "e" as "3" (its library
    serialization, as an attacker's client would upload it)."""
    from tokenizers import Tokenizer, decoders

    tok = Tokenizer.from_str(tokenizer_json)
    tok.decoder = decoders.Sequence([tok.decoder, decoders.Replace("e", "3")])
    return tok.to_str()


@dataclass
class World:
    server: CoordinatorServer
    stub: swarm_pb2_grpc.SwarmStub
    honest_json: str
    poisoned_json: str

    @property
    def honest_fp(self) -> str:
        return tokenizer_fingerprint(self.honest_json)

    def node(self, fingerprint: str | None = None, tokenizer_json: str | None = None) -> Node:
        """A SmolLM2 node (by default an honest one) talking real gRPC."""
        from tokenizers import Tokenizer

        card = model_card(fingerprint or self.honest_fp, SMOLLM2_VOCAB)
        card.base_model = "HuggingFaceTB/SmolLM2-135M-Instruct"
        return Node(NodeIdentity.generate(), self.stub, card,
                    tokenizer=Tokenizer.from_str(tokenizer_json or self.honest_json))

    def record(self, node: Node) -> Any:
        record = self.server.state.get_node(node.node_id)
        assert record is not None
        return record

    def score(self, node: Node) -> float:
        return reputation.current_score(self.record(node).standing, now_ms(),
                                        self.server.ctx.policy.half_life_s)

    def submit_honest(self, node: Node, rounds: int) -> list[str]:
        """``rounds`` leases answered with honest bundles; asserts each is accepted with
        its text verified against the node's own tokenizer. Returns the bundle ids."""
        ids = []
        for _ in range(rounds):
            (lease,) = node.lease()
            reply = node.submit_bundle(node.honest_bundle(lease))
            assert reply.error.code == 0, reply.error
            ids.append(reply.bundle_id)
        stored = {b.bundle_id: b for b in self.server.state.list_bundles(node.node_id, 100)}
        assert set(ids) <= set(stored)
        assert all(stored[i].text_verified for i in ids)
        return ids


@pytest.fixture
def world(tmp_path: Path, smollm2_json: str) -> Iterator[World]:
    config = make_config(db=str(tmp_path / "coordinator.db"), require_tokenizer=True)
    server = CoordinatorServer(config)
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        yield World(server, swarm_pb2_grpc.SwarmStub(channel), smollm2_json,
                    _poisoned_decoder(smollm2_json))
    finally:
        channel.close()
        server.stop(grace=1.0)


def test_class2_poisoned_decoder_upload_is_refused_and_honest_nodes_are_verified(
        world: World) -> None:
    honest_fp, poisoned_fp = world.honest_fp, tokenizer_fingerprint(world.poisoned_json)
    honest_doc, poisoned_doc = json.loads(world.honest_json), json.loads(world.poisoned_json)
    # only the decoder differs: the earlier fingerprint's inputs (model type, vocab,
    # merges, added tokens) are identical, so it could not tell the two apart
    assert [k for k in honest_doc if honest_doc[k] != poisoned_doc[k]] == ["decoder"]
    assert poisoned_fp != honest_fp

    # 1. the attacker registers the honest SmolLM2 card and uploads the poison first
    attacker = world.node()
    reply = attacker.register()
    assert reply.error.code == 0 and not reply.tokenizer_known, reply
    reply = attacker.upload(gzip.compress(world.poisoned_json.encode()))
    assert reply.error.code == ErrorCode.TOKENIZER_INVALID
    assert reply.error.reason == (f"uploaded tokenizer has fingerprint {poisoned_fp}, "
                                  f"expected {honest_fp}")
    # ... nor can it name the poison's own fingerprint under the honest card
    request = swarm_pb2.UploadTokenizerRequest(
        node_id=attacker.node_id, fingerprint=poisoned_fp,
        tokenizer_json_gz=gzip.compress(world.poisoned_json.encode()))
    reply = world.stub.UploadTokenizer(signed(request, "UploadTokenizer", attacker.identity,
                                              now_ms()), timeout=TIMEOUT_S)
    assert reply.error.code == ErrorCode.TOKENIZER_INVALID
    assert "differs from the registered model card" in reply.error.reason
    state = world.server.state
    assert not state.has_tokenizer(honest_fp) and not state.has_tokenizer(poisoned_fp)

    # 2. an honest SmolLM2 node: told the tokenizer is unknown, uploads its own
    honest_a = world.node()
    reply = honest_a.register()
    assert reply.error.code == 0 and not reply.tokenizer_known, reply
    assert honest_a.upload(gzip.compress(world.honest_json.encode())).error.code == 0
    assert state.has_tokenizer(honest_fp)
    # what the poison would have done to it: its honest text decodes otherwise
    (lease,) = honest_a.lease()
    bundle = honest_a.honest_bundle(lease)
    from tokenizers import Tokenizer

    poisoned = Tokenizer.from_str(world.poisoned_json)
    for c in bundle.completions:
        assert c.text == honest_a.tokenizer.decode(list(c.token_ids), skip_special_tokens=False)
        assert poisoned.decode(list(c.token_ids), skip_special_tokens=False) != c.text
    start = world.score(honest_a)
    reply = honest_a.submit_bundle(bundle)
    assert reply.error.code == 0 and reply.reward_mismatches == 0, reply.error
    stored = [reply.bundle_id, *world.submit_honest(honest_a, 2)]

    # 3. a second honest node with the same model: the tokenizer is known, it is verified
    honest_b = world.node()
    reply = honest_b.register()
    assert reply.error.code == 0 and reply.tokenizer_known, reply
    start_b = world.score(honest_b)
    world.submit_honest(honest_b, 2)
    relayed = {b.bundle_id for b in honest_b.pull().bundles}
    assert set(stored) <= relayed  # same fingerprint: token-level relay

    # 4. nobody honest was banned, quarantined or charged; both earned reputation
    for node in (honest_a, honest_b):
        node.heartbeat()  # still served
        record = world.record(node)
        assert not record.banned and not record.quarantined, record
        evidence = state.list_evidence(node.node_id, 50)
        assert evidence and all(e.kind == reputation.BUNDLE_VERIFIED and e.weight > 0
                                for e in evidence), evidence
    assert world.score(honest_a) > start and world.score(honest_b) > start_b


def test_class2_a_poisoned_tokenizer_under_its_own_fingerprint_judges_only_its_uploader(
        world: World) -> None:
    """Registering the poison under its own fingerprint works, but it is then the
    tokenizer of that fingerprint only: honest SmolLM2 nodes are not told it is theirs,
    and the uploader's text is checked against it (a text that is not its own
    tokenizer's decoding is a proof against the uploader, nobody else)."""
    poisoned_fp = tokenizer_fingerprint(world.poisoned_json)
    attacker = world.node(poisoned_fp, world.honest_json)  # samples with honest text
    reply = attacker.register()
    assert reply.error.code == 0 and not reply.tokenizer_known, reply
    reply = attacker.upload(gzip.compress(world.poisoned_json.encode()))
    assert reply.error.code == 0, reply
    assert world.server.state.has_tokenizer(poisoned_fp)

    honest = world.node()
    reply = honest.register()
    assert reply.error.code == 0 and not reply.tokenizer_known, reply
    assert honest.upload(gzip.compress(world.honest_json.encode())).error.code == 0
    world.submit_honest(honest, 2)

    (lease,) = attacker.lease()
    reply = attacker.submit_bundle(attacker.honest_bundle(lease))
    assert reply.error.code == ErrorCode.TEXT_MISMATCH, reply.error
    record = world.record(honest)
    assert not record.banned and not record.quarantined
    honest.heartbeat()


@pytest.mark.e2e
@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m"])
def test_embedded_models_fingerprint_the_same_on_client_and_coordinator(alias: str) -> None:
    """A client's fingerprint (``backend_tokenizer.to_str()`` of the converted copy) is the
    fingerprint of the same tokenizer read straight from the GGUF, of the converted
    ``tokenizer.json`` file, and the one the coordinator recomputes from the upload and
    from what its library loaded (``check_upload`` accepts it)."""
    from ftis.client.models import registry

    text, from_gguf = _client_tokenizer_json(alias)
    fingerprint = tokenizer_fingerprint(text)
    if from_gguf is not None:
        assert tokenizer_fingerprint(from_gguf) == fingerprint
        target = registry.converted_dir(registry.resolve(alias))
        assert target is not None
        assert tokenizer_fingerprint((target / "tokenizer.json").read_text()) == fingerprint
    tokenizer, vocab = check_upload(gzip.compress(text.encode()), fingerprint, fingerprint,
                                    max_gz_bytes=32 << 20, max_json_bytes=64 << 20)
    assert vocab == {"smollm2-135m": 49_152, "gemma3-270m": 262_144}[alias]
    assert tokenizer.decode(tokenizer.encode("3 + 4 = 7").ids).endswith("3 + 4 = 7")
