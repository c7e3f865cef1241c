"""The learner side of a simulated swarm: the volunteer's own
:class:`~ftis.client.node.runner.VolunteerNode`, driven one round phase per Flower
message (no ``flwr`` here).

A ClientApp cannot call its server in the middle of a message, so each round is two
messages, split where the node needs the coordinator's answer
(:meth:`VolunteerNode.sample` / :meth:`~VolunteerNode.submit` /
:meth:`~VolunteerNode.learn`):

1. *sample*: the message carries the heartbeat and lease replies; the node samples its
   groups and answers with its signed bundles and where its relay cursor stands;
2. *learn*: the message carries the SubmitBundle replies (verified rewards) and the
   relay pages; the node makes its local groups, pulls, takes its learner step and
   answers with its ReportMetrics request and metrics.

The node talks to a :class:`MessageConnection`, which answers the node's calls from the
replies the message carried, in the order the node makes them, and checks that each call
is the one the server answered.

Between messages the node lives in the actor process (:data:`_LIVE`); Flower may hand a
node's next message to another actor, so the node's whole state is also written to the
ClientApp's context (:meth:`SimLearner.snapshot`) when the run has more than one actor.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftis.client.node.runner import PULL_PAGE, PendingBundle, VolunteerNode
from ftis.client.swarm.connection import register_envelope, tokenizer_upload_bytes
from ftis.lab.simulate.coordinator import PullPlan
from ftis.lab.simulate.spec import TINY, SwarmSpec
from ftis.protocol.envelope import seal
from ftis.protocol.errors import raise_for_error
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import bundle_pb2, swarm_pb2


class SimulationError(RuntimeError):
    """The simulation's message sequence broke (a node's call was not answered, or its
    state is missing from the actor and the context)."""


def model_path(spec: SwarmSpec) -> str:
    """What the learners load: for :data:`~ftis.lab.simulate.spec.TINY`, a tiny random
    Llama of ``spec.model_seed`` built once under ``spec.out`` (deterministic, so every
    machine of a cluster builds the same weights; concurrent builders are safe);
    otherwise ``spec.model`` as given."""
    if spec.model != TINY:
        return spec.model
    from ftis.client.models.tiny import build_tiny_model

    target = Path(spec.out) / f"tiny-model-{spec.model_seed}"
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
        build_tiny_model(tmp / "m", seed=spec.model_seed)
        try:
            os.replace(tmp / "m", target)
        except OSError:  # another process built it first
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def build_node(spec: SwarmSpec, index: int, connection: Any) -> VolunteerNode:
    """Learner ``index`` of ``spec``: its config, runtime (threads, seed), policy and
    :class:`VolunteerNode` on ``connection`` (a ``SwarmConnection`` or a
    :class:`MessageConnection`), as ``ftis-client start`` builds it. The simulated and
    the native swarm both build their nodes here."""
    from ftis.client.models.loader import load_policy
    from ftis.client.node.runtime import configure_runtime

    cfg = spec.client_config(index, model_path(spec))
    configure_runtime(cfg)
    import torch

    torch.manual_seed(spec.model_seed)  # LoRA adapters' initialisation, if any
    policy = load_policy(cfg.model, peft=cfg.peft, lora=cfg.lora_settings)
    return VolunteerNode(cfg, policy, connection)


class MessageConnection:
    """The node's connection inside a simulation: the coordinator's replies that the
    last message carried, served in the order the node asks for them.

    Every reply is a serialized ``ftis.v1`` response; one with an ``error`` raises
    :class:`~ftis.protocol.errors.FtisError` as :class:`SwarmConnection` does, so the
    node's own handling of refusals applies. ReportMetrics is recorded
    (:attr:`report`) for the server to apply after the message.

    Args:
        identity: the node's key (bundles are sealed with it).
    """

    def __init__(self, identity: NodeIdentity) -> None:
        self.identity = identity
        #: times the coordinator forgot the node (never, in a simulation)
        self.reregistrations = 0
        self.heartbeat_reply = b""
        self.lease_reply = b""
        self.submit_replies: list[bytes] = []
        self.pages: list[bytes] = []
        self.page_cursor = 0
        self.report: bytes | None = None

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    def heartbeat(self, policy_version: int) -> swarm_pb2.HeartbeatResponse:
        reply = swarm_pb2.HeartbeatResponse.FromString(self._take("heartbeat_reply"))
        raise_for_error(reply.error)
        return reply

    def lease_tasks(self, count: int, group_size: int, max_new_tokens: int
                    ) -> list[swarm_pb2.TaskLease]:
        reply = swarm_pb2.LeaseTasksResponse.FromString(self._take("lease_reply"))
        raise_for_error(reply.error)
        return list(reply.leases)

    def submit_bundle(self, bundle: bundle_pb2.Bundle) -> swarm_pb2.SubmitBundleResponse:
        """The reply to the next submitted bundle (sealed and sent with the last
        *sample* answer, in the same order)."""
        if not self.submit_replies:
            raise SimulationError("a bundle was submitted that the server did not answer")
        reply = swarm_pb2.SubmitBundleResponse.FromString(self.submit_replies.pop(0))
        raise_for_error(reply.error)
        return reply

    def pull_bundles(self, cursor: int, max_bundles: int, fingerprint: str
                     ) -> swarm_pb2.PullBundlesResponse:
        """The next relay page; the server fetched the pages from the cursor the node
        announced, so ``cursor`` must be where the last page left it."""
        if not self.pages:
            raise SimulationError(f"a relay page was pulled (cursor {cursor}) that the "
                                  "server did not fetch")
        if cursor != self.page_cursor or max_bundles != PULL_PAGE:
            raise SimulationError(f"the node pulled from cursor {cursor}, the server "
                                  f"fetched from {self.page_cursor}")
        reply = swarm_pb2.PullBundlesResponse.FromString(self.pages.pop(0))
        raise_for_error(reply.error)
        self.page_cursor = max([cursor, reply.next_cursor,
                                *(b.sequence for b in reply.bundles)])
        return reply

    def report_metrics(self, step: int, values: dict[str, float],
                       feedback: Any = ()) -> None:
        self.report = swarm_pb2.ReportMetricsRequest(
            node_id=self.node_id, step=step, values=values,
            feedback=list(feedback)).SerializeToString()

    def _take(self, name: str) -> bytes:
        data: bytes = getattr(self, name)
        if not data:
            raise SimulationError(f"the node asked for a {name.split('_')[0]} the server "
                                  "did not send")
        setattr(self, name, b"")
        return data


@dataclass
class SampleAnswer:
    """A learner's answer to *sample*: its signed bundles (serialized
    ``SignedEnvelope``, lease order) and what it will pull."""

    envelopes: list[bytes]
    pull: PullPlan


@dataclass
class LearnAnswer:
    """A learner's answer to *learn*: its ReportMetrics request (serialized, unsigned)
    and the round's metrics (floats)."""

    report: bytes
    metrics: dict[str, float] = field(default_factory=dict)


class SimLearner:
    """One simulated learner: a :class:`VolunteerNode` on a :class:`MessageConnection`.

    Args:
        spec: the swarm.
        index: the learner's index in [0, N).
    """

    def __init__(self, spec: SwarmSpec, index: int) -> None:
        self.spec, self.index = spec, index
        self.conn = MessageConnection(spec.identity(index))
        self.node = build_node(spec, index, self.conn)
        self.pending: list[PendingBundle] = []
        self.stats: dict[str, float] = {}
        self.elapsed_s = 0.0  # of the round so far, across messages

    @property
    def node_id(self) -> str:
        return self.conn.node_id

    def register(self) -> tuple[bytes, str, bytes]:
        """``(RegisterRequest envelope, tokenizer fingerprint, gzip'd tokenizer.json)``."""
        policy = self.node.policy
        envelope = register_envelope(self.conn.identity, policy.card,
                                     f"sim-{self.index}")
        return (envelope.SerializeToString(), policy.card.tokenizer_fingerprint,
                tokenizer_upload_bytes(policy.tokenizer_json))

    def sample(self, heartbeat: bytes, lease: bytes) -> SampleAnswer:
        """Phase 1 (:meth:`VolunteerNode.sample`) on the server's heartbeat and lease
        replies (serialized ``HeartbeatResponse`` / ``LeaseTasksResponse``)."""
        started = time.perf_counter()
        self.conn.heartbeat_reply, self.conn.lease_reply = heartbeat, lease
        self.stats = {}
        self.pending = self.node.sample(self.stats)
        envelopes = [seal("bundle", p.bundle, self.conn.identity).SerializeToString()
                     for p in self.pending]
        self.conn.page_cursor = self.node.pool.cursor
        self.elapsed_s = time.perf_counter() - started
        return SampleAnswer(envelopes, PullPlan(self.node.pulls, self.node.pool.cursor,
                                                self.node.relay_fingerprint))

    def learn(self, submitted: list[bytes], pages: list[bytes]) -> LearnAnswer:
        """Phases 2 and 3 (:meth:`VolunteerNode.submit`, :meth:`~VolunteerNode.learn`)
        on the server's SubmitBundle replies (one per envelope sent) and relay pages.

        Raises:
            SimulationError: replies or pages left unused (the node and the server
                disagree on the round).
        """
        started = time.perf_counter() - self.elapsed_s
        self.conn.submit_replies, self.conn.pages = list(submitted), list(pages)
        self.conn.report = None
        local = self.node.submit(self.pending, self.stats)
        result = self.node.learn(local, self.stats, started)
        if self.conn.submit_replies or self.conn.pages:
            raise SimulationError(f"learner {self.index}: {len(self.conn.submit_replies)} "
                                  f"replies and {len(self.conn.pages)} pages unused")
        self.pending, self.stats, self.elapsed_s = [], {}, 0.0
        return LearnAnswer(self.conn.report or b"", dict(result.metrics))

    # -------------------------------------------------------------- state between actors
    def snapshot(self) -> bytes:
        """Everything the node needs to go on in another process (``torch.save`` bytes):
        weights, optimizer, sampler generator, round, external pool (groups, cursor, its
        random state) and the round in progress."""
        import torch

        node = self.node
        pool = {k: v for k, v in vars(node.pool).items() if k not in ("decode", "retokenizer")}
        state = {"model": node.policy.model.state_dict(),
                 "optimizer": node.learner.optimizer.state_dict(),
                 "generator": node.generator.get_state(), "round": node.round,
                 "updates": node.learner.updates, "pool": pool, "pending": self.pending,
                 "stats": self.stats, "elapsed_s": self.elapsed_s,
                 "page_cursor": self.conn.page_cursor}
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    def restore(self, data: bytes) -> None:
        """Load a :meth:`snapshot` (this process's own bytes, so unpickling is safe)."""
        import torch

        state = torch.load(io.BytesIO(data), weights_only=False)
        node = self.node
        node.policy.model.load_state_dict(state["model"])
        node.learner.optimizer.load_state_dict(state["optimizer"])
        node.generator.set_state(state["generator"])
        node.round, node.learner.updates = state["round"], state["updates"]
        vars(node.pool).update(state["pool"])
        self.pending, self.stats = state["pending"], state["stats"]
        self.elapsed_s, self.conn.page_cursor = state["elapsed_s"], state["page_cursor"]


#: Learners alive in this process: ``(run key, index) -> (message count, learner)``.
_LIVE: dict[tuple[str, int], tuple[int, SimLearner]] = {}


def live_learner(run_key: str, spec: SwarmSpec, index: int, step: int,
                 snapshot: bytes | None) -> SimLearner:
    """Learner ``index`` as it was after message ``step`` (0: new).

    The one this process holds if it saw that message; else one rebuilt from
    ``snapshot`` (the context's copy).

    Raises:
        SimulationError: neither is there (a run with more than one actor and
            snapshots off).
    """
    held = _LIVE.get((run_key, index))
    if held is not None and held[0] == step:
        return held[1]
    if step == 0:
        learner = SimLearner(spec, index)
    elif snapshot is not None:
        learner = SimLearner(spec, index)
        learner.restore(snapshot)
    else:
        raise SimulationError(
            f"learner {index} was last seen in another actor process and has no snapshot "
            "in its context; run with snapshots on (--snapshots) when the engine has "
            "more than one actor")
    _LIVE[(run_key, index)] = (step, learner)
    return learner


def keep(run_key: str, index: int, step: int, learner: SimLearner) -> None:
    """Remember that ``learner`` is now at message ``step`` in this process."""
    _LIVE[(run_key, index)] = (step, learner)


def forget(run_key: str) -> None:
    """Drop this run's learners from this process."""
    for key in [k for k in _LIVE if k[0] == run_key]:
        del _LIVE[key]
