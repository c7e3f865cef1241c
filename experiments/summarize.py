"""Regenerate the tables of docs/results.md from committed raw experiment results.

Usage::

    python experiments/summarize.py --collect runs/ftis_methods   # copy raw results in
    python experiments/summarize.py                               # rewrite the tables
    python experiments/summarize.py --check                       # exit 1 if stale

Raw results live in ``experiments/results/ID/`` (``--results``): the run's
``config.json``, ``results.jsonl`` (one line per cell, client and round) and
``evals.jsonl`` (held-out evaluations, with per-prompt rewards), as written by
``ftis-lab experiment --out RUN``; ``--collect RUN`` copies them there, ``ID`` being
the config's ``id`` (else the run folder's name).

In the document (``--doc``) every table between ``<!-- table:ID/KIND -->`` and
``<!-- /table -->`` is rewritten from ``experiments/results/ID``; KIND is ``arms``
(per arm: held-out pass@1, mean reward, the gates' filtered and truncated shares, and
"cannot tell the methods apart" where both are under 1 %), ``divergence`` (per arm with
external groups: the external completions' k1 against the learner in nats/token, per
cell and per round, the rounds above the default δ, and the cells' filtered shares),
``contrasts`` (seed-paired
sign-flip test, 95 % bootstrap interval, raw and Holm-adjusted p) or ``power`` (paired
seeds needed for the config's target). Without results the table says "not yet run".
The power line of each experiment is printed as well.

A MERIT experiment (``ftis-lab merit experiment``; its ``config.json`` says
``"experiment": "merit"``) has the kinds ``families`` (held-out pass@1 per arm ×
family), ``samples`` (what each arm trained on), ``contrasts`` and ``power``
(:mod:`ftis.lab.merit.report`); its tables are in docs/merit.md, which is rewritten
together with docs/results.md unless ``--doc`` names documents.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from ftis.client.learner.config import DEFAULT_FILTER_THRESHOLD
from ftis.lab.experiment import report
from ftis.lab.experiment.matrix import ExperimentConfig, analysis
from ftis.lab.merit.experiment import MeritExperimentConfig
from ftis.lab.merit.report import SAMPLES_COLUMNS
from ftis.lab.merit.report import tables as merit_tables

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
DOC = ROOT / "docs" / "results.md"
DOCS = (DOC, ROOT / "docs" / "merit.md")
KINDS = ("arms", "divergence", "contrasts", "power")
MERIT_KINDS = ("families", "samples", "contrasts", "power")
MARKER = re.compile(r"(<!-- table:(?P<id>[A-Za-z0-9_.-]+)/(?P<kind>\w+) -->\n)(?P<body>.*?)"
                    r"(?P<end><!-- /table -->)", re.DOTALL)
_PLACEHOLDER_COLUMNS = {"arms": (report.ARMS_COLUMNS, 5),
                        "divergence": (report.divergence_columns(DEFAULT_FILTER_THRESHOLD), 4),
                        "contrasts": (report.CONTRAST_COLUMNS, 3),
                        "power": (report.POWER_COLUMNS, 3),
                        "families": (["arm", "seeds", "{metric} per family",
                                      "mean over families"], 1),
                        "samples": (SAMPLES_COLUMNS, 1)}


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def collect(run: Path, results: Path = RESULTS) -> Path:
    """Copy ``run``'s config.json, results.jsonl and evals.jsonl to ``results/ID``."""
    cfg = json.loads((run / "config.json").read_text())
    dest = results / (cfg.get("id") or run.name)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "results.jsonl", "evals.jsonl"):
        if (run / name).exists():
            shutil.copyfile(run / name, dest / name)
    return dest


def _is_merit(folder: Path) -> bool:
    path = folder / "config.json"
    return path.exists() and json.loads(path.read_text()).get("experiment") == "merit"


def load(results: Path, exp_id: str) -> tuple[ExperimentConfig, list[dict], list[dict]] | None:
    """An experiment's config, result rows and evaluations, or ``None`` if not run."""
    folder = results / exp_id
    if not (folder / "config.json").exists():
        return None
    cfg = ExperimentConfig.model_validate_json((folder / "config.json").read_text())
    rows, evals = _jsonl(folder / "results.jsonl"), _jsonl(folder / "evals.jsonl")
    if not rows and not evals:
        return None
    return cfg, rows, evals


def tables(results: Path, exp_id: str) -> dict[str, str] | None:
    """``{kind: markdown}`` of one experiment (``None`` if it has no results)."""
    if _is_merit(results / exp_id):
        folder = results / exp_id
        rows = _jsonl(folder / "results.jsonl")
        if not rows:
            return None
        cfg = MeritExperimentConfig.model_validate_json((folder / "config.json").read_text())
        return merit_tables(cfg, rows)
    loaded = load(results, exp_id)
    if loaded is None:
        return None
    cfg, rows, evals = loaded
    if cfg.arms is None:
        raise ValueError(f"{exp_id}: tables need an arms config")
    return analysis(cfg, rows, evals)


def regenerate(text: str, results: Path = RESULTS) -> tuple[str, list[str]]:
    """``text`` with every marked table rewritten; also the power lines printed for the
    experiments that have results."""
    cache: dict[str, dict[str, str] | None] = {}
    lines: list[str] = []

    def repl(m: re.Match) -> str:
        exp_id, kind = m["id"], m["kind"]
        if kind not in KINDS + MERIT_KINDS:
            raise ValueError(f"unknown table kind {kind!r} (expected one of "
                             f"{KINDS + MERIT_KINDS})")
        if exp_id not in cache:
            cache[exp_id] = tables(results, exp_id)
            if cache[exp_id] is not None:
                lines.append(f"{exp_id}: {cache[exp_id]['power_line']}")
        got = cache[exp_id]
        if got is None:
            columns, right = _PLACEHOLDER_COLUMNS[kind]
            body = report.placeholder(columns, "held-out pass@1", right)
        elif kind not in got:
            raise ValueError(f"{exp_id} has no {kind!r} table")
        else:
            body = got[kind]
        return f"{m.group(1)}{body}\n{m['end']}"

    return MARKER.sub(repl, text), lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="raw results folder")
    ap.add_argument("--doc", type=Path, action="append", default=None,
                    help="document with table markers (repeat; default: docs/results.md "
                         "and docs/merit.md)")
    ap.add_argument("--collect", type=Path, nargs="*", default=[], metavar="RUN",
                    help="copy these runs' raw results into --results first")
    ap.add_argument("--check", action="store_true",
                    help="only check: exit 1 if the document's tables are stale")
    args = ap.parse_args(argv)
    for run in args.collect:
        print(f"collected {run} -> {collect(run, args.results)}")
    stale = False
    for doc in args.doc or DOCS:
        old = doc.read_text()
        new, power = regenerate(old, args.results)
        for line in power:
            print(line)
        if args.check:
            if new != old:
                print(f"{doc}: tables are stale; run experiments/summarize.py",
                      file=sys.stderr)
                stale = True
            continue
        if new != old:
            doc.write_text(new)
            print(f"rewrote the tables of {doc}")
    if stale:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
