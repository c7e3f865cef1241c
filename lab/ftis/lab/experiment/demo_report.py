"""What ``make demo`` concludes, computed from the clients' logs (pure, no I/O).

Each demo client evaluates its policy on the same held-out prompts before its first
update and after its last one (``eval.jsonl`` lines with per-prompt rewards). This
module pairs the two evaluations prompt by prompt and tests the change:

* the **primary** metric, fixed before any demo was run: sampled pass@1 (the mean
  reward of k completions per prompt at the training temperature) of the full
  fine-tune client, two-sided sign-flip test over prompts
  (:func:`~ftis.lab.experiment.stats.paired_comparison`);
* secondary, for every client: greedy pass@1 with McNemar's exact test, and the
  sampled metric with the same paired test as the primary.

Nothing is corrected for the secondary tests; they are reported, not claimed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from ftis.lab.experiment.stats import mcnemar_exact, paired_comparison

ALPHA = 0.05


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average: element ``i`` is the mean of ``values[max(0, i-w+1):i+1]``.

    Raises:
        ValueError: if ``window < 1``.
    """
    if window < 1:
        raise ValueError("window must be >= 1")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += float(v)
        if i >= window:
            total -= float(values[i - window])
        out.append(total / min(i + 1, window))
    return out


def first_and_last_eval(evals: list[dict]) -> tuple[dict, dict]:
    """The evaluation at round 0 (before any update) and the one of the highest round.

    Raises:
        ValueError: if there is no round-0 evaluation or no later one.
    """
    by_round = {int(e["round"]): e for e in evals}
    if 0 not in by_round:
        raise ValueError("no evaluation before training (round 0)")
    last = max(by_round)
    if last == 0:
        raise ValueError("no evaluation after training")
    return by_round[0], by_round[last]


def client_comparison(evals: list[dict], set_name: str = "heldout") -> dict:
    """Greedy (McNemar) and sampled (sign-flip) before/after comparisons of one client.

    Args:
        evals: the client's ``eval.jsonl`` records (``per_prompt[set_name]`` holds
            ``greedy`` and ``sampled`` lists over the same prompts in each record).

    Returns:
        ``{"rounds": [0, R], "greedy": {...}, "sampled": {...}}`` with means, counts,
        interval and p-values (``sampled`` is absent when no samples were drawn).

    Raises:
        ValueError: as :func:`first_and_last_eval`, or when the two evaluations cover
            different numbers of prompts.
    """
    before, after = first_and_last_eval(evals)
    b, a = before["per_prompt"][set_name], after["per_prompt"][set_name]
    if len(b["greedy"]) != len(a["greedy"]):
        raise ValueError("before and after evaluations cover different prompts")
    mc = mcnemar_exact([x == 1.0 for x in b["greedy"]], [x == 1.0 for x in a["greedy"]])
    out: dict = {
        "rounds": [int(before["round"]), int(after["round"])],
        "greedy": {"metric": "greedy pass@1", "test": "McNemar exact, two-sided",
                   **asdict(mc)},
    }
    if b.get("sampled") and a.get("sampled"):
        pc = paired_comparison(b["sampled"], a["sampled"])
        out["sampled"] = {"metric": "sampled pass@1", "test": "paired sign-flip, two-sided",
                          **asdict(pc)}
    return out


def demo_conclusion(per_client: dict[str, dict], primary: str, samples: int,
                    temperature: float) -> dict:
    """The ``heldout`` block of ``report.json`` from the primary client's comparison.

    Returns:
        ``{"metric", "client", "before", "after", "diff", "ci95", "n_prompts", "p_value",
        "test", "significant"}``; ``significant`` is ``p < 0.05`` and ``after > before``.

    Raises:
        KeyError: if the primary client has no sampled comparison.
    """
    s = per_client[primary]["sampled"]
    return {
        "metric": f"sampled pass@1 (k={samples}, T={temperature:g}), exact-match reward",
        "client": primary,
        "before": s["before"],
        "after": s["after"],
        "diff": s["diff"],
        "ci95": [s["ci_low"], s["ci_high"]],
        "n_prompts": s["n"],
        "p_value": s["p_value"],
        "test": s["test"],
        "significant": bool(s["p_value"] < ALPHA and s["after"] > s["before"]),
    }
