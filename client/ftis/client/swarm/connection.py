"""The client side of the ``ftis.v1.Swarm`` service: register, lease, submit, pull, report.

Every call raises :class:`ftis.protocol.errors.FtisError` when the coordinator answers
with an error code (never retried), and retries transient transport failures
(coordinator stopped or restarting: ``UNAVAILABLE``/``DEADLINE_EXCEEDED``) with
exponential backoff and full jitter (:func:`backoff_delay`) for as long as
:class:`RetryPolicy` allows (by default until the coordinator has been unreachable for
30 minutes), so a node outlives a coordinator restart with its identity, round counter
and checkpoints. Submissions are idempotent from the coordinator's point of view (a
lease is answered once), so a retried submission whose first attempt landed comes back
as ``BUNDLE_REPLAYED``; a lease that expired during the outage comes back as
``LEASE_EXPIRED``; the round loop drops both
(:meth:`~ftis.client.node.runner.HonestHooks.submit`).
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from ftis.client.settings.throttle import TokenBucket
from ftis.protocol.auth import sign_request
from ftis.protocol.bundles import MAX_GRPC_MESSAGE_BYTES
from ftis.protocol.capabilities import CLIENT_CAPABILITIES
from ftis.protocol.envelope import seal
from ftis.protocol.errors import ErrorCode, raise_for_error
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


def backoff_delay(attempt: int, rng: random.Random, base_s: float = 0.5,
                  cap_s: float = 30.0) -> float:
    """Seconds to wait before retry ``attempt`` (0 = the first retry): "full jitter".

    Uniform on ``[0, min(cap_s, base_s * 2**attempt)]`` (Brooker, "Exponential Backoff
    and Jitter", AWS Architecture Blog, 2015): the ceiling doubles per attempt up to
    ``cap_s``, and the draw spreads the volunteers that lost the same coordinator over
    the whole window so that they do not all come back at the same instant. Pure but
    for ``rng``: the same seed gives the same delays.

    Raises:
        ValueError: ``attempt < 0``, ``base_s <= 0`` or ``cap_s < base_s``.
    """
    if attempt < 0 or base_s <= 0 or cap_s < base_s:
        raise ValueError(f"need attempt >= 0 and 0 < base_s <= cap_s, got attempt={attempt}, "
                         f"base_s={base_s}, cap_s={cap_s}")
    ceiling = cap_s if attempt >= 64 else min(cap_s, base_s * 2.0**attempt)
    return rng.uniform(0.0, ceiling)


@dataclass(frozen=True)
class RetryPolicy:
    """How long a call keeps retrying ``UNAVAILABLE``/``DEADLINE_EXCEEDED``.

    Attributes:
        base_s, cap_s: :func:`backoff_delay`'s first ceiling and cap, seconds.
        max_outage_s: give up (re-raise the last ``grpc.RpcError``) once the next retry
            would start more than this many seconds after the call's first failure;
            ``None``: never.
        max_attempts: give up after this many attempts (the first included); ``None``:
            no limit.
    """

    base_s: float = 0.5
    cap_s: float = 30.0
    max_outage_s: float | None = 1800.0
    max_attempts: int | None = None

    def gives_up(self, attempts: int, failing_s: float, next_delay_s: float) -> bool:
        """Whether to stop after ``attempts`` failed attempts, the first ``failing_s``
        seconds ago, rather than wait ``next_delay_s`` and try again."""
        if self.max_attempts is not None and attempts >= self.max_attempts:
            return True
        return self.max_outage_s is not None and failing_s + next_delay_s > self.max_outage_s


def register_envelope(identity: NodeIdentity, card: bundle_pb2.ModelCard,
                      display_name: str = "") -> bundle_pb2.SignedEnvelope:
    """The signed ``register`` envelope of a RegisterRequest: ``card``, this client's
    version and capabilities (:data:`ftis.protocol.capabilities.CLIENT_CAPABILITIES`),
    the time now (unix ms; the coordinator allows ``register_clock_skew_s``)."""
    payload = swarm_pb2.RegisterPayload(
        model_card=card, client_version=CLIENT_VERSION,
        timestamp_ms=int(time.time() * 1000), display_name=display_name,
        capabilities=CLIENT_CAPABILITIES,
    )
    return seal("register", payload, identity)


def tokenizer_upload_bytes(tokenizer_json: str) -> bytes:
    """``tokenizer.json`` as UploadTokenizer carries it: gzip (level 6, no timestamp, so
    the same text gives the same bytes)."""
    return gzip.compress(tokenizer_json.encode(), compresslevel=6, mtime=0)


def is_stored_acknowledgement(reply: swarm_pb2.SubmitBundleResponse, bundle_id: str) -> bool:
    """Whether ``reply`` is BUNDLE_REPLAYED for the payload whose SHA-256 is ``bundle_id``
    with the stored bundle's verified rewards: the coordinator already stored it (an
    earlier attempt's reply was lost), so this is its acknowledgement."""
    return (reply.error.code == ErrorCode.BUNDLE_REPLAYED and reply.bundle_id == bundle_id
            and len(reply.verified_rewards) > 0)


class SwarmConnection:
    """A volunteer's connection to the coordinator.

    Args:
        target: ``HOST:PORT`` of the coordinator's volunteer listener.
        identity: the node's Ed25519 key pair.
        card: the node's model card.
        timeout_s: per-call deadline, seconds.
        retries: most attempts per call (the first included); ``None``: as many as
            ``retry.max_outage_s`` allows. Overrides ``retry.max_attempts``.
        retry: the backoff of transient failures (:class:`RetryPolicy`).
        rng: the jitter's random source (default: seeded from the OS).
        sleep, clock: ``time.sleep`` and ``time.monotonic``, replaceable in tests.
        tokenizer_json: the node's ``tokenizer.json`` text, uploaded at registration when
            the coordinator does not know the card's tokenizer fingerprint yet (it then
            checks ``text == decode(token_ids)`` on every bundle).

    Every request other than Register and SubmitBundle (which carry signed envelopes) is
    signed with :func:`ftis.protocol.auth.sign_request`.
    """

    def __init__(self, target: str, identity: NodeIdentity, card: bundle_pb2.ModelCard,
                 *, timeout_s: float = 60.0, retries: int | None = None,
                 retry: RetryPolicy | None = None, display_name: str = "",
                 tokenizer_json: str | None = None, rng: random.Random | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.tokenizer_json = tokenizer_json
        self.identity = identity
        self.card = card
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        if retries is not None:
            self.retry = RetryPolicy(self.retry.base_s, self.retry.cap_s,
                                     self.retry.max_outage_s, retries)
        self.rng = rng or random.Random()
        self._sleep, self._clock = sleep, clock
        self.display_name = display_name
        #: transient failures retried so far (all calls)
        self.transient_failures = 0
        #: times the coordinator had forgotten this node (NODE_UNKNOWN: its database was
        #: reset or restored) and the node registered again; a caller's relay cursor from
        #: before is meaningless after one
        self.reregistrations = 0
        self.channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", 64 * MAX_GRPC_MESSAGE_BYTES),
                # gRPC's own reconnect backoff (default up to 120 s) would keep the channel
                # failing fast for up to two minutes after the coordinator is back
                ("grpc.initial_reconnect_backoff_ms", 500),
                ("grpc.min_reconnect_backoff_ms", 500),
                ("grpc.max_reconnect_backoff_ms", 5000),
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

    def _call(self, fn: Callable[..., T], request: Message, method: str | None = None,
              accept: Callable[[T], bool] | None = None, recover: bool = True) -> T:
        """``fn(request)``, retried on ``UNAVAILABLE``/``DEADLINE_EXCEEDED`` under
        :attr:`retry`; raises ``FtisError`` on a coded answer (unless ``accept`` takes
        it), the last ``grpc.RpcError`` on giving up or on any other status.

        With ``recover``, a coordinator that has lost this node's state is repaired once
        per call and the call repeated: NODE_UNKNOWN registers again (a coordinator whose
        database was reset; :attr:`reregistrations` counts it), TOKENIZER_REQUIRED
        uploads the tokenizer again, VERIFICATION_BUSY (nothing was stored, nothing
        charged) waits one backoff step and sends the same request again."""
        attempt, first_failure = 0, None
        repaired: set[int] = set()
        while True:
            if method is not None:  # re-sign on each attempt: fresh timestamp
                sign_request(request, method, self.identity)
            try:
                response = fn(request, timeout=self.timeout_s)
            except grpc.RpcError as exc:
                if exc.code() not in _RETRY_CODES:
                    raise
                now = self._clock()
                first_failure = now if first_failure is None else first_failure
                delay = backoff_delay(attempt, self.rng, self.retry.base_s, self.retry.cap_s)
                attempt += 1
                if self.retry.gives_up(attempt, now - first_failure, delay):
                    log.error("coordinator %s: %s; giving up after %d attempts over %.0f s",
                              self.target, exc.code().name, attempt, now - first_failure)
                    raise
                self.transient_failures += 1
                log.warning("coordinator %s: %s; retry %d in %.1f s", self.target,
                            exc.code().name, attempt, delay)
                self._sleep(delay)
                continue
            if first_failure is not None:
                log.warning("coordinator %s is back after %.1f s", self.target,
                            self._clock() - first_failure)
            if accept is not None and response.error.code and accept(response):
                return response
            code = response.error.code
            if recover and code not in repaired and self._repair(code):
                repaired.add(code)
                continue
            raise_for_error(response.error)
            return response

    def _repair(self, code: int) -> bool:
        """Restore what the coordinator lost for error ``code``; False if nothing can."""
        if code == ErrorCode.NODE_UNKNOWN:
            log.warning("coordinator %s does not know node %s (its database was reset?); "
                        "registering again", self.target, self.node_id)
            self.register()
            self.reregistrations += 1
            return True
        if code == ErrorCode.VERIFICATION_BUSY:  # the coordinator's capacity, not ours
            delay = backoff_delay(1, self.rng, self.retry.base_s, self.retry.cap_s)
            log.warning("coordinator %s is busy verifying; resubmitting in %.1f s",
                        self.target, delay)
            self._sleep(delay)
            return True
        if code == ErrorCode.TOKENIZER_REQUIRED and self.tokenizer_json is not None:
            log.warning("coordinator %s asks for the tokenizer again; uploading it",
                        self.target)
            self.upload_tokenizer(self.tokenizer_json)
            return True
        return False

    def register(self) -> swarm_pb2.RegisterResponse:
        env = register_envelope(self.identity, self.card, self.display_name)
        resp = self._call(self.stub.Register, swarm_pb2.RegisterRequest(envelope=env),
                          recover=False)
        if not resp.tokenizer_known and self.tokenizer_json is not None:
            self.upload_tokenizer(self.tokenizer_json)
        return resp

    def upload_tokenizer(self, tokenizer_json: str) -> None:
        """Upload ``tokenizer.json`` (gzip) for the card's tokenizer fingerprint."""
        data = tokenizer_upload_bytes(tokenizer_json)
        self._call(self.stub.UploadTokenizer, swarm_pb2.UploadTokenizerRequest(
            node_id=self.node_id, fingerprint=self.card.tokenizer_fingerprint,
            tokenizer_json_gz=data), "UploadTokenizer", recover=False)

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

        A BUNDLE_REPLAYED reply that carries this very payload's stored acknowledgement
        (:func:`is_stored_acknowledgement`: a retry after a reply that was lost) is
        returned as the success it is.

        Waits first for :attr:`upload_limit`, if set, to allow the envelope's bytes.
        """
        if self.upload_limit is not None:
            self.upload_limit.consume(envelope.ByteSize())
        bundle_id = hashlib.sha256(envelope.payload).hexdigest()
        return self._call(self.stub.SubmitBundle,
                          swarm_pb2.SubmitBundleRequest(envelope=envelope),
                          accept=lambda reply: is_stored_acknowledgement(reply, bundle_id))

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
