"""MERIT's four-way experiment (issue 16): joint training, the conflict-aware split and a
random split (each merged once by tokens), and each branch alone, at equal total samples
(``ftis-lab merit experiment --config FILE --out DIR``).

Per seed:

1. **The plan** at the shared initialisation (:func:`ftis.lab.merit.run.plan`, written
   to ``OUT/plans/sSEED.json`` and reused when there), or one committed plan file for
   every seed (``plan_file``): the conflict-aware and the random split, ``K = 2^r``
   branches each.
2. **The arms**, each a real local swarm (a coordinator and one ``ftis-client``, started
   by the experiment matrix's launcher, :func:`ftis.lab.experiment.matrix.run_swarm`):

   * ``joint``: one swarm leased the whole mix;
   * ``conflict`` and ``random``: one swarm per branch, leased only the branch's
     families, every branch from the same base; the branches are then merged one-shot,
     weighted by the completion tokens the coordinator accepted from each
     (:func:`ftis.lab.merit.run.merge`);
   * **each branch alone**: every branch's own model, evaluated without merging.

   Equal total samples: every branch runs ``rounds`` rounds of ``local_groups`` groups of
   ``group_size`` completions; joint runs ``K * rounds`` rounds of ``local_groups``
   groups (``joint_schedule = "rounds"``: same batch, K times the steps) or ``rounds``
   rounds of ``K * local_groups`` groups (``"groups"``: same steps, K times the batch).
   :func:`planned_completions` checks it before anything runs; the coordinators'
   accepted counts are recorded in the ``train`` rows.

   Why a swarm per branch rather than one coordinator with branch assignments: a
   separate coordinator isolates the branches completely (no shared task counter, no
   relay, no assignment race while a node registers), each branch is its own resumable
   cell, and on a 2-core machine the branches would run one after another anyway. With
   one learner per branch and no external groups this trains exactly what a branch of
   ``ftis-admin branches`` with the branch-aware relay trains.
3. **Evaluation** of the base model, the joint model, each branch and each merged model
   on every family's held-out set (the client's own evaluation,
   :mod:`ftis.client.node.evaluation`, one set per family drawn only from operand keys
   the coordinators never lease, ``heldout_fraction``): greedy and, with
   ``eval.samples``, sampled pass@1, per prompt too.

Cells run one after another in ``OUT/cells/NAME``; a finished cell (``DONE``) is skipped
when the experiment is started again, and refused if its settings changed
(:class:`~ftis.lab.experiment.matrix.CellMismatchError`). Results: one raw row per cell
and family in ``OUT/results.jsonl`` (:mod:`ftis.lab.merit.report` makes the tables).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from ftis.client.node.evaluation import EvalConfig
from ftis.lab.experiment.launcher import ClientSpec
from ftis.lab.experiment.matrix import (
    ClientRole,
    PowerSettings,
    base_client_args,
    cell_spec,
    coordinator_settings,
    done_or_fresh,
    merge_args,
    run_swarm,
)
from ftis.lab.experiment.report import read_metrics
from ftis.tasks import TaskSpec

#: the arms trained (``joint``) or split and merged (the splits)
SPLITS: dict[str, str] = {"conflict": "conflict_aware", "random": "random"}
#: what a contrast may name: the merged splits, joint, the base model, and a split's
#: branches alone, each family scored by the branch that trained it (``*_own``)
CONTRAST_ARMS = ("joint", "conflict", "random", "conflict_own", "random_own", "base")
#: the client's folder name inside a training cell
LEARNER = "learner"


class PlanSettings(BaseModel):
    """How the per-seed plan samples its per-family gradients (:func:`run.plan`)."""

    groups: int = Field(16, ge=1, description="prompts per family")
    group_size: int = Field(8, ge=2)
    temperature: float = Field(0.7, gt=0)
    max_new_tokens: int = Field(32, ge=1)


class MeritContrast(BaseModel):
    """``arm`` minus ``baseline`` of the mean held-out pass@1 over families, paired by
    seed (names from :data:`CONTRAST_ARMS`)."""

    arm: str
    baseline: str

    @model_validator(mode="after")
    def _known(self) -> MeritContrast:
        for n in (self.arm, self.baseline):
            if n not in CONTRAST_ARMS:
                raise ValueError(f"unknown contrast arm {n!r}; choose from {CONTRAST_ARMS}")
        return self


def _default_contrasts() -> list[MeritContrast]:
    return [MeritContrast(arm="conflict", baseline="joint"),
            MeritContrast(arm="conflict", baseline="random"),
            MeritContrast(arm="random", baseline="joint")]


class MeritExperimentConfig(BaseModel):
    """The four-way MERIT experiment (``ftis-lab merit experiment --config FILE``, JSON).

    Attributes:
        client: the learner of every swarm (model, PEFT kind, learning rate, extra
            ``ftis-client start`` flags); the same base for every arm.
        families: one task spec per ReasoningGYM family (distinct datasets).
        rounds: rounds of each branch; ``local_groups`` groups of ``group_size`` each.
        split_rounds: ``r``: ``K = 2^r`` branches per split.
        joint_schedule: how joint gets the branches' total samples (module docstring).
        plan_file: one committed plan (``ftis-lab merit plan``) for every seed; without
            it each seed plans at the base with ``plan``.
        heldout_fraction: share of operand keys never leased and evaluated on.
        eval: the evaluation settings (its ``in_distribution`` is replaced by each
            family in turn, ``out_of_distribution`` by none, ``heldout_fraction`` by
            the one above).
        primary: which pass@1 the tables and contrasts compare.
        contrasts: pre-registered, Holm-adjusted together.
    """

    experiment: Literal["merit"] = "merit"
    id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    name: str = "MERIT four-way"
    client: ClientRole = Field(default_factory=lambda: ClientRole(
        name=LEARNER, model="smollm2-135m", peft="lora"))
    families: list[TaskSpec] = Field(min_length=2)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    rounds: int = Field(10, ge=1)
    local_groups: int = Field(4, ge=1)
    group_size: int = Field(8, ge=2)
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(0.7, gt=0)
    split_rounds: int = Field(1, ge=1)
    joint_schedule: Literal["rounds", "groups"] = "rounds"
    plan: PlanSettings = Field(default_factory=PlanSettings)
    plan_file: Path | None = None
    heldout_fraction: float = Field(0.2, gt=0, lt=1)
    eval: EvalConfig = Field(default_factory=lambda: EvalConfig(size=32, max_new_tokens=32))
    primary: Literal["greedy", "sampled"] = "greedy"
    contrasts: list[MeritContrast] = Field(default_factory=_default_contrasts)
    power: PowerSettings = Field(default_factory=PowerSettings)
    threads_per_client: int = Field(1, ge=1)
    cell_timeout_min: float = Field(180.0, gt=0)
    keep_models: bool = Field(False, description="keep the trained checkpoints and the "
                              "merged models (about 0.5-1.6 GB each for a 135M model)")

    @field_validator("families")
    @classmethod
    def _distinct(cls, v: list[TaskSpec]) -> list[TaskSpec]:
        names = [t.dataset for t in v]
        if len(set(names)) != len(names):
            raise ValueError("one task spec per family (dataset names must be distinct)")
        return v

    @model_validator(mode="after")
    def _check(self) -> MeritExperimentConfig:
        if self.client.role != "learner":
            raise ValueError("the client is a learner")
        if self.primary == "sampled" and not self.eval.samples:
            raise ValueError("primary 'sampled' needs eval.samples > 0")
        return self

    @classmethod
    def load(cls, path: Path) -> MeritExperimentConfig:
        return cls.model_validate_json(path.read_text())

    @property
    def results_id(self) -> str:
        return self.id or "merit"

    def family_eval(self, spec: TaskSpec) -> EvalConfig:
        """The evaluation of one family: its held-out set only."""
        return self.eval.model_copy(update={"in_distribution": [spec],
                                            "out_of_distribution": [],
                                            "heldout_fraction": self.heldout_fraction})


# ----------------------------------------------------------------------- pure: cells


@dataclass(frozen=True)
class MeritCell:
    """One step of the experiment.

    Attributes:
        name: its folder under ``OUT/cells``.
        kind: ``base`` (evaluate the base model), ``train`` (a swarm, then evaluate its
            model) or ``merge`` (merge ``branches``' models, then evaluate).
        seed: the seed (``None`` for ``base``, which no seed changes).
        arm: ``base``, ``joint`` or a split (``conflict``, ``random``).
        model: ``base``, ``joint``, ``merged`` or a branch name (``b0``, ``b1``, ...).
        tasks: a training cell's task mix.
        rounds: a training cell's rounds; ``local_groups`` groups per round.
        branches: a merge cell's branch cells (names).
    """

    name: str
    kind: Literal["base", "train", "merge"]
    seed: int | None
    arm: str
    model: str
    tasks: tuple[TaskSpec, ...] = ()
    rounds: int = 0
    local_groups: int = 0
    branches: tuple[str, ...] = ()


def split_branches(plan: dict[str, Any], families: Sequence[TaskSpec]
                   ) -> dict[str, list[list[TaskSpec]]]:
    """Each split of ``plan`` (``branches.conflict_aware``, ``branches.random``) as the
    config's task specs, keyed by arm (``conflict``, ``random``).

    Raises:
        ValueError: a split is missing, names a family not in ``families``, or is not a
            partition of them; or the two splits have different numbers of branches.
    """
    by_name = {t.dataset: t for t in families}
    out: dict[str, list[list[TaskSpec]]] = {}
    for arm, key in SPLITS.items():
        branches = plan.get("branches", {}).get(key)
        if not branches:
            raise ValueError(f"the plan has no {key!r} split")
        named = [name for b in branches for name in b]
        unknown = sorted(set(named) - set(by_name))
        if unknown:
            raise ValueError(f"the {key} split names families not in the config: {unknown}")
        if sorted(named) != sorted(by_name):
            raise ValueError(f"the {key} split is not a partition of the config's families")
        out[arm] = [[by_name[n] for n in b] for b in branches]
    if len({len(b) for b in out.values()}) != 1:
        raise ValueError("the splits have different numbers of branches")
    return out


def merit_cells(cfg: MeritExperimentConfig,
                splits: dict[int, dict[str, list[list[TaskSpec]]]]) -> list[MeritCell]:
    """The experiment as cells, seed-major (an interrupted run leaves whole seeds):
    ``base``, then per seed ``joint``, each split's branches and its merge.

    Args:
        splits: per seed, :func:`split_branches` of its plan.
    """
    out = [MeritCell(name="base", kind="base", seed=None, arm="base", model="base")]
    for seed in cfg.seeds:
        k = len(splits[seed]["conflict"])
        rounds, groups = ((k * cfg.rounds, cfg.local_groups) if cfg.joint_schedule == "rounds"
                          else (cfg.rounds, k * cfg.local_groups))
        out.append(MeritCell(name=f"joint__s{seed}", kind="train", seed=seed, arm="joint",
                             model="joint", tasks=tuple(cfg.families), rounds=rounds,
                             local_groups=groups))
        for arm in SPLITS:
            names = []
            for i, tasks in enumerate(splits[seed][arm]):
                cell = MeritCell(name=f"{arm}__b{i}__s{seed}", kind="train", seed=seed,
                                 arm=arm, model=f"b{i}", tasks=tuple(tasks),
                                 rounds=cfg.rounds, local_groups=cfg.local_groups)
                out.append(cell)
                names.append(cell.name)
            out.append(MeritCell(name=f"{arm}__merged__s{seed}", kind="merge", seed=seed,
                                 arm=arm, model="merged", branches=tuple(names)))
    return out


def splits_from_rows(rows: Sequence[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The splits each seed trained, read back from its ``train`` rows (pure): per seed
    whose branches of every split are all there and merged, ``{"seed": s, "branches":
    {"conflict_aware": [[family, ...], ...], "random": [...]}}``, the part of a plan
    that :func:`split_branches` reads. Lets a resumed run skip re-planning seeds it
    restored (a plan takes minutes of CPU); the plan's matrix is not in the rows."""
    trained: dict[tuple[int, str], dict[int, list[str]]] = {}
    merged: set[tuple[int, str]] = set()
    for r in rows:
        if r.get("seed") is None or r.get("arm") not in SPLITS:
            continue
        key = (int(r["seed"]), str(r["arm"]))
        if r.get("kind") == "train" and str(r.get("model", "")).startswith("b"):
            trained.setdefault(key, {})[int(r["model"][1:])] = list(r["families"])
        elif r.get("kind") == "merge":
            merged.add(key)
    out: dict[int, dict[str, Any]] = {}
    for seed in sorted({s for s, _ in trained}):
        branches = {}
        for arm, name in SPLITS.items():
            got = trained.get((seed, arm), {})
            if (seed, arm) not in merged or sorted(got) != list(range(len(got))):
                break
            branches[name] = [got[i] for i in range(len(got))]
        else:
            out[seed] = {"seed": seed, "branches": branches}
    return out


def unmerged_branches(rows: Sequence[dict[str, Any]]) -> set[str]:
    """The branch cells among ``rows`` whose split has no merge row for their seed (pure):
    a run stopped between a branch and its merge. Their models do not travel with the
    rows, so :func:`restore_cells` leaves them to train again and
    :func:`collect_results` may drop their rows."""
    cells = {(r["cell"], r.get("arm"), r.get("model"), r.get("seed")) for r in rows}
    merged = {(arm, seed) for _, arm, model, seed in cells if model == "merged"}
    return {name for name, arm, model, seed in cells
            if arm in SPLITS and model != "merged" and (arm, seed) not in merged}


def planned_completions(cells: Sequence[MeritCell], group_size: int
                        ) -> dict[tuple[int, str], int]:
    """Completions each arm trains on, per ``(seed, arm)``: the sum over its training
    cells of ``rounds * local_groups * group_size``."""
    out: dict[tuple[int, str], int] = {}
    for c in cells:
        if c.kind == "train" and c.seed is not None:
            key = (c.seed, c.arm)
            out[key] = out.get(key, 0) + c.rounds * c.local_groups * group_size
    return out


def check_equal_samples(cells: Sequence[MeritCell], group_size: int) -> None:
    """Raises ``ValueError`` unless every arm of a seed trains on the same number of
    completions."""
    by_seed: dict[int, dict[str, int]] = {}
    for (seed, arm), n in planned_completions(cells, group_size).items():
        by_seed.setdefault(seed, {})[arm] = n
    for seed, arms in by_seed.items():
        if len(set(arms.values())) > 1:
            raise ValueError(f"seed {seed}: unequal total samples {arms}")


# ------------------------------------------------------------------------- I/O: run


def load_plan(cfg: MeritExperimentConfig, seed: int, out: Path) -> dict[str, Any]:
    """The plan of ``seed``: ``plan_file`` if set, else ``OUT/plans/sSEED.json``, made
    at the base model with :func:`ftis.lab.merit.run.plan` when missing.

    Raises:
        ftis.lab.merit.run.MeritError: a family had no reward variance at the base.
    """
    if cfg.plan_file is not None:
        return dict(json.loads(cfg.plan_file.read_text()))
    path = out / "plans" / f"s{seed}.json"
    if path.exists():
        return dict(json.loads(path.read_text()))
    from ftis.lab.merit.run import plan

    p = cfg.plan
    got = plan(cfg.client.model, list(cfg.families), peft=cfg.client.peft, groups=p.groups,
               group_size=p.group_size, rounds=cfg.split_rounds, temperature=p.temperature,
               max_new_tokens=p.max_new_tokens, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(got, indent=1))
    return got


def evaluate_families(policy: Any, cfg: MeritExperimentConfig) -> list[dict[str, Any]]:
    """Held-out pass@1 of ``policy`` on every family (one row each): ``family``, ``n``
    prompts, ``greedy`` and ``sampled`` (``None`` without ``eval.samples``) pass@1 in
    [0, 1], and the per-prompt rewards (``greedy_per_prompt``, ``sampled_per_prompt``)
    for paired tests."""
    import torch

    from ftis.client.node.evaluation import build_eval_sets, evaluate_sets

    torch.set_num_threads(cfg.threads_per_client)
    rows = []
    for spec in cfg.families:
        ecfg = cfg.family_eval(spec)
        (result,) = evaluate_sets(policy, build_eval_sets(ecfg), ecfg).values()
        rows.append({"family": spec.dataset, "n": len(result.greedy),
                     "greedy": sum(result.greedy) / max(len(result.greedy), 1),
                     "sampled": (sum(result.sampled) / len(result.sampled)
                                 if result.sampled else None),
                     "greedy_per_prompt": result.greedy,
                     "sampled_per_prompt": result.sampled})
    return rows


def _labels(cell: MeritCell) -> dict[str, Any]:
    return {"cell": cell.name, "seed": cell.seed, "arm": cell.arm, "model": cell.model}


def _eval_spec(cfg: MeritExperimentConfig) -> dict[str, Any]:
    return {"families": [cfg.family_eval(t).model_dump() for t in cfg.families]}


def _read_rows(cdir: Path) -> list[dict[str, Any]]:
    path = cdir / "rows.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _finish(cdir: Path, rows: list[dict[str, Any]]) -> None:
    (cdir / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (cdir / "DONE").write_text("ok\n")


def training_record(cell: MeritCell, cdir: Path, group_size: int) -> dict[str, Any]:
    """A training cell's ``train`` row: what its coordinator accepted (``completions``,
    ``completion_tokens``: the merge weight), the planned completions, and the
    learner's mean reward in its first and last rounds."""
    from ftis.coordinator.state.sql import open_state

    state = open_state(f"sqlite:///{cdir / 'coordinator.db'}")
    try:
        nodes = state.list_nodes()
    finally:
        state.close()
    metrics = read_metrics(cdir / LEARNER / "metrics.jsonl")
    return {"kind": "train", **_labels(cell), "families": [t.dataset for t in cell.tasks],
            "rounds": cell.rounds, "local_groups": cell.local_groups,
            "group_size": group_size,
            "planned_completions": cell.rounds * cell.local_groups * group_size,
            "completions": sum(n.completions for n in nodes),
            "completion_tokens": sum(n.completion_tokens for n in nodes),
            "rounds_run": len(metrics),
            "reward_first": metrics[0]["reward_mean"] if metrics else None,
            "reward_last": metrics[-1]["reward_mean"] if metrics else None}


def run_base_cell(cfg: MeritExperimentConfig, cell: MeritCell, out: Path) -> list[dict]:
    """Evaluate the base model (once: no seed changes it)."""
    cdir = out / "cells" / cell.name
    spec = {"model": cfg.client.model, "eval": _eval_spec(cfg)}
    if not done_or_fresh(cdir, spec, f"cell {cell.name}"):
        from ftis.client.models.loader import load_policy

        policy = load_policy(cfg.client.model)
        _finish(cdir, [{"kind": "eval", **_labels(cell), **r}
                       for r in evaluate_families(policy, cfg)])
    return _read_rows(cdir)


def run_train_cell(cfg: MeritExperimentConfig, cell: MeritCell, out: Path) -> list[dict]:
    """Train ``cell``'s swarm, then evaluate its model; a joint model's checkpoints are
    removed then, a branch's are kept for its merge."""
    from ftis.lab.merit.run import trained_policy

    assert cell.seed is not None
    cdir = out / "cells" / cell.name
    args = merge_args(base_client_args(cfg, cfg.client, method="on_policy",
                                       local=cell.local_groups, external=0,
                                       rounds=cell.rounds, seed=1000 * cell.seed,
                                       checkpoint_every=cell.rounds), cfg.client.extra_args)
    coordinator = coordinator_settings(list(cell.tasks), cell.seed, cfg.heldout_fraction)
    spec = cell_spec(cdir, coordinator, {LEARNER: args}, {"eval": _eval_spec(cfg)})
    label = f"cell {cell.name}"
    if not done_or_fresh(cdir, spec, label):
        run_swarm(cfg, cdir, label, coordinator, [ClientSpec(LEARNER, args)])
        rows = [training_record(cell, cdir, cfg.group_size)]
        policy = trained_policy(cfg.client.model, cfg.client.peft, cdir / LEARNER)
        rows += [{"kind": "eval", **_labels(cell), **r} for r in evaluate_families(policy, cfg)]
        if cell.arm == "joint" and not cfg.keep_models:
            shutil.rmtree(cdir / LEARNER / "checkpoints", ignore_errors=True)
        _finish(cdir, rows)
    return _read_rows(cdir)


def run_merge_cell(cfg: MeritExperimentConfig, cell: MeritCell, out: Path) -> list[dict]:
    """Merge the branches' models by the completion tokens their coordinators accepted,
    evaluate the merged model, then remove the merged weights and the branches'
    checkpoints unless ``keep_models`` (their rows keep everything the tables need).

    Raises:
        ftis.lab.merit.run.MeritError: a branch's checkpoints are gone before its merge
            (delete that branch's cell folder to train it again).
    """
    from ftis.client.models.loader import load_policy
    from ftis.lab.merit.run import Branch, merge

    cdir = out / "cells" / cell.name
    folders = [out / "cells" / b / LEARNER for b in cell.branches]
    spec = {"branches": list(cell.branches), "model": cfg.client.model,
            "peft": cfg.client.peft, "eval": _eval_spec(cfg)}
    if not done_or_fresh(cdir, spec, f"cell {cell.name}"):
        tokens = [next(r["completion_tokens"] for r in _read_rows(out / "cells" / b)
                       if r["kind"] == "train") for b in cell.branches]
        record = merge(cfg.client.model, [Branch(f, float(t)) for f, t in
                                          zip(folders, tokens, strict=True)],
                       cdir / "model", peft=cfg.client.peft)
        rows: list[dict[str, Any]] = [{"kind": "merge", **_labels(cell),
                                       "branches": list(cell.branches), "tokens": tokens,
                                       "weights": record["weights"]}]
        policy = load_policy(str(cdir / "model"))
        rows += [{"kind": "eval", **_labels(cell), **r} for r in evaluate_families(policy, cfg)]
        if not cfg.keep_models:
            shutil.rmtree(cdir / "model", ignore_errors=True)
        _finish(cdir, rows)
    if not cfg.keep_models:
        for f in folders:  # also after a run stopped between the merge and this clean-up
            shutil.rmtree(f / "checkpoints", ignore_errors=True)
    return _read_rows(cdir)


def collect_results(out: Path, dst: Path) -> int:
    """Copy what a run under ``out`` has finished so far (``config.json``,
    ``results.jsonl``, ``plans/``) to ``dst``, the folder to commit and to resume from
    (:func:`restore_cells`); a run in progress keeps going (its results file is replaced
    atomically after every cell). Returns the number of rows copied.

    Raises:
        ValueError: ``out`` has no ``config.json`` or ``results.jsonl`` yet, or ``dst``
            holds rows of cells that ``out`` has not finished (collecting would lose
            them: restore them first with :func:`restore_cells`), other than branches
            without their merge (:func:`unmerged_branches`, trained again anyway).
    """
    from ftis.lab.experiment.matrix import read_jsonl

    for name in ("config.json", "results.jsonl"):
        if not (out / name).exists():
            raise ValueError(f"{out} has no {name}: no cell has finished there yet")
    rows = read_jsonl(out / "results.jsonl")
    old = read_jsonl(dst / "results.jsonl")  # unmerged branches train again anyway
    lost = sorted({r["cell"] for r in old} - {r["cell"] for r in rows}
                  - unmerged_branches(old))
    if lost:
        raise ValueError(f"{dst} holds rows of {len(lost)} cells not finished under {out} "
                         f"(e.g. {lost[0]}); restore them first (--restore-from) or "
                         "collect to another folder")
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out / "config.json", dst / "config.json")
    shutil.copyfile(out / "results.jsonl", dst / "results.jsonl")
    _copy_plans(out, dst, overwrite=True)
    return len(rows)


def _copy_plans(src: Path, dst: Path, overwrite: bool) -> None:
    """Copy ``src/plans/s*.json`` to ``dst/plans/`` (a plan already there is kept unless
    ``overwrite``)."""
    for plan_path in sorted((src / "plans").glob("s*.json")):
        target = dst / "plans" / plan_path.name
        if overwrite or not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(plan_path, target)


def restore_cells(cfg: MeritExperimentConfig, src: Path, out: Path) -> int:
    """Rebuild under ``out`` the finished cells whose rows the results folder ``src``
    holds (its ``results.jsonl``, e.g. committed under ``experiments/results/``), so that
    a run resumed on another machine, or after its working folder was lost, skips them;
    ``src/plans/*.json`` are copied too when there. Each restored cell gets its rows, a
    ``RESTORED`` file naming ``src`` and a ``DONE`` marker, but no model, so a branch
    whose merge is not in ``src`` is not restored (it trains again). A cell already
    finished under ``out`` is left as it is.

    Returns:
        The number of cells restored.

    Raises:
        ValueError: ``src`` was written by another config
            (:func:`ftis.lab.experiment.matrix.same_config`).
    """
    from collections import defaultdict

    from ftis.lab.experiment.matrix import read_jsonl, same_config

    same_config(cfg.model_dump(mode="json"), src)
    all_rows = read_jsonl(src / "results.jsonl")
    by_cell: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in all_rows:
        by_cell[row["cell"]].append(row)
    _copy_plans(src, out, overwrite=False)
    for seed, plan in splits_from_rows(all_rows).items():
        dst = out / "plans" / f"s{seed}.json"
        if not dst.exists():  # a finished seed needs only its splits, not a new plan
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(json.dumps({**plan, "restored_from": f"train rows of {src}"},
                                      indent=1))
    unmerged = unmerged_branches(all_rows)
    restored = 0
    for name, rows in by_cell.items():
        cdir = out / "cells" / name
        if name in unmerged or (cdir / "DONE").exists():  # a branch needs its model
            continue                                       # until it is merged
        shutil.rmtree(cdir, ignore_errors=True)
        cdir.mkdir(parents=True)
        (cdir / "RESTORED").write_text(f"{src}\n")
        _finish(cdir, rows)
        restored += 1
    return restored


def cells_as_planned(cfg: MeritExperimentConfig, out: Path) -> Iterator[MeritCell]:
    """:func:`merit_cells` in order, each seed planned (:func:`load_plan`) only when its
    cells come up: a plan takes minutes of CPU, so seed 0 trains while later seeds are
    still unplanned, and a run stopped part way has planned only the seeds it reached.

    Raises:
        ValueError: a seed's plan is not a partition of the families, or its arms would
            train on unequal samples (when that seed comes up).
    """
    yield MeritCell(name="base", kind="base", seed=None, arm="base", model="base")
    for seed in cfg.seeds:
        one = cfg.model_copy(update={"seeds": [seed]})
        cells = merit_cells(one, {seed: split_branches(load_plan(cfg, seed, out),
                                                       cfg.families)})[1:]
        check_equal_samples(cells, cfg.group_size)
        yield from cells


def run_merit(cfg: MeritExperimentConfig, out: Path,
              on_cell: Callable[[MeritCell], None] | None = None) -> Path:
    """Plan (each seed when it comes up: :func:`cells_as_planned`), train, merge and
    evaluate every cell (finished ones skipped); writes
    ``OUT/config.json`` and ``OUT/results.jsonl`` (returned). The results file is
    rewritten after every cell with the rows of the cells finished so far, so a long run
    can be collected (``experiments/summarize.py --collect OUT``) while it goes on.

    Raises:
        ValueError: a plan is not a partition of the families, or arms would train on
            unequal samples (raised when that seed comes up).
        ftis.lab.experiment.matrix.CellMismatchError: a finished cell has other settings.
        RuntimeError, TimeoutError: a swarm failed (see its ``logs/``).
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    runners = {"base": run_base_cell, "train": run_train_cell, "merge": run_merge_cell}
    rows: list[dict[str, Any]] = []
    path = out / "results.jsonl"
    for cell in cells_as_planned(cfg, out):
        if on_cell:
            on_cell(cell)
        rows += runners[cell.kind](cfg, cell, out)
        tmp = path.with_suffix(".jsonl.tmp")  # a reader never sees half a file
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)
    return path
