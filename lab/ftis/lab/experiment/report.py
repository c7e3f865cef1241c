"""Markdown tables and PNG reward curves from clients' ``metrics.jsonl`` logs."""

from __future__ import annotations

import json
import math
from pathlib import Path

COLUMNS = [
    ("round", "round", "{:d}"),
    ("reward_mean", "mean verified reward", "{:.3f}"),
    ("tokens_per_second", "tokens/s", "{:.0f}"),
    ("is_weight_mean", "IS weight mean", "{:.3f}"),
    ("is_weight_max", "IS weight max", "{:.3f}"),
    ("filtered_frac", "filtered share", "{:.3f}"),
    ("external_groups_used", "external groups", "{:.0f}"),
    ("external_is_weight_mean", "ext. IS weight mean", "{:.3f}"),
    ("external_is_weight_max", "ext. IS weight max", "{:.3f}"),
    ("external_filtered_frac", "ext. filtered share", "{:.3f}"),
    ("round_seconds", "round s", "{:.1f}"),
]


def read_metrics(path: Path) -> list[dict]:
    """Records of a ``metrics.jsonl`` file (a resumed client's repeated rounds: last wins)."""
    by_round: dict[int, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                by_round[int(rec["round"])] = rec
    return [by_round[k] for k in sorted(by_round)]


def markdown_table(records: list[dict]) -> str:
    head = "| " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    sep = "|" + "|".join("---:" for _ in COLUMNS) + "|"
    rows = []
    for r in records:
        cells = []
        for key, _, fmt in COLUMNS:
            v = r.get(key)
            if v is None:
                cells.append("–")
            else:
                cells.append(fmt.format(int(v) if fmt == "{:d}" else float(v)))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *rows])


def reward_side_by_side(runs: dict[str, list[dict]]) -> str:
    """One row per round, one reward column per client."""
    names = list(runs)
    rounds = sorted({int(r["round"]) for recs in runs.values() for r in recs})
    head = "| round | " + " | ".join(names) + " |"
    sep = "|---:|" + "|".join("---:" for _ in names) + "|"
    rows = []
    for k in rounds:
        cells = []
        for n in names:
            rec = next((r for r in runs[n] if int(r["round"]) == k), None)
            cells.append(f"{rec['reward_mean']:.3f}" if rec else "–")
        rows.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *rows])


def plot_rewards(runs: dict[str, list[dict]], path: Path, title: str = "") -> Path:
    """PNG of mean verified reward per round, one line per client."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for name, recs in runs.items():
        xs = [int(r["round"]) for r in recs]
        ys = [float(r["reward_mean"]) for r in recs]
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("round")
    ax.set_ylabel("mean verified reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ------------------------------------------------------------------ arms analysis
# Seed-paired comparisons of experiment arms (see ftis.lab.experiment.matrix): the
# gates' filtered/truncated shares per arm, contrasts with a sign-flip test, a bootstrap
# interval and Holm's adjustment, and the paired seeds needed for a target power.

#: methods whose update differs from NoIS only where the gates act
GATED_METHODS = ("tis", "ftis")
#: below this share of filtered completions and truncated tokens, F-TIS/TIS/NoIS compute
#: nearly the same update: an arm's comparison with them cannot tell the methods apart
GATE_IDLE_SHARE = 0.01
#: client label of contrasts on the mean over a pairing's learners
POOLED = "learners (mean)"
NOT_YET_RUN = "not yet run"
METRIC_LABELS = {"eval_heldout": "held-out greedy pass@1",
                 "eval_heldout_sampled": "held-out sampled pass@1",
                 "eval_ood": "OOD greedy pass@1", "eval_ood_sampled": "OOD sampled pass@1"}


def metric_label(metric: str) -> str:
    """Readable name of an ``eval.jsonl`` key (the key itself when unknown)."""
    return METRIC_LABELS.get(metric, metric)

ARMS_COLUMNS = ["pairing", "arm", "method", "I-J", "client", "seeds", "{metric} start",
                "{metric} end", "mean reward", "ext. groups / round", "ext. filtered share",
                "ext. truncated share", "max raw ratio", "gates"]
CONTRAST_COLUMNS = ["pairing", "client", "contrast", "n", "mean difference",
                    "95 % bootstrap CI", "p (sign-flip)", "p (Holm)",
                    "family-wise 95 % CI (sign-flip)", "note"]
#: family-wise coverage of the contrasts' simultaneous sign-flip intervals
FAMILY_LEVEL = 0.95
POWER_COLUMNS = ["pairing", "client", "contrast", "n", "sd of paired difference",
                 "paired seeds needed"]
DIVERGENCE_COLUMNS = ["pairing", "arm", "method", "client", "cells",
                      "ext. k1 (nats/token), mean of cells", "cell means, min–max",
                      "largest round mean", "rounds with mean > δ = {delta:g}",
                      "ext. filtered share per cell, min–max", "seed of the largest share"]


def mean_sd(values: list[float]) -> str:
    """``mean ± sd`` to 3 decimals (the value alone for one, ``–`` for none)."""
    import statistics

    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def default_contrasts(arms: list[tuple[str, int]]) -> list[tuple[str, str]]:
    """``(arm, baseline)`` pairs from ``(name, external groups)`` of the arms: every arm
    with J > 0 against ``alone_batch_matched``, then ``ftis`` vs ``tis``, ``tis`` vs
    ``nois`` and ``ftis`` vs ``ftis_old_gate``, each where both arms exist."""
    names = [n for n, _ in arms]
    out = []
    if "alone_batch_matched" in names:
        out += [(n, "alone_batch_matched") for n, j in arms if j > 0]
    for a, b in (("ftis", "tis"), ("tis", "nois"), ("ftis", "ftis_old_gate")):
        if a in names and b in names:
            out.append((a, b))
    return out


def final_values(evals: list[dict], metric: str) -> dict[tuple, dict[int, tuple]]:
    """``{(pairing, arm, client): {seed: (start, end)}}`` of ``metric``: the value at
    round 0 (``None`` without one) and at the last evaluation that has the metric."""
    by: dict[tuple, dict[int, list[dict]]] = {}
    for e in evals:
        if metric in e:
            key = arm_key(e)
            by.setdefault(key, {}).setdefault(int(e["seed"]), []).append(e)
    out: dict[tuple, dict[int, tuple]] = {}
    for key, seeds in by.items():
        for seed, recs in seeds.items():
            recs = sorted(recs, key=lambda r: int(r["round"]))
            start = float(recs[0][metric]) if int(recs[0]["round"]) == 0 else None
            out.setdefault(key, {})[seed] = (start, float(recs[-1][metric]))
    return out


def pooled(ends: dict[tuple, dict[int, tuple]], pairing: str, arm: str,
           clients: list[str]) -> dict[int, float]:
    """Per seed, the mean end value over ``clients`` (seeds where every client has one)."""
    per = [ends.get((pairing, arm, c), {}) for c in clients]
    seeds = set.intersection(*(set(p) for p in per)) if per else set()
    return {s: sum(p[s][1] for p in per) / len(per) for s in sorted(seeds)}


def arm_key(r: dict) -> tuple:
    """``(pairing, arm, client)`` of a result or evaluation row (older rows name the
    method instead of the arm)."""
    return (r["pairing"], r.get("arm", r.get("method")), r["client"])


def gate_shares(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """Per ``(pairing, arm, client)``, over the rounds that used external groups: mean
    ``external_filtered_frac`` (completions) and ``external_truncated_frac`` (tokens),
    the largest raw ratio and the mean divergence; absent for arms without them."""
    acc: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        if not r.get("external_groups_used"):
            continue
        key = arm_key(r)
        d = acc.setdefault(key, {"filtered": [], "truncated": [], "raw_max": [],
                                 "divergence": []})
        for name, field in (("filtered", "external_filtered_frac"),
                            ("truncated", "external_truncated_frac"),
                            ("raw_max", "external_is_weight_raw_max"),
                            ("divergence", "external_divergence_mean")):
            if r.get(field) is not None:
                d[name].append(float(r[field]))
    out = {}
    for key, d in acc.items():
        out[key] = {"rounds": float(max(len(v) for v in d.values())),
                    "filtered": sum(d["filtered"]) / len(d["filtered"]) if d["filtered"]
                    else 0.0,
                    "truncated": sum(d["truncated"]) / len(d["truncated"]) if d["truncated"]
                    else 0.0,
                    "raw_max": max(d["raw_max"]) if d["raw_max"] else float("nan"),
                    "divergence": sum(d["divergence"]) / len(d["divergence"])
                    if d["divergence"] else float("nan")}
    return out


def divergence_rows(rows: list[dict], delta: float) -> dict[tuple, dict[str, float]]:
    """How far the external completions were from the learner, per ``(pairing, arm,
    client)``, over the rounds that used external groups.

    Args:
        rows: per-round learner records with ``seed``, ``external_groups_used``,
            ``external_k1_mean`` (mean over the round's external completions of their k1
            mean, ``log pi_gen - log pi_learner`` per token, nats/token; DESIGN.md
            section 4) and ``external_filtered_frac`` (share of external completions the
            gate zeroed). Rounds without ``external_k1_mean`` are left out.
        delta: threshold in nats/token; the rounds whose mean is above it are counted
            (the new gate's default δ: ``ftis.client.learner.config``).

    Returns:
        ``{key: {"cells", "k1_mean" (mean of the cells' means), "k1_min", "k1_max" (the
        cells' means), "round_max" (largest round mean), "rounds_over", "rounds",
        "filtered_min", "filtered_max" (the cells' mean filtered shares) and
        "filtered_max_seed"}}``; absent for arms without external groups.
    """
    import statistics

    cells: dict[tuple, dict[int, dict[str, list[float]]]] = {}
    for r in rows:
        k1 = r.get("external_k1_mean")
        if not r.get("external_groups_used") or k1 is None:
            continue
        key = arm_key(r)
        cell = cells.setdefault(key, {}).setdefault(int(r["seed"]),
                                                    {"k1": [], "filtered": []})
        cell["k1"].append(float(k1))
        cell["filtered"].append(float(r.get("external_filtered_frac") or 0.0))
    out = {}
    for key, seeds in cells.items():
        k1_means = [statistics.mean(c["k1"]) for c in seeds.values()]
        filtered = {s: statistics.mean(c["filtered"]) for s, c in seeds.items()}
        top = max(filtered, key=lambda s: (filtered[s], -s))
        rounds = [v for c in seeds.values() for v in c["k1"]]
        out[key] = {"cells": len(seeds), "k1_mean": statistics.mean(k1_means),
                    "k1_min": min(k1_means), "k1_max": max(k1_means),
                    "round_max": max(rounds), "rounds_over": sum(v > delta for v in rounds),
                    "rounds": len(rounds), "filtered_min": min(filtered.values()),
                    "filtered_max": filtered[top], "filtered_max_seed": top}
    return out


def gates_idle(shares: dict[str, float] | None) -> bool:
    """True when both the filtered and the truncated share are under 1 %
    (:data:`GATE_IDLE_SHARE`), or there were no external groups at all."""
    if not shares:
        return True
    return shares["filtered"] < GATE_IDLE_SHARE and shares["truncated"] < GATE_IDLE_SHARE


def paired_contrasts(items: list[dict], seed: int = 0) -> list[dict]:
    """Seed-paired comparisons, Holm-adjusted over all of them.

    Args:
        items: dicts with ``after`` and ``before`` (``{seed: value}``: the arm and its
            baseline) and any labels (``pairing``, ``client``, ``arm``, ``baseline``,
            ``note``), which are kept.

    Returns:
        One dict per item: the labels, ``n`` (seeds in both), ``diff`` (mean of
        ``after - before``), ``ci_low``/``ci_high`` (95 % paired bootstrap; ``None``
        below 2 pairs, where resampling one pair only gives back its own difference),
        ``sd_diff``, ``p`` (two-sided sign-flip test, exact up to 16 seeds),
        ``p_holm`` (``None`` where there is no pair yet) and ``fw_low``/``fw_high``:
        the exact sign-flip interval at ``(1 - FAMILY_LEVEL) / m`` for ``m`` items
        (:func:`~ftis.lab.experiment.stats.sign_flip_interval`), so that all of them
        hold together with probability at least :data:`FAMILY_LEVEL` (Bonferroni);
        infinite where ``n`` pairs are too few to reject at that level, ``None``
        without pairs or above 16 pairs.

    The Holm family is every item, tested or not: an item without pairs counts as
    p = 1. The contrasts are fixed before the run, so a table made while cells are
    still missing adjusts over the whole pre-registered family (conservative) instead of
    over whichever contrasts happen to have finished.
    """
    from ftis.lab.experiment.stats import (
        EXACT_MAX_PAIRS,
        holm,
        paired_comparison,
        sign_flip_interval,
    )

    out = []
    fw_alpha = (1 - FAMILY_LEVEL) / max(1, len(items))
    for it in items:
        seeds = sorted(set(it["after"]) & set(it["before"]))
        row = {k: v for k, v in it.items() if k not in ("after", "before")}
        row.update(n=len(seeds), diff=None, ci_low=None, ci_high=None, sd_diff=None, p=None,
                   p_holm=None, fw_low=None, fw_high=None)
        if seeds:
            before = [it["before"][s] for s in seeds]
            after = [it["after"][s] for s in seeds]
            res = paired_comparison(before, after, seed=seed)
            row.update(diff=res.diff, sd_diff=res.sd_diff, p=res.p_value)
            if res.n > 1:
                row.update(ci_low=res.ci_low, ci_high=res.ci_high)
            if res.n <= EXACT_MAX_PAIRS:
                fw = sign_flip_interval(before, after, alpha=fw_alpha)
                row.update(fw_low=fw[0], fw_high=fw[1])
        out.append(row)
    adjusted = holm([1.0 if r["p"] is None else r["p"] for r in out])
    for r, adj in zip(out, adjusted, strict=True):
        if r["p"] is not None:
            r["p_holm"] = adj
    return out


def seeds_needed(sd_diff: float, effect: float, power: float, alpha: float,
                 family: int) -> int:
    """Paired seeds to detect ``effect`` with ``power`` when Holm runs over ``family``
    contrasts: :func:`~ftis.lab.experiment.stats.pairs_for_power` at ``alpha / family``,
    the level of Holm's first step (so the power holds for every contrast)."""
    from ftis.lab.experiment.stats import pairs_for_power

    return pairs_for_power(sd_diff, effect, alpha=alpha / family, power=power)


def power_rows(results: list[dict], effect: float, power: float, alpha: float,
               family: int) -> list[dict]:
    """:func:`seeds_needed` for each contrast with ``n >= 2`` (``None`` where sd is 0)."""
    out = []
    for r in results:
        if r["n"] >= 2 and r["sd_diff"] is not None:
            need = (seeds_needed(r["sd_diff"], effect, power, alpha, family)
                    if r["sd_diff"] > 0 else None)
            out.append({**r, "needed": need})
    return out


def _contrast_label(r: dict) -> str:
    return f"{r['arm']} − {r['baseline']}"


def _fmt(v: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if v is None else fmt.format(v)


def _head(columns: list[str], metric: str, right_from: int) -> list[str]:
    cols = [c.format(metric=metric_label(metric)) for c in columns]
    return ["| " + " | ".join(cols) + " |",
            "|" + "|".join("---" if i < right_from else "---:" for i in range(len(cols)))
            + "|"]


def placeholder(columns: list[str], metric: str = "held-out pass@1",
                right_from: int = 0) -> str:
    """A table with ``columns`` and one row saying "not yet run"."""
    cells = [NOT_YET_RUN] + ["–"] * (len(columns) - 1)
    return "\n".join([*_head(columns, metric, right_from), "| " + " | ".join(cells) + " |"])


def arms_table(arm_rows: list[dict], metric: str) -> str:
    """Markdown: one row per (pairing, arm, client) of the learners.

    ``arm_rows`` items: ``pairing``, ``arm``, ``method``, ``mix``, ``client``, ``ends``
    (``{seed: (start, end)}``), ``rewards`` (per-seed mean reward) and ``shares``
    (:func:`gate_shares` or ``None``), and ``ext_groups`` (external groups used per
    round, mean over rounds and seeds; below J when partners fell behind or finished
    early). The gates column says **cannot tell the methods
    apart** for a TIS/F-TIS arm whose filtered and truncated shares are both under 1 %.
    """
    if not arm_rows:
        return placeholder(ARMS_COLUMNS, metric, 5)
    lines = _head(ARMS_COLUMNS, metric, 5)
    for r in arm_rows:
        ends = r["ends"]
        starts = [v[0] for v in ends.values() if v[0] is not None]
        sh = r["shares"]
        if not sh:
            gates = filt = trunc = raw = "–"
        else:
            raw = f"{sh['raw_max']:.3g}"
            if r["method"] in GATED_METHODS:
                filt, trunc = f"{sh['filtered']:.4f}", f"{sh['truncated']:.4f}"
                gates = ("**cannot tell the methods apart** (both < 1 %)" if gates_idle(sh)
                         else "fired")
            else:
                filt = trunc = "n/a"
                gates = f"n/a ({r['method']} has no gate)"
        seeds = max(len(ends), len(r["rewards"]))
        lines.append(f"| {r['pairing']} | {r['arm']} | {r['method']} | {r['mix']} | "
                     f"{r['client']} | {seeds} | {mean_sd(starts)} | "
                     f"{mean_sd([v[1] for v in ends.values()])} | {mean_sd(r['rewards'])} | "
                     f"{_fmt(r.get('ext_groups'), '{:.2f}')} | {filt} | {trunc} | {raw} | "
                     f"{gates} |")
    return "\n".join(lines)


def divergence_columns(delta: float) -> list[str]:
    """:data:`DIVERGENCE_COLUMNS` with the threshold ``delta`` (nats/token) filled in."""
    return [c.format(delta=delta) if "{delta" in c else c for c in DIVERGENCE_COLUMNS]


def divergence_table(div_rows: list[dict], delta: float) -> str:
    """Markdown: one row per ``(pairing, arm, client)`` with external groups, from
    :func:`divergence_rows` (items also carry ``pairing``, ``arm``, ``method`` and
    ``client``). Filtered shares are "n/a" for methods without a gate; the seed of the
    largest share is "– (none)" where no cell filtered anything."""
    columns = divergence_columns(delta)
    if not div_rows:
        return placeholder(columns, right_from=4)
    lines = _head(columns, "", 4)
    for r in div_rows:
        if r["method"] in GATED_METHODS:
            filt = f"{r['filtered_min']:.4f}–{r['filtered_max']:.4f}"
            seed = f"{r['filtered_max_seed']}" if r["filtered_max"] > 0 else "– (none)"
        else:
            filt, seed = "n/a", f"n/a ({r['method']} has no gate)"
        lines.append(f"| {r['pairing']} | {r['arm']} | {r['method']} | {r['client']} | "
                     f"{r['cells']} | {r['k1_mean']:.3f} | "
                     f"{r['k1_min']:.3f}–{r['k1_max']:.3f} | {r['round_max']:.3f} | "
                     f"{r['rounds_over']} of {r['rounds']} | {filt} | {seed} |")
    return "\n".join(lines)


def contrasts_table(results: list[dict], metric: str) -> str:
    """Markdown: one row per contrast (``arm − baseline`` of ``metric``, seed-paired)."""
    if not results:
        return placeholder(CONTRAST_COLUMNS, metric, 3)
    lines = _head(CONTRAST_COLUMNS, metric, 3)
    m = len(results)
    lines[0] = (lines[0].replace("p (Holm)", f"p (Holm, m = {m})")
                .replace("CI (sign-flip) |", f"CI (sign-flip, {1 - FAMILY_LEVEL:.2f}/{m} each) |"))
    for r in results:
        ci = ("–" if r["ci_low"] is None
              else f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]")
        lines.append(f"| {r['pairing']} | {r['client']} | {_contrast_label(r)} | {r['n']} | "
                     f"{_fmt(r['diff'], '{:+.3f}')} | {ci} | {_fmt(r['p'])} | "
                     f"{_fmt(r['p_holm'])} | {_family_interval(r)} | {r.get('note') or ''} |")
    return "\n".join(lines)


def _family_interval(r: dict) -> str:
    """``[low, high]`` of :func:`paired_contrasts`' ``fw_low``/``fw_high``, "unbounded
    (n = k)" where that many pairs cannot reject at the family's level, "–" without."""
    low, high = r.get("fw_low"), r.get("fw_high")
    if low is None or high is None:
        return "–"
    if math.isinf(low):
        return f"unbounded (n = {r['n']})"
    return f"[{low:+.3f}, {high:+.3f}]"


def power_line(rows: list[dict], metric: str, effect: float, power: float, alpha: float,
               family: int) -> str:
    """One sentence: the largest number of paired seeds any contrast needs."""
    label = metric_label(metric)
    needs = [r for r in rows if r["needed"] is not None]
    if not needs:
        return (f"Seeds needed for {label}: no contrast has two or more paired seeds "
                "with a non-zero spread yet.")
    worst = max(needs, key=lambda r: r["needed"])
    return (f"To detect a difference of {effect:.2f} in {label} with {power:.0%} power, "
            f"two-sided, Holm over {family} contrasts (first step at alpha "
            f"{alpha}/{family} = {alpha / family:.4f}): up to {worst['needed']} paired seeds "
            f"({_contrast_label(worst)}, {worst['pairing']}: sd of the paired difference "
            f"{worst['sd_diff']:.3f} from n = {worst['n']}).")


def power_table(rows: list[dict], metric: str, effect: float, power: float, alpha: float,
                family: int) -> str:
    """Markdown: per contrast the observed sd of the paired difference and the paired
    seeds needed (:func:`seeds_needed`), then :func:`power_line`."""
    if not rows:
        return placeholder(POWER_COLUMNS, metric, 3)
    lines = _head(POWER_COLUMNS, metric, 3)
    for r in rows:
        lines.append(f"| {r['pairing']} | {r['client']} | {_contrast_label(r)} | {r['n']} | "
                     f"{r['sd_diff']:.3f} | "
                     f"{'–' if r['needed'] is None else r['needed']} |")
    return "\n".join([*lines, "", power_line(rows, metric, effect, power, alpha, family)])
