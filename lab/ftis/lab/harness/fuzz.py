"""Fuzzing machinery for bundle verification, shared by
``tests/unit/test_fuzz_verification.py`` (hypothesis, small) and
``bench/fuzz_verification.py`` (100k examples).

Every random decision goes through a :class:`Draw`, so the same generators run on
hypothesis (``HypothesisDraw``: reproducible, shrinkable) or on a plain
``random.Random`` (``RandomDraw``: fast).

Properties (each ``run_*`` function checks one example and returns its outcome, 0 for
acceptance or the rejection's error code; it raises :class:`PropertyViolation` when a
property fails, and lets any non-``FtisError`` exception escape, which is a crash):

* :func:`run_envelope_bytes`: arbitrary bytes into ``parse_envelope_bytes``.
* :func:`run_submit_bytes`: arbitrary bytes (or an arbitrary envelope, optionally with a
  valid signature over an arbitrary payload) into ``Coordinator.submit_bundle``.
* :func:`run_structured`: a valid signed bundle for a real lease, mutated at field,
  key, envelope and byte level, into ``Coordinator.submit_bundle``.
* :func:`run_check_structure`: random bundles into ``check_structure``, compared with
  the independent oracle :func:`structure_violations`.

Invariants checked on the coordinator: a rejection is an ``FtisError`` whose code is a
defined, non-zero ``ErrorCode`` with a one-line reason, and leaves the nodes, leases and
bundles tables exactly as they were (one exception by design: after TEXT_MISMATCH or
PROMPT_MISMATCH, proofs of misbehaviour, the signer's node row may change to banned and
nothing else); an acceptance adds exactly one bundle, answers its lease, and the stored
bundle satisfies every documented rule.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ftis.lab.harness.coordinator import (
    FP_A,
    FP_B,
    VOCAB,
    FakeClock,
    build_bundle,
    load_tokenizer,
    make_coordinator,
    register,
    register_with_tokenizer,
    snapshot,
)
from ftis.protocol.bundles import (
    MAX_TEXT_CHARS_PER_TOKEN,
    BundleLimits,
    check_structure,
)
from ftis.protocol.envelope import open_envelope, parse_envelope_bytes, signing_digest
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import bundle_pb2

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Codes ``ErrorCode`` defines (0 excluded: it means success).
DEFINED_CODES = frozenset(v for v in ErrorCode.values() if v != 0)
#: Payload limit of the fuzzed coordinator: small, so ENVELOPE_TOO_LARGE is reachable.
FUZZ_MAX_BUNDLE_BYTES = 64 * 1024
#: Lease shapes the structured fuzzer asks for (G, max_new_tokens).
GROUP_SIZES = (2, 3, 4)
MAX_NEW_TOKENS = (4, 8, 16)
#: ... for the tokenized world, whose valid completions encode to 10-11 tokens.
MAX_NEW_TOKENS_TOKENIZED = (12, 16)
#: Rejections that prove misbehaviour: the coordinator keeps the envelope and may ban
#: the signer, so the signer's node row may change (nothing else may).
PROOF_CODES = frozenset({ErrorCode.TEXT_MISMATCH, ErrorCode.PROMPT_MISMATCH})

NAN, INF = math.nan, math.inf
#: Log-prob values at and around every boundary of "finite and <= 0" (float32).
BOUNDARY_LOGPROBS = (
    0.5,
    NAN,
    -0.0,
    INF,
    1.4e-45,
    -INF,
    0.0,
    -1.4e-45,
    1e-7,
    5.0,
    -1e-7,
    -100.0,
    -100.01,
    -3.4e38,
    3.4e38,
    1e39,
    -1e39,
)
TEXT_CHUNKS = (
    "The answer is ",
    "7",
    "-3",
    "12",
    "<answer>",
    "</answer>",
    "\\boxed{",
    "}",
    " ",
    "\n",
    "\x00",
    "é",
    "🙂",
    "\u202e",
    "\ufeff",
    "1,000",
    "9" * 40,
    "nan",
    "inf",
    "<answer>5</answer>",
)


class PropertyViolation(AssertionError):
    """A fuzzing property failed (not a crash: the code under test returned or raised
    something it must not)."""


# -- randomness -------------------------------------------------------------------------


class Draw(Protocol):
    """The random decisions a generator can make."""

    def integer(self, lo: int, hi: int) -> int: ...  # inclusive bounds

    def choice(self, options: Sequence[Any]) -> Any: ...

    def chance(self, percent: int) -> bool: ...

    def binary(self, lo: int, hi: int) -> bytes: ...

    def real(self, lo: float, hi: float) -> float: ...


class RandomDraw:
    """:class:`Draw` on ``random.Random`` (fast; used by the benchmark)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[Any]) -> Any:
        return options[self.rng.randrange(len(options))]

    def chance(self, percent: int) -> bool:
        return self.rng.randrange(100) < percent

    def binary(self, lo: int, hi: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(lo, hi))

    def real(self, lo: float, hi: float) -> float:
        return self.rng.uniform(lo, hi)


#: Small ranges are drawn as ``lo + k % (hi - lo + 1)`` with ``k`` in ``[0, _SPAN)``.
_SPAN = 1 << 24


class HypothesisDraw:
    """:class:`Draw` on hypothesis' ``st.data()`` (reproducible, shrinks failures).

    The coordinator under test is stateful (leases answered, worlds replaced), so the
    *bounds* of a draw (e.g. a byte position in a payload whose length depends on the
    leased question) can differ when hypothesis replays a prefix of choices; hypothesis
    then reports "inconsistent data generation". Every small range is therefore drawn
    with the same fixed bounds and mapped onto the requested range, and the generators
    always make the same draws whatever the world's state (see ``run_structured``).
    """

    def __init__(self, data: Any) -> None:
        from hypothesis import strategies as st

        self.data = data
        self.st = st
        self._span = st.integers(0, _SPAN - 1)

    def integer(self, lo: int, hi: int) -> int:
        if hi - lo < _SPAN:
            return lo + self.data.draw(self._span) % (hi - lo + 1)
        return self.data.draw(self.st.integers(lo, hi))  # only with constant bounds

    def choice(self, options: Sequence[Any]) -> Any:
        return options[self.integer(0, len(options) - 1)]

    def chance(self, percent: int) -> bool:
        # hypothesis favours 0 (its "simplest" value): map 0 to the likelier outcome, so
        # rare branches stay rare instead of being taken whenever a draw is minimal
        k = self.integer(0, 99)
        return k < percent if percent >= 50 else k >= 100 - percent

    def binary(self, lo: int, hi: int) -> bytes:
        return self.data.draw(self.st.binary(min_size=lo, max_size=hi))

    def real(self, lo: float, hi: float) -> float:
        return self.data.draw(self.st.floats(lo, hi))


def draw_text(draw: Draw, max_chunks: int = 6) -> str:
    return "".join(draw.choice(TEXT_CHUNKS) for _ in range(draw.integer(0, max_chunks)))


def mutate_bytes(data: bytes, draw: Draw, max_ops: int = 3) -> bytes:
    """Flip bits, insert, delete, overwrite or duplicate bytes (at least one operation)."""
    buf = bytearray(data)
    for _ in range(draw.integer(1, max_ops)):
        op = draw.choice(("flip", "insert", "delete", "set", "dup"))
        pos = draw.integer(0, len(buf))
        if op == "insert" or not buf:
            buf[pos:pos] = draw.binary(1, 8)
            continue
        pos = min(pos, len(buf) - 1)
        if op == "flip":
            buf[pos] ^= 1 << draw.integer(0, 7)
        elif op == "delete":
            del buf[pos : pos + draw.integer(1, 8)]
        elif op == "set":
            buf[pos] = draw.choice((0x00, 0x01, 0x7F, 0x80, 0xFF))
        else:
            end = min(len(buf), pos + draw.integer(1, 16))
            buf[pos:pos] = buf[pos:end]
    return bytes(buf)


# -- the independent structure oracle ------------------------------------------------------


def structure_violations(bundle: bundle_pb2.Bundle, limits: BundleLimits) -> set[int]:
    """Every documented structural rule a bundle breaks (docs/error-codes.md 130-139,
    180-181).

    Written from the documentation, not from ``check_structure``: it collects all
    violations instead of stopping at the first, so ``check_structure`` must accept iff
    this set is empty and, when it rejects, report one of these codes.
    """
    out: set[int] = set()
    s = bundle.sampling
    temperature_ok = math.isfinite(s.temperature) and s.temperature > 0
    top_p_ok = (not math.isnan(s.top_p)) and 0 < s.top_p <= 1
    if not temperature_ok or not top_p_ok or s.top_k < 0:
        out.add(ErrorCode.SAMPLING_INVALID)
    if len(bundle.prompt_token_ids) == 0:
        out.add(ErrorCode.PROMPT_MISSING)
    if (limits.max_prompt_tokens is not None
            and len(bundle.prompt_token_ids) > limits.max_prompt_tokens) or (
            limits.max_prompt_chars is not None
            and len(bundle.prompt_text) > limits.max_prompt_chars):
        out.add(ErrorCode.PROMPT_TOO_LONG)

    def in_vocab(t: int) -> bool:
        return 0 <= t < limits.vocab_size

    if not all(in_vocab(t) for t in bundle.prompt_token_ids):
        out.add(ErrorCode.TOKEN_OUT_OF_VOCAB)
    if len(bundle.completions) != limits.group_size:
        out.add(ErrorCode.GROUP_SIZE_MISMATCH)
    for c in bundle.completions:
        n = len(c.token_ids)
        if n == 0:
            out.add(ErrorCode.COMPLETION_EMPTY)
        if n > limits.max_new_tokens:
            out.add(ErrorCode.COMPLETION_TOO_LONG)
        if len(c.logprobs) != n:
            out.add(ErrorCode.LOGPROB_COUNT_MISMATCH)
        if not all(in_vocab(t) for t in c.token_ids):
            out.add(ErrorCode.TOKEN_OUT_OF_VOCAB)
        if any(math.isnan(x) or math.isinf(x) for x in c.logprobs):
            out.add(ErrorCode.LOGPROB_NOT_FINITE)
        if any(x > 0 for x in c.logprobs if not math.isnan(x) and not math.isinf(x)):
            out.add(ErrorCode.LOGPROB_POSITIVE)
        if any(x < -100.0 for x in c.logprobs if not math.isnan(x) and not math.isinf(x)):
            out.add(ErrorCode.LOGPROB_TOO_SMALL)
        if len(c.text) == 0 or len(c.text) > MAX_TEXT_CHARS_PER_TOKEN * n:
            out.add(ErrorCode.TEXT_MISSING)
    return out


def _draw_token(draw: Draw, vocab: int) -> int:
    if draw.chance(97):
        return draw.integer(0, vocab - 1)
    return min(draw.choice((INT32_MIN, -1, 0, vocab - 1, vocab, vocab + 1, INT32_MAX)), INT32_MAX)


def _draw_logprob(draw: Draw) -> float:
    if draw.chance(96):
        return -draw.real(0.0, 30.0)
    return draw.choice(BOUNDARY_LOGPROBS)


def random_bundle(draw: Draw) -> tuple[bundle_pb2.Bundle, BundleLimits]:
    """A random bundle and limits, valid often enough that both outcomes are common:
    each field is drawn near its boundaries with a small probability."""
    limits = BundleLimits(
        group_size=draw.integer(1, 4),
        max_new_tokens=draw.integer(1, 6),
        vocab_size=draw.choice((1000, 50, 2, 1, INT32_MAX)),
        max_prompt_tokens=None if draw.chance(80) else draw.integer(0, 4),
        max_prompt_chars=None if draw.chance(80) else draw.integer(0, 8),
    )
    vocab = min(limits.vocab_size, INT32_MAX)
    n_completions = limits.group_size if draw.chance(95) else draw.integer(0, 6)
    completions = []
    for _ in range(n_completions):
        n = draw.integer(1, limits.max_new_tokens) if draw.chance(95) else draw.integer(0, 9)
        tokens = [_draw_token(draw, vocab) for _ in range(n)]
        n_lp = n if draw.chance(96) else max(0, n + draw.choice((-1, 1, 2)))
        logprobs = [_draw_logprob(draw) for _ in range(n_lp)]
        if draw.chance(95):
            text = "x" * draw.integer(1, max(1, MAX_TEXT_CHARS_PER_TOKEN * n))
        else:
            text = draw.choice(
                (
                    "",
                    "é" * (MAX_TEXT_CHARS_PER_TOKEN * n),
                    "🙂" * (MAX_TEXT_CHARS_PER_TOKEN * n + 1),
                    draw_text(draw),
                )
            )
        completions.append(bundle_pb2.Completion(token_ids=tokens, logprobs=logprobs, text=text))
    sampling = bundle_pb2.SamplingParams(
        temperature=draw.real(0.05, 2.0)
        if draw.chance(95)
        else draw.choice((0.0, -0.0, -1.0, 1e-45, NAN, INF, -INF, 1e39)),
        top_p=1.0 if draw.chance(96) else draw.choice((0.0, -0.1, 0.5, 1.0000001, 1.5, NAN, INF)),
        top_k=0 if draw.chance(96) else draw.choice((-1, INT32_MIN, 1, 50, INT32_MAX)),
    )
    n_prompt = draw.integer(1, 4) if draw.chance(96) else 0
    bundle = bundle_pb2.Bundle(
        sampling=sampling,
        prompt_text="q" * draw.integer(0, 10),
        prompt_token_ids=[_draw_token(draw, vocab) for _ in range(n_prompt)],
        completions=completions,
    )
    return bundle, limits


def run_check_structure(draw: Draw) -> int:
    """``check_structure`` accepts exactly the bundles the oracle finds no fault in."""
    bundle, limits = random_bundle(draw)
    expected = structure_violations(bundle, limits)
    try:
        check_structure(bundle, limits)
    except FtisError as err:
        _check_error(err)
        if err.code not in expected:
            raise PropertyViolation(
                f"check_structure raised {err} but the oracle finds "
                f"{sorted(ErrorCode.Name(c) for c in expected) or 'no fault'} in "
                f"{bundle!r} with {limits}"
            ) from err
        return err.code
    if expected:
        raise PropertyViolation(
            f"check_structure accepted a bundle breaking "
            f"{sorted(ErrorCode.Name(c) for c in expected)}: {bundle!r} with {limits}"
        )
    return 0


# -- the coordinator under fuzzing -----------------------------------------------------------


def _check_error(err: FtisError) -> None:
    if err.code not in DEFINED_CODES:
        raise PropertyViolation(f"rejection with undefined or zero code {err.code}: {err}")
    if not err.reason or "\n" in err.reason:
        raise PropertyViolation(f"rejection reason must be one non-empty line: {err.reason!r}")


class FuzzWorld:
    """A coordinator on in-memory SQLite with the cast the structured fuzzer needs.

    * ``node``: registered; submits the bundles.
    * ``other``: registered, holds a lease of its own (foreign-lease, wrong-node cases).
    * ``banned``: registered, then banned.
    * ``stranger``: never registered.

    With ``tokenized=True`` the coordinator requires uploaded tokenizers, ``node`` and
    ``other`` register the real test tokenizer (``ftis.lab.harness.coordinator.tokenizer_json``)
    and valid bundles are its encodings, so the text and prompt checks (TEXT_MISMATCH,
    PROMPT_MISMATCH, proof and automatic ban) are reached; otherwise token ids are
    random and no tokenizer is known (text checks skipped, as with
    ``require_tokenizer=False``).

    Leases of ``node`` are pooled per (G, max_new_tokens) and reused until a bundle
    answers them (rejections leave them unanswered).
    """

    def __init__(
        self, tokenized: bool = False, snapshot_fn: Callable[[Any], dict] = snapshot
    ) -> None:
        self.tokenized = tokenized
        self.snapshot = snapshot_fn
        self.clock = FakeClock()
        self.max_new_tokens = MAX_NEW_TOKENS_TOKENIZED if tokenized else MAX_NEW_TOKENS
        extra: dict[str, Any] = {"require_tokenizer": True} if tokenized else {}
        self.coord = make_coordinator(
            self.clock,
            max_bundle_bytes=FUZZ_MAX_BUNDLE_BYTES,
            max_outstanding_leases=1_000_000,
            max_new_tokens_limit=max(self.max_new_tokens),
            **extra,
        )
        if tokenized:
            self.tokenizer = load_tokenizer()
            self.node = register_with_tokenizer(self.coord)
            self.other = register_with_tokenizer(self.coord)
        else:
            self.tokenizer = None
            self.node = register(self.coord)
            self.other = register(self.coord)
        self.banned = register_with_tokenizer(self.coord) if tokenized else register(self.coord)
        (self.foreign_lease,) = self.coord.lease_tasks(self.other.node_id, 1, 2, 8)
        self.coord.ban(self.banned.node_id, "fuzz")
        self.stranger = NodeIdentity.generate()
        self.lease_ttl_ms = int(self.coord.config.lease_ttl_s * 1000)
        self.pool: dict[tuple[int, int], list[Any]] = {}
        self.answered: list[tuple[Any, bytes]] = []  # (lease, accepted envelope bytes)
        self.examples = 0
        self.last_input: bundle_pb2.SignedEnvelope | bytes | None = None
        #: the tables after the last submission (the next one's "before"); reset by
        #: anything else that writes (leasing)
        self._tables: dict | None = None

    def lease(self, group_size: int, max_new_tokens: int) -> Any:
        pool = self.pool.setdefault((group_size, max_new_tokens), [])
        if not pool:
            pool.extend(self.coord.lease_tasks(self.node.node_id, 2, group_size, max_new_tokens))
            self._tables = None
        return pool[0]

    def any_fresh_lease(self) -> Any | None:
        return next((p[0] for p in self.pool.values() if p), None)

    def healthy(self) -> bool:
        """False once the main node is banned (e.g. by an automatic ban)."""
        node = self.coord.state.get_node(self.node.node_id)
        return node is not None and not node.banned

    def submit(self, envelope: bundle_pb2.SignedEnvelope | bytes, advance_ms: int = 0) -> int:
        """Submit and check the coordinator invariants; returns 0 or the rejection code.

        Raises:
            PropertyViolation: a state change after a rejection, an undefined code, a
                multi-line reason, or an acceptance that breaks a documented rule.
            Exception: anything else the coordinator raises (a crash).
        """
        self.examples += 1
        self.last_input = envelope
        before = self._tables if self._tables is not None else self.snapshot(self.coord)
        self._tables = None
        self.clock.now_ms += advance_ms
        try:
            record = self.coord.submit_bundle(envelope)
        except FtisError as err:
            _check_error(err)
            after = self.snapshot(self.coord)
            if after != before and not self._allowed_proof_change(err, before, after):
                raise PropertyViolation(
                    f"state changed after rejection {err}: {_diff(before, after)}"
                ) from err
            self._tables = after
            return err.code
        finally:
            self.clock.now_ms -= advance_ms
        after = self.snapshot(self.coord)
        self._check_accepted(record, before, after)
        for pool in self.pool.values():
            pool[:] = [lease for lease in pool if lease.task_id != record.task_id]
        lease = self.coord.state.get_lease_by_task(record.task_id)
        self.answered.append((lease, record.envelope))
        self._tables = after
        return 0

    def _allowed_proof_change(self, err: FtisError, before: dict, after: dict) -> bool:
        """After TEXT_MISMATCH / PROMPT_MISMATCH only the signer's node row may change
        (the automatic ban), and the signer must then be banned."""
        if err.code not in PROOF_CODES:
            return False
        if before["leases"] != after["leases"] or before["bundles"] != after["bundles"]:
            return False
        gone = set(before["nodes"]) - set(after["nodes"])
        new = set(after["nodes"]) - set(before["nodes"])
        if len(gone) != 1 or len(new) != 1:
            return False
        banned = [n for n in self.coord.state.list_nodes() if n.banned]
        return len(banned) == 2  # the fuzz world's banned node and the signer

    def _check_accepted(self, record: Any, before: dict, after: dict) -> None:
        if len(after["bundles"]) != len(before["bundles"]) + 1:
            raise PropertyViolation("an accepted submission did not store exactly one bundle")
        if len(after["nodes"]) != len(before["nodes"]):
            raise PropertyViolation("an accepted submission added or removed nodes")
        envelope = parse_envelope_bytes(record.envelope, 2 * FUZZ_MAX_BUNDLE_BYTES)
        bundle, sender = open_envelope(envelope, "bundle", bundle_pb2.Bundle, FUZZ_MAX_BUNDLE_BYTES)
        node = self.coord.state.get_node(sender)
        lease = self.coord.state.get_lease_by_task(bundle.task_id)
        problems = []
        if node is None or node.banned:
            problems.append("sender unknown or banned")
        if bundle.node_id != sender or record.node_id != sender:
            problems.append("node id is not the signer's")
        if lease is None or lease.node_id != sender or lease.lease_id != bundle.lease_id:
            problems.append("lease unknown, foreign or wrong lease id")
        elif lease.bundle_id != record.bundle_id:
            problems.append("lease not marked answered by this bundle")
        if node is not None and bundle.model_card.tokenizer_fingerprint != node.fingerprint:
            problems.append("tokenizer fingerprint differs from the registered one")
        if node is not None and lease is not None:
            limits = BundleLimits(lease.group_size, lease.max_new_tokens, node.vocab_size)
            faults = structure_violations(bundle, limits)
            problems += [f"breaks {ErrorCode.Name(c)}" for c in sorted(faults)]
        rewards = record.verified_rewards
        if len(rewards) != len(bundle.completions) or not all(0 <= r <= 1 for r in rewards):
            problems.append(f"verified rewards {rewards} not one in [0, 1] per completion")
        if problems:
            raise PropertyViolation(f"accepted a bad bundle: {problems}")


def fast_snapshot(coordinator: Any) -> dict:
    """The rows of nodes, leases and bundles like ``ftis.lab.harness.coordinator.snapshot`` (same
    tables, same sorted-tuple shape, the ``_allowed_proof_change`` logic works on both),
    but values are kept as they come from SQLite instead of being JSON-encoded one by
    one: about 3x cheaper, for the 100k-example benchmark."""
    from sqlalchemy import select

    from ftis.coordinator.state.sql import Base

    out: dict[str, list[tuple[Any, ...]]] = {}
    with coordinator.state.engine.connect() as conn:
        for name in ("nodes", "leases", "bundles"):
            table = Base.metadata.tables[name]
            rows = conn.execute(select(table).order_by(*table.primary_key.columns)).all()
            out[name] = [
                tuple(repr(v) if isinstance(v, dict | list) else v for v in r) for r in rows
            ]
    return out


def _diff(before: dict, after: dict) -> str:
    parts = []
    for table in before:
        gone = set(before[table]) - set(after[table])
        new = set(after[table]) - set(before[table])
        if gone or new:
            parts.append(f"{table}: -{sorted(gone)[:2]} +{sorted(new)[:2]}")
    return "; ".join(parts)[:2000]


# -- arbitrary bytes -----------------------------------------------------------------------


def run_envelope_bytes(draw: Draw) -> int:
    """``parse_envelope_bytes`` on arbitrary bytes: an envelope or a coded rejection."""
    if draw.chance(50):
        data = draw.binary(0, 300)
    else:  # near-valid: byte edits of a well-formed envelope
        envelope = bundle_pb2.SignedEnvelope(
            payload_type="bundle",
            payload=draw.binary(0, 64),
            public_key=draw.binary(32, 32),
            signature=draw.binary(64, 64),
        )
        data = mutate_bytes(envelope.SerializeToString(), draw)
    limit = draw.choice((0, 1, 64, len(data), len(data) + 1, 1 << 20))
    try:
        parse_envelope_bytes(data, limit)
    except FtisError as err:
        _check_error(err)
        if err.code not in (ErrorCode.ENVELOPE_TOO_LARGE, ErrorCode.ENVELOPE_MALFORMED):
            raise PropertyViolation(f"parse_envelope_bytes raised undocumented {err}") from err
        return err.code
    if len(data) > limit:
        raise PropertyViolation(f"{len(data)} bytes accepted with limit {limit}")
    return 0


def run_submit_bytes(world: FuzzWorld, draw: Draw) -> int:
    """Arbitrary input on the coordinator's submit path."""
    kind = draw.choice(("raw", "envelope", "signed-garbage"))
    if kind == "raw":
        return world.submit(draw.binary(0, 400))
    if kind == "envelope":  # arbitrary field contents, as object or as bytes
        envelope = bundle_pb2.SignedEnvelope(
            payload_type=draw.choice(("bundle", "register", "", "bundle\x00", "Bundle")),
            payload=draw.binary(0, 200),
            # right lengths usually, so the signature check itself is reached
            public_key=draw.binary(32, 32) if draw.chance(70) else draw.binary(0, 40),
            signature=draw.binary(64, 64) if draw.chance(70) else draw.binary(0, 70),
        )
    else:  # a valid signature by a registered key over an arbitrary payload
        payload = draw.binary(0, 300)
        signer = draw.choice((world.node, world.other, world.stranger))
        envelope = bundle_pb2.SignedEnvelope(
            payload_type="bundle",
            payload=payload,
            public_key=signer.public_key,
            signature=signer.sign(signing_digest("bundle", payload)),
        )
    return world.submit(envelope.SerializeToString() if draw.chance(50) else envelope)


# -- structured mutations of a valid signed bundle --------------------------------------------


@dataclass
class Ctx:
    world: FuzzWorld
    lease: Any
    advance_ms: int = 0
    notes: list[str] = field(default_factory=list)


Mutation = Callable[[bundle_pb2.Bundle, Draw, Ctx], None]


def _index(draw: Draw, n: int) -> int | None:
    """A position in a sequence of length ``n`` (``None`` when empty); always one draw,
    whatever ``n`` is, so the draw sequence does not depend on the world's state."""
    k = draw.integer(0, _SPAN - 1)
    return k % n if n else None


def _pick_completion(b: bundle_pb2.Bundle, draw: Draw) -> bundle_pb2.Completion | None:
    i = _index(draw, len(b.completions))
    return None if i is None else b.completions[i]


def m_token_id(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    c = _pick_completion(b, draw)
    i = _index(draw, len(c.token_ids) if c is not None else 0)
    value = draw.choice((INT32_MIN, -1, 0, VOCAB - 1, VOCAB, VOCAB + 1, INT32_MAX, None))
    random_id = draw.integer(0, VOCAB)
    if c is not None and i is not None:
        c.token_ids[i] = random_id if value is None else value


def m_prompt(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    op = draw.choice(("clear", "token", "swap", "drop", "text-empty", "text-long"))
    ids = b.prompt_token_ids
    i = _index(draw, len(ids))
    value = draw.choice((INT32_MIN, -1, VOCAB, INT32_MAX))
    swapped = draw.integer(0, 399)  # in vocabulary, but no longer the leased question
    long_text = draw.choice((FUZZ_MAX_BUNDLE_BYTES // 2, FUZZ_MAX_BUNDLE_BYTES + 1))
    if op == "clear":
        del ids[:]
    elif op == "token" and i is not None:
        ids[i] = value
    elif op == "swap" and i is not None:
        ids[i] = swapped
    elif op == "drop" and i is not None:
        del ids[i]
    elif op == "text-empty":
        b.prompt_text = ""
    elif op == "text-long":  # beyond the fuzz world's payload limit -> ENVELOPE_TOO_LARGE
        b.prompt_text = "p" * long_text


def m_prompt_question(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    """Prompt tokens in vocabulary that no longer hold the leased question (another
    question, a prefix of the prompt, or made-up ids) -> PROMPT_MISMATCH when the
    coordinator knows the tokenizer."""
    op = draw.choice(("truncate", "made-up", "other-question"))
    cut = draw.integer(1, 8)
    made_up = [draw.integer(0, 399) for _ in range(4)]
    ids = b.prompt_token_ids
    if op == "truncate" and len(ids) > cut:
        del ids[-cut - 6 :]  # drops the end of the question with the template's tail
    elif op == "made-up":
        del ids[:]
        ids.extend(made_up)
    elif ctx.world.tokenizer is not None:
        from ftis.lab.harness.coordinator import chat_prompt

        ids[:] = ctx.world.tokenizer.encode(chat_prompt("What is 1 + 1?")).ids


def m_logprob(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    c = _pick_completion(b, draw)
    i = _index(draw, len(c.logprobs) if c is not None else 0)
    boundary, value, anywhere = draw.chance(80), draw.choice(BOUNDARY_LOGPROBS), draw.real(-50, 5)
    if c is not None and i is not None:
        c.logprobs[i] = value if boundary else anywhere


def m_logprob_count(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    c = _pick_completion(b, draw)
    drop = draw.chance(50)
    if c is not None:
        if drop and c.logprobs:
            del c.logprobs[-1]
        else:
            c.logprobs.append(-0.5)


def m_group_size(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    op = draw.choice(("drop", "duplicate", "clear", "add-many"))
    i = _index(draw, len(b.completions))
    extra = draw.integer(2, 40)
    if i is None:
        return
    if op == "drop":
        del b.completions[i]
    elif op == "duplicate":
        b.completions.add().CopyFrom(b.completions[i])
    elif op == "clear":
        del b.completions[:]
    else:
        for _ in range(extra):
            b.completions.add().CopyFrom(b.completions[i])


def m_text(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    c = _pick_completion(b, draw)
    which = draw.integer(0, 6)
    text = draw_text(draw)
    if c is None:
        return
    limit = MAX_TEXT_CHARS_PER_TOKEN * len(c.token_ids)
    c.text = ("", "x" * limit, "x" * (limit + 1), "🙂" * limit, text, "\x00", "\n" * 3)[which]


def m_length(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    c = _pick_completion(b, draw)
    mnt = ctx.lease.max_new_tokens
    n = draw.choice((0, 1, mnt, mnt + 1, 2 * mnt, 5000))
    token = draw.integer(0, VOCAB - 1)
    if c is None:
        return
    c.ClearField("token_ids")
    c.ClearField("logprobs")
    c.token_ids.extend([token] * n)
    c.logprobs.extend([-0.25] * n)


def m_task_id(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    w = ctx.world
    fresh = w.any_fresh_lease()
    b.task_id = draw.choice(
        (
            "",
            "unknown",
            "x" * 300,
            "'; DROP TABLE leases; --",
            "\x00",
            w.foreign_lease.task_id,
            w.answered[-1][0].task_id if w.answered else "no-answered-lease-yet",
            fresh.task_id if fresh is not None else b.task_id,
        )
    )


def m_lease_id(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    w = ctx.world
    fresh = w.any_fresh_lease()
    b.lease_id = draw.choice(
        (
            "",
            "0" * 32,
            b.lease_id.upper(),
            w.foreign_lease.lease_id,
            fresh.lease_id if fresh is not None else b.lease_id,
        )
    )


def m_foreign_lease(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    b.task_id, b.lease_id = ctx.world.foreign_lease.task_id, ctx.world.foreign_lease.lease_id


def m_replay_lease(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    i = _index(draw, len(ctx.world.answered))
    if i is not None:
        lease = ctx.world.answered[i][0]
        b.task_id, b.lease_id = lease.task_id, lease.lease_id


def m_node_id(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    w = ctx.world
    b.node_id = draw.choice(
        ("", w.other.node_id, w.stranger.node_id, w.banned.node_id, b.node_id.upper(), "z" * 32)
    )


def m_fingerprint(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    b.model_card.tokenizer_fingerprint = draw.choice(("", FP_B, FP_A.upper(), FP_A + "0"))


def m_model_card(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    card = b.model_card
    card.vocab_size = draw.choice((INT64_MIN, -1, 0, 1, INT64_MAX))
    card.parameter_count = draw.choice((INT64_MIN, 0, INT64_MAX))
    card.base_model = draw_text(draw)


def m_sampling(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    s = b.sampling
    which = draw.choice(("temperature", "top_p", "top_k", "max_new_tokens"))
    if which == "temperature":
        s.temperature = draw.choice((0.0, -0.0, -1.0, 1e-45, NAN, INF, -INF, 0.7))
    elif which == "top_p":
        s.top_p = draw.choice((0.0, -0.1, 1e-45, 0.9, 1.0000001, 2.0, NAN, INF))
    elif which == "top_k":
        s.top_k = draw.choice((INT32_MIN, -1, 0, 40, INT32_MAX))
    else:
        s.max_new_tokens = draw.choice((INT32_MIN, -1, 0, INT32_MAX))


def m_claims(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    for c in b.completions:
        c.claimed_reward = draw.choice((NAN, INF, -INF, -1.0, 0.0, 0.5, 1.0, 2.0, 1e39))
        c.finish_reason = draw.choice((0, 1, 2, 7, -1, INT32_MAX))  # open enum


def m_metadata(b: bundle_pb2.Bundle, draw: Draw, ctx: Ctx) -> None:
    b.policy_version = draw.choice((INT64_MIN, -1, 0, INT64_MAX))
    b.created_at_ms = draw.choice((INT64_MIN, 0, INT64_MAX))


MUTATIONS: tuple[Mutation, ...] = (
    m_token_id,
    m_prompt,
    m_prompt_question,
    m_logprob,
    m_logprob_count,
    m_group_size,
    m_text,
    m_length,
    m_task_id,
    m_lease_id,
    m_foreign_lease,
    m_replay_lease,
    m_node_id,
    m_fingerprint,
    m_model_card,
    m_sampling,
    m_claims,
    m_metadata,
)


#: For worlds with an uploaded tokenizer: in 40% of the examples one of these content
#: mutations comes first, so the text and prompt checks (TEXT_MISMATCH, PROMPT_MISMATCH)
#: are reached often whatever the generator's bias.
CONTENT_MUTATIONS: tuple[Mutation, ...] = (m_text, m_prompt_question, m_token_id)


def run_structured(world: FuzzWorld, draw: Draw, mutations: Sequence[Mutation] = ()) -> int:
    """Mutate a valid signed bundle for a real lease and submit it.

    Layers, each optional: 0-3 field mutations; the signing key (own, another
    registered node, a banned node, a stranger); the envelope (payload type, signature
    domain, truncated key or signature, lease expired by the clock, exact replay of an
    accepted envelope); and raw byte edits of the payload (re-signed with the right key,
    so they reach payload decoding and beyond) or of the whole envelope (not re-signed).
    """
    lease = world.lease(draw.choice(GROUP_SIZES), draw.choice(world.max_new_tokens))
    ctx = Ctx(world, lease)
    replay, i = draw.chance(3), _index(draw, len(world.answered))
    if replay:  # byte-exact replay of an accepted envelope (no further draws either way)
        return world.submit(world.answered[i][1] if i is not None else b"")
    bundle = build_bundle(
        lease,
        world.node,
        correct=[draw.chance(50) for _ in range(lease.group_size)],
        n_tokens=draw.integer(1, lease.max_new_tokens),
        seed=draw.integer(0, 1 << 16),
        tokenizer=world.tokenizer,
    )
    content, content_mutation = draw.chance(40), draw.choice(CONTENT_MUTATIONS)
    if content and world.tokenized:
        content_mutation(bundle, draw, ctx)
    for _ in range(draw.choice((0, 1, 1, 1, 2, 3))):
        draw.choice(mutations or MUTATIONS)(bundle, draw, ctx)

    signer = world.node
    if draw.chance(10):
        signer = draw.choice((world.other, world.banned, world.stranger))
    payload = bundle.SerializeToString(deterministic=True)
    if draw.chance(10):  # byte edits of the payload, then signed properly
        payload = mutate_bytes(payload, draw)
    payload_type, domain = "bundle", "bundle"
    if draw.chance(4):
        payload_type, domain = draw.choice(
            (("register", "register"), ("bundle", "register"), ("", "bundle"))
        )
    envelope = bundle_pb2.SignedEnvelope(
        payload_type=payload_type,
        payload=payload,
        public_key=signer.public_key,
        signature=signer.sign(signing_digest(domain, payload)),
    )
    if draw.chance(3):
        if draw.chance(50):
            envelope.public_key = envelope.public_key[: draw.integer(0, 31)]
        else:
            envelope.signature = envelope.signature[: draw.integer(0, 63)] or b"\x00" * 65
    if draw.chance(3):
        ctx.advance_ms = world.lease_ttl_ms + draw.choice((1, 1000, 10**9))
    data: bundle_pb2.SignedEnvelope | bytes = envelope
    if draw.chance(50):
        data = envelope.SerializeToString()
        if draw.chance(8):  # not re-signed: tampering in transit
            data = mutate_bytes(data, draw)
    return world.submit(data, ctx.advance_ms)
