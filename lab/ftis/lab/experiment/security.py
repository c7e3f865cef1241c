"""Security experiment: real swarms with attackers, measured from the outside.

For every attack kind (or group of kinds sharing one swarm) this starts a coordinator
(``letter_counting`` by default, so tiny random models get reward variance), two honest
clients and the attacker(s) as separate processes over loopback, runs R honest rounds
and measures:

- **detection**: the admin API (``ListNodes``) is polled every second; the first poll
  that shows an attacker quarantined or banned is mapped to the honest clients' round
  index (``1 + rounds completed by the slower honest client at that time``);
- **false positives**: honest nodes ever seen quarantined or banned (must be 0), and
  honest bundles the coordinator rejected;
- **leakage**: attacker groups in the honest learners' batches (``external_senders`` of
  their ``metrics.jsonl``) and, exactly by bundle id, attacker bundles that were stored
  while the attacker was quarantined and still reached an honest learner (must be 0);
- **harm**: the honest learners' mean verified reward per round against an attack-free
  baseline run with the same seeds.

Honest clients run as ``ftis-lab attack --kind honest``: the unmodified
:class:`~ftis.client.node.runner.VolunteerNode` plus a log of the bundle ids its learner
used (``attack.jsonl``), which ``metrics.jsonl`` does not record.

Outputs in ``OUT``: ``results.jsonl`` (one record per attacker and one for the
baseline), ``results.md`` (markdown table), ``rewards.png`` (honest reward curves,
attack vs baseline), and per run ``OUT/RUN/`` with logs, timelines and client folders.
"""

from __future__ import annotations

import json
import shutil
import statistics
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ftis.lab.attack import ATTACK_KINDS
from ftis.lab.attack.nodes import read_attack_log
from ftis.lab.experiment.launcher import (
    ClientSpec,
    LaunchError,
    Swarm,
    start_attacker,
    start_coordinator,
)
from ftis.lab.experiment.report import read_metrics

HONEST = ("honest-a", "honest-b")
#: Codes each kind is expected to draw (documentation and the integration test).
EXPECTED_CODES: dict[str, set[str]] = {
    "reward_liar": set(),
    "logprob_inflate": set(),
    "logprob_deflate": set(),
    "text_mismatch": {"TEXT_MISMATCH"},
    "replay": {"BUNDLE_REPLAYED", "PROMPT_MISMATCH"},
    "fabricated_prompt": {"PROMPT_MISMATCH"},
    "flooder": {"RATE_LIMITED", "ENVELOPE_TOO_LARGE", "REQUEST_TOO_LARGE", "LEASE_LIMIT"},
    "garbage": {"PAYLOAD_MALFORMED", "PAYLOAD_TYPE_INVALID", "SIGNATURE_INVALID",
                "ENVELOPE_MALFORMED", "AUTH_INVALID", "AUTH_EXPIRED"},
    "sybil_burst": {"REGISTRATION_THROTTLED"},
    "false_reporter": set(),
    "replay_frame": {"BUNDLE_REPLAYED"},
    "logprob_shade": set(),
    "sybil_feedback": set(),
    "answer_computer": set(),
}
#: Submissions of these variants are the attacker's honest cover, not attacks.
COVER_VARIANTS = {"own", "honest", "false_reporter", "sybil_feedback", "flood"}


@dataclass
class SecuritySettings:
    """What :func:`run_security_experiment` runs.

    Attributes:
        groups: kinds per swarm; ``[["reward_liar"], ["replay"]]`` runs two swarms.
        model: client model; ``None`` builds a tiny random model in ``out/tiny-model``.
        config: coordinator ``--config`` file; ``None`` writes ``letter_counting``.
        baseline: also run an attack-free swarm.
        attack_args: extra ``ftis-lab attack`` flags per kind.
        audit_reporters: ``reputation.audit_reporters`` of every swarm's coordinator (0:
            the config's own); with k > 0 the two honest nodes are the audit's seeds
            (``audit_seed_nodes``: their ids, generated before the coordinator starts),
            so that attackers on probation are relayed to them for audit only.
    """

    out: Path
    groups: list[list[str]] = field(default_factory=lambda: [[k] for k in ATTACK_KINDS])
    rounds: int = 8
    model: str | None = None
    config: Path | None = None
    local_groups: int = 3
    external_groups: int = 3
    group_size: int = 8
    max_new_tokens: int = 12
    learning_rate: float = 1e-3
    threads: int = 1
    baseline: bool = True
    timeout_s: float = 900.0
    attack_args: dict[str, list[str]] = field(default_factory=dict)
    poll_s: float = 0.2
    audit_reporters: int = 0


#: Heartbeats a minute each node may send in these swarms, at least. Every node's
#: harness sends two probes per submission (its quarantine flag before and after), on
#: top of the client's own heartbeat, and tiny-model rounds take about a second: with
#: the production quota of 60 the probes were refused, and the refusals emptied the
#: honest nodes' connection budgets, so that their bundles were answered RATE_LIMITED.
PROBE_HEARTBEATS_PER_MINUTE = 600.0


def swarm_config(config: Path, run_dir: Path, audit_reporters: int,
                 seeds: list[str]) -> Path:
    """A copy of ``config`` in ``run_dir`` with ``heartbeats_per_minute`` raised to at
    least :data:`PROBE_HEARTBEATS_PER_MINUTE` (the harness's probes are measurement, not
    node behaviour) and, with ``audit_reporters`` > 0, ``reputation.audit_reporters``
    set and ``seeds`` as ``audit_seed_nodes``."""
    data = json.loads(config.read_text())
    data["heartbeats_per_minute"] = max(float(data.get("heartbeats_per_minute", 0)),
                                        PROBE_HEARTBEATS_PER_MINUTE)
    if audit_reporters > 0:
        data.setdefault("reputation", {})["audit_reporters"] = audit_reporters
        data["audit_seed_nodes"] = sorted(seeds)
    path = run_dir / "coordinator.json"
    path.write_text(json.dumps(data, indent=1))
    return path


# -- admin polling ----------------------------------------------------------------------------
class AdminPoller:
    """Polls ``ListNodes`` every ``period_s`` on a thread; keeps a timeline (of changes).

    ``timeline`` holds ``(unix_time, {node_id: {reputation, quarantined, banned,
    probation}})`` and is also appended to ``path`` as JSONL.
    """

    def __init__(self, admin: str, path: Path, period_s: float = 0.2) -> None:
        import grpc

        from ftis.v1 import admin_pb2_grpc

        self.channel = grpc.insecure_channel(admin)
        self.stub = admin_pb2_grpc.AdminStub(self.channel)
        self.path, self.period_s = path, period_s
        self.timeline: list[tuple[float, dict[str, dict]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def poll(self) -> dict[str, dict]:
        import grpc

        from ftis.v1 import admin_pb2

        try:
            nodes = self.stub.ListNodes(admin_pb2.ListNodesRequest(), timeout=10).nodes
        except grpc.RpcError:
            return {}
        snap = {n.node_id: {"reputation": round(n.reputation, 4), "quarantined": n.quarantined,
                            "banned": n.banned, "probation": n.probation,
                            "accepted": n.bundles_accepted, "rejected": n.bundles_rejected}
                for n in nodes}
        now = time.time()
        changed = not self.timeline or self.timeline[-1][1] != snap
        self.timeline.append((now, snap))
        if changed:
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"time": now, "nodes": snap}) + "\n")
        return snap

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.poll()

    def start(self) -> AdminPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.poll()

    def node_details(self, node_id: str) -> dict:
        """GetNode: final state, rejections by code, evidence (newest first)."""
        import grpc
        from google.protobuf.json_format import MessageToDict

        from ftis.v1 import admin_pb2

        try:
            resp = self.stub.GetNode(admin_pb2.GetNodeRequest(node_id=node_id), timeout=10)
        except grpc.RpcError as exc:
            return {"error": exc.code().name}
        return MessageToDict(resp, preserving_proto_field_name=True)

    def stats(self) -> dict:
        from google.protobuf.json_format import MessageToDict

        from ftis.v1 import admin_pb2

        return MessageToDict(self.stub.Stats(admin_pb2.StatsRequest(), timeout=10),
                             preserving_proto_field_name=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.channel.close()


def first_flagged(timeline: list[tuple[float, dict[str, dict]]], node_id: str
                  ) -> tuple[float | None, float | None]:
    """First times ``node_id`` was seen quarantined and banned (``None``: never)."""
    q = b = None
    for t, snap in timeline:
        st = snap.get(node_id)
        if st is None:
            continue
        if q is None and st["quarantined"]:
            q = t
        if b is None and st["banned"]:
            b = t
    return q, b


def attacker_round_at(t: float, events: list[dict]) -> int:
    """The attacker's own round at time ``t`` (its latest logged round, at least 1)."""
    return max([int(e["round"]) for e in events if e["time"] <= t and e["round"] > 0],
               default=1)


def round_at(t: float, honest_runs: dict[str, list[dict]]) -> int:
    """Honest round during which time ``t`` fell: 1 + rounds the slower honest client
    had completed by then."""
    done = [sum(1 for r in recs if float(r["time"]) <= t) for recs in honest_runs.values()]
    return 1 + (min(done) if done else 0)


# -- one swarm ------------------------------------------------------------------------------
def _common_args(s: SecuritySettings, model: str) -> list[str]:
    return ["--model", model, "--rounds", str(s.rounds), "--local-groups", str(s.local_groups),
            "--external-groups", str(s.external_groups), "--group-size", str(s.group_size),
            "--max-new-tokens", str(s.max_new_tokens), "--method", "ftis",
            "--learning-rate", str(s.learning_rate), "--peft", "none"]


def _wait_registered(poller: AdminPoller, ids: list[str], timeout_s: float,
                     procs: dict[str, Any]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(i in poller.poll() for i in ids):
            return
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        if dead:
            raise LaunchError(f"clients exited before registering: {dead}")
        time.sleep(0.5)
    raise LaunchError(f"clients not registered after {timeout_s}s")


def run_swarm(settings: SecuritySettings, name: str, kinds: list[str], model: str,
              config: Path, on_progress: Any = None) -> dict:
    """One swarm: coordinator + 2 honest clients + one attacker per kind in ``kinds``.

    Returns the raw material for :func:`analyze` (also written to ``OUT/NAME/run.json``).
    """
    from ftis.protocol.identity import NodeIdentity

    run_dir = settings.out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    ids = {n: NodeIdentity.load_or_create(run_dir / n / "node_key.pem").node_id
           for n in [*HONEST, *(f"attacker-{k}" for k in kinds)]}
    common = _common_args(settings, model)
    t0 = time.time()
    config = swarm_config(config, run_dir, settings.audit_reporters,
                          [ids[n] for n in HONEST])
    proc, listen, admin = start_coordinator(run_dir, ["--config", str(config)])
    swarm = Swarm(out=run_dir, coordinator=proc, listen=listen, admin=admin)
    poller = AdminPoller(admin, run_dir / "timeline.jsonl", settings.poll_s)
    codes: dict[str, int | None] = {}
    go = run_dir / "go"
    try:
        for seed, k in enumerate(kinds, start=11):
            start_attacker(swarm, ClientSpec(f"attacker-{k}", [
                *common, "--seed", str(seed), "--wait-for", str(go),
                *settings.attack_args.get(k, [])]), k, settings.threads)
        for seed, n in enumerate(HONEST, start=1):
            start_attacker(swarm, ClientSpec(n, [*common, "--seed", str(seed),
                                                 "--wait-for", str(go)]), "honest",
                           settings.threads)
        _wait_registered(poller, list(ids.values()), 180, swarm.clients)
        go.touch()
        poller.start()
        deadline = time.monotonic() + settings.timeout_s
        honest = {n: swarm.clients[n] for n in HONEST}
        while any(p.poll() is None for p in honest.values()):
            if time.monotonic() > deadline:
                raise LaunchError(f"{name}: honest clients still running after "
                                  f"{settings.timeout_s}s")
            if on_progress is not None:
                done = min(len(read_metrics(run_dir / n / "metrics.jsonl")) for n in HONEST)
                on_progress(done)
            time.sleep(0.5)
        codes = {n: p.poll() for n, p in swarm.clients.items()}
        poller.stop()
        final = {i: poller.node_details(i) for i in poller.timeline[-1][1]} \
            if poller.timeline else {}
        stats = poller.stats()
    finally:
        poller.close()
        swarm.stop()
    raw = {"name": name, "kinds": kinds, "ids": ids, "exit_codes": codes,
           "wall_s": time.time() - t0, "stats": stats, "final": final,
           "timeline": poller.timeline}
    (run_dir / "run.json").write_text(json.dumps({k: v for k, v in raw.items()
                                                  if k != "timeline"}, indent=1, default=str))
    return raw


# -- analysis ---------------------------------------------------------------------------------
def honest_rewards(run_dir: Path) -> list[float]:
    """Mean verified reward per round over the honest clients (rounds all of them did)."""
    runs = [read_metrics(run_dir / n / "metrics.jsonl") for n in HONEST]
    n = min((len(r) for r in runs), default=0)
    return [statistics.fmean(float(r[i]["reward_mean"]) for r in runs) for i in range(n)]


def _codes(events: list[dict]) -> Counter[str]:
    c: Counter[str] = Counter()
    for e in events:
        if e["event"] in ("submit", "garbage", "register", "round_error"):
            c[e["code_name"]] += 1
        elif e["event"] == "flood":
            c.update({k: v for k, v in e["submit_codes"].items() if k != "OK"})
            c.update({f"lease:{k}": v for k, v in e["lease_codes"].items() if k != "OK"})
        elif e["event"] == "sybil":
            c.update({f"register:{k}": v for k, v in e["register_codes"].items()})
            c.update({f"lease:{k}": v for k, v in e["lease_codes"].items()})
    return c


def analyze(settings: SecuritySettings, raw: dict, baseline: list[float] | None) -> list[dict]:
    """One record per attacker of a swarm (see the module docstring for the fields)."""
    run_dir = settings.out / raw["name"]
    ids: dict[str, str] = raw["ids"]
    timeline = raw["timeline"]
    honest_runs = {n: read_metrics(run_dir / n / "metrics.jsonl") for n in HONEST}
    honest_ids = {ids[n] for n in HONEST}
    honest_events = {n: read_attack_log(run_dir / n / "attack.jsonl") for n in HONEST}
    # false positives
    flagged = sorted({i for _, snap in timeline for i, st in snap.items()
                      if i in honest_ids and (st["quarantined"] or st["banned"])})
    honest_rejected = sum(1 for ev in honest_events.values() for e in ev
                          if e["event"] == "submit" and e["code"] != 0)
    received = [(e, n) for n, ev in honest_events.items() for e in ev
                if e["event"] == "received"]
    rewards = honest_rewards(run_dir)
    out = []
    for kind in raw["kinds"]:
        name = f"attacker-{kind}"
        events = read_attack_log(run_dir / name / "attack.jsonl")
        main_id = ids[name]
        attacker_ids = {main_id}
        for e in events:
            if e["event"] == "sybil":
                attacker_ids.update(e["admitted"])
        q_t, b_t = first_flagged(timeline, main_id)
        flagged_t = min((t for t in (q_t, b_t) if t is not None), default=None)
        submits = [e for e in events if e["event"] == "submit"]
        accepted = [e for e in submits if e["code"] == 0]
        # flood rejections are logged in aggregate; garbage requests one by one
        n_submissions = len(submits) + sum(
            v for e in events if e["event"] == "flood"
            for k, v in e["submit_codes"].items() if k != "OK") + sum(
            1 for e in events if e["event"] == "garbage")
        bad_accepted = [e for e in accepted if e.get("variant") not in COVER_VARIANTS]
        # stored while quarantined: the heartbeats just before and after both said so
        quarantined_ids = {e["bundle_id"] for e in accepted
                           if e.get("quarantined_before") and e.get("quarantined_after")}
        edge_ids = {e["bundle_id"] for e in accepted
                    if e.get("quarantined_before") != e.get("quarantined_after")}
        used_senders = [s for recs in honest_runs.values() for r in recs
                        for s in r.get("external_senders", [])]
        groups_learned = sum(1 for s in used_senders if s in attacker_ids)
        learned_ids = {b for e, _ in received for b, s in zip(e["bundle_ids"], e["senders"],
                                                              strict=False)
                       if s in attacker_ids}
        learned_after = sum(1 for e, _ in received for s in e["senders"]
                            if s in attacker_ids and flagged_t is not None
                            and e["time"] > flagged_t)
        sybils = [e for e in events if e["event"] == "sybil"]
        sybil_flagged = sum(1 for i in attacker_ids - {main_id}
                            if any(t is not None for t in first_flagged(timeline, i)))
        final = raw["final"].get(main_id, {})
        node = final.get("node", {})
        evidence = Counter(ev.get("kind", "") for ev in final.get("evidence", []))
        codes = _codes(events)
        expected = EXPECTED_CODES.get(kind, set())
        seen = {c.split(":")[-1] for c in codes}
        rec = {
            "kind": kind, "run": raw["name"], "node_id": main_id,
            "rounds": settings.rounds,
            "quarantined_round": round_at(q_t, honest_runs) if q_t else None,
            "banned_round": round_at(b_t, honest_runs) if b_t else None,
            "detected_round": round_at(flagged_t, honest_runs) if flagged_t else None,
            "detected_attacker_round": attacker_round_at(flagged_t, events)
            if flagged_t else None,
            "quarantined_end": bool(node.get("quarantined", False)),
            "banned_end": bool(node.get("banned", False)),
            "reputation_end": float(node.get("reputation", 0.5)),
            "ban_reason": node.get("ban_reason", ""),
            "submissions": n_submissions, "accepted": len(accepted),
            "bad_accepted": len(bad_accepted),
            "accepted_while_quarantined": len(quarantined_ids),
            "codes": dict(codes), "expected_codes": sorted(expected),
            "expected_codes_seen": sorted(expected & seen),
            "coordinator_rejections": final.get("rejections_by_code", {}),
            "evidence_kinds": dict(evidence),
            "negative_feedback": sum(1 for ev in final.get("evidence", [])
                                     if ev.get("kind") == "feedback"
                                     and float(ev.get("weight", 0)) < 0),
            "evidence_bad_end": float(node.get("evidence_bad", 0.0)),
            "attacker_groups_learned": groups_learned,
            "attacker_groups_learned_after_detection": learned_after,
            "quarantined_bundles_learned": len(learned_ids & quarantined_ids),
            "quarantine_edge_bundles_learned": len(learned_ids & edge_ids),
            "released": bool(q_t) and not bool(node.get("quarantined", False))
            and not bool(node.get("banned", False)),
            "sybils_attempted": sum(e["attempted"] for e in sybils),
            "sybils_admitted": len(attacker_ids) - 1,
            "sybils_leased": sum(len(e["leased"]) for e in sybils),
            "sybils_flagged": sybil_flagged,
            "false_positive_nodes": flagged, "false_positives": len(flagged),
            "honest_rejected_bundles": honest_rejected,
            "honest_reward": rewards,
            "honest_reward_mean": statistics.fmean(rewards) if rewards else None,
            "baseline_reward_mean": statistics.fmean(baseline) if baseline else None,
            "exit_codes": raw["exit_codes"], "wall_s": round(raw["wall_s"], 1),
        }
        rec["verdict"] = verdict(rec)
        out.append(rec)
    return out


def verdict(rec: dict) -> str:
    """One phrase for the table (first match wins): ``HARMED HONEST NODES`` (a false
    positive or rejected honest bundles), ``banned``, ``quarantined``, ``quarantined,
    released``, ``throttled`` (sybil_burst, flooder), ``reports ignored``
    (false_reporter with false_report evidence; sybil_feedback that harmed nobody),
    ``rejected`` (every bad submission
    refused with an expected code), ``flagged by receivers`` (negative feedback or other
    bad evidence, still relayed), ``missed``."""
    kind = rec["kind"]
    if rec["false_positives"] or rec.get("honest_rejected_bundles"):
        return "HARMED HONEST NODES"
    if rec["banned_end"] or rec["banned_round"]:
        return "banned"
    if rec["quarantined_end"]:
        return "quarantined"
    if rec["quarantined_round"]:
        return "quarantined, released"
    if kind == "sybil_burst":
        return "throttled" if rec["codes"].get("register:REGISTRATION_THROTTLED") else "missed"
    if kind == "flooder":
        return "throttled" if rec["expected_codes_seen"] else "missed"
    if kind == "false_reporter":
        return "reports ignored" if rec.get("evidence_kinds", {}).get("false_report") \
            else "missed"
    if kind == "sybil_feedback":  # the ring's target is the honest nodes (checked above)
        return "reports ignored"
    if rec["submissions"] and rec["bad_accepted"] == 0 and rec["expected_codes_seen"]:
        return "rejected"
    if rec.get("negative_feedback") or rec.get("evidence_bad_end", 0.0) > 0:
        return "flagged by receivers"  # only feedback adds bad evidence to these kinds
    return "missed"


def load_raw(run_dir: Path) -> dict:
    """The raw record of a finished swarm from ``run.json`` and ``timeline.jsonl`` (the
    timeline file holds the polls at which something changed, enough for
    :func:`first_flagged`)."""
    raw = json.loads((run_dir / "run.json").read_text())
    path = run_dir / "timeline.jsonl"
    raw["timeline"] = [(r["time"], r["nodes"]) for r in map(json.loads, path.read_text(
        ).splitlines() if path.exists() else [])]
    return raw


def reanalyze(settings: SecuritySettings) -> list[dict]:
    """Rebuild ``results.*`` and the plot from the run folders under ``settings.out``."""
    baseline = None
    if (settings.out / "baseline" / "summary.json").exists():
        baseline = json.loads((settings.out / "baseline" / "summary.json").read_text())[
            "honest_reward"]
    records: list[dict] = []
    for group in settings.groups:
        run_dir = settings.out / "+".join(group)
        if (run_dir / "run.json").exists():
            records += analyze(settings, load_raw(run_dir), baseline)
    write_outputs(settings, records, baseline)
    return records


# -- outputs ----------------------------------------------------------------------------------
def _fmt_round(r: int | None, rounds: int) -> str:
    return "–" if r is None else (f"{r}" if r <= rounds else f">{rounds}")


def markdown_table(records: list[dict]) -> str:
    """One row per attacker."""
    head = ("| kind | verdict | detected: honest round / attacker round | attacker submissions: "
            "accepted / total | bad accepted | top rejection codes | attacker groups learned by "
            "honest (after detection) | quarantined bundles learned | honest nodes flagged | "
            "honest bundles rejected | honest reward (baseline) |")
    sep = "|" + "|".join(["---"] * 2 + ["---:"] * 9) + "|"
    rows = []
    for r in records:
        top = ", ".join(f"{k} ×{v}" for k, v in sorted(
            ((k, v) for k, v in r["codes"].items() if k not in ("OK",)),
            key=lambda kv: -kv[1])[:3]) or "–"
        if r["kind"] == "sybil_burst":
            top = (f"{r['sybils_admitted']}/{r['sybils_attempted']} sybils admitted, "
                   f"{r['sybils_leased']} leased; " + top)
        hr = r["honest_reward_mean"]
        br = r["baseline_reward_mean"]
        reward = "–" if hr is None else f"{hr:.3f}" + ("" if br is None else f" ({br:.3f})")
        detected = _fmt_round(r["detected_round"], r["rounds"])
        if r.get("detected_attacker_round"):
            detected += f" / {r['detected_attacker_round']}"
        rows.append(
            f"| {r['kind']} | {r['verdict']} | {detected} | "
            f"{r['accepted']} / {r['submissions']} | {r['bad_accepted']} | {top} | "
            f"{r['attacker_groups_learned']} ({r['attacker_groups_learned_after_detection']}) | "
            f"{r['quarantined_bundles_learned']} | {r['false_positives']} | "
            f"{r.get('honest_rejected_bundles', 0)} | {reward} |")
    return "\n".join([head, sep, *rows])


def plot_rewards(records: list[dict], baseline: list[float] | None, path: Path) -> Path:
    """Small multiples: honest mean reward per round, attack run vs attack-free baseline."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(records), 1)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), dpi=110,
                             sharex=True, sharey=True, squeeze=False)
    for ax, rec in zip(axes.flat, records, strict=False):
        ys = rec["honest_reward"]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", ms=3, label="with attacker")
        if baseline:
            ax.plot(range(1, len(baseline) + 1), baseline, ls="--", color="gray",
                    label="baseline")
        if rec["detected_round"]:
            ax.axvline(rec["detected_round"], color="red", alpha=0.4, lw=1)
        ax.set_title(f"{rec['kind']} ({rec['verdict']})", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(records):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.supxlabel("honest round")
    fig.supylabel("honest mean verified reward")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_outputs(settings: SecuritySettings, records: list[dict],
                  baseline: list[float] | None) -> dict[str, Path]:
    out = settings.out
    with open(out / "results.jsonl", "w") as fh:
        if baseline is not None:
            fh.write(json.dumps({"kind": "baseline", "honest_reward": baseline,
                                 "honest_reward_mean": statistics.fmean(baseline)
                                 if baseline else None}) + "\n")
        for r in records:
            fh.write(json.dumps(r, default=str) + "\n")
    table = markdown_table(records)
    (out / "results.md").write_text(
        f"# Security experiment ({settings.rounds} honest rounds per run)\n\n{table}\n\n"
        "detected: honest round during which the admin API first showed the attacker "
        "quarantined or banned. Rewards: honest learners' mean verified reward over all "
        "rounds (attack-free baseline in parentheses).\n")
    paths = {"results": out / "results.jsonl", "table": out / "results.md"}
    paths["plot"] = plot_rewards(records, baseline, out / "rewards.png")
    return paths


# -- entry point ------------------------------------------------------------------------------
def prepare(settings: SecuritySettings) -> tuple[str, Path]:
    """The model path and coordinator config, building defaults under ``out``."""
    settings.out.mkdir(parents=True, exist_ok=True)
    model = settings.model
    if model is None:
        from ftis.client.models.tiny import build_tiny_model

        path = settings.out / "tiny-model"
        if not (path / "config.json").exists():
            build_tiny_model(path, seed=0)
        model = str(path)
    config = settings.config
    if config is None:
        config = settings.out / "coordinator.json"
        config.write_text(json.dumps({"tasks": [{"dataset": "letter_counting"}],
                                      "task_seed": 1}))
    return model, config


def run_security_experiment(settings: SecuritySettings, console: Any = None) -> list[dict]:
    """Run the baseline and every group of ``settings``; write the outputs; return records."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    model, config = prepare(settings)
    (settings.out / "settings.json").write_text(json.dumps(asdict(settings), default=str,
                                                           indent=1))
    runs: list[tuple[str, list[str]]] = ([("baseline", [])] if settings.baseline else []) + [
        ("+".join(g), g) for g in settings.groups]
    records: list[dict] = []
    baseline: list[float] | None = None
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        overall = progress.add_task("runs", total=len(runs))
        for name, kinds in runs:
            task = progress.add_task(f"{name}", total=settings.rounds)
            raw = run_swarm(settings, name, kinds, model, config,
                            on_progress=lambda d, t=task: progress.update(t, completed=d))
            progress.update(task, completed=settings.rounds)
            if not kinds:
                baseline = honest_rewards(settings.out / name)
                fp = sorted({i for _, snap in raw["timeline"] for i, st in snap.items()
                             if st["quarantined"] or st["banned"]})
                (settings.out / name / "summary.json").write_text(json.dumps(
                    {"honest_reward": baseline, "flagged_nodes": fp}))
            else:
                records += analyze(settings, raw, baseline)
            progress.advance(overall)
    if baseline is None and (settings.out / "baseline" / "summary.json").exists():
        baseline = json.loads((settings.out / "baseline" / "summary.json").read_text())[
            "honest_reward"]
    for r in records:
        if baseline and r["baseline_reward_mean"] is None:
            r["baseline_reward_mean"] = statistics.fmean(baseline)
    write_outputs(settings, records, baseline)
    return records
