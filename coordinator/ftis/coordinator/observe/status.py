"""The read-only status page: what it shows, computed from the database, and its HTML.

:func:`build_status` reads only through the bounded, read-only :class:`State` queries
(``list_nodes``, ``swarm_counts`` and the history methods: at most
:data:`~ftis.coordinator.state.base.HISTORY_MAX_ROWS` newest rows per table) and returns
plain data: the charts (x in unix seconds, one y array per series, at most
:data:`MAX_POINTS` buckets), the nodes table and the quarantine and ban events.
:func:`render_page` turns it into server-rendered HTML; ``static/status.js`` draws the
charts with the vendored uPlot and refreshes the page in place every
:data:`REFRESH_S` seconds.

What the page never carries: envelopes, completion or prompt text, public keys,
tokenizers, proofs, evidence details written from a request (only coordinator-written
reasons: evidence kinds, error code names, ban reasons), full model paths (the base
model's last path component only).

Reputation over time is reconstructed from the stored standing and the evidence rows of
the window, backwards (``good`` and ``bad`` only decay between events, so the value
before an event is the value after it minus its weights, grown back by the decay), and
the quarantine flag is replayed forwards over the window with the policy in force
(:func:`ftis.coordinator.reputation.next_quarantined`). A policy change re-evaluates
nodes without an evidence row; a node whose replayed flag differs from the stored one
gets a "policy re-evaluation" event at its last standing update.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ftis.coordinator import reputation
from ftis.coordinator.handlers.context import REPUTATION_SETTING
from ftis.coordinator.reputation import ReputationConfig
from ftis.coordinator.state.base import EvidenceRecord, NodeRecord, State
from ftis.protocol.errors import code_name
from ftis.v1 import bundle_pb2

#: Default history window of the page (``/?window=SECONDS`` changes it).
DEFAULT_WINDOW_S = 6 * 3600
MIN_WINDOW_S, MAX_WINDOW_S = 60, 30 * 86400
#: Time buckets per chart at most.
MAX_POINTS = 120
#: Nodes drawn as their own line (reputation, learner metrics) at most.
MAX_NODE_SERIES = 12
#: Rows of the nodes table and of the events table at most.
MAX_TABLE_NODES = 200
MAX_EVENTS = 100
#: The page reloads its data in place this often (seconds).
REFRESH_S = 10
#: Accepted and rejected rates are averaged over this trailing window (or one bucket).
RATE_WINDOW_MS = 60_000
#: A node seen within this window counts as active.
ACTIVE_WINDOW_MS = 5 * 60 * 1000
#: Learner metrics the clients report (``ftis-client`` round metrics), charted per node.
LEARNER_METRICS = (
    ("reward_mean", "verified reward (local groups)"),
    ("is_weight_mean", "importance-weight mean"),
    ("truncated_frac", "truncated share"),
    ("filtered_frac", "filtered share (F-TIS gate)"),
)
_PROOF_KINDS = (reputation.TEXT_MISMATCH, reputation.PROMPT_MISMATCH)
_SIZE_TOKEN = re.compile(r"^\d+(\.\d+)?[kmbt]$")
_FAMILY_DROP = {"instruct", "it", "chat", "base", "hf"}
_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9 ._:/+@()-]")


def policy_of(state: State, default: ReputationConfig) -> ReputationConfig:
    """The reputation policy in force: the stored one (admin-set), else ``default``."""
    try:
        stored = state.get_setting(REPUTATION_SETTING)
        if stored:
            return ReputationConfig.from_dict(json.loads(stored))
    except (ValueError, TypeError):
        pass
    return default


def _card(node: NodeRecord) -> bundle_pb2.ModelCard:
    card = bundle_pb2.ModelCard()
    try:
        card.ParseFromString(node.model_card)
    except Exception:  # a card that no longer parses shows as unknown
        card = bundle_pb2.ModelCard()
    return card


def model_name(base_model: str) -> str:
    """The base model's last path component (no local paths on the page)."""
    name = base_model.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    return safe_label(name) or "unknown"


def model_family(base_model: str) -> str:
    """The model family of a model card's base model: its name without size and
    instruct suffixes, lowercased (``HuggingFaceTB/SmolLM2-135M-Instruct`` ->
    ``smollm2``, ``google/gemma-3-270m`` -> ``gemma-3``)."""
    name = model_name(base_model).lower()
    parts = [p for p in re.split(r"[-_]", name)
             if p and not _SIZE_TOKEN.match(p) and p not in _FAMILY_DROP]
    return "-".join(parts) or name


def safe_label(text: str, limit: int = 40) -> str:
    """A chart label from user-chosen text: a safe character set, bounded length."""
    return _LABEL_UNSAFE.sub("", text)[:limit].strip()


def node_label(node: NodeRecord) -> str:
    name = safe_label(node.display_name, 24)
    return f"{node.node_id[:8]} {name}".strip()


def node_state(node: NodeRecord, policy: ReputationConfig) -> str:
    if node.banned:
        return "banned"
    if node.quarantined:
        return "quarantined"
    if reputation.in_probation(node.bundles_accepted, node.audit_status, policy):
        return "probation"
    return "ok"


# -- reputation reconstruction ----------------------------------------------------------
@dataclass(frozen=True)
class _Anchor:
    """Evidence (good, bad) at ``at_ms``; between anchors it only decays."""

    at_ms: int
    good: float
    bad: float


def _groups(rows: list[EvidenceRecord]) -> list[tuple[int, list[EvidenceRecord]]]:
    """Consecutive rows of one time (one transaction's events), oldest first."""
    out: list[tuple[int, list[EvidenceRecord]]] = []
    for r in rows:
        if out and out[-1][0] == r.at_ms:
            out[-1][1].append(r)
        else:
            out.append((r.at_ms, [r]))
    return out


_RESET_AMOUNT = re.compile(r"bad evidence ([0-9.eE+-]+) reset")


def _grow(value: float, dt_ms: int, half_life_s: float) -> float:
    """``value`` at an earlier time, ``dt_ms`` before (the inverse of decay)."""
    return value / reputation.decay_factor(dt_ms, half_life_s) if dt_ms > 0 else value


def _clean(value: float, scale: float) -> float:
    return 0.0 if value < 1e-9 * max(1.0, scale) else value


@dataclass
class _History:
    """One node's reconstructed evidence: ``before`` (the standing just before its first
    event of the window) and one anchor per event group (the standing after it)."""

    before: _Anchor
    after: list[_Anchor]

    def score_at(self, t_ms: int, half_life_s: float) -> float:
        anchor = self.before
        for a in self.after:
            if a.at_ms <= t_ms:
                anchor = a
            else:
                break
        f = reputation.decay_factor(t_ms - anchor.at_ms, half_life_s) if t_ms >= anchor.at_ms \
            else 1.0 / reputation.decay_factor(anchor.at_ms - t_ms, half_life_s)
        return reputation.score(anchor.good * f, anchor.bad * f)


def reconstruct(node: NodeRecord, groups: list[tuple[int, list[EvidenceRecord]]],
                half_life_s: float) -> _History:
    """Backwards from the stored standing over the window's event groups."""
    good, bad, at = node.rep_good, node.rep_bad, node.rep_updated_ms
    after: list[_Anchor] = []
    for t, rows in reversed(groups):
        good, bad = _grow(good, at - t, half_life_s), _grow(bad, at - t, half_life_s)
        after.append(_Anchor(t, good, bad))
        if len(rows) == 1 and rows[0].kind == reputation.OPERATOR_RESET:
            m = _RESET_AMOUNT.search(rows[0].detail)
            bad = float(m.group(1)) if m else 0.0
        else:
            pos = sum(r.weight for r in rows if r.weight > 0)
            neg = -sum(r.weight for r in rows if r.weight < 0)
            good, bad = _clean(good - pos, good), _clean(bad - neg, bad)
        at = t
    after.reverse()
    return _History(_Anchor(at, good, bad), after)


def _worst_reason(rows: list[EvidenceRecord]) -> str:
    worst = min(rows, key=lambda r: r.weight)
    detail = worst.detail if worst.kind != reputation.FEEDBACK else worst.detail.split(":")[0]
    return f"{worst.kind}: {detail}"[:200] if detail else worst.kind


def quarantine_events(node: NodeRecord, history: _History,
                      groups: list[tuple[int, list[EvidenceRecord]]],
                      policy: ReputationConfig) -> list[dict[str, Any]]:
    """Quarantine entries and releases of one node within the window (forward replay)."""
    bundles_in_window = sum(1 for _, rows in groups for r in rows
                            if r.kind in reputation.BUNDLE_KINDS)
    verified = max(node.bundles_accepted - bundles_in_window, 0)
    start = history.before
    quarantined = (reputation.score(start.good, start.bad)
                   < reputation.threshold(verified, policy))
    events = []
    for (t, rows), anchor in zip(groups, history.after, strict=True):
        if len(rows) == 1 and rows[0].kind == reputation.OPERATOR_RESET:
            if quarantined:
                events.append({"at_ms": t, "node": node, "event": "released",
                               "reason": "operator unban: bad evidence reset"})
            quarantined = False
            continue
        verified += sum(1 for r in rows if r.kind in reputation.BUNDLE_KINDS)
        value = reputation.score(anchor.good, anchor.bad)
        now_q = reputation.next_quarantined(quarantined, value, verified, policy)
        if now_q != quarantined:
            limit = reputation.threshold(verified, policy)
            events.append({
                "at_ms": t, "node": node, "event": "quarantined" if now_q else "released",
                "reason": (f"score {value:.3f} < {limit:.2f} after {_worst_reason(rows)}"
                           if now_q else f"score recovered to {value:.3f}")})
        quarantined = now_q
    if quarantined != node.quarantined and not node.banned:
        events.append({"at_ms": node.rep_updated_ms, "node": node,
                       "event": "quarantined" if node.quarantined else "released",
                       "reason": "policy re-evaluation (or before the window)"})
    return events


# -- the page's data ------------------------------------------------------------------------
def _grid(since_ms: int, now_ms: int) -> tuple[int, list[int]]:
    span = max(now_ms - since_ms, 1000)
    bucket = max(1000, math.ceil(span / MAX_POINTS))
    count = max(1, math.ceil(span / bucket))
    return bucket, [since_ms + k * bucket for k in range(count)]


def _chart(chart_id: str, title: str, unit: str, x: list[float],
           series: Sequence[tuple[str, Sequence[float | None]]], kind: str = "line",
           note: str = "", x_label: str = "") -> dict[str, Any]:
    """One chart: ``x`` in unix seconds unless ``x_label`` names another axis."""
    return {"id": chart_id, "title": title, "unit": unit, "kind": kind, "note": note,
            "x_time": not x_label, "x_label": x_label, "x": x,
            "series": [{"label": label, "values": values} for label, values in series]}


def _round(v: float | None, digits: int = 4) -> float | None:
    return None if v is None or not math.isfinite(v) else round(v, digits)


def build_status(state: State, policy: ReputationConfig, now_ms: int,
                 window_s: int = DEFAULT_WINDOW_S) -> dict[str, Any]:
    """Everything the page shows (plain data, JSON-ready)."""
    window_s = min(max(int(window_s), MIN_WINDOW_S), MAX_WINDOW_S)
    nodes = state.list_nodes()
    counts = state.swarm_counts(now_ms, ACTIVE_WINDOW_MS)
    by_id = {n.node_id: n for n in nodes}
    earliest = min((n.registered_at_ms for n in nodes), default=now_ms)
    since = max(now_ms - window_s * 1000, earliest - 1000)
    bucket, starts = _grid(since, now_ms)
    index = {s: k for k, s in enumerate(starts)}
    x = [s / 1000.0 for s in starts]
    n_b = len(starts)
    cards = {n.node_id: _card(n) for n in nodes}
    family = {nid: model_family(c.base_model) for nid, c in cards.items()}

    # verified reward per dataset and per model family
    rewards = state.reward_history(since, bucket)
    sums: dict[tuple[str, str], list[list[float]]] = defaultdict(
        lambda: [[0.0] * n_b, [0.0] * n_b])
    accepted_window = 0
    for r in rewards:
        k = index.get(r.start_ms)
        if k is None:
            continue
        accepted_window += r.bundles
        for group in (("dataset", r.dataset), ("family", family.get(r.node_id, "unknown"))):
            sums[group][0][k] += r.reward_sum
            sums[group][1][k] += r.completions

    def reward_series(kind: str) -> list[tuple[str, list[float | None]]]:
        return [(safe_label(name) or "?", [_round(s / c) if c else None for s, c in zip(*v,
                                                                                         strict=True)])
                for (k, name), v in sorted(sums.items()) if k == kind]

    # verdicts per minute, by code: the average over the trailing RATE_WINDOW_MS (or
    # one bucket, if longer), as Prometheus' rate() would show it
    verdicts = state.verdict_history(since, bucket)
    counts_by_code: dict[int, list[float]] = {0: [0.0] * n_b}
    rejected_window: dict[str, int] = defaultdict(int)
    for v in verdicts:
        k = index.get(v.start_ms)
        if k is None:
            continue
        counts_by_code.setdefault(v.code, [0.0] * n_b)[k] += v.count
        if v.code:
            rejected_window[code_name(v.code)] += v.count
    span = max(1, round(max(RATE_WINDOW_MS, bucket) / bucket))
    per_min = 60_000.0 / (span * bucket)
    rate_series = []
    for code, values in sorted(counts_by_code.items()):
        trailing, total = [], 0.0
        for k, c in enumerate(values):
            total += c - (values[k - span] if k >= span else 0.0)
            trailing.append(_round(total * per_min, 3))
        rate_series.append(("accepted" if code == 0 else code_name(code), trailing))

    # reputation: distribution now, each node's score over time, quarantine events
    half_life = policy.half_life_s
    scores_now = {n.node_id: reputation.current_score(n.standing, now_ms, half_life)
                  for n in nodes}
    bins = [0.0] * 10
    for nid, s in scores_now.items():
        if not by_id[nid].banned:
            bins[min(int(s * 10), 9)] += 1
    evidence = state.evidence_since(since)
    per_node: dict[str, list[EvidenceRecord]] = defaultdict(list)
    for e in evidence:
        per_node[e.node_id].append(e)
    events: list[dict[str, Any]] = []
    histories = {}
    for nid, rows in per_node.items():
        node = by_id.get(nid)
        if node is None:
            continue
        groups = _groups(rows)
        histories[nid] = reconstruct(node, groups, half_life)
        events.extend(quarantine_events(node, histories[nid], groups, policy))
    for node in nodes:
        if node.node_id not in histories and node.quarantined and not node.banned:
            events.append({"at_ms": node.rep_updated_ms, "node": node, "event": "quarantined",
                           "reason": "before the window"})
        if node.banned:
            proofs = [e for e in per_node.get(node.node_id, []) if e.kind in _PROOF_KINDS]
            at = proofs[0].at_ms if proofs and node.ban_reason.startswith("proof") else None
            events.append({"at_ms": at, "node": node, "event": "banned",
                           "reason": node.ban_reason[:200] or "banned"})
    shown_rep = sorted(histories, key=lambda nid: (
        not (by_id[nid].quarantined or by_id[nid].banned), -by_id[nid].last_seen_ms))
    shown_rep = shown_rep[:MAX_NODE_SERIES]
    ends = [min(s + bucket, now_ms) for s in starts]
    rep_series = []
    for nid in shown_rep:
        node, hist = by_id[nid], histories[nid]
        rep_series.append((node_label(node), [
            _round(hist.score_at(t, half_life)) if t >= node.registered_at_ms else None
            for t in ends]))
    if rep_series:
        rep_series.append((f"quarantine threshold {policy.quarantine_threshold:g}",
                           [policy.quarantine_threshold] * n_b))

    # learner metrics per node against the client's round (its reported step), the
    # newest report of each step range when there are more than MAX_POINTS steps
    keys = tuple(k for k, _ in LEARNER_METRICS)
    reports = [p for p in state.metrics_history(since, keys) if p.node_id in by_id]
    last_report: dict[str, int] = {}
    for p in reports:
        last_report[p.node_id] = p.at_ms
    shown_learner = sorted(last_report, key=lambda nid: -last_report[nid])[:MAX_NODE_SERIES]
    shown_set = set(shown_learner)
    steps = sorted({p.step for p in reports if p.node_id in shown_set})
    lo = steps[0] if steps else 0
    stride = max(1, math.ceil((steps[-1] - lo + 1) / MAX_POINTS)) if steps else 1
    step_keys = sorted({(st - lo) // stride for st in steps})
    step_index = {k: i for i, k in enumerate(step_keys)}
    step_x = [float(lo + k * stride) for k in step_keys]
    learner: dict[str, dict[str, list[float | None]]] = defaultdict(
        lambda: {k: [None] * len(step_x) for k in keys})
    for p in reports:
        if p.node_id in shown_set:
            i = step_index[(p.step - lo) // stride]
            for name, value in p.values.items():
                learner[p.node_id][name][i] = _round(value)

    charts = [
        _chart("reward_dataset", "Verified reward by dataset", "mean reward", x,
               reward_series("dataset")),
        _chart("reward_family", "Verified reward by model family", "mean reward", x,
               reward_series("family")),
        _chart("verdict_rates", "Bundles accepted and rejected, by code", "per minute", x,
               rate_series, note=f"averaged over the trailing "
                                 f"{span * bucket / 1000:g} s"),
        _chart("reputation_hist", "Reputation distribution (now, banned nodes excluded)",
               "nodes", [i / 10 + 0.05 for i in range(10)], [("nodes", bins)], kind="bars",
               x_label="score"),
        _chart("reputation_nodes", "Reputation of each node over time", "score", x, rep_series,
               note=f"{len(histories)} nodes with evidence in the window; "
                    f"{len(rep_series) - 1 if rep_series else 0} drawn"),
    ]
    for key, title in LEARNER_METRICS:
        charts.append(_chart(
            f"learner_{key}", f"Learner: {title}", key, step_x,
            [(node_label(by_id[nid]), learner[nid][key]) for nid in shown_learner],
            x_label="round (client step)",
            note=f"reports in the window of {len(last_report)} nodes; "
                 f"{len(shown_learner)} drawn" + (f"; every {stride} steps" if stride > 1
                                                  else "")))

    def age(ms: int | None) -> str:
        if not ms:
            return "-"
        s = max(0.0, (now_ms - ms) / 1000)
        return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 \
            else f"{s / 3600:.1f}h ago"

    table = []
    for n in sorted(nodes, key=lambda n: -n.last_seen_ms)[:MAX_TABLE_NODES]:
        card = cards[n.node_id]
        metrics = n.latest_metrics
        table.append({
            "node_id": n.node_id, "name": n.display_name[:64],
            "model": model_name(card.base_model), "family": family[n.node_id],
            "peft": card.peft or "-", "parameters": int(card.parameter_count),
            "state": node_state(n, policy), "reputation": round(scores_now[n.node_id], 4),
            "accepted": n.bundles_accepted, "rejected": n.bundles_rejected,
            "mismatches": n.reward_mismatches, "last_seen": age(n.last_seen_ms),
            "step": n.latest_metrics_step,
            "reward_mean": _round(metrics.get("reward_mean")),
        })
    events.sort(key=lambda e: -(e["at_ms"] or 0))
    event_rows = [{"at": age(e["at_ms"]) if e["at_ms"] else "-",
                   "at_ms": e["at_ms"], "node_id": e["node"].node_id,
                   "name": e["node"].display_name[:64], "event": e["event"],
                   "reason": e["reason"]} for e in events[:MAX_EVENTS]]
    return {
        "generated_at_ms": now_ms, "window_s": window_s, "since_ms": since,
        "bucket_s": bucket / 1000.0, "refresh_s": REFRESH_S,
        "summary": {
            "nodes": counts.nodes, "active": counts.active_nodes,
            "quarantined": counts.quarantined_nodes, "banned": counts.banned_nodes,
            "leases_outstanding": counts.leases_outstanding,
            "leases_expired": counts.leases_expired,
            "accepted_window": accepted_window,
            "rejected_window": sum(rejected_window.values()),
            "rejected_by_code": dict(sorted(rejected_window.items())),
        },
        "policy": {"quarantine_threshold": policy.quarantine_threshold,
                   "probation_threshold": policy.probation_threshold,
                   "probation_bundles": policy.probation_bundles,
                   "half_life_s": policy.half_life_s},
        "charts": charts, "nodes": table, "nodes_total": len(nodes), "events": event_rows,
    }


# -- HTML ---------------------------------------------------------------------------------
def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _json_script(data: Any) -> str:
    """JSON safe inside ``<script type="application/json">`` (no ``</script>``)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _window_links(current: int) -> str:
    options = [(900, "15 min"), (3600, "1 h"), (6 * 3600, "6 h"), (86400, "24 h"),
               (7 * 86400, "7 days")]
    return " ".join(
        f'<a href="?window={s}"{" class=on" if s == current else ""}>{label}</a>'
        for s, label in options)


def render_page(status: dict[str, Any]) -> str:
    """The status page (server-rendered; charts drawn by ``static/status.js``)."""
    s = status["summary"]
    tiles = [("nodes", s["nodes"]), ("active (5 min)", s["active"]),
             ("quarantined", s["quarantined"]), ("banned", s["banned"]),
             ("bundles accepted (window)", s["accepted_window"]),
             ("bundles rejected (window)", s["rejected_window"]),
             ("leases outstanding", s["leases_outstanding"]),
             ("leases expired", s["leases_expired"])]
    tile_html = "".join(f'<div class="tile"><b>{_e(v)}</b><span>{_e(k)}</span></div>'
                        for k, v in tiles)
    chart_html = "".join(
        f'<section class="chart" id="chart-{_e(c["id"])}" data-chart="{_e(c["id"])}">'
        f'<h3>{_e(c["title"])}</h3><div class="plot"></div>'
        f'<p class="note">{_e(c["note"])}</p></section>' for c in status["charts"])
    cols = ["node", "name", "model", "family", "peft", "state", "reputation", "accepted",
            "rejected", "mismatches", "last seen", "step", "reward"]
    rows = "".join(
        f'<tr data-node-id="{_e(n["node_id"])}" class="st-{_e(n["state"])}">'
        f'<td class="mono" title="{_e(n["node_id"])}">{_e(n["node_id"][:16])}</td>'
        f'<td>{_e(n["name"])}</td><td>{_e(n["model"])}</td><td>{_e(n["family"])}</td>'
        f'<td>{_e(n["peft"])}</td><td>{_e(n["state"])}</td><td>{n["reputation"]:.3f}</td>'
        f'<td>{n["accepted"]}</td><td>{n["rejected"]}</td><td>{n["mismatches"]}</td>'
        f'<td>{_e(n["last_seen"])}</td><td>{n["step"]}</td>'
        f'<td>{_num(n["reward_mean"])}</td></tr>'
        for n in status["nodes"])
    more = status["nodes_total"] - len(status["nodes"])
    more_html = f'<p class="note">{more} more nodes not shown</p>' if more > 0 else ""
    ev_rows = "".join(
        f'<tr class="ev-{_e(e["event"])}"><td>{_e(e["at"])}</td>'
        f'<td class="mono" title="{_e(e["node_id"])}">{_e(e["node_id"][:16])}</td>'
        f'<td>{_e(e["name"])}</td><td>{_e(e["event"])}</td><td>{_e(e["reason"])}</td></tr>'
        for e in status["events"]) or '<tr><td colspan="5">none in this window</td></tr>'
    codes = ", ".join(f"{_e(k)}: {v}" for k, v in s["rejected_by_code"].items()) or "none"
    p = status["policy"]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>FTIS coordinator status</title>
<link rel="stylesheet" href="static/uplot/uPlot.min.css">
<link rel="stylesheet" href="static/status.css">
<noscript><meta http-equiv="refresh" content="{REFRESH_S * 3}"></noscript>
</head><body>
<main id="status" data-generated-at="{status['generated_at_ms']}">
<header><h1>FTIS coordinator</h1>
<p>window: {_window_links(status['window_s'])} &middot; bucket {status['bucket_s']:g} s
&middot; refreshes every {status['refresh_s']} s &middot;
<span id="updated">updated {_e(_utc(status['generated_at_ms']))}</span></p></header>
<div class="tiles">{tile_html}</div>
<p class="note">rejections in the window by code: {codes}. Policy: quarantine below
{p['quarantine_threshold']:g} ({p['probation_threshold']:g} on probation, first
{p['probation_bundles']} bundles), evidence half-life {p['half_life_s']:g} s.</p>
<div class="charts">{chart_html}</div>
<h2>Quarantine and ban events</h2>
<table id="events"><thead><tr><th>when</th><th>node</th><th>name</th><th>event</th>
<th>reason</th></tr></thead><tbody>{ev_rows}</tbody></table>
<h2>Nodes ({status['nodes_total']})</h2>
<table id="nodes"><thead><tr>{''.join(f'<th>{c}</th>' for c in cols)}</tr></thead>
<tbody>{rows}</tbody></table>{more_html}
<script type="application/json" id="status-data">{_json_script(status_for_page(status))}</script>
</main>
<script src="static/uplot/uPlot.iife.min.js"></script>
<script src="static/status.js"></script>
</body></html>
"""


def status_for_page(status: dict[str, Any]) -> dict[str, Any]:
    """The part of the status the page's script needs (the charts)."""
    return {"generated_at_ms": status["generated_at_ms"], "refresh_s": status["refresh_s"],
            "charts": status["charts"]}


def _utc(ms: int) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
