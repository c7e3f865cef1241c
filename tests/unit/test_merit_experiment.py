"""MERIT's four-way experiment without running a model: the plan's splits as task
specs, the cells and their equal total samples, the tables and contrasts from
hand-made rows, and summarize.py filling docs tables from MERIT raw results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_loader import load_script

from ftis.lab.merit.experiment import (
    MeritExperimentConfig,
    check_equal_samples,
    merit_cells,
    planned_completions,
    split_branches,
)
from ftis.lab.merit.report import arm_values, contrast_results, family_table, tables

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ["products", "chain_sum", "gcd", "letter_counting"]
A, B = "products", "gcd"
PLAN = {"branches": {"conflict_aware": [["products"], ["chain_sum", "gcd", "letter_counting"]],
                     "random": [["letter_counting", "gcd"], ["products", "chain_sum"]]}}


def config(**kw) -> MeritExperimentConfig:  # noqa: ANN003
    return MeritExperimentConfig.model_validate({
        "families": [{"dataset": f} for f in FAMILIES], "seeds": [0, 1], "rounds": 3,
        "local_groups": 2, "group_size": 4, **kw})


def test_split_branches_maps_names_to_specs_and_refuses_bad_plans() -> None:
    cfg = config()
    got = split_branches(PLAN, cfg.families)
    assert [[t.dataset for t in b] for b in got["conflict"]] == [
        ["products"], ["chain_sum", "gcd", "letter_counting"]]
    assert got["random"][0][1] is cfg.families[2]
    for bad, needle in [
        ({"branches": {"random": [["products"]]}}, "no 'conflict_aware'"),
        ({"branches": {**PLAN["branches"], "random": [["products", "leg_counting"],
                                                      ["chain_sum", "gcd"]]}}, "not in"),
        ({"branches": {**PLAN["branches"], "random": [["products"], ["chain_sum"]]}},
         "partition"),
        ({"branches": {**PLAN["branches"], "random": [FAMILIES]}}, "numbers of branches"),
    ]:
        with pytest.raises(ValueError, match=needle):
            split_branches(bad, cfg.families)


@pytest.mark.parametrize("schedule, joint", [("rounds", (6, 2)), ("groups", (3, 4))])
def test_cells_train_every_arm_on_equal_total_samples(schedule, joint) -> None:
    cfg = config(joint_schedule=schedule)
    splits = {s: split_branches(PLAN, cfg.families) for s in cfg.seeds}
    cells = merit_cells(cfg, splits)
    assert [c.name for c in cells] == [
        "base",
        "joint__s0", "conflict__b0__s0", "conflict__b1__s0", "conflict__merged__s0",
        "random__b0__s0", "random__b1__s0", "random__merged__s0",
        "joint__s1", "conflict__b0__s1", "conflict__b1__s1", "conflict__merged__s1",
        "random__b0__s1", "random__b1__s1", "random__merged__s1"]
    j = next(c for c in cells if c.name == "joint__s0")
    assert (j.rounds, j.local_groups) == joint and len(j.tasks) == 4
    b1 = next(c for c in cells if c.name == "conflict__b1__s1")
    assert [t.dataset for t in b1.tasks] == ["chain_sum", "gcd", "letter_counting"]
    assert (b1.rounds, b1.local_groups, b1.seed) == (3, 2, 1)
    merged = next(c for c in cells if c.name == "random__merged__s0")
    assert merged.branches == ("random__b0__s0", "random__b1__s0")
    # 2 branches x 3 rounds x 2 groups x G = 4 for every arm and seed
    assert planned_completions(cells, 4) == {(s, a): 48 for s in (0, 1)
                                             for a in ("joint", "conflict", "random")}
    check_equal_samples(cells, 4)
    with pytest.raises(ValueError, match="unequal total samples"):
        check_equal_samples([c for c in cells if c.name != "random__b1__s0"], 4)


def test_config_refuses_what_the_experiment_cannot_compare() -> None:
    with pytest.raises(ValueError, match="distinct"):
        config(families=[{"dataset": "gcd"}, {"dataset": "gcd"}])
    with pytest.raises(ValueError, match="unknown contrast arm"):
        config(contrasts=[{"arm": "merged", "baseline": "joint"}])
    with pytest.raises(ValueError, match="eval.samples"):
        config(primary="sampled")
    with pytest.raises(ValueError):
        config(heldout_fraction=0.0)  # the held-out split is what is evaluated
    # the per-family evaluation: that family's held-out set only
    ev = config(heldout_fraction=0.25).family_eval(config().families[2])
    assert [t.dataset for t in ev.in_distribution] == ["gcd"]
    assert ev.out_of_distribution == [] and ev.heldout_fraction == 0.25


def _rows() -> list[dict]:
    """Two seeds, two families (A, B): conflict branches b0 = {A}, b1 = {B}."""
    rows: list[dict] = []

    def ev(seed, arm, model, a, b):  # noqa: ANN001, ANN202
        for fam, v in ((A, a), (B, b)):
            rows.append({"kind": "eval", "cell": f"{arm}__{model}__s{seed}", "seed": seed,
                         "arm": arm, "model": model, "family": fam, "n": 10, "greedy": v,
                         "sampled": None})

    ev(None, "base", "base", 0.1, 0.2)
    for seed, shift in ((0, 0.0), (1, 0.1)):
        for arm, model, branch_fams in (("conflict", "b0", [A]), ("conflict", "b1", [B]),
                                        ("random", "b0", [B]), ("random", "b1", [A])):
            rows.append({"kind": "train", "seed": seed, "arm": arm, "model": model,
                         "families": branch_fams, "planned_completions": 8,
                         "completions": 8, "completion_tokens": 100 + seed})
        rows.append({"kind": "train", "seed": seed, "arm": "joint", "model": "joint",
                     "families": [A, B], "planned_completions": 16, "completions": 16,
                     "completion_tokens": 201})
        ev(seed, "joint", "joint", 0.3 + shift, 0.5 + shift)
        ev(seed, "conflict", "merged", 0.4 + shift, 0.6 + shift)
        ev(seed, "conflict", "b0", 0.7 + shift, 0.0)
        ev(seed, "conflict", "b1", 0.0, 0.9)
        ev(seed, "random", "merged", 0.2 + shift, 0.2)
        ev(seed, "random", "b0", 0.0, 0.5)
        ev(seed, "random", "b1", 0.5, 0.0)
        rows.append({"kind": "merge", "seed": seed, "arm": "conflict", "weights": [0.5, 0.5]})
    return rows


def test_arm_values_tables_and_contrasts_by_hand() -> None:
    cfg = MeritExperimentConfig.model_validate({
        "families": [{"dataset": A}, {"dataset": B}], "seeds": [0, 1]})
    rows = _rows()
    assert arm_values(cfg, rows, "base") == {0: {A: 0.1, B: 0.2}, 1: {A: 0.1, B: 0.2}}
    own = arm_values(cfg, rows, "conflict_own")
    assert own[0] == {A: 0.7, B: 0.9} and own[1] == pytest.approx({A: 0.8, B: 0.9})
    assert arm_values(cfg, rows, "conflict", model="b1")[1] == {A: 0.0, B: 0.9}
    got = {(r["arm"], r["baseline"]): r for r in contrast_results(cfg, rows)}
    # conflict - joint: +0.1 in both seeds; conflict - random: (0.3, 0.35)
    assert got[("conflict", "joint")]["diff"] == pytest.approx(0.1)
    assert got[("conflict", "joint")]["n"] == 2 and got[("conflict", "joint")]["p"] == 0.5
    assert got[("conflict", "random")]["diff"] == pytest.approx(0.325)
    assert got[("random", "joint")]["diff"] == pytest.approx(-0.225)
    assert all(r["p_holm"] == 1.0 for r in got.values())  # 3 x 0.5, capped
    text = family_table(cfg, rows)
    assert "| base (start of every arm) | 2 | 0.100 ± 0.000 | 0.200 ± 0.000 | 0.150 ± 0.000 |" \
        in text
    assert "| conflict split, merged | 2 | 0.450 ± 0.071 | 0.650 ± 0.071 | 0.550 ± 0.071 |" \
        in text
    assert f"| conflict b0 alone ({A}) | 2 |" in text
    assert "| conflict branches, each on its own families | 2 | 0.750 ± 0.071 | 0.900 ± 0.000" \
        in text
    all_tables = tables(cfg, rows)
    assert "| joint | 1 | 2 | 16.000 ± 0.000 | 16.000 ± 0.000 | 201.000 ± 0.000 | – |" \
        in all_tables["samples"]
    assert "| conflict | 2 | 2 | 16.000 ± 0.000 |" in all_tables["samples"]
    assert "0.500 / 0.500" in all_tables["samples"]
    assert "conflict − joint" in all_tables["contrasts"]
    # no rows: every table says "not yet run"
    empty = tables(cfg, [])
    assert all("not yet run" in empty[k] for k in ("families", "samples", "contrasts"))


def test_summarize_fills_merit_tables_from_raw_results(tmp_path) -> None:
    summarize = load_script("experiments/summarize.py")
    cfg = MeritExperimentConfig.model_validate({
        "id": "m", "families": [{"dataset": A}, {"dataset": B}], "seeds": [0, 1]})
    doc = tmp_path / "merit.md"
    doc.write_text("x\n<!-- table:m/families -->\nold\n<!-- /table -->\n"
                   "<!-- table:m/contrasts -->\n<!-- /table -->\n")
    assert summarize.main(["--results", str(tmp_path / "r"), "--doc", str(doc)]) == 0
    assert doc.read_text().count("not yet run") == 2
    folder = tmp_path / "r" / "m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(cfg.model_dump_json())
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    assert summarize.main(["--results", str(tmp_path / "r"), "--doc", str(doc),
                           "--check"]) == 1
    assert summarize.main(["--results", str(tmp_path / "r"), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "| conflict split, merged | 2 |" in text and "conflict − random" in text
    assert summarize.main(["--results", str(tmp_path / "r"), "--doc", str(doc),
                           "--check"]) == 0


def test_committed_merit_config_and_doc_tables_are_current() -> None:
    cfg = MeritExperimentConfig.load(ROOT / "experiments" / "merit_fourway.json")
    assert {t.dataset for t in cfg.families} >= {"products", "chain_sum", "gcd"}
    assert [(c.arm, c.baseline) for c in cfg.contrasts] == [
        ("conflict", "joint"), ("conflict", "random"), ("random", "joint")]
    summarize = load_script("experiments/summarize.py")
    assert summarize.main(["--doc", str(ROOT / "docs" / "merit.md"), "--check"]) == 0
    assert "<!-- table:merit_fourway/families -->" in (ROOT / "docs" / "merit.md").read_text()


def test_restore_cells_resumes_from_committed_rows_and_retrains_unmerged_branches(
        tmp_path, monkeypatch) -> None:
    """Committed rows rebuild their cells in an empty --out: the resumed run computes only
    what is missing, and a branch whose merge was not committed (its model is gone)
    trains again; a results folder from another config is refused."""
    from ftis.lab.experiment.matrix import done_or_fresh
    from ftis.lab.merit import experiment as mx

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(PLAN))
    cfg = config(plan_file=str(plan_file))
    cells = merit_cells(cfg, {s: split_branches(PLAN, cfg.families) for s in cfg.seeds})
    ran: list[str] = []

    def fake(cfg_, cell, out):  # noqa: ANN001, ANN202
        cdir = out / "cells" / cell.name
        if not (cdir / "DONE").exists():
            ran.append(cell.name)
            cdir.mkdir(parents=True, exist_ok=True)
            labels = {"cell": cell.name, "seed": cell.seed, "arm": cell.arm,
                      "model": cell.model}
            rows = [{"kind": "eval", **labels, "family": "gcd"}]
            if cell.kind == "train":
                rows.insert(0, {"kind": "train", **labels,
                                "families": [t.dataset for t in cell.tasks]})
            elif cell.kind == "merge":
                rows.insert(0, {"kind": "merge", **labels, "branches": list(cell.branches)})
            mx._finish(cdir, rows)
        return mx._read_rows(cdir)

    for name in ("run_base_cell", "run_train_cell", "run_merge_cell"):
        monkeypatch.setattr(mx, name, fake)
    full = mx.run_merit(cfg, tmp_path / "first").read_text().splitlines()
    assert len(ran) == len(cells) == 15
    committed = tmp_path / "committed"
    (committed / "plans").mkdir(parents=True)
    (committed / "plans" / "s1.json").write_text(json.dumps(PLAN))
    (committed / "config.json").write_text(cfg.model_dump_json())
    # seed 1 stopped after random__b0: its merge is not in the committed rows
    keep = full[:full.index(next(x for x in full if '"random__b1__s1"' in x))]
    (committed / "results.jsonl").write_text("\n".join(keep) + "\n")

    new = tmp_path / "new"
    assert mx.restore_cells(cfg, committed, new) == 12  # base + 7 + 4; not random__b0__s1
    assert not (new / "cells" / "random__b0__s1").exists()
    assert (new / "plans" / "s1.json").exists()
    # seed 0 had no plan file in src: its splits come back from its train rows
    assert json.loads((new / "plans" / "s0.json").read_text())["branches"] == {
        "conflict_aware": [["products"], ["chain_sum", "gcd", "letter_counting"]],
        "random": [["letter_counting", "gcd"], ["products", "chain_sum"]]}
    assert (new / "cells" / "joint__s1" / "RESTORED").exists()
    assert done_or_fresh(new / "cells" / "joint__s1", {"any": "spec"}, "x")  # trusted
    assert mx.restore_cells(cfg, committed, new) == 0
    ran.clear()
    assert mx.run_merit(cfg, new).read_text().splitlines() == full
    assert ran == ["random__b0__s1", "random__b1__s1", "random__merged__s1"]
    with pytest.raises(ValueError, match="rounds"):
        mx.restore_cells(config(plan_file=str(plan_file), rounds=4), committed, new)


def test_each_seed_is_planned_only_when_its_cells_come_up(tmp_path, monkeypatch) -> None:
    from ftis.lab.merit import experiment as mx

    events: list[str] = []

    def plan(cfg_, seed, out):  # noqa: ANN001, ANN202
        events.append(f"plan s{seed}")
        return PLAN

    monkeypatch.setattr(mx, "load_plan", plan)
    got = [c.name for c in mx.cells_as_planned(config(), tmp_path)
           if not events.append(c.name)]
    cfg = config()
    assert got == [c.name for c in merit_cells(cfg, {s: split_branches(PLAN, cfg.families)
                                                     for s in cfg.seeds})]
    assert events.index("plan s1") == events.index("random__merged__s0") + 1
    assert events[:2] == ["base", "plan s0"]


def test_cli_collect_to_and_restore_from(tmp_path) -> None:
    from typer.testing import CliRunner

    from ftis.lab.cli.main import app
    from ftis.lab.merit.experiment import unmerged_branches as mx_unmerged
    from ftis.protocol.exit_codes import ExitCode

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(PLAN))
    cfg = config(plan_file=str(plan_file))
    path = tmp_path / "cfg.json"
    path.write_text(cfg.model_dump_json())
    out = tmp_path / "out"
    runner = CliRunner()
    got = runner.invoke(app, ["merit", "experiment", "--config", str(path), "--out", str(out),
                              "--collect-to", str(tmp_path / "c")])
    assert got.exit_code == ExitCode.USAGE and "no cell has finished" in got.output
    (out / "plans").mkdir(parents=True)
    (out / "config.json").write_text(cfg.model_dump_json())
    (out / "plans" / "s0.json").write_text(json.dumps(PLAN))
    (out / "results.jsonl").write_text(json.dumps({"kind": "eval", "cell": "base"}) + "\n")
    got = runner.invoke(app, ["merit", "experiment", "--config", str(path), "--out", str(out),
                              "--collect-to", str(tmp_path / "c")])
    assert got.exit_code == 0 and "1 rows" in got.output
    assert (tmp_path / "c" / "plans" / "s0.json").exists()
    other = tmp_path / "other.json"
    other.write_text(config(plan_file=str(plan_file), rounds=5).model_dump_json())
    got = runner.invoke(app, ["merit", "experiment", "--config", str(other), "--out",
                              str(tmp_path / "o"), "--restore-from", str(tmp_path / "c")])
    assert got.exit_code == ExitCode.USAGE and "another config" in got.output
    # a results folder with more cells than the run is not overwritten
    (tmp_path / "c" / "results.jsonl").write_text(
        json.dumps({"kind": "eval", "cell": "base"}) + "\n"
        + json.dumps({"kind": "eval", "cell": "joint__s0"}) + "\n")
    got = runner.invoke(app, ["merit", "experiment", "--config", str(path), "--out", str(out),
                              "--collect-to", str(tmp_path / "c")])
    assert got.exit_code == ExitCode.USAGE and "1 cells not finished" in got.output
    assert "joint__s0" in (tmp_path / "c" / "results.jsonl").read_text()
    # ... but a branch without its merge may go: its model is gone, it trains again
    branch = {"kind": "train", "cell": "conflict__b0__s0", "seed": 0, "arm": "conflict",
              "model": "b0", "families": ["gcd"]}
    (tmp_path / "c" / "results.jsonl").write_text(json.dumps(branch) + "\n")
    assert mx_unmerged([branch]) == {"conflict__b0__s0"}
    assert mx_unmerged([branch, {**branch, "kind": "merge", "cell": "conflict__merged__s0",
                                 "model": "merged"}]) == set()
    got = runner.invoke(app, ["merit", "experiment", "--config", str(path), "--out", str(out),
                              "--collect-to", str(tmp_path / "c")])
    assert got.exit_code == 0, got.output
