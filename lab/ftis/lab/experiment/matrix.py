"""Experiment matrices: arms × seeds × pairings, each cell a real local swarm.

Two ways to write a matrix (``ftis-lab experiment --config FILE``):

* **Arms** (``"arms": [...]``): each arm names the learner's method, its local groups I,
  external groups J and extra client flags, e.g. ``alone`` (on_policy, I, J = 0),
  ``alone_batch_matched`` (on_policy, I + J local groups: the batch-size control),
  ``nois``, ``tis``, ``ftis_old_gate`` and ``ftis``. A pairing's clients are
  **learners** (they run the arm and are evaluated) or **partners** (real clients that
  generate and train on their own rollouts only, on_policy with J = 0, with their own
  flags such as ``--temperature 1.2`` or ``--peft qlora``; a partner with ``pretrain``
  first trains alone on another task mix in its own swarm, and the cell resumes from
  that checkpoint: a partner drifted by RL). An arm with ``"partners": false`` runs the
  learners only; when every pairing has the same learners such a cell is shared by all
  pairings (pairing label ``solo``).
* **Methods × mixes** (the older form, ``"methods"`` and ``"mixes"``): every client of a
  pairing runs every method at every I/J mix; ``alone`` is on_policy with J = 0.

Cells run one after another, each in ``OUT/cells/NAME`` (arms: seed-major, so an
interrupted run leaves whole seeds). A finished cell (``DONE``) is skipped when the
experiment is started again; its ``spec.json`` (client flags, coordinator and
evaluation settings) must match the current config, otherwise the run stops instead of
mixing settings. Results: ``OUT/results.jsonl`` (one line per cell, client and round),
``OUT/evals.jsonl`` (held-out evaluations), ``OUT/summary.md`` (arms: arm table with
the gates' filtered/truncated shares, seed-paired contrasts with Holm-adjusted
p-values, seeds needed for the target power) and PNG curves.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from ftis.client.learner.config import DEFAULT_FILTER_THRESHOLD, METHODS, Method
from ftis.client.models.peft import PeftKind
from ftis.client.node.config import ClientConfig
from ftis.client.node.evaluation import EvalConfig
from ftis.lab.experiment import report
from ftis.lab.experiment.launcher import ClientSpec, launch
from ftis.lab.experiment.report import read_metrics
from ftis.tasks.source import DEFAULT_TASKS, TaskSpec

#: A client's method: the learner's enumeration, defined once in the client.
ClientMethod = Method
#: "alone" is on_policy training on local rollouts only (external groups 0).
METHOD_CHOICES = ("alone", *METHODS)
#: The client's defaults (``ftis-client start``), read where a matrix leaves a setting as
#: the client would have it, so that none is restated here.
_CLIENT = ClientConfig.model_fields

#: pairing label of arms run without partners when all pairings share their learners
SOLO = "solo"


class Pretrain(BaseModel):
    """A partner's pre-phase: ``rounds`` rounds alone (on_policy, J = 0) on ``tasks`` in
    its own swarm (``OUT/pretrain/PAIRING__ROLE__sSEED``, shared by the seed's cells).

    The cell copies (hard-links) the last checkpoint into the partner's folder, so the
    partner resumes from it: weights, AdamW state and its learning rate.
    """

    rounds: int = Field(ge=1)
    tasks: list[TaskSpec] = Field(min_length=1)


class ClientRole(BaseModel):
    """One member of a pairing.

    Attributes:
        role: ``learner`` (runs the arm's method/I/J, evaluated) or ``partner`` (on_policy,
            J = 0, not evaluated; only in arms configs).
        local_groups: a partner's own groups per round (default: the largest J of the
            arms, at least 1, so each learner finds J foreign groups per round).
        extra_args: ``ftis-client start`` flags of this client; they override the
            matrix's flags and the arm's (``["--temperature", "1.2"]``).
        pretrain: a partner's pre-phase (:class:`Pretrain`).
    """

    name: str
    model: str = _CLIENT["model"].default
    peft: PeftKind = _CLIENT["peft"].default
    learning_rate: float | None = None
    extra_args: list[str] = Field(default_factory=list)
    role: Literal["learner", "partner"] = "learner"
    local_groups: int | None = Field(None, ge=1)
    pretrain: Pretrain | None = None

    @model_validator(mode="after")
    def _partner_only(self) -> ClientRole:
        if self.role == "learner" and (self.pretrain is not None
                                       or self.local_groups is not None):
            raise ValueError(f"{self.name}: pretrain and local_groups are for partners; a "
                             "learner's groups come from the arm")
        return self


class Pairing(BaseModel):
    name: str
    clients: list[ClientRole] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> Pairing:
        names = [c.name for c in self.clients]
        if len(set(names)) != len(names):
            raise ValueError(f"pairing {self.name}: client names must be unique")
        if not any(c.role == "learner" for c in self.clients):
            raise ValueError(f"pairing {self.name}: needs at least one learner")
        return self

    @property
    def learners(self) -> list[ClientRole]:
        return [c for c in self.clients if c.role == "learner"]


class Mix(BaseModel):
    """Local groups I and external groups J per round (SAPO's I/J)."""

    local: int = Field(ge=1)
    external: int = Field(ge=0)

    @property
    def label(self) -> str:
        return f"{self.local}-{self.external}"


class Arm(BaseModel):
    """One arm: the learners' method, local groups I, external groups J, extra flags.

    Attributes:
        args: extra ``ftis-client start`` flags of the learners in this arm (e.g.
            ``["--divergence", "kl_learner_gen", "--filter-threshold", "50"]``).
        partners: start the pairing's partners too (``false`` for arms that cannot use
            them, such as ``alone``: saves their compute).
    """

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
    method: ClientMethod
    local: int = Field(ge=1)
    external: int = Field(0, ge=0)
    args: list[str] = Field(default_factory=list)
    partners: bool = True

    @property
    def mix(self) -> str:
        return f"{self.local}-{self.external}"


class Contrast(BaseModel):
    """``arm`` minus ``baseline``, paired by seed."""

    arm: str
    baseline: str


class PowerSettings(BaseModel):
    """Target of the sample-size line: detect ``effect`` (in the primary metric's unit)
    with ``power`` at two-sided ``alpha`` after Holm over ``family_size`` contrasts
    (default: this config's contrasts)."""

    effect: float = Field(0.10, gt=0)
    power: float = Field(0.8, gt=0, lt=1)
    alpha: float = Field(0.05, gt=0, lt=1)
    family_size: int | None = Field(None, ge=1)


class ExperimentConfig(BaseModel):
    """An experiment matrix (``ftis-lab experiment --config FILE``, JSON or TOML)."""

    id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                           description="short name: the folder of its committed results")
    name: str = "experiment"
    rounds: int = Field(6, ge=1)
    seeds: list[int] = Field(default_factory=lambda: [0])
    methods: list[str] = Field(default_factory=lambda: ["ftis"])
    pairings: list[Pairing] = Field(min_length=1)
    mixes: list[Mix] = Field(default_factory=lambda: [Mix(local=2, external=2)])
    arms: list[Arm] | None = None
    contrasts: list[Contrast] | None = Field(
        None, description="default: every arm with J > 0 vs alone_batch_matched, ftis vs "
        "tis, tis vs nois, ftis vs ftis_old_gate (those whose arms exist)")
    pool_clients: bool = Field(False, description="contrasts on the mean over learners")
    primary_metric: str = Field("eval_heldout", description="eval.jsonl key compared at "
                                "the last evaluation (eval_heldout_sampled: sampled pass@1)")
    power: PowerSettings = Field(default_factory=PowerSettings)
    group_size: int = Field(_CLIENT["group_size"].default, ge=2)
    max_new_tokens: int = Field(48, ge=1, description="shorter than the client's default: "
                                "the matrices' tasks need few tokens")
    temperature: float = _CLIENT["temperature"].default
    tasks: list[TaskSpec] = Field(default_factory=lambda: list(DEFAULT_TASKS))
    heldout_fraction: float = Field(0.0, ge=0, lt=1, description="the coordinator never "
                                    "leases this share of operand keys (ftis.tasks.split)")
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

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        if self.arms is None:
            if any(c.role == "partner" for p in self.pairings for c in p.clients):
                raise ValueError("partner roles need an arms config")
            if self.contrasts:
                raise ValueError("contrasts need an arms config")
        else:
            names = [a.name for a in self.arms]
            if not names or len(set(names)) != len(names):
                raise ValueError("arms need unique names")
            for a in self.arms:
                if a.method == "on_policy" and a.external:
                    raise ValueError(f"arm {a.name}: on_policy uses no external groups; "
                                     "set external 0 (or local I + J for a batch-matched "
                                     "control)")
            for c in self.contrasts or []:
                for n in (c.arm, c.baseline):
                    if n not in names:
                        raise ValueError(f"contrast refers to unknown arm {n!r}")
        if (self.heldout_fraction > 0 and "heldout_fraction" in EvalConfig.model_fields
                and "heldout_fraction" not in self.eval.model_fields_set):
            # evaluate on the operand keys the coordinator never leases
            self.eval = self.eval.model_copy(update={"heldout_fraction":
                                                     self.heldout_fraction})
        return self

    @classmethod
    def load(cls, path: Path) -> ExperimentConfig:
        text = path.read_text()
        if path.suffix == ".toml":
            import tomllib

            return cls.model_validate(tomllib.loads(text))
        return cls.model_validate_json(text)

    @property
    def results_id(self) -> str:
        return self.id or "experiment"

    def contrast_list(self) -> list[Contrast]:
        """The configured contrasts, or the default rule (see ``contrasts``)."""
        if self.arms is None:
            return []
        if self.contrasts is not None:
            return list(self.contrasts)
        return [Contrast(arm=a, baseline=b) for a, b in
                report.default_contrasts([(a.name, a.external) for a in self.arms])]

    def solo_label(self, pairing: Pairing) -> str:
        """Pairing label of this pairing's partner-less cells."""
        first = [c.model_dump() for c in self.pairings[0].learners]
        if all([c.model_dump() for c in p.learners] == first for p in self.pairings):
            return SOLO
        return f"{pairing.name}-{SOLO}"

    def partner_local_groups(self, role: ClientRole) -> int:
        if role.local_groups is not None:
            return role.local_groups
        return max([1, *(a.external for a in self.arms or [])])


# ---------------------------------------------------------------------------- cells


def cells(cfg: ExperimentConfig) -> list[dict]:
    """The matrix as a list of cells.

    Each cell is a dict: ``name`` (its folder), ``pairing`` (label: the pairing's name,
    or ``solo``), ``source`` (the pairing it was built from), ``roles`` (``(k, ClientRole)``
    pairs started, ``k`` the role's index in its pairing, which sets its seed), ``arm``
    (:class:`Arm`), ``mix`` (``"I-J"``), ``method`` (the arm's name; the older form's
    method, ``alone`` included), ``seed`` and ``legacy`` (built from methods × mixes).
    """
    out = []
    if cfg.arms is None:
        for pairing, mix, method, seed in itertools.product(cfg.pairings, cfg.mixes,
                                                            cfg.methods, cfg.seeds):
            alone = method == "alone"
            arm = Arm(name=method, method="on_policy" if alone else method, local=mix.local,
                      external=0 if alone else mix.external)
            out.append({"name": f"{pairing.name}__{mix.label}__{method}__s{seed}",
                        "pairing": pairing.name, "source": pairing.name,
                        "roles": list(enumerate(pairing.clients)), "arm": arm,
                        "mix": mix.label, "method": method, "seed": seed, "legacy": True})
        return out
    seen: set[str] = set()
    for seed, pairing, arm in itertools.product(cfg.seeds, cfg.pairings, cfg.arms):
        roles = [(k, r) for k, r in enumerate(pairing.clients)
                 if arm.partners or r.role == "learner"]
        label = pairing.name if arm.partners else cfg.solo_label(pairing)
        name = f"{label}__{arm.name}__s{seed}"
        if name in seen:
            continue
        seen.add(name)
        out.append({"name": name, "pairing": label, "source": pairing.name, "roles": roles,
                    "arm": arm, "mix": arm.mix, "method": arm.name, "seed": seed,
                    "legacy": False})
    return out


def merge_args(base: list[str], override: list[str]) -> list[str]:
    """``base + override`` without the ``base`` flags that ``override`` sets again.

    A flag followed by a token that is not a flag is taken as ``--flag VALUE``;
    ``--flag=VALUE`` is understood too.
    """
    def flags(args: list[str]) -> set[str]:
        return {a.split("=", 1)[0] for a in args if a.startswith("--")}

    again = flags(override)
    kept: list[str] = []
    i = 0
    while i < len(base):
        tok = base[i]
        valued = (tok.startswith("--") and "=" not in tok and i + 1 < len(base)
                  and not base[i + 1].startswith("--"))
        width = 2 if valued else 1
        if not (tok.startswith("--") and tok.split("=", 1)[0] in again):
            kept += base[i:i + width]
        i += width
    return kept + list(override)


class SwarmSettings(Protocol):
    """What the swarm launcher reads of a config (:class:`ExperimentConfig`, or another
    runner's config such as MERIT's): the clients' sampling and the cells' limits."""

    @property
    def group_size(self) -> int: ...
    @property
    def max_new_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def threads_per_client(self) -> int: ...
    @property
    def cell_timeout_min(self) -> float: ...


def base_client_args(cfg: SwarmSettings, role: ClientRole, *, method: str, local: int,
                     external: int, rounds: int, seed: int,
                     checkpoint_every: int) -> list[str]:
    """``ftis-client start`` flags of ``role`` running ``method`` with ``local`` groups
    (I) and ``external`` groups (J) per round for ``rounds`` rounds (without
    ``role.extra_args``: :func:`merge_args` them on top)."""
    args = ["--model", role.model, "--peft", role.peft, "--rounds", str(rounds),
            "--local-groups", str(local), "--external-groups", str(external),
            "--group-size", str(cfg.group_size), "--max-new-tokens", str(cfg.max_new_tokens),
            "--temperature", str(cfg.temperature), "--method", method,
            "--seed", str(seed), "--display-name", role.name,
            "--checkpoint-every", str(checkpoint_every)]
    if role.learning_rate is not None:
        args += ["--learning-rate", str(role.learning_rate)]
    return args


def client_args(cfg: ExperimentConfig, cell: dict, role: ClientRole, k: int,
                eval_file: Path) -> list[str]:
    """``ftis-client start`` flags of ``role`` (index ``k`` in its pairing) in ``cell``.

    Learners run the arm (method, I, J, the arm's args) and are evaluated; partners run
    on_policy with J = 0 (and their pre-phase's rounds on top, when they have one).
    Later flags override earlier ones: matrix < arm < role.
    """
    arm: Arm = cell["arm"]
    seed = 1000 * cell["seed"] + k
    if role.role == "learner":
        args = base_client_args(cfg, role, method=arm.method, local=arm.local,
                          external=arm.external, rounds=cfg.rounds, seed=seed,
                          checkpoint_every=cfg.rounds)
        if cfg.eval_every:
            args += ["--eval-every", str(cfg.eval_every), "--eval-config", str(eval_file)]
        args = merge_args(args, arm.args)
    else:
        # a partner runs until its cell's learners are done (run_cell stops it then), so
        # the learners see external groups in every round however fast the partner is
        pre = role.pretrain.rounds if role.pretrain else 0
        args = base_client_args(cfg, role, method="on_policy",
                          local=cfg.partner_local_groups(role), external=0,
                          rounds=pre + PARTNER_ROUND_FACTOR * cfg.rounds, seed=seed,
                          checkpoint_every=PARTNER_ROUND_FACTOR * cfg.rounds)
    return merge_args(args, role.extra_args)


_client_args = client_args  # the older name


def coordinator_settings(tasks: list[TaskSpec], seed: int,
                         heldout_fraction: float = 0.0) -> dict:
    """The coordinator's ``--config`` leasing ``tasks`` with ``task_seed`` ``seed``, and
    never the ``heldout_fraction`` of operand keys (:mod:`ftis.tasks.split`) when > 0."""
    out: dict[str, Any] = {"tasks": [t.model_dump() for t in tasks], "task_seed": seed}
    if heldout_fraction > 0:
        out["heldout_fraction"] = heldout_fraction
    return out


def coordinator_config(cfg: ExperimentConfig, seed: int,
                       tasks: list[TaskSpec] | None = None) -> dict:
    """The coordinator's ``--config`` for a cell (or a pre-phase, with its ``tasks``:
    no held-out part then)."""
    if tasks is not None:
        return coordinator_settings(tasks, seed)
    return coordinator_settings(cfg.tasks, seed, cfg.heldout_fraction)


#: a partner's round budget, in multiples of the cell's rounds; it is stopped as soon as
#: the learners finish, so this only has to outlast them
PARTNER_ROUND_FACTOR = 10


class CellMismatchError(RuntimeError):
    """A finished cell was run with other settings than the current config's."""


def cell_spec(cdir: Path, coordinator: dict, clients: dict[str, list[str]],
              extra: dict | None = None) -> dict:
    """A cell's settings as written to ``spec.json`` (the cell folder's path replaced by
    ``{cell}``, so a moved run still matches)."""
    here = str(cdir)
    return json.loads(json.dumps({
        "coordinator": coordinator,
        "clients": {n: [a.replace(here, "{cell}") for a in args]
                    for n, args in clients.items()},
        **(extra or {})}))


def _check_spec(cdir: Path, spec: dict, label: str) -> None:
    path = cdir / "spec.json"
    if not path.exists():  # finished before specs were written: trust it
        return
    old = json.loads(path.read_text())
    if old != spec:
        keys = sorted(k for k in set(old) | set(spec) if old.get(k) != spec.get(k))
        raise CellMismatchError(
            f"{label} in {cdir} was run with other settings ({', '.join(keys)} differ); "
            "use another --out, or delete the folder to run it again")


def done_or_fresh(cdir: Path, spec: dict, label: str) -> bool:
    """True if ``cdir`` holds a finished run of ``spec`` (``CellMismatchError`` if it was
    run with other settings); otherwise empty ``cdir``, write ``spec.json``, False."""
    if (cdir / "DONE").exists():
        _check_spec(cdir, spec, label)
        return True
    shutil.rmtree(cdir, ignore_errors=True)
    cdir.mkdir(parents=True)
    (cdir / "spec.json").write_text(json.dumps(spec, indent=1))
    return False


def run_swarm(cfg: SwarmSettings, cdir: Path, label: str, coordinator: dict,
               specs: list[ClientSpec],
               on_progress: Callable[[int], None] | None = None,
               wait_for: set[str] | None = None) -> None:
    """Run ``specs`` against a fresh coordinator until every client in ``wait_for``
    (default: all) has exited; the others (partners) are then stopped. Raises
    ``RuntimeError`` if a waited-for client exits non-zero, ``TimeoutError`` past the
    cell timeout."""
    waited = [s for s in specs if wait_for is None or s.name in wait_for]
    coord_cfg = cdir / "coordinator.json"
    coord_cfg.write_text(json.dumps(coordinator))
    swarm = launch(cdir, specs, threads_per_client=cfg.threads_per_client,
                   coordinator_args=["--config", str(coord_cfg)])
    try:
        deadline = time.monotonic() + cfg.cell_timeout_min * 60
        while any(swarm.clients[s.name].poll() is None for s in waited):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{label} exceeded {cfg.cell_timeout_min} min")
            if on_progress:
                on_progress(min(len(read_metrics(cdir / s.name / "metrics.jsonl"))
                                for s in waited))
            time.sleep(2.0)
        codes = {s.name: swarm.clients[s.name].returncode for s in waited}
        # a partner that died early starved the learners of external groups
        codes.update({n: p.returncode for n, p in swarm.clients.items()
                      if n not in codes and p.poll() is not None})
    finally:
        swarm.stop()
    if any(codes.values()):
        raise RuntimeError(f"{label}: client exit codes {codes}; see {cdir / 'logs'}")


def run_pretrain(cfg: ExperimentConfig, pairing: str, k: int, role: ClientRole, seed: int,
                 out: Path) -> Path:
    """Run (or reuse) ``role``'s pre-phase for ``seed``; returns its checkpoints folder."""
    assert role.pretrain is not None
    pdir = out / "pretrain" / f"{pairing}__{role.name}__s{seed}"
    pre = role.pretrain
    coordinator = coordinator_config(cfg, seed, pre.tasks)
    args = merge_args(base_client_args(cfg, role, method="on_policy",
                                 local=cfg.partner_local_groups(role), external=0,
                                 rounds=pre.rounds, seed=1000 * seed + k,
                                 checkpoint_every=pre.rounds), role.extra_args)
    spec = cell_spec(pdir, coordinator, {role.name: args})
    label = f"pre-phase {pdir.name}"
    if not done_or_fresh(pdir, spec, label):
        run_swarm(cfg, pdir, label, coordinator, [ClientSpec(role.name, args)])
        (pdir / "DONE").write_text("ok\n")
    return pdir / role.name / "checkpoints"


def _link_checkpoint(src: Path, dst: Path) -> None:
    """Put ``src``'s latest checkpoint into ``dst`` (hard links where possible)."""
    name = (src / "latest").read_text().strip()

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    dst.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src / name, dst / name, copy_function=link)
    (dst / "latest").write_text(name)


def cell_settings(cfg: ExperimentConfig, cell: dict, cdir: Path
                  ) -> tuple[dict[str, list[str]], dict, dict]:
    """A cell's client flags (by role), coordinator ``--config`` and the settings
    :func:`run_cell` writes to its ``spec.json`` (the cell folder ``cdir`` as
    ``{cell}``): what decides whether two runs ran the same cell."""
    args = {role.name: client_args(cfg, cell, role, k, cdir / "eval.json")
            for k, role in cell["roles"]}
    coordinator = coordinator_config(cfg, cell["seed"])
    pre = {role.name: role.pretrain.model_dump() for _, role in cell["roles"]
           if role.role == "partner" and role.pretrain}
    spec = cell_spec(cdir, coordinator, args,
                     {"eval": cfg.eval.model_dump() if cfg.eval_every else None,
                      "pretrain": pre})
    return args, coordinator, spec


def cell_specs(cfg: ExperimentConfig) -> dict[str, dict]:
    """Every cell's name -> its ``spec.json`` settings (:func:`cell_settings`). Two
    configs run the same cell exactly when a name maps to equal specs in both."""
    return {cell["name"]: cell_settings(cfg, cell, Path("cells") / cell["name"])[2]
            for cell in cells(cfg)}


def run_cell(cfg: ExperimentConfig, cell: dict, out: Path,
             on_progress: Callable[[int], None] | None = None) -> list[dict]:
    """Run one cell (skipped if ``DONE`` exists and its settings match); returns its
    result rows."""
    cdir = out / "cells" / cell["name"]
    eval_file = cdir / "eval.json"
    args, coordinator, spec = cell_settings(cfg, cell, cdir)
    label = f"cell {cell['name']}"
    if not done_or_fresh(cdir, spec, label):
        for k, role in cell["roles"]:
            if role.role == "partner" and role.pretrain:
                ckpt = run_pretrain(cfg, cell["source"], k, role, cell["seed"], out)
                _link_checkpoint(ckpt, cdir / role.name / "checkpoints")
        if cfg.eval_every:
            eval_file.write_text(cfg.eval.model_dump_json())
        specs = [ClientSpec(name, a) for name, a in args.items()]
        learners = {role.name for _, role in cell["roles"] if role.role == "learner"}
        run_swarm(cfg, cdir, label, coordinator, specs, on_progress, wait_for=learners)
        for _, role in cell["roles"]:  # weights + AdamW state: ~1.6 GB per 135M model
            shutil.rmtree(cdir / role.name / "checkpoints", ignore_errors=True)
        (cdir / "DONE").write_text("ok\n")
    return cell_rows(cell, cdir)


def cell_rows(cell: dict, cdir: Path) -> list[dict]:
    """The result rows of a cell's clients (one per client and round), from their
    ``metrics.jsonl`` under ``cdir``."""
    return [_row(cell, role, rec) for _, role in cell["roles"]
            for rec in read_metrics(cdir / role.name / "metrics.jsonl")]


_KEEP = ("round", "reward_mean", "tokens_per_second", "is_weight_mean", "is_weight_max",
         "is_weight_raw_max", "filtered_frac", "truncated_frac", "divergence_mean",
         "external_is_weight_mean", "external_is_weight_max", "external_filtered_frac",
         "external_is_weight_raw_max", "external_truncated_frac", "external_divergence_mean",
         "external_groups_used", "external_cross_tokenizer_groups", "round_seconds",
         "peak_rss_mb", "eval_heldout", "eval_ood", "eval_heldout_sampled",
         "eval_ood_sampled", "gate_mean", "gate_max", "external_gate_mean",
         "external_gate_max", "external_logratio_gen_mean")


def _method(cell: dict, role: ClientRole) -> str:
    """The method column: the older form's method name (``alone`` included), else the
    method the client ran."""
    if cell["legacy"]:
        return cell["method"]
    return cell["arm"].method if role.role == "learner" else "on_policy"


def _row(cell: dict, role: ClientRole, rec: dict) -> dict:
    keep = {k: rec[k] for k in _KEEP if k in rec}
    # the gate's estimators (k1_mean, ...) under whatever names the learner logs them
    keep.update({k: v for k, v in rec.items() if "k1" in k and isinstance(v, int | float)})
    return {"cell": cell["name"], "pairing": cell["pairing"], "mix": cell["mix"],
            "arm": cell["method"], "method": _method(cell, role), "role": role.role,
            "seed": cell["seed"], "client": role.name, **keep}


def read_evals(out: Path, cell: dict) -> list[dict]:
    rows = []
    for _, role in cell["roles"]:
        path = out / "cells" / cell["name"] / role.name / "eval.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                if not line.strip():
                    continue
                rec = json.loads(line)
                rec.pop("method", None)  # the cell's method ("alone" runs as on_policy)
                rows.append({**rec, "cell": cell["name"], "pairing": cell["pairing"],
                             "mix": cell["mix"], "arm": cell["method"],
                             "method": _method(cell, role), "role": role.role,
                             "seed": cell["seed"], "client": role.name})
    return rows


def collect_finished(cfg: ExperimentConfig, out: Path) -> tuple[list[dict], list[dict], int]:
    """The result rows and held-out evaluations of the cells of ``cfg`` already finished
    under ``out`` (a ``DONE`` marker), without running or touching any cell: a run still
    in progress keeps going, and its finished cells can be committed before it ends.

    Returns:
        ``(rows, evals, cells finished)``, in the matrix's cell order.
    """
    rows: list[dict] = []
    evals: list[dict] = []
    done = 0
    for cell in cells(cfg):
        cdir = out / "cells" / cell["name"]
        if not (cdir / "DONE").exists():
            continue
        done += 1
        rows += cell_rows(cell, cdir)
        evals += read_evals(out, cell)
    return rows, evals, done


def results_config(src: Path) -> dict:
    """``src/config.json`` of a results folder (``--collect-to``).

    Raises:
        ValueError: ``src`` has no ``config.json``.
    """
    path = src / "config.json"
    if not path.exists():
        raise ValueError(f"{src} has no config.json: not a results folder")
    return dict(json.loads(path.read_text()))


def same_config(current: dict, src: Path) -> None:
    """Check that the results folder ``src`` was written by the config ``current`` (its
    ``model_dump(mode="json")``): ``src/config.json`` must equal it in every setting but
    ``seeds``, and its seeds must all be among ``current``'s. A config may add seeds to a
    finished run (a power table asked for more: docs/results.md E.3); every cell is one
    seed, so the cells both hold were run with the same settings. Dropping a seed is
    refused: collecting over ``src`` would then lose its cells.

    Raises:
        ValueError: ``src`` has no ``config.json``, it differs in another setting (the
            keys are named), or it holds seeds that ``current`` lacks (they are named).
    """
    old = results_config(src)
    cur = json.loads(json.dumps(current))
    keys = sorted(k for k in set(old) | set(cur) if k != "seeds" and old.get(k) != cur.get(k))
    if keys:
        raise ValueError(f"{src} was run with another config ({', '.join(keys)} differ)")
    missing = sorted(set(old.get("seeds", [])) - set(cur.get("seeds", [])))
    if missing:
        raise ValueError(f"{src} was run with another config (seeds differ: it holds "
                         f"seeds {missing} that this config lacks)")


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (blank lines skipped); ``[]`` if it is absent."""
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


#: the labels :func:`_row` and :func:`read_evals` add to a client's own records
_LABELS = ("cell", "pairing", "mix", "arm", "method", "role", "seed", "client")


def cells_dropped(dst: Path, rows: list[dict]) -> list[str]:
    """The cells whose rows ``dst/results.jsonl`` holds but ``rows`` does not: what
    writing ``rows`` over ``dst`` would lose (e.g. collecting a run that was not
    restored from the committed results first)."""
    have = {r["cell"] for r in rows}
    return sorted({r["cell"] for r in read_jsonl(dst / "results.jsonl")} - have)


def restore_finished(cfg: ExperimentConfig, src: Path, out: Path) -> int:
    """Rebuild under ``out`` the finished cells whose raw results ``src`` holds (a folder
    written by ``--collect-to`` or by a finished run, e.g. committed under
    ``experiments/results/``), so that a run resumed on another machine, or after its
    working folder was lost, skips them. Each restored cell gets its clients'
    ``metrics.jsonl`` and ``eval.jsonl`` back from the rows (:func:`cell_rows` and
    :func:`read_evals` then return exactly the rows of ``src``), a ``RESTORED`` file
    naming ``src`` and a ``DONE`` marker; no checkpoints (nothing needs them once a cell
    is done). A cell already finished under ``out`` is left as it is.

    Returns:
        The number of cells restored.

    Raises:
        ValueError: ``src`` was written by another config (:func:`same_config`).
    """
    same_config(cfg.model_dump(mode="json"), src)
    return _restore(cfg, src, out, {c["name"] for c in cells(cfg)})


def restore_shared(cfg: ExperimentConfig, src: Path, out: Path) -> int:
    """As :func:`restore_finished`, from the results of *another* experiment: only the
    cells that are cells of both with equal settings (:func:`cell_specs`), e.g. the
    partner-less ``solo__*`` cells that every partner experiment run into
    ``runs/ftis_methods`` shares. A cell whose settings differ in any flag is never
    restored, so nothing run with other settings is mixed in.

    Returns:
        The number of cells restored.

    Raises:
        ValueError: ``src`` has no ``config.json``, or it is not an experiment matrix.
    """
    try:
        other = ExperimentConfig.model_validate(results_config(src))
    except ValidationError as exc:
        raise ValueError(f"{src} was not written by an experiment matrix: {exc}") from exc
    theirs = cell_specs(other)
    shared = {n for n, spec in cell_specs(cfg).items() if theirs.get(n) == spec}
    return _restore(cfg, src, out, shared)


def _restore(cfg: ExperimentConfig, src: Path, out: Path, names: set[str]) -> int:
    """Rebuild the cells of ``cfg`` named in ``names`` whose rows ``src`` holds."""
    rows: dict[str, list[dict]] = defaultdict(list)
    for r in read_jsonl(src / "results.jsonl"):
        rows[r["cell"]].append(r)
    evals: dict[str, list[dict]] = defaultdict(list)
    for e in read_jsonl(src / "evals.jsonl"):
        evals[e["cell"]].append(e)
    restored = 0
    for cell in cells(cfg):
        cdir = out / "cells" / cell["name"]
        if (cell["name"] not in names or cell["name"] not in rows
                or (cdir / "DONE").exists()):
            continue
        shutil.rmtree(cdir, ignore_errors=True)
        for _, role in cell["roles"]:
            rdir = cdir / role.name
            rdir.mkdir(parents=True)
            for name, recs in (("metrics.jsonl", rows[cell["name"]]),
                               ("eval.jsonl", evals[cell["name"]])):
                own = [{k: v for k, v in r.items() if k not in _LABELS}
                       for r in recs if r["client"] == role.name]
                (rdir / name).write_text("".join(json.dumps(r) + "\n" for r in own))
        (cdir / "RESTORED").write_text(f"{src}\n")
        (cdir / "DONE").write_text("ok\n")
        restored += 1
    return restored


def write_results(cfg: ExperimentConfig, rows: list[dict], evals: list[dict], out: Path) -> None:
    """``out/config.json``, ``out/results.jsonl`` and ``out/evals.jsonl``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    with open(out / "results.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    with open(out / "evals.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in evals)


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

            def on_progress(r: int, base: int = base) -> None:
                progress.update(total, completed=base + r)

            rows += run_cell(cfg, cell, out, on_progress)
            evals += read_evals(out, cell)
            progress.update(total, completed=(i + 1) * cfg.rounds)
    write_results(cfg, rows, evals, out)
    return write_summary(cfg, rows, evals, out)


# --------------------------------------------------------------------------- summary


def mean_sd(values: list[float]) -> str:
    return report.mean_sd(values)


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


def analysis(cfg: ExperimentConfig, rows: list[dict], evals: list[dict]) -> dict[str, Any]:
    """The arms analysis: ``arms``, ``divergence`` (how far external completions were
    from the learner, :func:`report.divergence_rows` at the default δ), ``contrasts`` and
    ``power`` markdown tables, plus the contrast results (``results``) and the power line
    (``power_line``)."""
    arms = {a.name: a for a in cfg.arms or []}
    order = {a: i for i, a in enumerate(arms)}
    learners = [r for r in rows if r.get("role", "learner") == "learner"]
    ends = report.final_values([e for e in evals if e.get("role", "learner") == "learner"],
                               cfg.primary_metric)
    shares = report.gate_shares(learners)
    rewards: dict[tuple, list[float]] = defaultdict(list)
    by_seed: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in learners:
        by_seed[(r["pairing"], r["arm"], r["client"])][r["seed"]].append(r["reward_mean"])
    ext_used: dict[tuple, list[float]] = defaultdict(list)
    for r in learners:
        ext_used[(r["pairing"], r["arm"], r["client"])].append(
            float(r.get("external_groups_used") or 0.0))
    for key, seeds in by_seed.items():
        rewards[key] = [statistics.mean(v) for v in seeds.values()]
    pairing_order = {p.name: i for i, p in enumerate(cfg.pairings)}
    keys = sorted(set(by_seed) | set(ends), key=lambda k: (
        pairing_order.get(k[0], -1), order.get(k[1], 99), k[1], k[2]))
    arm_rows = []
    for key in keys:
        a = arms.get(key[1])
        arm_rows.append({"pairing": key[0], "arm": key[1],
                         "method": a.method if a else key[1],
                         "mix": a.mix if a else "", "client": key[2],
                         "ends": ends.get(key, {}), "rewards": rewards.get(key, []),
                         "ext_groups": (statistics.mean(ext_used[key]) if ext_used.get(key)
                                        else None),
                         "shares": shares.get(key)})
    divergence = report.divergence_rows(learners, DEFAULT_FILTER_THRESHOLD)
    div_rows = [{"pairing": r["pairing"], "arm": r["arm"], "method": r["method"],
                 "client": r["client"], **divergence[(r["pairing"], r["arm"], r["client"])]}
                for r in arm_rows if (r["pairing"], r["arm"], r["client"]) in divergence]
    flagged = {(r["pairing"], r["arm"]) for r in arm_rows
               if r["method"] in report.GATED_METHODS and report.gates_idle(r["shares"])}

    def where(pairing: str, arm: str) -> str:
        a = arms[arm]
        return pairing if a.partners else cfg.solo_label(
            next(p for p in cfg.pairings if p.name == pairing))

    def values(label: str, arm: str, client: str, learners: list[str]) -> dict[int, float]:
        if client == report.POOLED:
            return report.pooled(ends, label, arm, learners)
        return {s: v[1] for s, v in ends.get((label, arm, client), {}).items()}

    items, seen = [], set()
    for pairing in cfg.pairings:
        names = [x.name for x in pairing.learners]
        for c in cfg.contrast_list():
            pa, pb = where(pairing.name, c.arm), where(pairing.name, c.baseline)
            for client in [report.POOLED] if cfg.pool_clients else names:
                if (pa, c.arm, pb, c.baseline, client) in seen:  # two partner-less arms
                    continue
                seen.add((pa, c.arm, pb, c.baseline, client))
                notes = [f"gates idle in {arm}" for lab, arm in ((pa, c.arm), (pb, c.baseline))
                         if (lab, arm) in flagged]
                items.append({"pairing": pa if pa == pb else pairing.name,
                              "client": client, "arm": c.arm,
                              "baseline": c.baseline,
                              "after": values(pa, c.arm, client, names),
                              "before": values(pb, c.baseline, client, names),
                              "note": "; ".join(notes)})
    results = report.paired_contrasts(items)
    family = cfg.power.family_size or max(len(items), 1)
    power = report.power_rows(results, cfg.power.effect, cfg.power.power, cfg.power.alpha,
                              family)
    return {
        "arms": report.arms_table(arm_rows, cfg.primary_metric),
        "divergence": report.divergence_table(div_rows, DEFAULT_FILTER_THRESHOLD),
        "contrasts": report.contrasts_table(results, cfg.primary_metric),
        "power": report.power_table(power, cfg.primary_metric, cfg.power.effect,
                                    cfg.power.power, cfg.power.alpha, family),
        "results": results,
        "power_line": report.power_line(power, cfg.primary_metric, cfg.power.effect,
                                        cfg.power.power, cfg.power.alpha, family),
    }


def write_summary(cfg: ExperimentConfig, rows: list[dict], evals: list[dict], out: Path) -> Path:
    if cfg.arms is not None:
        res = analysis(cfg, rows, evals)
        lines = [f"# {cfg.name}", "",
                 f"{cfg.rounds} rounds, seeds {cfg.seeds}, G = {cfg.group_size}, "
                 f"max_new_tokens = {cfg.max_new_tokens}, temperature {cfg.temperature}; "
                 f"primary metric `{cfg.primary_metric}` at the last evaluation.", "",
                 "## Arms", "", res["arms"], "", "## Contrasts (seed-paired)", "",
                 res["contrasts"], "", "## Power", "", res["power"], "",
                 *[f"![{p.name}]({p.name})" for p in plot_curves(rows, out, by_mix=False)],
                 ""]
        path = out / "summary.md"
        path.write_text("\n".join(lines))
        (out / "summary.json").write_text(json.dumps(
            {"contrasts": res["results"], "power": res["power_line"]}, indent=1))
        return path
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


def plot_curves(rows: list[dict], out: Path, by_mix: bool = True) -> list[Path]:
    """One PNG per (pairing, mix) (``by_mix`` false: per pairing): learners' reward per
    round, one line per (arm, client), mean over seeds with a min–max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    by_panel: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("role", "learner") != "learner":
            continue
        by_panel[(r["pairing"], r["mix"]) if by_mix else (r["pairing"],)].append(r)
    for panel, prow in sorted(by_panel.items()):
        fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
        lines: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in prow:
            lines[(r.get("arm", r["method"]), r["client"])][r["round"]].append(r["reward_mean"])
        for (arm, client), per_round in sorted(lines.items()):
            xs = sorted(per_round)
            mean = [statistics.mean(per_round[x]) for x in xs]
            (line,) = ax.plot(xs, mean, marker=".", label=f"{arm} / {client}")
            ax.fill_between(xs, [min(per_round[x]) for x in xs],
                            [max(per_round[x]) for x in xs], alpha=0.12,
                            color=line.get_color())
        ax.set_xlabel("round")
        ax.set_ylabel("mean verified reward")
        ax.set_title(f"{panel[0]}, I-J = {panel[1]}" if by_mix else panel[0])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out / ("curves_" + "_".join(panel) + ".png")
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
