"""The experiment runner runs a real matrix (2 methods × 1 seed × 1 pairing × 1 mix) of
local swarms with held-out evaluation and writes results, summary and curves."""

from __future__ import annotations

import json

import pytest

from ftis.lab.experiment.matrix import ExperimentConfig, run_experiment

pytestmark = pytest.mark.integration


def test_matrix_of_tiny_swarms(tmp_path, tiny_model_dir):
    letters = [{"dataset": "letter_counting"}]
    cfg = ExperimentConfig.model_validate({
        "name": "tiny", "rounds": 2, "seeds": [0], "methods": ["alone", "ftis"],
        "pairings": [{"name": "full+lora", "clients": [
            {"name": "full", "model": str(tiny_model_dir), "learning_rate": 1e-3},
            {"name": "lora", "model": str(tiny_model_dir), "peft": "lora",
             "learning_rate": 1e-2}]}],
        "mixes": [{"local": 2, "external": 2}], "group_size": 4, "max_new_tokens": 8,
        "tasks": letters, "eval_every": 1,
        "eval": {"in_distribution": letters, "out_of_distribution": [{"dataset": "gcd"}],
                 "size": 4, "max_new_tokens": 8},
    })
    summary = run_experiment(cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2  # methods × clients × rounds
    assert {(r["method"], r["client"]) for r in rows} == {
        ("alone", "full"), ("alone", "lora"), ("ftis", "full"), ("ftis", "lora")}
    assert all(r["external_groups_used"] == 0 for r in rows if r["method"] == "alone")
    evals = [json.loads(line) for line in (tmp_path / "evals.jsonl").read_text().splitlines()]
    # evaluation of the starting policy (round 0) and after each round
    for method in ("alone", "ftis"):
        for client in ("full", "lora"):
            got = sorted(e["round"] for e in evals
                         if e["method"] == method and e["client"] == client)
            assert got == [0, 1, 2]
    assert all(0.0 <= e["eval_heldout"] <= 1.0 and 0.0 <= e["eval_ood"] <= 1.0 for e in evals)
    text = summary.read_text()
    assert "| full+lora | 2-2 | ftis | lora |" in text
    assert (tmp_path / "curves_full+lora_2-2.png").stat().st_size > 1000
    # a second start reuses finished cells instead of re-running them
    mtime = (tmp_path / "results.jsonl").stat().st_mtime_ns
    run_experiment(cfg, tmp_path)
    assert (tmp_path / "results.jsonl").stat().st_mtime_ns >= mtime
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 8
