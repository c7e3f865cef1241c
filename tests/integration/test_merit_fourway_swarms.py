"""MERIT's four-way runner end to end on a tiny random model: real local swarms for
joint and for every branch of both splits, the one-shot token-weighted merge, held-out
evaluation per family, equal total samples, and a resumed run that skips every cell."""

from __future__ import annotations

import json

import pytest
import torch

from ftis.lab.merit import experiment as merit_experiment
from ftis.lab.merit.experiment import LEARNER, MeritExperimentConfig, run_merit
from ftis.lab.merit.report import contrast_results, family_table, samples_table

pytestmark = pytest.mark.integration

FAMILIES = ["letter_counting", "chain_sum", "gcd"]


def test_fourway_runner_on_tiny_swarms(tmp_path, tiny_model_dir, monkeypatch) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"branches": {
        "conflict_aware": [["letter_counting"], ["chain_sum", "gcd"]],
        "random": [["chain_sum"], ["letter_counting", "gcd"]]}}))
    cfg = MeritExperimentConfig.model_validate({
        "id": "tiny_merit", "seeds": [0],
        "client": {"name": "learner", "model": str(tiny_model_dir), "peft": "none",
                   "learning_rate": 1e-3},
        "families": [{"dataset": f} for f in FAMILIES],
        "rounds": 1, "local_groups": 1, "group_size": 2, "max_new_tokens": 4,
        "plan_file": str(plan), "heldout_fraction": 0.3,
        "eval": {"size": 2, "max_new_tokens": 4}, "keep_models": True})
    out = tmp_path / "run"
    seen: list[list[str]] = []  # the cells results.jsonl holds as each cell starts

    def peek(_cell: object) -> None:
        path = out / "results.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        seen.append(sorted({json.loads(x)["cell"] for x in lines}))

    rows = [json.loads(x) for x in run_merit(cfg, out, on_cell=peek).read_text().splitlines()]
    # written as the run goes: each cell starts with every earlier cell's rows on disk
    assert seen[0] == [] and all(len(b) == len(a) + 1 for a, b in zip(seen, seen[1:], strict=False))
    every = {r["cell"] for r in rows}
    assert len(every) == len(seen) and len(every - set(seen[-1])) == 1  # all but the last

    train = {(r["arm"], r["model"]): r for r in rows if r["kind"] == "train"}
    assert set(train) == {("joint", "joint"), ("conflict", "b0"), ("conflict", "b1"),
                          ("random", "b0"), ("random", "b1")}
    assert train[("conflict", "b1")]["families"] == ["chain_sum", "gcd"]
    # equal total samples: joint runs K = 2 times the rounds of one branch
    assert train[("joint", "joint")]["rounds"] == 2
    for arm in ("conflict", "random"):
        for key in ("planned_completions", "completions"):
            assert (train[(arm, "b0")][key] + train[(arm, "b1")][key]
                    == train[("joint", "joint")][key] == 2 * 1 * 1 * 2)
    assert all(r["completion_tokens"] > 0 and r["rounds_run"] == r["rounds"]
               for r in train.values())

    evals = [r for r in rows if r["kind"] == "eval"]
    models = {(r["arm"], r["model"]) for r in evals}
    assert models == {("base", "base"), *train, ("conflict", "merged"), ("random", "merged")}
    assert len(evals) == len(models) * len(FAMILIES)
    for r in evals:
        assert 1 <= r["n"] <= 2 and len(r["greedy_per_prompt"]) == r["n"]
        assert 0.0 <= r["greedy"] <= 1.0 and r["sampled"] is None
    assert {r["seed"] for r in evals if r["arm"] == "base"} == {None}

    # the merge: weights are the branches' accepted completion tokens, normalised
    (merge,) = [r for r in rows if r["kind"] == "merge" and r["arm"] == "conflict"]
    tokens = [train[("conflict", "b0")]["completion_tokens"],
              train[("conflict", "b1")]["completion_tokens"]]
    assert merge["tokens"] == tokens
    assert merge["weights"] == pytest.approx([t / sum(tokens) for t in tokens])
    # the tables: every arm and family; one seed gives a pair but no spread
    text = family_table(cfg, rows)
    assert "| joint | 1 |" in text and "conflict b1 alone (chain_sum, gcd)" in text
    assert "letter_counting (n = " in text
    assert "| joint | 1 | 1 | 4.000 | 4.000 |" in samples_table(cfg, rows)
    got = contrast_results(cfg, rows)
    assert [(r["arm"], r["baseline"], r["n"]) for r in got] == [
        ("conflict", "joint", 1), ("conflict", "random", 1), ("random", "joint", 1)]

    # a second start skips every finished cell: no swarm runs again. The conflict
    # merge is removed and its branches moved apart (a tiny random model rarely has
    # reward variance, so they may not have moved at all): only that cell runs again,
    # and every merged weight is W0 + sum_k w_k (W_k - W0)
    import shutil

    from ftis.client.learner.checkpoint import save_checkpoint
    from ftis.client.learner.config import LearnerConfig
    from ftis.client.learner.trainer import Learner
    from ftis.client.models.loader import load_policy
    from ftis.lab.merit.run import trained_policy

    def refuse(*_a, **_k):  # noqa: ANN202
        raise AssertionError("a finished cell ran again")

    monkeypatch.setattr(merit_experiment, "run_swarm", refuse)
    shutil.rmtree(out / "cells" / "conflict__merged__s0")
    branches = []
    for i, shift in enumerate((1e-2, -3e-2)):
        folder = out / "cells" / f"conflict__b{i}__s0" / LEARNER
        policy = trained_policy(str(tiny_model_dir), "none", folder)
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(shift)
        save_checkpoint(folder / "checkpoints", 99, policy.model,
                        Learner(policy.model, LearnerConfig(), 0).optimizer, {})
        branches.append({k: v.detach().clone() for k, v in policy.model.state_dict().items()})
    again = [json.loads(x) for x in run_merit(cfg, out).read_text().splitlines()]
    assert [r for r in again if r["cell"] != "conflict__merged__s0"] == [
        r for r in rows if r["cell"] != "conflict__merged__s0"]
    (merge,) = [r for r in again if r["kind"] == "merge" and r["arm"] == "conflict"]
    assert merge["tokens"] == tokens
    w0 = load_policy(str(tiny_model_dir)).model.state_dict()
    merged = load_policy(str(out / "cells" / "conflict__merged__s0" / "model")).model
    name = next(k for k in w0 if k.endswith("layers.0.self_attn.q_proj.weight"))
    weights = [t / sum(tokens) for t in tokens]
    expected = w0[name].double() + sum(
        w * (b[name].double() - w0[name].double())
        for w, b in zip(weights, branches, strict=True))
    assert torch.allclose(merged.state_dict()[name].double(), expected, atol=1e-6)
    assert not torch.allclose(merged.state_dict()[name], w0[name], atol=1e-4)

    # and now nothing at all runs again, not even an evaluation
    monkeypatch.setattr(merit_experiment, "evaluate_families", refuse)
    assert [json.loads(x) for x in run_merit(cfg, out).read_text().splitlines()] == again
