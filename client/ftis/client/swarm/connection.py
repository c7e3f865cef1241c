"""The client side of the ``ftis.v1.Swarm`` service: register, lease, submit, pull, report.

Every call raises :class:`ftis.protocol.errors.FtisError` when the coordinator answers
with an error code, and retries transient transport failures (coordinator restarting,
``UNAVAILABLE``/``DEADLINE_EXCEEDED``) with exponential backoff. Submissions are
idempotent from the coordinator's point of view (a lease is answered once), so a retried
submission whose first attempt landed comes back as ``BUNDLE_REPLAYED``.
"""

from __future__ import annotations

import gzip
import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from ftis.client.settings.throttle import TokenBucket
from ftis.protocol.auth import sign_request
from ftis.protocol.bundles import MAX_GRPC_MESSAGE_BYTES
from ftis.protocol.envelope import seal
from ftis.protocol.errors import raise_for_error
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import bundle_pb2, common_pb2, swarm_pb2, swarm_pb2_grpc


class _Response(Protocol):
    """A Swarm response: every one has an ``error`` field."""

    @property
    def error(self) -> common_pb2.Error: ...


log = logging.getLogger(__name__)
T = TypeVar("T", bound=_Response)
CLIENT_VERSION = "ftis-client/0.1.0"
_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class SwarmConnection:
    """A volunteer's connection to the coordinator.

    Args:
        target: ``HOST:PORT`` of the coordinator's volunteer listener.
        identity: the node's Ed25519 key pair.
        card: the node's model card.
        timeout_s: per-call deadline.
        retries: attempts for transient failures.
        tokenizer_json: the node's ``tokenizer.json`` text, uploaded at registration when
            the coordinator does not know the card's tokenizer fingerprint yet (it then
            checks ``text == decode(token_ids)`` on every bundle).

    Every request other than Register and SubmitBundle (which carry signed envelopes) is
    signed with :func:`ftis.protocol.auth.sign_request`.
    """

    def __init__(self, target: str, identity: NodeIdentity, card: bundle_pb2.ModelCard,
                 *, timeout_s: float = 60.0, retries: int = 8, display_name: str = "",
                 tokenizer_json: str | None = None) -> None:
        self.target = target
        self.tokenizer_json = tokenizer_json
        self.identity = identity
        self.card = card
        self.timeout_s = timeout_s
        self.retries = retries
        self.display_name = display_name
        self.channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", 64 * MAX_GRPC_MESSAGE_BYTES),
            ],
        )
        self.stub = swarm_pb2_grpc.SwarmStub(self.channel)
        #: caps the bundle upload rate (``max_upload_rate``); ``None``: no cap
        self.upload_limit: TokenBucket | None = None

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    def close(self) -> None:
        self.channel.close()

    def _call(self, fn: Callable[..., T], request: Message, method: str | None = None) -> T:
        delay = 0.5
        for attempt in range(self.retries):
            if method is not None:  # re-sign on each attempt: fresh timestamp
                sign_request(request, method, self.identity)
            try:
                response = fn(request, timeout=self.timeout_s)
            except grpc.RpcError as exc:
                if exc.code() not in _RETRY_CODES or attempt == self.retries - 1:
                    raise
                log.warning("coordinator %s: %s; retrying in %.1fs", self.target,
                            exc.code().name, delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            raise_for_error(response.error)
            return response
        raise AssertionError("unreachable")

    def register(self) -> swarm_pb2.RegisterResponse:
        payload = swarm_pb2.RegisterPayload(
            model_card=self.card, client_version=CLIENT_VERSION,
            timestamp_ms=int(time.time() * 1000), display_name=self.display_name,
        )
        env = seal("register", payload, self.identity)
        resp = self._call(self.stub.Register, swarm_pb2.RegisterRequest(envelope=env))
        if not resp.tokenizer_known and self.tokenizer_json is not None:
            self.upload_tokenizer(self.tokenizer_json)
        return resp

    def upload_tokenizer(self, tokenizer_json: str) -> None:
        """Upload ``tokenizer.json`` (gzip) for the card's tokenizer fingerprint."""
        data = gzip.compress(tokenizer_json.encode(), compresslevel=6, mtime=0)
        self._call(self.stub.UploadTokenizer, swarm_pb2.UploadTokenizerRequest(
            node_id=self.node_id, fingerprint=self.card.tokenizer_fingerprint,
            tokenizer_json_gz=data), "UploadTokenizer")

    def heartbeat(self, policy_version: int) -> swarm_pb2.HeartbeatResponse:
        return self._call(self.stub.Heartbeat, swarm_pb2.HeartbeatRequest(
            node_id=self.node_id, policy_version=policy_version), "Heartbeat")

    def lease_tasks(self, count: int, group_size: int, max_new_tokens: int
                    ) -> list[swarm_pb2.TaskLease]:
        resp = self._call(self.stub.LeaseTasks, swarm_pb2.LeaseTasksRequest(
            node_id=self.node_id, count=count, group_size=group_size,
            max_new_tokens=max_new_tokens), "LeaseTasks")
        return list(resp.leases)

    def submit_bundle(self, bundle: bundle_pb2.Bundle) -> swarm_pb2.SubmitBundleResponse:
        """Sign and submit; returns the reply with the verified rewards."""
        return self.submit_envelope(seal("bundle", bundle, self.identity))

    def submit_envelope(self, envelope: bundle_pb2.SignedEnvelope
                        ) -> swarm_pb2.SubmitBundleResponse:
        """Submit an already sealed envelope (raises FtisError on a coded rejection).

        Waits first for :attr:`upload_limit`, if set, to allow the envelope's bytes.
        """
        if self.upload_limit is not None:
            self.upload_limit.consume(envelope.ByteSize())
        return self._call(self.stub.SubmitBundle,
                          swarm_pb2.SubmitBundleRequest(envelope=envelope))

    def pull_bundles(self, cursor: int, max_bundles: int, fingerprint: str
                     ) -> swarm_pb2.PullBundlesResponse:
        return self._call(self.stub.PullBundles, swarm_pb2.PullBundlesRequest(
            node_id=self.node_id, cursor=cursor, max_bundles=max_bundles,
            tokenizer_fingerprint=fingerprint, skip_zero_variance=True), "PullBundles")

    def report_metrics(self, step: int, values: dict[str, float],
                       feedback: Iterable[swarm_pb2.SenderFeedback] = ()) -> None:
        self._call(self.stub.ReportMetrics, swarm_pb2.ReportMetricsRequest(
            node_id=self.node_id, step=step, values=values, feedback=list(feedback)),
            "ReportMetrics")
