"""Tables of MERIT's four-way experiment from its raw rows (``results.jsonl`` of
:func:`ftis.lab.merit.experiment.run_merit`); pure functions, markdown out.

* :func:`family_table`: held-out pass@1 per arm × family (mean ± sd over seeds), the
  base model first (every arm's start), then joint, each split merged, each of its
  branches alone, and each split's branches on their own families (``*_own``: a family
  scored by the branch that trained it), with the mean over families.
* :func:`samples_table`: completions and tokens each arm trained on (equal by design).
* :func:`complete_seeds`: what every table reads: the seeds with all arms finished.
* :func:`contrast_results`: the pre-registered contrasts on the mean over families,
  paired by seed: bootstrap CI, sign-flip p, Holm
  (:func:`ftis.lab.experiment.report.paired_contrasts`).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from ftis.lab.experiment import report
from ftis.lab.merit.experiment import SPLITS, MeritExperimentConfig

#: the contrasts' pairing and client columns (the matrix's table has them)
PAIRING, CLIENT = "merit", "mean over families"
SAMPLES_COLUMNS = ["arm", "cells per seed", "seeds", "planned completions",
                   "accepted completions", "completion tokens", "merge weights"]


def complete_seeds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` without the seeds that are not finished: a seed counts once it has the
    joint model's and every split's merged model's evaluations (a run in progress, or
    committed part way through a seed, leaves the others out of every table, so that each
    table's n is the same seeds). Rows without a seed (the base model) are kept."""
    have: dict[int, set[tuple[str, str]]] = defaultdict(set)
    for r in rows:
        if r.get("kind") == "eval" and r.get("seed") is not None:
            have[r["seed"]].add((r["arm"], r["model"]))
    need = {("joint", "joint"), *((arm, "merged") for arm in SPLITS)}
    done = {s for s, got in have.items() if need <= got}
    return [r for r in rows if r.get("seed") is None or r["seed"] in done]


def metric_label(cfg: MeritExperimentConfig) -> str:
    return f"held-out {cfg.primary} pass@1"


def _mean_sd(values: list[float]) -> str:
    return report.mean_sd(values)


def arm_values(cfg: MeritExperimentConfig, rows: list[dict[str, Any]], arm: str,
               model: str | None = None) -> dict[int, dict[str, float]]:
    """``{seed: {family: pass@1}}`` of one arm (``cfg.primary``).

    Args:
        arm: ``base`` (the same values for every seed that has any result), ``joint``,
            a split (its merged model, or ``model`` = ``b0``, ``b1``, ... for one
            branch alone) or ``<split>_own`` (each family from the branch that trained
            it).
    """
    evals = [r for r in rows if r.get("kind") == "eval"]
    key = cfg.primary
    out: dict[int, dict[str, float]] = defaultdict(dict)
    if arm == "base":
        seeds = {r["seed"] for r in rows if r.get("seed") is not None}
        base = {r["family"]: float(r[key]) for r in evals if r["arm"] == "base"}
        return {s: dict(base) for s in sorted(seeds)} if base else {}
    if arm.endswith("_own"):
        split = arm[: -len("_own")]
        trained = {(r["seed"], r["model"]): set(r["families"]) for r in rows
                   if r.get("kind") == "train" and r["arm"] == split}
        for r in evals:
            if r["arm"] == split and r["family"] in trained.get((r["seed"], r["model"]), ()):
                out[r["seed"]][r["family"]] = float(r[key])
        return dict(out)
    want = model or ("joint" if arm == "joint" else "merged")
    for r in evals:
        if r["arm"] == arm and r["model"] == want and r.get(key) is not None:
            out[r["seed"]][r["family"]] = float(r[key])
    return dict(out)


def mean_over_families(values: dict[int, dict[str, float]], families: list[str]
                       ) -> dict[int, float]:
    """Per seed, the mean over ``families`` (seeds that lack one are left out)."""
    return {s: statistics.fmean(v[f] for f in families) for s, v in values.items()
            if all(f in v for f in families)}


def _rows_of_table(cfg: MeritExperimentConfig, rows: list[dict[str, Any]]
                   ) -> list[tuple[str, dict[int, dict[str, float]]]]:
    """``(label, values)`` per table row, in the table's order (rows without values are
    left out)."""
    out = [("base (start of every arm)", arm_values(cfg, rows, "base")),
           ("joint", arm_values(cfg, rows, "joint"))]
    for split in SPLITS:
        out.append((f"{split} split, merged", arm_values(cfg, rows, split)))
        branches = sorted({r["model"] for r in rows if r.get("kind") == "train"
                           and r["arm"] == split})
        for b in branches:
            fams = sorted({f for r in rows if r.get("kind") == "train" and r["arm"] == split
                           and r["model"] == b for f in r["families"]})
            out.append((f"{split} {b} alone ({', '.join(fams)})",
                        arm_values(cfg, rows, split, model=b)))
        out.append((f"{split} branches, each on its own families",
                    arm_values(cfg, rows, f"{split}_own")))
    return [(label, v) for label, v in out if v]


def family_table(cfg: MeritExperimentConfig, rows: list[dict[str, Any]]) -> str:
    """Markdown: held-out pass@1 (``cfg.primary``) per arm × family and the mean over
    families, mean ± sd over seeds; "not yet run" without rows."""
    families = [t.dataset for t in cfg.families]
    columns = ["arm", "seeds", *families, "mean over families"]
    body = _rows_of_table(cfg, rows)
    if not body:
        return report.placeholder(columns, metric_label(cfg), 1)
    ns = {r["family"]: r["n"] for r in rows if r.get("kind") == "eval"}
    head = ["| " + " | ".join(["arm", "seeds", *[f"{f} (n = {ns.get(f, '?')})"
                                                  for f in families],
                               "mean over families"]) + " |",
            "|---|" + "|".join("---:" for _ in columns[1:]) + "|"]
    lines = list(head)
    for label, values in body:
        cells = [_mean_sd([v[f] for v in values.values() if f in v]) for f in families]
        means = list(mean_over_families(values, families).values())
        lines.append(f"| {label} | {len(values)} | " + " | ".join(cells)
                     + f" | {_mean_sd(means)} |")
    return "\n".join(lines)


def samples_table(cfg: MeritExperimentConfig, rows: list[dict[str, Any]]) -> str:
    """Markdown: per arm, what it trained on, mean over seeds (equal samples check)."""
    train = [r for r in rows if r.get("kind") == "train"]
    if not train:
        return report.placeholder(SAMPLES_COLUMNS, metric_label(cfg), 1)
    lines = ["| " + " | ".join(SAMPLES_COLUMNS) + " |",
             "|---|" + "|".join("---:" for _ in SAMPLES_COLUMNS[1:]) + "|"]
    weights: dict[str, list[list[float]]] = defaultdict(list)
    for r in rows:
        if r.get("kind") == "merge":
            weights[r["arm"]].append(r["weights"])
    for arm in ("joint", *SPLITS):
        per_seed: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        cells: dict[int, int] = defaultdict(int)
        for r in train:
            if r["arm"] == arm:
                d = per_seed[r["seed"]]
                for k in ("planned_completions", "completions", "completion_tokens"):
                    d[k] += float(r[k])
                cells[r["seed"]] += 1
        if not per_seed:
            continue

        def col(k: str, per_seed: dict = per_seed) -> str:
            return _mean_sd([d[k] for d in per_seed.values()])

        w = weights.get(arm)
        shown = ("–" if not w else " / ".join(
            f"{statistics.fmean(x[i] for x in w):.3f}" for i in range(len(w[0]))))
        lines.append(f"| {arm} | {max(cells.values())} | {len(per_seed)} | "
                     f"{col('planned_completions')} | {col('completions')} | "
                     f"{col('completion_tokens')} | {shown} |")
    return "\n".join(lines)


def contrast_results(cfg: MeritExperimentConfig, rows: list[dict[str, Any]]
                     ) -> list[dict[str, Any]]:
    """The config's contrasts on the mean over families, seed-paired and Holm-adjusted
    together (:func:`ftis.lab.experiment.report.paired_contrasts`)."""
    families = [t.dataset for t in cfg.families]
    items = [{"pairing": PAIRING, "client": CLIENT, "arm": c.arm, "baseline": c.baseline,
              "after": mean_over_families(arm_values(cfg, rows, c.arm), families),
              "before": mean_over_families(arm_values(cfg, rows, c.baseline), families),
              "note": ""} for c in cfg.contrasts]
    return report.paired_contrasts(items)


def tables(cfg: MeritExperimentConfig, rows: list[dict[str, Any]]) -> dict[str, str]:
    """``{"families", "samples", "contrasts", "power", "power_line"}`` markdown, over the
    finished seeds only (:func:`complete_seeds`)."""
    rows = complete_seeds(rows)
    results = contrast_results(cfg, rows)
    p = cfg.power
    family = p.family_size or max(len(results), 1)
    power = report.power_rows(results, p.effect, p.power, p.alpha, family)
    label = metric_label(cfg)
    return {"families": family_table(cfg, rows), "samples": samples_table(cfg, rows),
            "contrasts": (report.contrasts_table(results, label) if rows
                          else report.placeholder(report.CONTRAST_COLUMNS, label, 3)),
            "power": report.power_table(power, label, p.effect, p.power, p.alpha, family),
            "power_line": report.power_line(power, label, p.effect, p.power, p.alpha,
                                            family)}
