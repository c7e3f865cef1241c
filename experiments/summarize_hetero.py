"""Summarise heterogeneous-swarm experiment folders for docs/results.md.

Usage: python experiments/summarize_hetero.py runs/hetero_family runs/hetero_quant ...

Per (setting, method, client), over seeds: mean verified reward of own rollouts, held-out
greedy pass@1 at the start and the end, peak RSS (max over rounds and seeds, MiB), and
what came from the other client: external groups used, how many were cross-tokenizer,
and the mean importance weight on them.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from ftis.lab.experiment.matrix import mean_sd
from ftis.lab.experiment.report import read_metrics

_rows = read_metrics


def summarize(folder: Path) -> str:
    cfg = json.loads((folder / "config.json").read_text())
    by_key: dict[tuple[str, str], dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for metrics in sorted(folder.glob("cells/*/*/metrics.jsonl")):
        cell, client = metrics.parent.parent.name, metrics.parent.name
        method = cell.split("__")[2]
        rows = _rows(metrics)
        if len(rows) < cfg["rounds"]:  # unfinished cell
            continue
        d = by_key[(method, client)]
        d["reward"].append(statistics.mean(r["reward_mean"] for r in rows))
        d["rss"].append(max(r.get("peak_rss_mb", 0.0) for r in rows))
        d["external"].append(sum(r.get("external_groups_used", 0.0) for r in rows))
        d["cross"].append(sum(r.get("external_cross_tokenizer_groups", 0.0) for r in rows))
        d["weights"] += [r["external_is_weight_mean"] for r in rows
                         if r.get("external_groups_used") and "external_is_weight_mean" in r]
        d["round_s"] += [r["round_seconds"] for r in rows]
        d["raw_max"] += [r["external_is_weight_raw_max"] for r in rows
                         if r.get("external_groups_used") and "external_is_weight_raw_max" in r]
        d["trunc"] += [r["external_truncated_frac"] for r in rows
                       if r.get("external_groups_used") and "external_truncated_frac" in r]
        evals = metrics.parent / "eval.jsonl"
        if evals.exists():
            ev = _rows(evals)
            d["eval_start"].append(ev[0]["eval_heldout"])
            d["eval_end"].append(ev[-1]["eval_heldout"])
    lines = [f"**{cfg['name']}** ({cfg['rounds']} rounds, seeds {cfg['seeds']})", "",
             "| method | client | mean reward | held-out pass@1 start → end | peak RSS (MiB) "
             "| external groups used (cross-tokenizer) | mean weight on external tokens "
             "| max raw ratio | truncated token share | median round s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (method, client), d in sorted(by_key.items()):
        weights = f"{statistics.mean(d['weights']):.3g}" if d["weights"] else "-"
        raw = f"{max(d['raw_max']):.3g}" if d["raw_max"] else "-"
        trunc = f"{statistics.mean(d['trunc']):.3f}" if d["trunc"] else "-"
        lines.append(
            f"| {method} | {client} | {mean_sd(d['reward'])} | {mean_sd(d['eval_start'])} → "
            f"{mean_sd(d['eval_end'])} | {max(d['rss']):.0f} | {sum(d['external']):.0f} "
            f"({sum(d['cross']):.0f}) | {weights} | {raw} | {trunc} "
            f"| {statistics.median(d['round_s']):.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(summarize(Path(arg)))
