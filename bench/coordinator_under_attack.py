#!/usr/bin/env python3
"""Honest latency while one identity or one connection misbehaves (issue 13, "Beyond
these classes"): ``make bench-attack``.

Every run starts a fresh coordinator (SQLite file, one worker, the **production**
defaults: quotas, registration throttle, reputation; only the task mix and
``require_tokenizer`` are set) and ``--honest`` registered volunteers that each loop
``LeaseTasks(1) -> SubmitBundle (G = 8 x 256 SmolLM2 tokens, text checked) ->
PullBundles`` with ``--pace`` seconds between loops (so an honest node stays inside its
120 bundles/minute quota). In the attack runs one attacker runs beside them from the
same event loop with ``--inflight`` requests in flight at all times:

* ``garbage``: one unauthenticated connection sending 4 KiB of random bytes as
  SubmitBundle requests (they do not parse: gRPC answers INTERNAL);
* ``oversized``: one connection sending 2 MiB requests to Heartbeat (refused before
  decoding: REQUEST_TOO_LARGE, or the transport limit);
* ``bad_signature``: well-formed bundle envelopes with one signature byte flipped
  (decoded, signature checked, SIGNATURE_INVALID; each costs a verdict row);
* ``heartbeat_flood``: one registered identity sending signed Heartbeats;
* ``pull_flood``: one registered identity pulling pages of 64 (PullBundles quota);
* ``register_burst``: fresh identities registering (REGISTRATION_THROTTLED);
* ``bundle_spam``: one registered identity submitting valid-looking signed bundles for
  tasks it never leased (its quota, then TASK_UNKNOWN / RATE_LIMITED, each −1).

Attack-free runs come first and last; the reference of every attack run is their mean,
measured in the same invocation. Per run: honest verified bundles/s, honest p50/p99 per
RPC, the attacker's requests/s and its answers by code. The ratio column is the attack
run's honest p99 over the reference's, per RPC (the issue's bound: within 2×). The
attacker shares the generator's process and both share the machine's cores with the
coordinator, so a ratio above 2 may come from the generator as much as from the
coordinator: the coordinator CPU column tells which.

Each ratio comes with a 95 % block-bootstrap interval (:func:`p99_ratio_ci`): the calls
of a run are cut into 1-second blocks of completion time (calls in the same second share
the machine's stalls, so they are not independent draws), the blocks of the attack run
and of both attack-free runs are resampled with replacement, and the ratio of the
resampled p99s is taken 2,000 times. A run is within the bound with some evidence when
the interval's upper end is below 2.

The last line is ``worst_p99_ratio=<x> kind=<k> rpc=<r>``.

Usage: ``python bench/coordinator_under_attack.py [--kinds all] [--seconds 15]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import grpc  # noqa: E402
from coordinator_load_node import (  # noqa: E402
    LoadStats,
    Material,
    percentile_ms,
    register_volunteers,
    run_volunteers,
)
from coordinator_load_server import CoordinatorProcess, SqliteDatabase, TreeSampler  # noqa: E402

from ftis.protocol.auth import sign_request  # noqa: E402
from ftis.protocol.envelope import seal  # noqa: E402
from ftis.protocol.errors import code_name  # noqa: E402
from ftis.protocol.identity import NodeIdentity  # noqa: E402
from ftis.tasks.source import DEFAULT_TASKS  # noqa: E402
from ftis.v1 import swarm_pb2, swarm_pb2_grpc  # noqa: E402

KINDS = ("garbage", "oversized", "bad_signature", "heartbeat_flood", "pull_flood",
         "register_burst", "bundle_spam")
RPCS = ("LeaseTasks", "SubmitBundle", "PullBundles")
#: seconds of completion time per bootstrap block (:func:`p99_ratio_ci`)
BLOCK_S = 1.0


def settings() -> dict:
    """Production defaults; only the task mix (the pre-built completions are checked
    against it) and the text checks are set."""
    return {"tasks": [t.model_dump() for t in DEFAULT_TASKS], "require_tokenizer": True}


def _raw(channel: grpc.aio.Channel, method: str) -> Callable[..., Awaitable[bytes]]:
    """A unary call that sends and returns raw bytes (no protobuf on our side)."""
    return channel.unary_unary(f"/ftis.v1.Swarm/{method}", request_serializer=None,
                               response_deserializer=None)


class Attacker:
    """``inflight`` concurrent request loops of one kind; counts answers by code."""

    def __init__(self, kind: str, target: str, material: Material, inflight: int) -> None:
        self.kind, self.target, self.material = kind, target, material
        self.inflight = inflight
        self.codes: Counter[str] = Counter()
        self.sent = 0
        self.identity = NodeIdentity.generate()

    def prepare(self) -> None:
        """Register the attacker's identity where its kind needs one (blocking)."""
        if self.kind in ("heartbeat_flood", "pull_flood", "bundle_spam", "bad_signature"):
            self.identity = register_volunteers(self.target, self.material, 1)[0]

    async def run(self, stop: asyncio.Event) -> None:
        channel = grpc.aio.insecure_channel(self.target, options=[
            ("grpc.max_send_message_length", 8 << 20)])
        stub = swarm_pb2_grpc.SwarmStub(channel)
        raw = {m: _raw(channel, m) for m in ("SubmitBundle", "Heartbeat")}
        try:
            await asyncio.gather(*(self._loop(stub, raw, stop, k)
                                   for k in range(self.inflight)))
        finally:
            await channel.close(grace=None)

    async def _loop(self, stub: Any, raw: dict[str, Any], stop: asyncio.Event,
                    k: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                reply = await self._one(stub, raw, k, n)
                code = reply.error.code
                self.codes[code_name(code) if code else "OK"] += 1
            except grpc.aio.AioRpcError as exc:
                self.codes[f"grpc:{exc.code().name}"] += 1
            self.sent += 1

    async def _one(self, stub: Any, raw: dict[str, Any], k: int, n: int) -> Any:
        ident, kind, timeout = self.identity, self.kind, 30
        if kind == "garbage":
            return swarm_pb2.SubmitBundleResponse.FromString(
                await raw["SubmitBundle"](os.urandom(4096), timeout=timeout))
        if kind == "oversized":
            return swarm_pb2.HeartbeatResponse.FromString(
                await raw["Heartbeat"](os.urandom(2 << 20), timeout=timeout))
        if kind == "heartbeat_flood":
            req = swarm_pb2.HeartbeatRequest(node_id=ident.node_id, policy_version=1)
            sign_request(req, "Heartbeat", ident)
            return await stub.Heartbeat(req, timeout=timeout)
        if kind == "pull_flood":
            req = swarm_pb2.PullBundlesRequest(
                node_id=ident.node_id, cursor=0, max_bundles=64,
                tokenizer_fingerprint=self.material.card.tokenizer_fingerprint)
            sign_request(req, "PullBundles", ident)
            return await stub.PullBundles(req, timeout=timeout)
        if kind == "register_burst":
            fresh = NodeIdentity.generate()
            payload = swarm_pb2.RegisterPayload(model_card=self.material.card,
                                                client_version="bench",
                                                timestamp_ms=int(time.time() * 1000))
            return await stub.Register(swarm_pb2.RegisterRequest(
                envelope=seal("register", payload, fresh)), timeout=timeout)
        # bundle_spam, bad_signature: a bundle for a task it never leased
        lease = swarm_pb2.TaskLease(task_id=f"{k:08x}{n:024x}", lease_id=f"{n:032x}",
                                    question="What is 1 + 1?")
        lease.messages.add(role="user", content="What is 1 + 1?")
        envelope = seal("bundle", self.material.bundle(ident.node_id, lease), ident)
        if kind == "bad_signature":
            envelope.signature = bytes([envelope.signature[0] ^ 1]) + envelope.signature[1:]
        return await stub.SubmitBundle(swarm_pb2.SubmitBundleRequest(envelope=envelope),
                                       timeout=timeout)


def _attacker_process(kind: str, target: str, inflight: int, ready: Any, stop: Any,
                      out: Any) -> None:
    """The attacker's own process (its CPU is not the honest generator's): prepare,
    signal ``ready``, attack until ``stop`` is set, put ``(sent, codes)`` on ``out``."""
    attacker = Attacker(kind, target, Material.build(), inflight)
    attacker.prepare()
    sent_at: list[tuple[float, int]] = []  # (time, requests sent), every 0.25 s

    async def attack() -> None:
        halt = asyncio.Event()
        task = asyncio.create_task(attacker.run(halt))
        while not stop.is_set():
            sent_at.append((time.time(), attacker.sent))
            await asyncio.sleep(0.25)
        halt.set()
        await task

    ready.set()
    asyncio.run(attack())
    out.put((sent_at, dict(attacker.codes.most_common(3))))


def _blocks(finished: list[float], latencies: list[float], block_s: float) -> list[list[float]]:
    """Latencies grouped by the ``block_s``-second block in which their call finished."""
    if not finished:
        return []
    start = min(finished)
    blocks: dict[int, list[float]] = {}
    for t, lat in zip(finished, latencies, strict=True):
        blocks.setdefault(int((t - start) // block_s), []).append(lat)
    return [blocks[k] for k in sorted(blocks)]


def p99_ratio_ci(attack: list[list[float]], reference: list[list[float]],
                 rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile block-bootstrap interval of ``p99(attack) / p99(reference)``.

    Args:
        attack, reference: latencies (any unit, the same for both) in blocks; the blocks
            of each side are resampled with replacement, keeping each block whole.
        rounds: bootstrap resamples.

    Returns:
        ``(low, high)``; ``(nan, nan)`` when a side has no blocks.
    """
    if not attack or not reference:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    ratios = []
    for _ in range(rounds):
        a = [x for b in rng.choices(attack, k=len(attack)) for x in b]
        r = [x for b in rng.choices(reference, k=len(reference)) for x in b]
        ratios.append(percentile_ms(a, 99) / max(percentile_ms(r, 99), 1e-12))
    ratios.sort()
    return ratios[int(0.025 * rounds)], ratios[min(int(0.975 * rounds), rounds - 1)]


def run(kind: str | None, material: Material, args: argparse.Namespace,
        workdir: Path) -> dict:
    """One fresh coordinator, the honest volunteers, and the attacker ``kind`` (``None``:
    attack-free); returns the honest statistics and the attacker's counts."""
    db = SqliteDatabase()
    tag = kind or f"none-{time.monotonic_ns()}"
    coord = CoordinatorProcess(workdir, db.fresh(workdir, tag), tag, settings=settings())
    sampler: TreeSampler | None = None
    proc: Any = None
    try:
        target = coord.start()
        sampler = TreeSampler(coord.pid, 0.5).start()
        identities = register_volunteers(target, material, args.honest)
        if kind is not None:
            import multiprocessing

            ctx = multiprocessing.get_context("spawn")
            ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
            proc = ctx.Process(target=_attacker_process,
                               args=(kind, target, args.inflight, ready, stop, out))
            proc.start()
            if not ready.wait(120):
                raise RuntimeError(f"attacker {kind} did not start")
        stats = LoadStats()
        marks: dict[str, Any] = {}

        async def both() -> tuple[float, float]:
            def on_window(start: float, end: float) -> None:
                marks["start"] = sampler.sample() if sampler else None
                marks["t0"] = time.time()

            result = await run_volunteers(target, identities, material, stats, args.warmup,
                                          args.seconds, on_window=on_window,
                                          pace_s=args.pace, timeout_s=60.0)
            marks["t1"] = time.time()
            return result

        _, wall = asyncio.run(both())
        end = sampler.sample()
        start = marks["start"]
        attack_rate, codes = 0.0, {}
        if proc is not None:
            stop.set()
            sent_at, codes = out.get(timeout=60)
            proc.join(30)
            inside = [n for t, n in sent_at if marks["t0"] <= t <= marks["t1"]]
            if len(inside) >= 2:
                attack_rate = (inside[-1] - inside[0]) / max(marks["t1"] - marks["t0"], 1e-9)
        return {
            "kind": kind or "none", "wall": wall, "verified": stats.verified,
            "p50": {r: percentile_ms(stats.latencies.get(r, []), 50) for r in RPCS},
            "p99": {r: percentile_ms(stats.latencies.get(r, []), 99) for r in RPCS},
            "blocks": {r: _blocks(stats.finished[r], stats.latencies[r], BLOCK_S) for r in RPCS},
            "errors": dict(stats.errors),
            "coord_cpu": 100 * (end.cpu_s - start.cpu_s) / max(end.t - start.t, 1e-9),
            "attack_rate": attack_rate,
            "attack_codes": codes,
            "alive": coord.alive(),
        }
    finally:
        if proc is not None and proc.is_alive():
            proc.terminate()
            proc.join(10)
        if sampler is not None:
            sampler.stop()
        coord.stop()
        db.drop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="all", help=f"comma-separated of {', '.join(KINDS)}")
    ap.add_argument("--honest", type=int, default=8)
    ap.add_argument("--pace", type=float, default=0.75, help="seconds between honest loops")
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--seconds", type=float, default=15.0)
    args = ap.parse_args(argv)
    kinds = list(KINDS) if args.kinds == "all" else args.kinds.split(",")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)}")
    material = Material.build()
    workdir = Path(tempfile.mkdtemp(prefix="ftis-attack-bench-"))
    print(f"# {args.honest} honest volunteers, one loop per {args.pace:g} s each; attacker "
          f"with {args.inflight} requests in flight; {args.seconds:g} s per run after "
          f"{args.warmup:g} s; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    head = (f"{'kind':>16} {'bundles/s':>9} " + " ".join(f"{r + ' p50/p99 ms':>25}" for r in RPCS)
            + f" {'p99 ratio (L/S/P)':>19} {'coord CPU %':>11} {'attack/s':>9}  attacker answers")
    print(head, flush=True)
    results = [run(None, material, args, workdir)]
    _print(results[0], None)
    for kind in kinds:
        results.append(run(kind, material, args, workdir))
        print(f"# {kind} done", file=sys.stderr, flush=True)
    results.append(run(None, material, args, workdir))
    ref = {r: (results[0]["p99"][r] + results[-1]["p99"][r]) / 2 for r in RPCS}
    ref_blocks = {r: results[0]["blocks"][r] + results[-1]["blocks"][r] for r in RPCS}
    worst = (0.0, "", "")
    for res in results[1:-1]:
        _print(res, ref)
        for r in RPCS:
            ratio = res["p99"][r] / max(ref[r], 1e-9)
            if ratio > worst[0]:
                worst = (ratio, res["kind"], r)
    _print(results[-1], None)
    print("reference p99 (mean of the attack-free runs): "
          + ", ".join(f"{r} {ref[r]:.1f} ms" for r in RPCS))
    print(f"95 % block-bootstrap intervals ({BLOCK_S:g} s blocks) of p99(attack) / "
          "p99(both attack-free runs):")
    for res in results[1:-1]:
        cis = [p99_ratio_ci(res["blocks"][r], ref_blocks[r]) for r in RPCS]
        print(f"{res['kind']:>16} " + "  ".join(
            f"{r} [{lo:.2f}, {hi:.2f}]" for r, (lo, hi) in zip(RPCS, cis, strict=True)),
            flush=True)
    print(f"worst_p99_ratio={worst[0]:.2f} kind={worst[1]} rpc={worst[2]}")
    return 0


def _print(res: dict, ref: dict | None) -> None:
    lat = " ".join(f"{res['p50'][r]:>11.1f} / {res['p99'][r]:>9.1f}" for r in RPCS)
    ratio = ("/".join(f"{res['p99'][r] / max(ref[r], 1e-9):.2f}" for r in RPCS)
             if ref else "–")
    answers = ", ".join(f"{k} ×{v}" for k, v in res["attack_codes"].items()) or "–"
    if not res["alive"]:
        answers += "  COORDINATOR DIED"
    print(f"{res['kind']:>16} {res['verified'] / max(res['wall'], 1e-9):>9.1f} {lat} "
          f"{ratio:>19} {res['coord_cpu']:>11.0f} {res['attack_rate']:>9.0f}  {answers}",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
