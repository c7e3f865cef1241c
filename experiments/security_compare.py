"""Side by side: two security-experiment runs (``ftis-lab security-experiment``'s
``results.jsonl``), one row per attack kind, as the markdown table in
docs/security-results.md ("Audit-based probation on").

    python experiments/security_compare.py \\
        experiments/results/security-audit-2026-11-24/noaudit \\
        experiments/results/security-audit-2026-11-24/audit
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(folder: Path) -> dict[str, dict]:
    """Per attack kind, its record in ``folder/results.jsonl``."""
    return {r["kind"]: r for r in map(json.loads, (folder / "results.jsonl").open())}


def table(base: dict[str, dict], new: dict[str, dict]) -> str:
    """Markdown: verdict, attacker groups honest learners trained on, honest nodes
    flagged, honest bundles rejected and honest reward, base → new."""
    lines = ["| kind | verdict | attacker groups learned by honest | honest nodes flagged "
             "| honest bundles rejected | honest reward |",
             "|---|---|---:|---:|---:|---:|"]
    for kind in base:
        b, n = base[kind], new.get(kind)
        if n is None or "verdict" not in b:  # the attack-free baseline's record
            continue
        lines.append(
            f"| {kind} | {b['verdict']} → {n['verdict']} | "
            f"{b['attacker_groups_learned']} → {n['attacker_groups_learned']} | "
            f"{b['false_positives']} → {n['false_positives']} | "
            f"{b['honest_rejected_bundles']} → {n['honest_rejected_bundles']} | "
            f"{b['honest_reward_mean']:.3f} → {n['honest_reward_mean']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    print(table(load(Path(argv[0])), load(Path(argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
