"""Experiment arms: client flags, resumable cells, the arms analysis and the regenerated
docs tables (no processes: ``launch`` is replaced by a fake that writes the logs)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError
from script_loader import load_script

from ftis.lab.experiment import matrix, report
from ftis.lab.experiment.matrix import (
    PARTNER_ROUND_FACTOR,
    CellMismatchError,
    ExperimentConfig,
    analysis,
    cells,
    client_args,
    collect_finished,
    coordinator_config,
    merge_args,
    restore_finished,
    restore_shared,
    run_cell,
    run_experiment,
    write_results,
)

ROOT = Path(__file__).resolve().parents[2]
TASKS = [{"dataset": "chain_sum", "reward": "exact",
          "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}]
LEARNER = {"name": "learner", "model": "tiny", "learning_rate": 1e-5}
HOT = {"name": "hot", "clients": [
    LEARNER, {"name": "partner", "role": "partner", "model": "tiny",
              "extra_args": ["--temperature", "1.2"]}]}


def arms_config(**over) -> ExperimentConfig:
    base = {
        "id": "t", "name": "t", "rounds": 2, "seeds": [0], "pairings": [HOT],
        "arms": [
            {"name": "alone", "method": "on_policy", "local": 2, "partners": False},
            {"name": "alone_batch_matched", "method": "on_policy", "local": 4,
             "partners": False},
            {"name": "nois", "method": "nois", "local": 2, "external": 2},
            {"name": "tis", "method": "tis", "local": 2, "external": 2},
            {"name": "ftis_old_gate", "method": "ftis", "local": 2, "external": 2,
             "args": ["--divergence", "kl_learner_gen", "--filter-threshold", "50"]},
            {"name": "ftis", "method": "ftis", "local": 2, "external": 2}],
        "group_size": 4, "max_new_tokens": 8, "temperature": 0.7, "tasks": TASKS,
        "heldout_fraction": 0.4, "eval_every": 2, "eval": {"size": 4},
        "primary_metric": "eval_heldout_sampled"}
    base.update(over)
    return ExperimentConfig.model_validate(base)


def flag(args: list[str], name: str) -> str | None:
    """The value of ``name`` in ``args``; fails if the flag is given twice."""
    hits = [i for i, a in enumerate(args) if a == name]
    assert len(hits) <= 1, f"{name} given {len(hits)} times in {args}"
    return args[hits[0] + 1] if hits else None


def by_name(cfg: ExperimentConfig) -> dict[str, dict]:
    return {c["name"]: c for c in cells(cfg)}


def args_of(cfg: ExperimentConfig, cell: dict, role_name: str) -> list[str]:
    k, role = next((k, r) for k, r in cell["roles"] if r.name == role_name)
    return client_args(cfg, cell, role, k, Path("CELL/eval.json"))


# ------------------------------------------------------------------- arm expansion
def test_arms_expand_to_the_right_client_flags():
    cfg = arms_config(seeds=[0, 3])
    cs = by_name(cfg)
    # partner-less arms run once per seed, shared by the pairings; seed-major order
    assert list(cs)[:6] == ["solo__alone__s0", "solo__alone_batch_matched__s0",
                            "hot__nois__s0", "hot__tis__s0", "hot__ftis_old_gate__s0",
                            "hot__ftis__s0"]
    assert len(cs) == 12
    abm = cs["solo__alone_batch_matched__s3"]
    assert [r.name for _, r in abm["roles"]] == ["learner"]
    a = args_of(cfg, abm, "learner")
    assert (flag(a, "--method"), flag(a, "--local-groups"), flag(a, "--external-groups")) == (
        "on_policy", "4", "0")
    assert flag(a, "--seed") == "3000"
    assert flag(a, "--temperature") == "0.7"
    assert flag(a, "--eval-every") == "2" and flag(a, "--eval-config") == "CELL/eval.json"
    alone = args_of(cfg, cs["solo__alone__s0"], "learner")
    assert (flag(alone, "--method"), flag(alone, "--local-groups"),
            flag(alone, "--external-groups")) == ("on_policy", "2", "0")

    old = cs["hot__ftis_old_gate__s0"]
    assert [r.name for _, r in old["roles"]] == ["learner", "partner"]
    la = args_of(cfg, old, "learner")
    assert (flag(la, "--method"), flag(la, "--local-groups"), flag(la, "--external-groups"),
            flag(la, "--divergence"), flag(la, "--filter-threshold")) == (
        "ftis", "2", "2", "kl_learner_gen", "50")
    new = args_of(cfg, cs["hot__ftis__s0"], "learner")
    assert flag(new, "--divergence") is None and flag(new, "--filter-threshold") is None
    assert flag(args_of(cfg, cs["hot__tis__s0"], "learner"), "--method") == "tis"
    assert flag(args_of(cfg, cs["hot__nois__s0"], "learner"), "--method") == "nois"

    # the partner: on_policy on its own rollouts, J = 0, its own temperature, not evaluated
    pa = args_of(cfg, old, "partner")
    assert (flag(pa, "--method"), flag(pa, "--external-groups"), flag(pa, "--local-groups"),
            flag(pa, "--temperature")) == ("on_policy", "0", "2", "1.2")
    assert flag(pa, "--eval-every") is None
    assert flag(pa, "--seed") == "1"
    # partner flags do not depend on the arm
    assert pa == args_of(cfg, cs["hot__nois__s0"], "partner")


def test_solo_cells_per_pairing_when_learners_differ():
    other = {"name": "q", "clients": [{**LEARNER, "learning_rate": 2e-5},
                                      {"name": "partner", "role": "partner", "peft": "qlora"}]}
    cfg = arms_config(pairings=[HOT, other])
    names = list(by_name(cfg))
    assert "hot-solo__alone__s0" in names and "q-solo__alone__s0" in names
    same = arms_config(pairings=[HOT, {**other, "clients": [LEARNER, other["clients"][1]]}])
    names = list(by_name(same))
    assert names.count("solo__alone__s0") == 1 and "q__ftis__s0" in names


def test_merge_args_later_flags_win():
    base = ["--method", "ftis", "--temperature", "0.7", "--seed", "1"]
    assert merge_args(base, ["--temperature", "1.2"]) == [
        "--method", "ftis", "--seed", "1", "--temperature", "1.2"]
    assert merge_args(base, ["--seed=5", "--qlora-double-quant"]) == [
        "--method", "ftis", "--temperature", "0.7", "--seed=5", "--qlora-double-quant"]
    assert merge_args(["--flag", "--x", "-1"], ["--flag"]) == ["--x", "-1", "--flag"]


def test_partner_local_groups_and_pretrain_rounds():
    cfg = arms_config(pairings=[{"name": "drift", "clients": [LEARNER, {
        "name": "p", "role": "partner", "local_groups": 3,
        "pretrain": {"rounds": 5, "tasks": [{"dataset": "gcd"}]}}]}])
    cell = by_name(cfg)["drift__ftis__s0"]
    pa = args_of(cfg, cell, "p")
    assert flag(pa, "--local-groups") == "3"
    # 5 pre-phase rounds, then open-ended: the cell stops it when the learner is done
    assert flag(pa, "--rounds") == str(5 + PARTNER_ROUND_FACTOR * 2)
    assert flag(args_of(cfg, cell, "learner"), "--rounds") == "2"


def test_config_validation():
    with pytest.raises(ValidationError, match="on_policy uses no external"):
        arms_config(arms=[{"name": "x", "method": "on_policy", "local": 2, "external": 2}])
    with pytest.raises(ValidationError, match="unknown arm"):
        arms_config(contrasts=[{"arm": "ftis", "baseline": "nope"}])
    with pytest.raises(ValidationError, match="unique"):
        arms_config(arms=[{"name": "a", "method": "tis", "local": 1, "external": 1}] * 2)
    with pytest.raises(ValidationError, match="partners"):
        arms_config(pairings=[{"name": "p", "clients": [{**LEARNER, "local_groups": 2}]}])
    with pytest.raises(ValidationError, match="learner"):
        arms_config(pairings=[{"name": "p", "clients": [{"name": "x", "role": "partner"}]}])
    with pytest.raises(ValidationError, match="arms config"):
        ExperimentConfig.model_validate({"pairings": [HOT], "methods": ["ftis"]})


def test_heldout_fraction_reaches_coordinator_and_evaluation():
    cfg = arms_config()
    assert coordinator_config(cfg, 7) == {"tasks": [cfg.tasks[0].model_dump()],
                                          "task_seed": 7, "heldout_fraction": 0.4}
    if "heldout_fraction" in type(cfg.eval).model_fields:
        assert cfg.eval.heldout_fraction == 0.4
        explicit = arms_config(eval={"size": 4, "heldout_fraction": 0.0})
        assert explicit.eval.heldout_fraction == 0.0
    assert "heldout_fraction" not in coordinator_config(arms_config(heldout_fraction=0.0), 0)


def test_legacy_methods_by_mixes_config_still_expands():
    cfg = ExperimentConfig.load(ROOT / "experiments" / "ftis_comparison.json")
    cs = by_name(cfg)
    assert "full+lora__2-2__alone__s0" in cs and "full+lora__2-2__vis__s1" in cs
    alone = args_of(cfg, cs["full+lora__2-2__alone__s0"], "lora")
    assert (flag(alone, "--method"), flag(alone, "--external-groups"),
            flag(alone, "--local-groups"), flag(alone, "--peft")) == (
        "on_policy", "0", "2", "lora")
    vis = args_of(cfg, cs["full+lora__2-2__vis__s1"], "full")
    assert (flag(vis, "--method"), flag(vis, "--external-groups"), flag(vis, "--seed")) == (
        "vis", "2", "1000")
    assert flag(vis, "--eval-every") == "3"  # every client of the older form is evaluated


@pytest.mark.parametrize("name", ["ftis_methods", "ftis_power_pilot", "sapo_peer",
                                  "ftis_qlora_partner", "ftis_drifted_partner",
                                  "ftis_comparison", "ftis_comparison_diverging",
                                  "sapo_sweep", "hetero_family", "hetero_family_geometric",
                                  "hetero_peft", "hetero_quant"])
def test_committed_configs_load(name):
    cfg = ExperimentConfig.load(ROOT / "experiments" / f"{name}.json")
    assert cells(cfg)


def test_committed_methods_configs():
    main = ExperimentConfig.load(ROOT / "experiments" / "ftis_methods.json")
    assert {a.name for a in main.arms} == {"alone", "alone_batch_matched", "nois", "tis",
                                           "ftis_old_gate", "ftis"}
    assert main.heldout_fraction == 0.4 and main.temperature == 0.7
    assert {t.dataset for t in main.tasks} == {"products", "chain_sum"}
    assert all(t.reward == "exact" for t in main.tasks)
    assert len(main.contrast_list()) == 7
    sapo = ExperimentConfig.load(ROOT / "experiments" / "sapo_peer.json")
    assert {(a.local, a.external) for a in sapo.arms} == {(4, 0), (3, 1), (2, 2), (1, 3)}
    assert {a.local + a.external for a in sapo.arms} == {4}
    for arm in sapo.arms:  # J really J: one peer may fill it, and the round waits for it
        if arm.external:
            share = float(arm.args[arm.args.index("--max-sender-share") + 1])
            assert int(share * (arm.local + arm.external)) >= arm.external
            assert float(arm.args[arm.args.index("--external-wait-s") + 1]) > 0


@pytest.mark.parametrize(("name", "solo_arms", "pairing"), [
    ("sapo_peer", ["alone_batch_matched"], "peer"),
    ("ftis_qlora_partner", ["alone", "alone_batch_matched"], "qlora_partner"),
    ("ftis_drifted_partner", ["alone", "alone_batch_matched"], "drifted_partner"),
])
def test_configs_run_into_the_main_folder_share_its_solo_cells(name, solo_arms, pairing):
    """These run into runs/ftis_methods: their partner-less cells must be the main run's
    ``solo__*`` cells exactly (reused, not re-run), and their partnered cells the main
    config's cells of the same pairing, arm and seed."""
    main = ExperimentConfig.load(ROOT / "experiments" / "ftis_methods.json")
    cfg = ExperimentConfig.load(ROOT / "experiments" / f"{name}.json")
    main_cells = by_name(main)
    mine = by_name(cfg)
    solo = {n: c for n, c in mine.items() if n.startswith("solo__")}
    assert sorted(solo) == sorted(f"solo__{a}__s{s}" for a in solo_arms for s in range(9))
    assert all(n.startswith(f"{pairing}__") for n in set(mine) - set(solo))
    for cell_name, cell in mine.items():
        other = main_cells.get(cell_name)
        if other is None:  # an arm the main config does not have (sapo_peer's mixes)
            assert name == "sapo_peer"
            continue
        for _, role in cell["roles"]:
            assert args_of(cfg, cell, role.name) == args_of(main, other, role.name)
        assert coordinator_config(cfg, cell["seed"]) == coordinator_config(main, cell["seed"])
    assert cfg.eval == main.eval


def test_pilot_cells_are_cells_of_the_main_run():
    """The power pilot runs into the same folder as ftis_methods: each of its cells must
    have exactly the main run's settings, so the main run reuses it."""
    main = ExperimentConfig.load(ROOT / "experiments" / "ftis_methods.json")
    pilot = ExperimentConfig.load(ROOT / "experiments" / "ftis_power_pilot.json")
    main_cells = by_name(main)
    assert pilot.power.family_size == len(main.pairings) * len(main.contrast_list())
    for name, cell in by_name(pilot).items():
        other = main_cells[name]
        for _, role in cell["roles"]:
            assert args_of(pilot, cell, role.name) == args_of(main, other, role.name)
        assert coordinator_config(pilot, cell["seed"]) == coordinator_config(main, cell["seed"])
        assert pilot.eval == main.eval


# -------------------------------------------------------------- running (faked) cells
class _Proc:
    """A finished client, or (``running``) one that runs until the swarm stops it."""

    def __init__(self, running: bool = False):
        self.returncode = None if running else 0

    def poll(self) -> int | None:
        return self.returncode


class _Swarm:
    """Partners (``--method on_policy`` without ``--eval-every``) never finish alone."""

    def __init__(self, specs):
        self.clients = {s.name: _Proc(running=flag(s.args, "--eval-every") is None
                                      and len(specs) > 1) for s in specs}
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True
        for p in self.clients.values():
            if p.returncode is None:
                p.returncode = -15


END = {("solo", "alone_batch_matched"): [0.5, 0.4, 0.6], ("hot", "tis"): [0.5, 0.5, 0.6],
       ("hot", "ftis"): [0.6, 0.5, 0.8]}
SHARES = {"tis": (0.0, 0.004), "ftis": (0.05, 0.002)}


@pytest.fixture
def fake_launch(monkeypatch):
    """Replace ``launch``: write each client's metrics (and a learner's evaluations) the
    way a real client would; record the calls."""
    calls: list[dict] = []

    def launch(out, specs, threads_per_client=1, coordinator_args=None):
        coord = json.loads(Path(coordinator_args[1]).read_text())
        calls.append({"out": out, "specs": specs, "coordinator": coord,
                      "had_checkpoint": {s.name: (out / s.name / "checkpoints" / "latest")
                                         .exists() for s in specs}})
        pairing, arm, seed_s = out.name.split("__") if out.parent.name == "cells" else (
            "", "", "s0")
        seed = int(seed_s[1:])
        for s in specs:
            d = out / s.name
            d.mkdir(parents=True, exist_ok=True)
            rounds = int(flag(s.args, "--rounds"))
            ext = int(flag(s.args, "--external-groups"))
            filt, trunc = SHARES.get(arm, (0.0, 0.0))
            with open(d / "metrics.jsonl", "w") as fh:
                for r in range(1, rounds + 1):
                    rec = {"round": r, "reward_mean": 0.2, "external_groups_used": float(ext),
                           "node_id": "x", "external_senders": []}
                    if ext:
                        rec.update(external_filtered_frac=filt, external_truncated_frac=trunc,
                                   external_is_weight_raw_max=3.0, external_k1_mean=0.01)
                    fh.write(json.dumps(rec) + "\n")
            if flag(s.args, "--eval-every"):
                end = END.get((pairing, arm), [0.3, 0.3, 0.3])[seed]
                with open(d / "eval.jsonl", "w") as fh:
                    for r, v in ((0, 0.3), (rounds, end)):
                        fh.write(json.dumps({"round": r, "method": "x", "eval_heldout": v,
                                             "eval_heldout_sampled": v}) + "\n")
            ck = d / "checkpoints" / f"step-{rounds:06d}"
            ck.mkdir(parents=True, exist_ok=True)
            (ck / "trainable.safetensors").write_text("w")
            (d / "checkpoints" / "latest").write_text(ck.name)
        swarm = _Swarm(specs)
        calls[-1]["swarm"] = swarm
        return swarm

    monkeypatch.setattr(matrix, "launch", launch)
    return calls


def test_run_cell_writes_settings_and_is_resumable(tmp_path, fake_launch):
    cfg = arms_config()
    cell = by_name(cfg)["hot__ftis_old_gate__s0"]
    rows = run_cell(cfg, cell, tmp_path)
    assert len(fake_launch) == 1
    call = fake_launch[0]
    assert call["coordinator"] == {"tasks": [cfg.tasks[0].model_dump()], "task_seed": 0,
                                   "heldout_fraction": 0.4}
    assert [s.name for s in call["specs"]] == ["learner", "partner"]
    cdir = tmp_path / "cells" / cell["name"]
    assert (cdir / "DONE").exists() and (cdir / "spec.json").exists()
    assert json.loads((cdir / "eval.json").read_text())["size"] == 4
    assert not (cdir / "learner" / "checkpoints").exists()  # removed after the cell
    # the cell ended when the learner finished; the still-running partner was stopped
    assert call["swarm"].stopped and call["swarm"].clients["partner"].returncode == -15
    assert len(rows) == 2 + 2 * PARTNER_ROUND_FACTOR
    learner = [r for r in rows if r["client"] == "learner"]
    assert {(r["arm"], r["method"], r["role"], r["mix"]) for r in learner} == {
        ("ftis_old_gate", "ftis", "learner", "2-2")}
    assert learner[0]["external_k1_mean"] == 0.01  # the gate's estimators are kept
    assert {r["method"] for r in rows if r["client"] == "partner"} == {"on_policy"}

    # a finished cell is skipped: no new launch, the same rows
    assert run_cell(cfg, cell, tmp_path) == rows
    assert len(fake_launch) == 1
    # ... but not silently reused under other settings
    with pytest.raises(CellMismatchError, match="clients"):
        run_cell(arms_config(group_size=6), by_name(arms_config(group_size=6))[cell["name"]],
                 tmp_path)
    # an unfinished cell (no DONE) is run again from scratch
    (cdir / "DONE").unlink()
    run_cell(cfg, cell, tmp_path)
    assert len(fake_launch) == 2


def test_partner_pretrain_runs_once_per_seed_and_is_resumed(tmp_path, fake_launch):
    drift = {"name": "drift", "clients": [LEARNER, {
        "name": "p", "role": "partner", "learning_rate": 1e-5,
        "pretrain": {"rounds": 3, "tasks": [{"dataset": "gcd", "reward": "exact"}]}}]}
    cfg = arms_config(pairings=[drift])
    cs = by_name(cfg)
    run_cell(cfg, cs["drift__tis__s0"], tmp_path)
    run_cell(cfg, cs["drift__ftis__s0"], tmp_path)
    pre = [c for c in fake_launch if c["out"].parent.name == "pretrain"]
    cell_calls = [c for c in fake_launch if c["out"].parent.name == "cells"]
    assert len(pre) == 1 and len(cell_calls) == 2
    assert pre[0]["coordinator"]["tasks"][0]["dataset"] == "gcd"
    assert "heldout_fraction" not in pre[0]["coordinator"]
    pa = pre[0]["specs"][0].args
    assert (flag(pa, "--rounds"), flag(pa, "--method"), flag(pa, "--external-groups")) == (
        "3", "on_policy", "0")
    assert all(c["had_checkpoint"] == {"learner": False, "p": True} for c in cell_calls)
    # the pre-phase's checkpoint survives the cells (they only linked it)
    assert (tmp_path / "pretrain" / "drift__p__s0" / "p" / "checkpoints" / "latest").exists()


def test_run_experiment_end_to_end_with_fake_swarms(tmp_path, fake_launch):
    cfg = arms_config(seeds=[0, 1, 2], arms=[
        {"name": "alone_batch_matched", "method": "on_policy", "local": 4, "partners": False},
        {"name": "tis", "method": "tis", "local": 2, "external": 2},
        {"name": "ftis", "method": "ftis", "local": 2, "external": 2}])
    summary = run_experiment(cfg, tmp_path)
    assert len(fake_launch) == 9
    text = summary.read_text()
    assert "| hot | learner | ftis − alone_batch_matched | 3 | +0.133 | [+0.100, +0.200] | " \
           "0.250 | 0.750 |" in text
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    # seeds × (3 learners × 2 rounds + 2 partners, each run open-ended)
    assert len(rows) == 3 * (3 * 2 + 2 * 2 * PARTNER_ROUND_FACTOR)
    run_experiment(cfg, tmp_path)  # resumed: every cell reused
    assert len(fake_launch) == 9


def test_collect_finished_reads_only_done_cells_without_running(tmp_path, fake_launch):
    """Cells with DONE are collected (the same rows a full run writes); a cell without
    DONE (a run in progress) is neither read nor started."""
    cfg = arms_config(seeds=[0, 1], arms=[
        {"name": "alone_batch_matched", "method": "on_policy", "local": 4, "partners": False},
        {"name": "tis", "method": "tis", "local": 2, "external": 2}])
    run_experiment(cfg, tmp_path)
    full = (tmp_path / "results.jsonl").read_text().splitlines()
    launched = len(fake_launch)
    unfinished = next(c["name"] for c in cells(cfg) if c["seed"] == 1 and c["method"] == "tis")
    (tmp_path / "cells" / unfinished / "DONE").unlink()
    rows, evals, done = collect_finished(cfg, tmp_path)
    assert done == 3 and len(fake_launch) == launched
    assert all(r["cell"] != unfinished for r in rows + evals)
    assert [json.dumps(r) for r in rows] == [x for x in full if unfinished not in x]
    write_results(cfg, rows, evals, tmp_path / "partial")
    assert (tmp_path / "partial" / "results.jsonl").read_text().splitlines() == \
        [json.dumps(r) for r in rows]
    assert json.loads((tmp_path / "partial" / "config.json").read_text())["seeds"] == [0, 1]


def test_restore_finished_resumes_from_committed_results_on_a_new_machine(tmp_path,
                                                                         fake_launch):
    """A results folder (``--collect-to``) rebuilds its cells in an empty --out: the
    resumed run launches only the missing cells and writes the same rows; a config that
    adds a seed restores the same cells, one that drops a seed or changes a setting is
    refused."""
    cfg = arms_config(seeds=[0, 1], arms=[
        {"name": "alone_batch_matched", "method": "on_policy", "local": 4, "partners": False},
        {"name": "tis", "method": "tis", "local": 2, "external": 2}])
    first = tmp_path / "first"
    run_experiment(cfg, first)
    full_rows = (first / "results.jsonl").read_text()
    full_evals = (first / "evals.jsonl").read_text()
    unfinished = next(c["name"] for c in cells(cfg) if c["seed"] == 1 and c["method"] == "tis")
    (first / "cells" / unfinished / "DONE").unlink()
    rows, evals, _ = collect_finished(cfg, first)
    write_results(cfg, rows, evals, tmp_path / "committed")

    new = tmp_path / "new"
    assert restore_finished(cfg, tmp_path / "committed", new) == 3
    assert restore_finished(cfg, tmp_path / "committed", new) == 0  # already there
    assert (new / "cells" / cells(cfg)[0]["name"] / "RESTORED").exists()
    launched = len(fake_launch)
    run_experiment(cfg, new)
    assert len(fake_launch) == launched + 1  # only the unfinished cell ran
    assert fake_launch[-1]["out"].name == unfinished
    assert (new / "results.jsonl").read_text() == full_rows
    assert (new / "evals.jsonl").read_text() == full_evals

    more = arms_config(seeds=[0, 1, 2], arms=cfg.model_dump()["arms"])  # a seed added
    assert restore_finished(more, tmp_path / "committed", tmp_path / "more") == 3
    with pytest.raises(ValueError, match=r"seeds \[1\] that this config lacks"):
        restore_finished(arms_config(seeds=[0, 2], arms=cfg.model_dump()["arms"]),
                         tmp_path / "committed", tmp_path / "x")
    with pytest.raises(ValueError, match=r"another config \(rounds differ\)"):
        restore_finished(arms_config(seeds=[0, 1], rounds=3, arms=cfg.model_dump()["arms"]),
                         tmp_path / "committed", tmp_path / "x")
    with pytest.raises(ValueError, match="no config.json"):
        restore_finished(cfg, tmp_path / "nothing", tmp_path / "x")


def test_cli_restore_from_rebuilds_then_runs_the_rest_and_refuses_another_config(
        tmp_path, fake_launch):
    from typer.testing import CliRunner

    from ftis.lab.cli.main import app
    from ftis.protocol.exit_codes import ExitCode

    cfg = arms_config(seeds=[0, 1], arms=[
        {"name": "alone_batch_matched", "method": "on_policy", "local": 4, "partners": False},
        {"name": "tis", "method": "tis", "local": 2, "external": 2}])
    def restore(config: ExperimentConfig, name: str):
        """``ftis-lab experiment`` with ``config`` into ``tmp_path/name``, restoring from
        the committed seed 0."""
        path = tmp_path / f"{name}.json"
        path.write_text(config.model_dump_json())
        return CliRunner().invoke(app, ["experiment", "--config", str(path), "--out",
                                        str(tmp_path / name), "--restore-from",
                                        str(tmp_path / "committed")])

    run_experiment(cfg, tmp_path / "first")
    rows, evals, _ = collect_finished(cfg, tmp_path / "first")
    write_results(cfg, rows[: len(rows) // 2], [], tmp_path / "committed")  # seed 0 only
    launched = len(fake_launch)
    got = restore(cfg, "new")
    assert got.exit_code == 0, got.output
    assert "restored 2 finished cells" in got.output
    assert len(fake_launch) == launched + 2  # seed 1's two cells only
    got = restore(arms_config(seeds=[0, 1, 2]), "other")  # other arms
    assert got.exit_code == ExitCode.USAGE and "another config (arms differ)" in got.output
    # the same config with a seed added restores seed 0 and runs seeds 1 and 2
    launched = len(fake_launch)
    got = restore(cfg.model_copy(update={"seeds": [0, 1, 2]}), "more")
    assert got.exit_code == 0, got.output
    assert "restored 2 finished cells" in got.output
    assert len(fake_launch) == launched + 4
    # ... but one that drops a committed seed is refused
    got = restore(cfg.model_copy(update={"seeds": [1]}), "fewer")
    assert got.exit_code == ExitCode.USAGE and "seeds [0]" in got.output
    # collecting a run that lacks committed cells over those results would lose them
    write_results(cfg, rows, evals, tmp_path / "full")
    seed1 = next(c["name"] for c in cells(cfg) if c["seed"] == 1)
    (tmp_path / "first" / "cells" / seed1 / "DONE").unlink()
    got = CliRunner().invoke(app, ["experiment", "--config", str(tmp_path / "new.json"),
                                   "--out", str(tmp_path / "first"), "--collect-to",
                                   str(tmp_path / "full")])
    assert got.exit_code == ExitCode.USAGE and "1 cells not finished" in got.output
    assert len((tmp_path / "full" / "results.jsonl").read_text().splitlines()) == len(rows)


def test_restore_shared_rebuilds_only_the_cells_another_experiment_ran_alike(
        tmp_path, fake_launch):
    """Another experiment's results rebuild the cells both configs run with equal
    settings (the solo cells), never its own partnered cells nor a solo cell whose
    learner flags differ; the resumed run launches only the rest, and the shared cells'
    rows are the other experiment's rows."""
    solo = {"name": "alone_batch_matched", "method": "on_policy", "local": 4,
            "partners": False}
    first = arms_config(id="first", seeds=[0, 1], arms=[
        solo, {"name": "tis", "method": "tis", "local": 2, "external": 2}])
    run_experiment(first, tmp_path / "first")
    rows, evals, _ = collect_finished(first, tmp_path / "first")
    write_results(first, rows, evals, tmp_path / "committed")

    second = arms_config(id="second", seeds=[0, 1], arms=[
        solo, {"name": "nois", "method": "nois", "local": 2, "external": 2}])
    new = tmp_path / "new"
    assert restore_shared(second, tmp_path / "committed", new) == 2
    assert sorted(p.name for p in (new / "cells").iterdir()) == [
        "solo__alone_batch_matched__s0", "solo__alone_batch_matched__s1"]
    launched = len(fake_launch)
    run_experiment(second, new)
    assert sorted(c["out"].name for c in fake_launch[launched:]) == [
        "hot__nois__s0", "hot__nois__s1"]
    got, _, _ = collect_finished(second, new)
    solo_rows = [r for r in rows if r["cell"].startswith("solo__")]
    assert [r for r in got if r["cell"].startswith("solo__")] == solo_rows

    # the same cell names, but the learner's flags differ: nothing is shared
    hot = json.loads(json.dumps(HOT))
    hot["clients"][0]["learning_rate"] = 3e-5
    third = arms_config(id="third", seeds=[0, 1], pairings=[hot], arms=[solo])
    assert {c["name"] for c in cells(third)} <= {r["cell"] for r in rows}
    assert restore_shared(third, tmp_path / "committed", tmp_path / "x") == 0
    with pytest.raises(ValueError, match="no config.json"):
        restore_shared(second, tmp_path / "nothing", tmp_path / "x")


def test_cli_restore_shared_from_without_running(tmp_path, fake_launch):
    """``--restore-shared-from DIR --no-run`` fills --out and launches nothing."""
    from typer.testing import CliRunner

    from ftis.lab.cli.main import app

    solo = {"name": "alone", "method": "on_policy", "local": 2, "partners": False}
    first = arms_config(id="first", seeds=[0], arms=[
        solo, {"name": "tis", "method": "tis", "local": 2, "external": 2}])
    run_experiment(first, tmp_path / "first")
    rows, evals, _ = collect_finished(first, tmp_path / "first")
    write_results(first, rows, evals, tmp_path / "committed")
    config = tmp_path / "second.json"
    config.write_text(arms_config(id="second", seeds=[0], arms=[solo]).model_dump_json())
    launched = len(fake_launch)
    got = CliRunner().invoke(app, ["experiment", "--config", str(config), "--out",
                                   str(tmp_path / "new"), "--restore-shared-from",
                                   str(tmp_path / "committed"), "--no-run"])
    assert got.exit_code == 0, got.output
    assert "restored 1 shared finished cells" in got.output
    assert len(fake_launch) == launched
    assert (tmp_path / "new" / "cells" / "solo__alone__s0" / "DONE").exists()


# ------------------------------------------------------------------- arms analysis
def synthetic(tmp_path: Path) -> tuple[ExperimentConfig, list[dict], list[dict]]:
    """Three seeds of alone_batch_matched (solo), tis and ftis (hot pairing)."""
    cfg = arms_config(seeds=[0, 1, 2], arms=[
        {"name": "alone_batch_matched", "method": "on_policy", "local": 4, "partners": False},
        {"name": "tis", "method": "tis", "local": 2, "external": 2},
        {"name": "ftis", "method": "ftis", "local": 2, "external": 2}])
    rows, evals = [], []
    for (pairing, arm), ends in END.items():
        for seed, end in enumerate(ends):
            ext = 0 if arm == "alone_batch_matched" else 2
            filt, trunc = SHARES.get(arm, (0.0, 0.0))
            for r in (1, 2):
                rows.append({"pairing": pairing, "arm": arm, "method": arm, "role": "learner",
                             "client": "learner", "seed": seed, "round": r,
                             "reward_mean": 0.1 * r, "external_groups_used": ext,
                             "external_filtered_frac": filt,
                             "external_truncated_frac": trunc,
                             "external_is_weight_raw_max": 3.0})
                if ext:  # a partner's rows never count
                    rows.append({"pairing": pairing, "arm": arm, "method": "on_policy",
                                 "role": "partner", "client": "partner", "seed": seed,
                                 "round": r, "reward_mean": 0.9})
            for r, v in ((0, 0.3), (2, end)):
                evals.append({"pairing": pairing, "arm": arm, "role": "learner",
                              "client": "learner", "seed": seed, "round": r,
                              "eval_heldout_sampled": v, "eval_heldout": 0.5})
    return cfg, rows, evals


def test_analysis_numbers_and_gate_flag(tmp_path):
    cfg, rows, evals = synthetic(tmp_path)
    res = analysis(cfg, rows, evals)
    got = {(r["arm"], r["baseline"]): r for r in res["results"]}
    assert list(got) == [("tis", "alone_batch_matched"), ("ftis", "alone_batch_matched"),
                         ("ftis", "tis")]
    # differences by seed: tis - abm (0, .1, 0); ftis - abm (.1, .1, .2); ftis - tis (.1, 0, .2)
    assert [got[k]["n"] for k in got] == [3, 3, 3]
    assert [got[k]["diff"] for k in got] == pytest.approx([0.1 / 3, 0.4 / 3, 0.1])
    assert [got[k]["p"] for k in got] == pytest.approx([1.0, 0.25, 0.5])  # exact sign-flip
    assert [got[k]["p_holm"] for k in got] == pytest.approx([1.0, 0.75, 1.0])
    assert (got[("ftis", "alone_batch_matched")]["ci_low"],
            got[("ftis", "alone_batch_matched")]["ci_high"]) == pytest.approx((0.1, 0.2))
    # tis: filtered 0 and truncated 0.4 % -> both under 1 %: flagged, and so is every
    # contrast that involves it; ftis filtered 5 %: fired
    assert got[("ftis", "tis")]["note"] == "gates idle in tis"
    assert got[("ftis", "alone_batch_matched")]["note"] == ""
    arms = res["arms"]
    assert ("| hot | tis | tis | 2-2 | learner | 3 | 0.300 ± 0.000 | 0.533 ± 0.058 | "
            "0.150 ± 0.000 | 2.00 | 0.0000 | 0.0040 | 3 | **cannot tell the methods apart** "
            "(both < 1 %) |") in arms
    assert "| hot | ftis | ftis | 2-2 | learner | 3 | 0.300 ± 0.000 | 0.633 ± 0.153 |" in arms
    assert "| 0.0500 | 0.0020 | 3 | fired |" in arms
    assert ("| solo | alone_batch_matched | on_policy | 4-0 | learner | 3 | 0.300 ± 0.000 | "
            "0.500 ± 0.100 | 0.150 ± 0.000 | 0.00 | – | – | – | – |") in arms
    assert "partner" not in arms
    assert "p (Holm, m = 3)" in res["contrasts"]
    # three seeds cannot bound a family-wise interval at 0.05/3 (2/8 > 0.0167)
    assert "| hot | learner | ftis − tis | 3 | +0.100 | [+0.000, +0.200] | 0.500 | 1.000 | " \
           "unbounded (n = 3) | gates idle in tis |" in res["contrasts"]
    # power: sd of the differences 0.0577, 0.0577, 0.1; Holm over 3 contrasts ->
    # alpha 0.05/3: ((2.394 + 0.842) * sd / 0.1)^2 + 1 -> 5, 5, 12; never below the
    # exact sign-flip test's floor at 0.05/3: 2 / 2^7 = 0.016 <= 0.0167 -> 7, 7, 12
    assert "| hot | learner | ftis − tis | 3 | 0.100 | 12 |" in res["power"]
    assert "| hot | learner | ftis − alone_batch_matched | 3 | 0.058 | 7 |" in res["power"]
    assert "up to 12 paired seeds (ftis − tis, hot" in res["power_line"]


def test_gate_flag_threshold_is_one_percent():
    base = {"rounds": 1.0, "raw_max": 1.0, "divergence": 0.0}
    assert report.gates_idle({**base, "filtered": 0.0099, "truncated": 0.0099})
    assert not report.gates_idle({**base, "filtered": 0.01, "truncated": 0.0})
    assert not report.gates_idle({**base, "filtered": 0.0, "truncated": 0.02})
    assert report.gates_idle(None)  # no external groups at all


def test_divergence_rows_hand_computed():
    """Two cells of one arm: k1 per round (0.5, 1.5) at seed 0 and (0.2, 0.4) at seed 3;
    filtered shares (0.1, 0.3) and (0.0, 0.0)."""
    base = {"pairing": "p", "arm": "ftis", "client": "learner", "external_groups_used": 2}
    rows = [{**base, "seed": 0, "round": 1, "external_k1_mean": 0.5,
             "external_filtered_frac": 0.1},
            {**base, "seed": 0, "round": 2, "external_k1_mean": 1.5,
             "external_filtered_frac": 0.3},
            {**base, "seed": 3, "round": 1, "external_k1_mean": 0.2,
             "external_filtered_frac": 0.0},
            {**base, "seed": 3, "round": 2, "external_k1_mean": 0.4,
             "external_filtered_frac": 0.0},
            # no external groups, or no k1 logged: left out
            {**base, "seed": 5, "round": 1, "external_groups_used": 0,
             "external_k1_mean": 9.0},
            {**base, "seed": 6, "round": 1, "external_filtered_frac": 1.0}]
    got = report.divergence_rows(rows, delta=1.0)[("p", "ftis", "learner")]
    # cell means 1.0 and 0.3 -> mean 0.65; one round (1.5) above 1; 1.0 itself is not
    assert got == pytest.approx({"cells": 2, "k1_mean": 0.65, "k1_min": 0.3, "k1_max": 1.0,
                                 "round_max": 1.5, "rounds_over": 1, "rounds": 4,
                                 "filtered_min": 0.0, "filtered_max": 0.2,
                                 "filtered_max_seed": 0})
    assert report.divergence_rows(rows, delta=0.45)[("p", "ftis", "learner")][
        "rounds_over"] == 2
    table = report.divergence_table([{"pairing": "p", "arm": "ftis", "method": "ftis",
                                      "client": "learner", **got}], 1.0)
    assert "rounds with mean > δ = 1 |" in table
    assert ("| p | ftis | ftis | learner | 2 | 0.650 | 0.300–1.000 | 1.500 | 1 of 4 | "
            "0.0000–0.2000 | 0 |") in table
    nois = report.divergence_table([{"pairing": "p", "arm": "nois", "method": "nois",
                                     "client": "learner", **got}], 1.0)
    assert "| 1 of 4 | n/a | n/a (nois has no gate) |" in nois
    idle = report.divergence_table([{"pairing": "p", "arm": "tis", "method": "tis",
                                     "client": "learner", **got, "filtered_max": 0.0}], 1.0)
    assert "| 0.0000–0.0000 | – (none) |" in idle
    assert report.divergence_table([], 1.0).count(report.NOT_YET_RUN) == 1


def test_analysis_divergence_table_covers_arms_with_external_groups(tmp_path):
    cfg, rows, evals = synthetic(tmp_path)
    for r in rows:
        if r.get("external_groups_used"):
            r["external_k1_mean"] = 0.1 * r["round"] + r["seed"]  # cells 0.15, 1.15, 2.15
    div = analysis(cfg, rows, evals)["divergence"]
    assert "alone_batch_matched" not in div and "partner" not in div
    assert ("| hot | tis | tis | learner | 3 | 1.150 | 0.150–2.150 | 2.200 | 4 of 6 | "
            "0.0000–0.0000 | – (none) |") in div
    assert "| hot | ftis | ftis | learner | 3 | 1.150 |" in div


def test_pooled_clients_and_power_family_override(tmp_path):
    cfg, rows, evals = synthetic(tmp_path)
    two = [{**e, "client": c} for e in evals for c in ("learner", "b")]
    for e in two:  # client b is 0.1 better everywhere: the pooled differences are unchanged
        if e["client"] == "b" and e["round"] == 2:
            e["eval_heldout_sampled"] += 0.1
    pairing = {"name": "hot", "clients": [LEARNER, {**LEARNER, "name": "b"},
                                          {"name": "partner", "role": "partner"}]}
    cfg = arms_config(seeds=[0, 1, 2], pairings=[pairing], pool_clients=True,
                      power={"family_size": 21}, arms=[a.model_dump() for a in cfg.arms])
    res = analysis(cfg, rows, two)
    assert [r["client"] for r in res["results"]] == [report.POOLED] * 3
    assert [r["diff"] for r in res["results"]] == pytest.approx([0.1 / 3, 0.4 / 3, 0.1])
    assert "Holm over 21 contrasts" in res["power_line"]


# -------------------------------------------------------------- docs regeneration
def _summarize_module():
    return load_script("experiments/summarize.py")


DOC = """# Results

<!-- table:t/arms -->
old arms
<!-- /table -->

text between

<!-- table:t/contrasts -->
old
<!-- /table -->

<!-- table:t/power -->
<!-- /table -->

<!-- table:missing/contrasts -->
stale numbers
<!-- /table -->
"""


def test_summarize_regenerates_tables_from_raw_results(tmp_path):
    summarize = _summarize_module()
    cfg, rows, evals = synthetic(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(cfg.model_dump_json())
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    doc = tmp_path / "results.md"
    doc.write_text(DOC)
    results = tmp_path / "results"
    assert summarize.main(["--results", str(results), "--doc", str(doc), "--check"]) == 1
    assert summarize.main(["--results", str(results), "--doc", str(doc),
                           "--collect", str(run)]) == 0
    assert (results / "t" / "results.jsonl").exists()  # collected under the config's id
    text = doc.read_text()
    assert "old arms" not in text and "stale numbers" not in text
    assert "text between" in text
    assert ("| hot | learner | ftis − alone_batch_matched | 3 | +0.133 | [+0.100, +0.200] | "
            "0.250 | 0.750 | unbounded (n = 3) |  |") in text
    assert "| hot | learner | tis − alone_batch_matched | 3 | +0.033 | [+0.000, +0.100] | " \
           "1.000 | 1.000 | unbounded (n = 3) | gates idle in tis |" in text
    assert "**cannot tell the methods apart**" in text
    assert "up to 12 paired seeds" in text
    # an experiment without results gets a "not yet run" table
    missing = text.split("<!-- table:missing/contrasts -->")[1]
    assert missing.split("\n")[3].startswith("| not yet run |")
    # idempotent, and --check now passes
    assert summarize.main(["--results", str(results), "--doc", str(doc), "--check"]) == 0
    assert summarize.regenerate(text, results)[0] == text


def test_docs_results_tables_are_current():
    """docs/results.md matches what summarize.py makes of the committed raw results."""
    summarize = _summarize_module()
    text = (ROOT / "docs" / "results.md").read_text()
    assert "<!-- table:ftis_methods/contrasts -->" in text
    assert summarize.regenerate(text)[0] == text


def test_make_experiments_names_configs_that_exist_and_resume_from_their_results():
    """Every experiment `make experiments` runs has its config, and the folder it
    restores from (when committed) is that config's own results."""
    import re

    text = (ROOT / "Makefile").read_text()
    names = re.search(r"^EXPERIMENTS := (.*?)(?<!\\)$", text, re.M | re.S).group(1)
    ids = names.replace("\\", " ").split() + ["ftis_methods"]
    assert "sapo_peer" in ids and "ftis_qlora_partner" in ids
    for name in ids:
        cfg = ExperimentConfig.load(ROOT / "experiments" / f"{name}.json")
        assert cfg.id == name
        results = ROOT / "experiments" / "results" / name
        if results.exists():  # --restore-from would accept it
            matrix.same_config(cfg.model_dump(mode="json"), results)


def test_holm_counts_contrasts_without_pairs_as_p_one():
    """A pre-registered contrast with no finished pair yet stays in the Holm family:
    5 positive pairs give the exact sign-flip p = 2/32 = 0.0625, and with one untested
    contrast beside it Holm multiplies by m = 2, not 1."""
    five = {s: 0.5 for s in range(5)}
    tested = {"arm": "ftis", "baseline": "tis", "after": {s: 0.6 + 0.01 * s for s in five},
              "before": five}
    untested = {"arm": "ftis", "baseline": "alone", "after": {}, "before": five}
    got = report.paired_contrasts([tested, untested])
    assert got[0]["p"] == pytest.approx(0.0625)
    assert got[0]["p_holm"] == pytest.approx(0.125)
    assert got[1]["n"] == 0 and got[1]["p"] is None and got[1]["p_holm"] is None
    assert report.paired_contrasts([tested])[0]["p_holm"] == pytest.approx(0.0625)
    assert "p (Holm, m = 2)" in report.contrasts_table(
        [{**r, "pairing": "p", "client": "c"} for r in got], "eval_heldout_sampled")


def test_contrasts_carry_family_wise_sign_flip_intervals():
    """Each contrast's interval is the exact sign-flip one at 0.05 / m. Six pairs with
    differences 0.01..0.06: alone (m = 1, alpha 0.05) j = floor(0.05 * 64 / 2) = 1, the
    smallest and largest difference; beside an untested contrast (m = 2, 0.025 each)
    j = 0, which six pairs cannot bound."""
    six = {s: 0.5 for s in range(6)}
    tested = {"arm": "a", "baseline": "b", "before": six,
              "after": {s: 0.51 + 0.01 * s for s in six}}
    alone = report.paired_contrasts([tested])[0]
    assert (alone["fw_low"], alone["fw_high"]) == (pytest.approx(0.01), pytest.approx(0.06))
    row = report.contrasts_table([{**alone, "pairing": "p", "client": "c"}],
                                 "eval_heldout_sampled").splitlines()
    assert "family-wise 95 % CI (sign-flip, 0.05/1 each)" in row[0]
    assert "| [+0.010, +0.060] |" in row[-1]
    untested = {"arm": "a", "baseline": "c", "before": six, "after": {}}
    pair = report.paired_contrasts([tested, untested])
    assert pair[0]["fw_low"] == -math.inf and pair[0]["fw_high"] == math.inf
    assert pair[1]["fw_low"] is None
    rows = report.contrasts_table([{**r, "pairing": "p", "client": "c"} for r in pair],
                                  "eval_heldout_sampled").splitlines()
    assert "| unbounded (n = 6) |" in rows[-2]
    assert rows[-1].endswith("| 0 | – | – | – | – | – |  |")


def test_one_pair_has_no_interval():
    """The bootstrap of a single pair resamples that pair only: its "interval" would be
    the point [d, d]. One pair gets its difference and p = 1 (exact sign-flip: both
    signs are as extreme), no interval; two pairs get a real one."""
    one = report.paired_contrasts([{"arm": "a", "baseline": "b", "after": {0: 0.7},
                                    "before": {0: 0.5}}])[0]
    assert one["n"] == 1 and one["diff"] == pytest.approx(0.2) and one["p"] == 1.0
    assert one["ci_low"] is None and one["ci_high"] is None
    row = report.contrasts_table([{**one, "pairing": "p", "client": "c"}],
                                 "eval_heldout_sampled").splitlines()[-1]
    assert "| +0.200 | – | 1.000 |" in row
    two = report.paired_contrasts([{"arm": "a", "baseline": "b", "after": {0: 0.7, 1: 0.6},
                                    "before": {0: 0.5, 1: 0.5}}])[0]
    assert (two["ci_low"], two["ci_high"]) == (pytest.approx(0.1), pytest.approx(0.2))
