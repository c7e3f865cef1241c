"""Markdown tables and PNG reward curves from clients' ``metrics.jsonl`` logs."""

from __future__ import annotations

import json
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
