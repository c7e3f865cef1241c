"""Experiment matrices: methods × seeds × pairings × local/external mixes.

Each cell is a real swarm (one coordinator and one client process per member of the
pairing, over loopback, see :mod:`launcher`); cells run one after another, each in its
own folder, and a finished cell is skipped when the experiment is started again.
Results: ``OUT/results.jsonl`` (one line per cell, client and round),
``OUT/evals.jsonl`` (greedy held-out evaluations), ``OUT/summary.md`` and PNG curves.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from ftis.client.experiment.launcher import ClientSpec, launch
from ftis.client.experiment.report import read_metrics
from ftis.client.node.evaluation import EvalConfig
from ftis.tasks.source import DEFAULT_TASKS, TaskSpec

#: "alone" is on_policy training on local rollouts only (external groups 0).
METHOD_CHOICES = ("alone", "on_policy", "nois", "vis", "tis", "ftis")


class ClientRole(BaseModel):
    """One member of a pairing."""

    name: str
    model: str = "smollm2-135m"
    peft: Literal["none", "lora", "qlora"] = "none"
    learning_rate: float | None = None
    extra_args: list[str] = Field(default_factory=list)


class Pairing(BaseModel):
    name: str
    clients: list[ClientRole]


class Mix(BaseModel):
    """Local groups I and external groups J per round (SAPO's I/J)."""

    local: int = Field(ge=1)
    external: int = Field(ge=0)

    @property
    def label(self) -> str:
        return f"{self.local}-{self.external}"


class ExperimentConfig(BaseModel):
    """An experiment matrix (``ftis-client experiment --config FILE``, JSON or TOML)."""

    name: str = "experiment"
    rounds: int = Field(6, ge=1)
    seeds: list[int] = Field(default_factory=lambda: [0])
    methods: list[str] = Field(default_factory=lambda: ["ftis"])
    pairings: list[Pairing]
    mixes: list[Mix] = Field(default_factory=lambda: [Mix(local=2, external=2)])
    group_size: int = Field(8, ge=2)
    max_new_tokens: int = Field(48, ge=1)
    temperature: float = 1.0
    tasks: list[TaskSpec] = Field(default_factory=lambda: list(DEFAULT_TASKS))
    eval_every: int = Field(0, ge=0)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    threads_per_client: int = Field(1, ge=1)
    cell_timeout_min: float = 60.0

    @field_validator("methods")
    @classmethod
    def _methods(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if m not in METHOD_CHOICES]
        if bad:
            raise ValueError(f"unknown methods {bad}; choose from {METHOD_CHOICES}")
        return v

    @classmethod
    def load(cls, path: Path) -> ExperimentConfig:
        text = path.read_text()
        if path.suffix == ".toml":
            import tomllib

            return cls.model_validate(tomllib.loads(text))
        return cls.model_validate_json(text)


def cells(cfg: ExperimentConfig) -> list[dict]:
    """The matrix as a list of cells (dicts with pairing, mix, method, seed, name)."""
    out = []
    for pairing, mix, method, seed in itertools.product(cfg.pairings, cfg.mixes, cfg.methods,
                                                        cfg.seeds):
        name = f"{pairing.name}__{mix.label}__{method}__s{seed}"
        out.append({"pairing": pairing, "mix": mix, "method": method, "seed": seed,
                    "name": name})
    return out


def _client_args(cfg: ExperimentConfig, cell: dict, role: ClientRole, k: int,
                 eval_file: Path) -> list[str]:
    mix, method = cell["mix"], cell["method"]
    external = 0 if method == "alone" else mix.external
    args = ["--model", role.model, "--peft", role.peft, "--rounds", str(cfg.rounds),
            "--local-groups", str(mix.local), "--external-groups", str(external),
            "--group-size", str(cfg.group_size), "--max-new-tokens", str(cfg.max_new_tokens),
            "--temperature", str(cfg.temperature),
            "--method", "on_policy" if method == "alone" else method,
            "--seed", str(1000 * cell["seed"] + k), "--display-name", role.name,
            "--checkpoint-every", str(cfg.rounds)]
    if role.learning_rate is not None:
        args += ["--learning-rate", str(role.learning_rate)]
    if cfg.eval_every:
        args += ["--eval-every", str(cfg.eval_every), "--eval-config", str(eval_file)]
    return args + role.extra_args


def run_cell(cfg: ExperimentConfig, cell: dict, out: Path,
             on_progress: Callable[[int], None] | None = None) -> list[dict]:
    """Run one cell (skipped if ``DONE`` exists); returns its result rows."""
    cdir = out / "cells" / cell["name"]
    if not (cdir / "DONE").exists():
        import shutil

        shutil.rmtree(cdir, ignore_errors=True)
        cdir.mkdir(parents=True)
        coord_cfg = cdir / "coordinator.json"
        coord_cfg.write_text(json.dumps({"tasks": [t.model_dump() for t in cfg.tasks],
                                         "task_seed": cell["seed"]}))
        eval_file = cdir / "eval.json"
        eval_file.write_text(cfg.eval.model_dump_json())
        specs = [ClientSpec(role.name, _client_args(cfg, cell, role, k, eval_file))
                 for k, role in enumerate(cell["pairing"].clients)]
        swarm = launch(cdir, specs, threads_per_client=cfg.threads_per_client,
                       coordinator_args=["--config", str(coord_cfg)])
        try:
            deadline = time.monotonic() + cfg.cell_timeout_min * 60
            while any(p.poll() is None for p in swarm.clients.values()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cell {cell['name']} exceeded {cfg.cell_timeout_min} min")
                if on_progress:
                    on_progress(min(len(read_metrics(cdir / r.name / "metrics.jsonl"))
                                    for r in cell["pairing"].clients))
                time.sleep(2.0)
            codes = {n: p.returncode for n, p in swarm.clients.items()}
        finally:
            swarm.stop()
        if any(codes.values()):
            raise RuntimeError(f"cell {cell['name']}: client exit codes {codes}; "
                               f"see {cdir / 'logs'}")
        for role in cell["pairing"].clients:  # weights + AdamW state: ~1.6 GB per 135M model
            shutil.rmtree(cdir / role.name / "checkpoints", ignore_errors=True)
        (cdir / "DONE").write_text("ok\n")
    rows = []
    for role in cell["pairing"].clients:
        for rec in read_metrics(cdir / role.name / "metrics.jsonl"):
            rows.append(_row(cell, role, rec))
    return rows


def _row(cell: dict, role: ClientRole, rec: dict) -> dict:
    keep = ("round", "reward_mean", "tokens_per_second", "is_weight_mean", "is_weight_max",
            "filtered_frac", "external_is_weight_mean", "external_is_weight_max",
            "external_filtered_frac", "external_is_weight_raw_max", "external_truncated_frac",
            "external_divergence_mean", "external_groups_used", "round_seconds", "peak_rss_mb",
            "eval_heldout", "eval_ood")
    return {"cell": cell["name"], "pairing": cell["pairing"].name, "mix": cell["mix"].label,
            "method": cell["method"], "seed": cell["seed"], "client": role.name,
            **{k: rec[k] for k in keep if k in rec}}


def read_evals(out: Path, cell: dict) -> list[dict]:
    rows = []
    for role in cell["pairing"].clients:
        path = out / "cells" / cell["name"] / role.name / "eval.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                rec.pop("method", None)  # the cell's method ("alone" runs as on_policy)
                rows.append({**rec, "cell": cell["name"], "pairing": cell["pairing"].name,
                             "mix": cell["mix"].label, "method": cell["method"],
                             "seed": cell["seed"], "client": role.name})
    return rows


def run_experiment(cfg: ExperimentConfig, out: Path) -> Path:
    """Run every cell with a progress bar, then write the summary; returns summary.md."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    all_cells = cells(cfg)
    rows, evals = [], []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn()) as progress:
        total = progress.add_task(cfg.name, total=len(all_cells) * cfg.rounds)
        for i, cell in enumerate(all_cells):
            progress.update(total, description=f"{cfg.name}: {cell['name']}")
            base = i * cfg.rounds
            rows += run_cell(cfg, cell, out,
                             lambda r, base=base: progress.update(total, completed=base + r))
            evals += read_evals(out, cell)
            progress.update(total, completed=(i + 1) * cfg.rounds)
    with open(out / "results.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    with open(out / "evals.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in evals)
    return write_summary(cfg, rows, evals, out)


def mean_sd(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def summarize(rows: list[dict], evals: list[dict]) -> list[dict]:
    """Per (pairing, mix, method, client): reward and eval statistics over seeds."""
    groups: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        groups[(r["pairing"], r["mix"], r["method"], r["client"])][r["seed"]].append(r)
    ev: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for e in evals:
        ev[(e["pairing"], e["mix"], e["method"], e["client"])][e["seed"]].append(e)
    table = []
    for key, by_seed in sorted(groups.items()):
        mean_reward, last_third, cumulative = [], [], []
        for recs in by_seed.values():
            recs = sorted(recs, key=lambda r: r["round"])
            rewards = [r["reward_mean"] for r in recs]
            mean_reward.append(statistics.mean(rewards))
            last_third.append(statistics.mean(rewards[-max(len(rewards) // 3, 1):]))
            cumulative.append(sum(rewards))
        first_eval, last_eval = defaultdict(list), defaultdict(list)
        for recs in ev.get(key, {}).values():
            recs = sorted(recs, key=lambda r: r["round"])
            for k in ("eval_heldout", "eval_ood"):
                if k in recs[0]:
                    first_eval[k].append(recs[0][k])
                    last_eval[k].append(recs[-1][k])
        table.append({"pairing": key[0], "mix": key[1], "method": key[2], "client": key[3],
                      "seeds": len(by_seed), "mean_reward": mean_reward,
                      "last_third_reward": last_third, "cumulative_reward": cumulative,
                      "first_eval": dict(first_eval), "last_eval": dict(last_eval)})
    return table


def write_summary(cfg: ExperimentConfig, rows: list[dict], evals: list[dict], out: Path) -> Path:
    table = summarize(rows, evals)
    lines = [f"# {cfg.name}", "",
             f"{cfg.rounds} rounds, seeds {cfg.seeds}, G = {cfg.group_size}, "
             f"max_new_tokens = {cfg.max_new_tokens}; values are mean ± sd over seeds.", "",
             "| pairing | I-J | method | client | mean reward | last-third reward | "
             "cumulative reward | held-out pass@1 (start → end) | OOD pass@1 (start → end) |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for t in table:
        def ev(k: str, t: dict = t) -> str:
            if k not in t["last_eval"]:
                return "–"
            return f"{mean_sd(t['first_eval'][k])} → {mean_sd(t['last_eval'][k])}"

        lines.append(f"| {t['pairing']} | {t['mix']} | {t['method']} | {t['client']} | "
                     f"{mean_sd(t['mean_reward'])} | {mean_sd(t['last_third_reward'])} | "
                     f"{mean_sd(t['cumulative_reward'])} | {ev('eval_heldout')} | "
                     f"{ev('eval_ood')} |")
    lines += ["", *[f"![{p.name}]({p.name})" for p in plot_curves(rows, out)], ""]
    path = out / "summary.md"
    path.write_text("\n".join(lines))
    (out / "summary.json").write_text(json.dumps(table, indent=1))
    return path


def plot_curves(rows: list[dict], out: Path) -> list[Path]:
    """One PNG per (pairing, mix): reward per round, one line per (method, client),
    mean over seeds with a min–max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    by_panel: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        by_panel[(r["pairing"], r["mix"])].append(r)
    for (pairing, mix), prow in sorted(by_panel.items()):
        fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
        lines: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in prow:
            lines[(r["method"], r["client"])][r["round"]].append(r["reward_mean"])
        for (method, client), per_round in sorted(lines.items()):
            xs = sorted(per_round)
            mean = [statistics.mean(per_round[x]) for x in xs]
            (line,) = ax.plot(xs, mean, marker=".", label=f"{method} / {client}")
            ax.fill_between(xs, [min(per_round[x]) for x in xs],
                            [max(per_round[x]) for x in xs], alpha=0.12,
                            color=line.get_color())
        ax.set_xlabel("round")
        ax.set_ylabel("mean verified reward")
        ax.set_title(f"{pairing}, I-J = {mix}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out / f"curves_{pairing}_{mix}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
