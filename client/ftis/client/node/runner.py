"""The volunteer's round loop (DESIGN.md section 3): lease, generate, score, submit,
pull, learn, report, checkpoint."""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from ftis.client.learner.checkpoint import load_checkpoint, save_checkpoint
from ftis.client.learner.trainer import Learner, SenderStats
from ftis.client.models.loader import Policy
from ftis.client.node.config import ClientConfig
from ftis.client.node.heap import trim_heap
from ftis.client.rollout.groups import RolloutGroup
from ftis.client.rollout.sampler import SampledCompletion, sample_groups
from ftis.client.swarm.connection import SwarmConnection
from ftis.client.swarm.cross_tokenizer import retokenizer_for
from ftis.client.swarm.external_pool import ExternalPool
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.v1 import bundle_pb2, swarm_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")
PULL_PAGE = 64
#: Seconds between pulls while a round waits for its external groups (``external_wait_s``).
EXTERNAL_WAIT_POLL_S = 1.0


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (0 where unsupported)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0.0
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


#: Audit-only groups (senders on the coordinator's audit-based probation) a node audits
#: per round: a forward pass each, no training; the rest wait in the pool.
AUDIT_GROUPS_PER_ROUND = 4
#: Bundle ids per feedback entry (the coordinator's bound).
MAX_FEEDBACK_BUNDLE_IDS = 64


def sender_feedback(stats: dict[str, SenderStats], external: list[RolloutGroup],
                    invalid: dict[str, int] | None = None,
                    mismatched: dict[str, int] | None = None,
                    rejected_ids: dict[str, list[str]] | None = None,
                    ) -> list[swarm_pb2.SenderFeedback]:
    """One ``SenderFeedback`` per sender a receiver learned from or rejected (pure).

    Args:
        stats: the learner's per-sender statistics of the step
            (:attr:`~ftis.client.learner.trainer.Learner.sender_stats`): tokens, mean
            log-ratio (nats/token) with its completion count and standard error (the
            coordinator's shading test, docs/reputation.md), filtered and truncated
            shares.
        external: the step's external groups (their ``meta["bundle_id"]`` are named: the
            coordinator counts feedback only for bundles it relayed to this node).
        invalid, mismatched: per sender, relayed bundles that failed local
            re-verification and completions whose text differed from their tokens.
        rejected_ids: per sender, the ids of those rejected bundles.

    Returns:
        the entries, at most :data:`MAX_FEEDBACK_BUNDLE_IDS` bundle ids each.
    """
    invalid, mismatched = invalid or {}, mismatched or {}
    rejected_ids = rejected_ids or {}
    by_sender: dict[str, swarm_pb2.SenderFeedback] = {}
    for sender, st in stats.items():
        by_sender[sender] = swarm_pb2.SenderFeedback(
            sender_node_id=sender, groups=0, tokens=st.tokens,
            mean_log_ratio=st.mean_log_ratio,
            filtered_frac=st.filtered / max(st.completions, 1),
            truncated_frac=st.truncated_tokens / max(st.tokens, 1),
            log_ratio_completions=st.log_ratio_completions,
            log_ratio_stderr=st.log_ratio_stderr)
    for g in external:
        fb = by_sender.setdefault(g.sender, swarm_pb2.SenderFeedback(sender_node_id=g.sender))
        fb.groups += 1
        if g.meta.get("bundle_id"):
            fb.bundle_ids.append(g.meta["bundle_id"])
    for sender in set(invalid) | set(mismatched):
        fb = by_sender.setdefault(sender, swarm_pb2.SenderFeedback(sender_node_id=sender))
        fb.invalid_bundles = invalid.get(sender, 0)
        fb.text_mismatches = mismatched.get(sender, 0)
        fb.bundle_ids.extend(b for b in rejected_ids.get(sender, [])
                             if b not in fb.bundle_ids)
    for fb in by_sender.values():
        del fb.bundle_ids[MAX_FEEDBACK_BUNDLE_IDS:]
    return list(by_sender.values())


@dataclass
class RoundResult:
    round: int
    metrics: dict[str, float]


@dataclass
class PendingBundle:
    """A bundle made in a round's sampling phase (:meth:`VolunteerNode.sample`), not yet
    submitted: the bundle to submit (after the hooks) and what the node learns from if
    it is accepted (its own sampled completions, with their sampler log-probs)."""

    bundle: bundle_pb2.Bundle
    task_id: str
    prompt_ids: list[int]
    sampled: list[SampledCompletion]


def _unless_rate_limited(call: Callable[[], T], what: str) -> tuple[bool, T | None]:
    """``(True, call())``, or ``(False, None)`` (logged as ``what``) when the
    coordinator's quota for the call answered RATE_LIMITED: the node goes on.

    Raises:
        FtisError: any other coded rejection.
    """
    try:
        return True, call()
    except FtisError as exc:
        if exc.code != ErrorCode.RATE_LIMITED:
            raise
        log.warning("%s: %s", what, exc)
        return False, None


def report_metrics(conn: SwarmConnection, step: int, stats: dict[str, float],
                   feedback: list[swarm_pb2.SenderFeedback]) -> bool:
    """Send one round's metrics and feedback; ``False`` (logged, the node goes on) when
    the coordinator's ReportMetrics quota refused them, since a lost report must not stop
    a volunteer's node.

    Raises:
        FtisError: any other coded rejection.
    """
    sent, _ = _unless_rate_limited(lambda: conn.report_metrics(step, stats, feedback),
                                   f"metrics of round {step} not reported")
    return sent


#: Seconds between two heartbeats of a node at least: a node whose rounds are faster
#: (a tiny model, a small model on a GPU) beats every other round or less, staying
#: within the coordinator's quota of 60 a minute.
HEARTBEAT_MIN_INTERVAL_S = 1.0


def heartbeat(conn: SwarmConnection, policy_version: int
              ) -> swarm_pb2.HeartbeatResponse | None:
    """One Heartbeat, or ``None`` (logged, the round goes on) when the coordinator's
    Heartbeat quota refused it: a heartbeat only reports liveness and reads the node's
    reputation, so losing one must not lose the round.

    Raises:
        FtisError: any other coded rejection.
    """
    _, reply = _unless_rate_limited(lambda: conn.heartbeat(policy_version),
                                    f"heartbeat of round {policy_version} refused")
    return reply


class NodeHooks(Protocol):
    """What a node does with each bundle it made and with its round's feedback.

    Injected into :class:`VolunteerNode` (composition): a volunteer's node uses
    :class:`HonestHooks`; ftis-lab's attackers pass an object of their own that changes
    bundles, submits them differently or reports other feedback, while the node keeps
    generating, learning and checkpointing as an honest one.
    """

    def bundle(self, honest: bundle_pb2.Bundle, lease: swarm_pb2.TaskLease,
               prompt_ids: list[int], prompt_text: str) -> bundle_pb2.Bundle:
        """The bundle to submit for ``lease``, given the honest one
        (:meth:`VolunteerNode.make_bundle`) and the prompt it was sampled from."""
        ...

    def submit(self, bundle: bundle_pb2.Bundle) -> swarm_pb2.SubmitBundleResponse | None:
        """Sign and submit ``bundle``; the reply, or ``None`` when it was refused (the
        node then does not learn from the group)."""
        ...

    def feedback(self, external: list[RolloutGroup],
                 honest: list[swarm_pb2.SenderFeedback]) -> list[swarm_pb2.SenderFeedback]:
        """The feedback to report for a step on ``external`` groups, given the honest
        entries (:meth:`VolunteerNode.feedback`, already computed: the pool's rejection
        counters are drained)."""
        ...


class HonestHooks:
    """The volunteer's :class:`NodeHooks`: the honest bundle, submitted as is, and the
    honest feedback.

    Args:
        connection: the node's registered :class:`SwarmConnection`.
    """

    def __init__(self, connection: SwarmConnection) -> None:
        self.conn = connection

    def bundle(self, honest: bundle_pb2.Bundle, lease: swarm_pb2.TaskLease,
               prompt_ids: list[int], prompt_text: str) -> bundle_pb2.Bundle:
        return honest

    def submit(self, bundle: bundle_pb2.Bundle) -> swarm_pb2.SubmitBundleResponse | None:
        """Sign and submit; ``None`` when the coordinator rejected it (logged)."""
        try:
            return self.conn.submit_bundle(bundle)
        except FtisError as exc:
            log.warning("bundle for task %s rejected: %s", bundle.task_id, exc)
            return None

    def feedback(self, external: list[RolloutGroup],
                 honest: list[swarm_pb2.SenderFeedback]) -> list[swarm_pb2.SenderFeedback]:
        return honest


class VolunteerNode:
    """Runs rounds for one policy against one coordinator.

    Args:
        config: :class:`ClientConfig`.
        policy: the loaded model, tokenizer and card.
        connection: a registered :class:`SwarmConnection`.
        hooks: what the node does with its bundles and feedback (default
            :class:`HonestHooks`; ftis-lab's attackers inject their own).
    """

    def __init__(self, config: ClientConfig, policy: Policy, connection: SwarmConnection,
                 hooks: NodeHooks | None = None) -> None:
        self.config = config
        self.policy = policy
        self.conn = connection
        self.hooks: NodeHooks = hooks if hooks is not None else HonestHooks(connection)
        self.out = Path(config.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.learner = Learner(policy.model,
                               config.learner_for(int(policy.card.parameter_count)),
                               pad_token_id=policy.tokenizer.pad_token_id)
        self.sampling = config.sampling
        self.pool = ExternalPool(connection.node_id, int(policy.card.vocab_size),
                                 policy.card.tokenizer_fingerprint,
                                 rng=random.Random(config.seed), decode=policy.decode,
                                 retokenizer=(retokenizer_for(policy)
                                              if config.cross_tokenizer != "off" else None))
        self.generator = torch.Generator().manual_seed(config.seed)
        self.round = 0
        self._registrations_seen = 0
        #: monotonic time of the last heartbeat sent, and the reputation it returned
        self._last_beat_s: float | None = None
        self._reputation = 0.0
        #: process start -> policy loaded, set by the CLI; logged once, in the first round
        self.startup_seconds: float | None = None
        self.metrics_path = self.out / "metrics.jsonl"
        self.eval_sets: list = []
        if config.eval_every:
            from ftis.client.node.evaluation import EvalConfig, build_eval_sets

            self.eval_config = (EvalConfig.model_validate_json(config.eval_config.read_text())
                                if config.eval_config else EvalConfig())
            self.eval_sets = build_eval_sets(self.eval_config)
            (self.out / "eval_sets.json").write_text(json.dumps(
                {s.name: [e.question for e in s.entries] for s in self.eval_sets}, indent=1))

    # ------------------------------------------------------------------ resume
    def resume(self) -> bool:
        """Load the latest checkpoint in ``out/checkpoints``; True if one was found."""
        state = load_checkpoint(self.out / "checkpoints", self.policy.model,
                                self.learner.optimizer)
        if state is None:
            return False
        self.round = int(state["round"])
        extra = state["extra"]
        self.pool.cursor = int(extra.get("cursor", 0))
        self.learner.updates = int(extra.get("updates", 0))
        gen_state = extra.get("generator_state")
        if gen_state is not None:
            self.generator.set_state(torch.tensor(gen_state, dtype=torch.uint8))
        log.info("resumed from round %d", self.round)
        return True

    # ------------------------------------------------------------------ one round
    # A round is three phases, each ending where the next needs the coordinator's answer:
    # :meth:`sample` (heartbeat, lease, generate: the bundles to submit), :meth:`submit`
    # (submit them; the verified rewards make the local groups) and :meth:`learn` (pull,
    # update, report). :meth:`run_round` runs them back to back; ftis-lab's simulator
    # (``ftis-lab simulate``) runs each phase on a Flower message, so that the bundles of
    # every learner are stored before any learner pulls.
    def beat(self, now: float | None = None) -> float:
        """A heartbeat unless one was sent less than :data:`HEARTBEAT_MIN_INTERVAL_S`
        ago (``now``: ``time.monotonic()`` seconds); returns the node's reputation as
        the last answered heartbeat gave it (0.0 before any)."""
        now = time.monotonic() if now is None else now
        if self._last_beat_s is None or now - self._last_beat_s >= HEARTBEAT_MIN_INTERVAL_S:
            self._last_beat_s = now
            reply = heartbeat(self.conn, self.round)
            if reply is not None:
                self._reputation = float(reply.reputation)
        return self._reputation

    def sample(self, stats: dict[str, float]) -> list[PendingBundle]:
        """Phase 1: heartbeat (at most one per :data:`HEARTBEAT_MIN_INTERVAL_S`; a
        refused one skipped), lease ``local_groups`` tasks, sample ``group_size``
        completions per task and make the bundles (:meth:`make_bundle`, then the hooks).

        Args:
            stats: the round's metrics, filled in place (``reputation``,
                ``generated_tokens``, ``generation_seconds``, ``tokens_per_second``).

        Returns:
            one :class:`PendingBundle` per leased task, in lease order.
        """
        cfg, pol = self.config, self.policy
        stats["reputation"] = self.beat()
        leases = self.conn.lease_tasks(cfg.local_groups, cfg.group_size, cfg.max_new_tokens)
        prompts = [pol.prompt_token_ids([{"role": m.role, "content": m.content}
                                         for m in lease.messages]) for lease in leases]
        result = sample_groups(pol.model, [ids for ids, _ in prompts], cfg.group_size,
                               self.sampling, pol.eos_token_ids, pol.tokenizer.pad_token_id,
                               self.generator, stop_strings=pol.stop_strings,
                               decode=pol.decode)
        stats["generated_tokens"] = float(result.generated_tokens)
        stats["generation_seconds"] = result.seconds
        stats["tokens_per_second"] = result.generated_tokens / max(result.seconds, 1e-9)
        return [PendingBundle(self.hooks.bundle(
                    self.make_bundle(lease, prompt_ids, prompt_text, sampled),
                    lease, prompt_ids, prompt_text), lease.task_id, prompt_ids, sampled)
                for lease, (prompt_ids, prompt_text), sampled in zip(
                    leases, prompts, result.completions, strict=True)]

    def submit(self, pending: list[PendingBundle], stats: dict[str, float]
               ) -> list[RolloutGroup]:
        """Phase 2: submit each pending bundle (``hooks.submit``); the accepted ones
        become local groups with the coordinator's verified rewards (a refused one is
        counted in ``bundles_rejected`` and not learned from).

        Args:
            stats: filled in place (``reward_mean``: mean verified reward in [0, 1] over
                the accepted completions, ``bundles_submitted``, ``bundles_rejected``,
                ``bundle_bytes_per_token``, ``local_groups_informative``).
        """
        groups, verified_all = [], []
        bundle_bytes, bundle_tokens = 0, 0
        for item in pending:
            bundle = item.bundle
            reply = self.hooks.submit(bundle)
            if reply is None:
                stats["bundles_rejected"] = stats.get("bundles_rejected", 0.0) + 1
                continue
            bundle_bytes += bundle.ByteSize()
            bundle_tokens += sum(len(c.token_ids) for c in bundle.completions)
            verified = list(reply.verified_rewards)
            verified_all += verified
            groups.append(RolloutGroup(
                prompt_ids=item.prompt_ids, completions=[c.token_ids for c in item.sampled],
                gen_logprobs=[c.logprobs for c in item.sampled], rewards=verified,
                local=True, sender=self.conn.node_id, policy_version=self.round,
                task_id=item.task_id))
        stats["reward_mean"] = sum(verified_all) / max(len(verified_all), 1)
        stats["bundles_submitted"] = float(len(groups))
        stats["bundle_bytes_per_token"] = bundle_bytes / max(bundle_tokens, 1)
        # SAPO: groups whose rewards are all equal carry no advantage; they are counted
        # apart (the learner drops them) and never shared as training signal
        stats["local_groups_informative"] = float(sum(not g.reward_variance_zero
                                                      for g in groups))
        return groups

    def make_bundle(self, lease: swarm_pb2.TaskLease, prompt_ids: list[int], prompt_text: str,
                    sampled: list[SampledCompletion]) -> bundle_pb2.Bundle:
        """The bundle for one leased task: completions and their sampler log-probs.

        The text of each completion is ``decode(token_ids)`` with special tokens kept, the
        exact rule the coordinator checks (``TEXT_MISMATCH``). No reward is claimed: the
        answers stay on the coordinator, whose verified rewards come back in the reply.
        """
        pol = self.policy
        completions = [
            bundle_pb2.Completion(token_ids=c.token_ids, logprobs=c.logprobs,
                                  text=pol.decode(c.token_ids), finish_reason=c.finish_reason)
            for c in sampled]
        return bundle_pb2.Bundle(
            task_id=lease.task_id, lease_id=lease.lease_id, node_id=self.conn.node_id,
            model_card=pol.card, policy_version=self.round,
            sampling=self.sampling.to_proto(), prompt_token_ids=prompt_ids,
            prompt_text=prompt_text, completions=completions,
            created_at_ms=int(time.time() * 1000))

    def feedback(self, external: list[RolloutGroup]) -> list[swarm_pb2.SenderFeedback]:
        """Per-sender statistics of this step for the coordinator's reputation system
        (:func:`sender_feedback` on the learner's statistics and the pool's rejections)."""
        invalid, mismatched = self.pool.drain_rejections()
        return sender_feedback(self.learner.sender_stats, external, invalid, mismatched,
                               self.pool.drain_rejected_ids())

    @property
    def relay_fingerprint(self) -> str:
        """The tokenizer fingerprint this node pulls bundles of: its own, or "" (every
        family's) with cross-tokenizer learning on."""
        return ("" if self.config.cross_tokenizer != "off"
                else self.policy.card.tokenizer_fingerprint)

    @property
    def pulls(self) -> bool:
        """Whether this node's rounds pull external groups (``external_groups > 0`` and
        not on-policy)."""
        return self.config.external_groups > 0 and self.config.method != "on_policy"

    def _pull_external(self) -> None:
        while True:
            # a coordinator that forgot this node (re-registered) has a new relay
            # sequence: the old cursor would skip everything it relays from now on
            registrations = getattr(self.conn, "reregistrations", 0)
            if registrations != self._registrations_seen:
                self._registrations_seen = registrations
                self.pool.cursor = 0
            try:
                resp = self.conn.pull_bundles(self.pool.cursor, PULL_PAGE,
                                              self.relay_fingerprint)
            except FtisError as exc:
                # the relay quotas (pulls, bytes per minute) hold back a node catching up
                # on a long relay: train on what the pool holds, pull the rest next round
                if exc.code != ErrorCode.RATE_LIMITED:
                    raise
                log.info("relay pull held back (%s); pulling on next round", exc)
                return
            for relayed in resp.bundles:
                self.pool.add(relayed)
            self.pool.cursor = max(self.pool.cursor, resp.next_cursor)
            if len(resp.bundles) < PULL_PAGE:
                return

    def _wait_for_external(self) -> float:
        """Pull once a second until the pool holds ``external_groups`` groups or
        ``external_wait_s`` seconds have passed; returns the seconds waited (0.0 when
        the pool already held them or the wait is off)."""
        cfg = self.config
        started = time.monotonic()
        deadline = started + cfg.external_wait_s
        while len(self.pool.groups) < cfg.external_groups:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(EXTERNAL_WAIT_POLL_S, left))
            self._pull_external()
        return time.monotonic() - started if cfg.external_wait_s else 0.0

    def run_round(self) -> RoundResult:
        """One round; returns its metrics (also appended to ``out/metrics.jsonl``)."""
        t0 = time.perf_counter()
        stats: dict[str, float] = {}
        local = self.submit(self.sample(stats), stats)
        return self.learn(local, stats, t0)

    def learn(self, local: list[RolloutGroup], stats: dict[str, float],
              started: float) -> RoundResult:
        """Phase 3: pull external groups, take the learner step on ``local`` plus them,
        evaluate when due, report metrics and feedback, append ``metrics.jsonl``,
        checkpoint when due.

        Args:
            local: :meth:`submit`'s groups.
            stats: the round's metrics so far (completed in place).
            started: ``time.perf_counter()`` at the round's start (``round_seconds``).
        """
        cfg = self.config
        external: list[RolloutGroup] = []
        audits: list[RolloutGroup] = []
        if self.pulls:
            self._pull_external()
            stats["external_wait_seconds"] = self._wait_for_external()
            external = self.pool.take(cfg.external_groups, cfg.max_groups_per_sender)
            audits = self.pool.take_audits(AUDIT_GROUPS_PER_ROUND)
        stats["external_groups_used"] = float(len(external))
        stats["external_pool_size"] = float(len(self.pool.groups))
        stats["external_cross_tokenizer_groups"] = float(sum(g.cross_tokenizer
                                                             for g in external))
        stats["audit_groups"] = float(len(audits))
        # audit-only groups: statistics only, never trained on
        stats.update(self.learner.step(local + external, audit=audits))
        self.round += 1
        last = cfg.rounds and self.round == cfg.rounds
        if self.eval_sets and (self.round % cfg.eval_every == 0 or last):
            stats.update(self.evaluate())
        stats["round_seconds"] = time.perf_counter() - started
        stats["peak_rss_mb"] = peak_rss_mb()
        if self.learner.device.type == "cuda":  # the model's memory is the GPU's
            stats["peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.learner.device) / 2**20
        stats["updates"] = float(self.learner.updates)
        if self.startup_seconds is not None:  # first round of this process only
            stats["startup_seconds"], self.startup_seconds = self.startup_seconds, None
        feedback = self.hooks.feedback(external + audits, self.feedback(external + audits))
        if not report_metrics(self.conn, self.round, stats, feedback):
            stats["report_rate_limited"] = 1.0
        record = {"round": self.round, "node_id": self.conn.node_id, "model": cfg.model,
                  "peft": cfg.peft, "method": cfg.method, "time": time.time(), **stats,
                  "external_senders": [g.sender for g in external]}
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.round % cfg.checkpoint_every == 0 or last:
            self.checkpoint()
        trim_heap()  # the round's freed tensors back to the system (node/heap.py)
        return RoundResult(self.round, stats)

    def evaluate(self) -> dict[str, float]:
        """Held-out evaluation now: means returned, and appended with the per-prompt
        rewards (for paired tests) to ``out/eval.jsonl``."""
        from ftis.client.node.evaluation import evaluate_sets, summarize

        t0 = time.perf_counter()
        per_set = evaluate_sets(self.policy, self.eval_sets, self.eval_config)
        result = summarize(per_set)
        result["eval_seconds"] = time.perf_counter() - t0
        per_prompt = {name: {"greedy": r.greedy, "sampled": r.sampled}
                      for name, r in per_set.items()}
        with open(self.out / "eval.jsonl", "a") as fh:
            fh.write(json.dumps({"round": self.round, "node_id": self.conn.node_id,
                                 "model": self.config.model, "peft": self.config.peft,
                                 "method": self.config.method, **result,
                                 "per_prompt": per_prompt}) + "\n")
        return result

    def checkpoint(self) -> None:
        save_checkpoint(self.out / "checkpoints", self.round, self.policy.model,
                        self.learner.optimizer,
                        {"cursor": self.pool.cursor, "updates": self.learner.updates,
                         "generator_state": self.generator.get_state().tolist()})

    def run(self, on_round: Callable[[RoundResult], None] | None = None,
            before_round: Callable[[], object] | None = None) -> None:
        """Run until ``config.rounds`` rounds are done (forever if 0).

        ``before_round`` is called before each round and may block: the volunteer
        settings pause the node there (:class:`ftis.client.settings.gate.RoundGate`),
        between rounds, when it holds no lease.
        """
        if self.eval_sets and self.round == 0:
            self.evaluate()  # the starting policy, before any update
        while self.config.rounds == 0 or self.round < self.config.rounds:
            if before_round:
                before_round()
            result = self.run_round()
            if on_round:
                on_round(result)
