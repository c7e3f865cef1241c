"""``ftis-admin branches``: reading the committed ``ftis-lab merit plan`` files, the
requests the commands send, and their exit codes (no coordinator: ``_call`` is
replaced; tests/integration/test_branches_server.py runs them against a real one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ftis.coordinator.admin_cli import main as admin
from ftis.coordinator.admin_cli.merit_plan import PlanError, parse_plan, read_plan
from ftis.protocol.errors import ErrorCode
from ftis.protocol.exit_codes import ExitCode
from ftis.v1 import admin_pb2, common_pb2

PLANS = Path(__file__).resolve().parents[2] / "experiments" / "results" / "merit-plans-2026-11-24"


def _shape(plan) -> list[tuple]:
    return [(b.name, b.families, b.tokens) for b in plan.branches]


def test_the_committed_plans_parse_to_their_splits() -> None:
    # token counts as written in the files' "families" (seed 0: products 1153,
    # chain_sum 863, gcd 1315, letter_counting 1229)
    seed0 = read_plan(PLANS / "plan-seed0.json")
    assert (seed0.split, seed0.model, seed0.seed) == ("conflict_aware", "smollm2-135m", 0)
    assert _shape(seed0) == [("b0", ("chain_sum", "gcd"), 863 + 1315),
                             ("b1", ("products", "letter_counting"), 1153 + 1229)]
    assert seed0.branches[0].share == pytest.approx(2178 / 4560)
    assert _shape(read_plan(PLANS / "plan-seed0.json", "random")) == [
        ("b0", ("letter_counting",), 1229), ("b1", ("products", "chain_sum", "gcd"), 3331)]
    # the easy-config plan (families with configs): products 1000, chain_sum 807,
    # gcd 1241, letter_counting 1229
    easy = read_plan(PLANS / "plan-easy-seed0.json")
    assert _shape(easy) == [("b0", ("products",), 1000),
                            ("b1", ("chain_sum", "gcd", "letter_counting"), 807 + 1241 + 1229)]
    seed1 = read_plan(PLANS / "plan-seed1.json", "random")
    assert _shape(seed1) == [("b0", ("products",), 1106),
                             ("b1", ("chain_sum", "gcd", "letter_counting"), 889 + 1389 + 1310)]


def test_a_plan_without_token_counts_has_zero_tokens() -> None:
    plan = parse_plan({"branches": {"conflict_aware": [["a"], ["b", "c"]]},
                       "families": [{"dataset": "a", "tokens": 3}]})
    assert [(b.tokens, b.share) for b in plan.branches] == [(0.0, 0.0), (0.0, 0.0)]


@pytest.mark.parametrize(("data", "split", "needle"), [
    ([], "conflict_aware", "no \"branches\""),
    ({"branches": {"random": [["a"]]}}, "conflict_aware", "(it has: random)"),
    ({"branches": {"conflict_aware": []}}, "conflict_aware", "non-empty list of branches"),
    ({"branches": {"conflict_aware": [["a"], []]}}, "conflict_aware", "branch 1"),
    ({"branches": {"conflict_aware": [["a", 3]]}}, "conflict_aware", "not a dataset name"),
    ({"branches": {"conflict_aware": [["a"], ["b", "a"]]}}, "conflict_aware",
     "'a' is in branches 0 and 1"),
    ({"branches": {"conflict_aware": [["a"]]}, "families": [{"dataset": "a", "tokens": -1}]},
     "conflict_aware", "tokens -1"),
])
def test_bad_plans_are_refused_with_one_line(data, split, needle) -> None:
    with pytest.raises(PlanError) as info:
        parse_plan(data, split)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_plan_shows_without_a_coordinator(monkeypatch) -> None:
    monkeypatch.setattr(admin, "_call", lambda *a: pytest.fail("no call without --apply"))
    result = CliRunner().invoke(admin.app, ["branches", "plan",
                                            str(PLANS / "plan-seed1.json"), "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["split"] == "conflict_aware" and shown["seed"] == 1
    assert [(b["name"], b["families"], b["tokens"]) for b in shown["branches"]] == [
        ("b0", ["chain_sum", "gcd"], 889 + 1389), ("b1", ["products", "letter_counting"],
                                                   1106 + 1310)]
    result = CliRunner().invoke(admin.app, ["branches", "plan",
                                            str(PLANS / "plan-seed1.json")],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "products, letter_counting" in result.output
    assert "not applied" in result.output


def test_plan_apply_defines_the_branches_replacing_the_others(monkeypatch) -> None:
    sent = []

    def call(method, request):
        sent.append((method, request))
        return admin_pb2.DefineBranchesResponse(branches=request.branches)

    monkeypatch.setattr(admin, "_call", call)
    result = CliRunner().invoke(admin.app, ["branches", "plan", str(PLANS / "plan-seed0.json"),
                                            "--split", "random", "--apply", "--json"])
    assert result.exit_code == 0, result.output
    ((method, request),) = sent
    assert method == "DefineBranches" and request.replace is True
    assert [(b.name, list(b.families), b.tokens) for b in request.branches] == [
        ("b0", ["letter_counting"], 1229.0), ("b1", ["products", "chain_sum", "gcd"], 3331.0)]


def test_clear_replaces_with_no_branches(monkeypatch) -> None:
    sent = []
    monkeypatch.setattr(admin, "_call", lambda method, request: sent.append(
        (method, request)) or admin_pb2.DefineBranchesResponse())
    result = CliRunner().invoke(admin.app, ["branches", "clear"])
    assert result.exit_code == 0, result.output
    assert sent == [("DefineBranches", admin_pb2.DefineBranchesRequest(replace=True))]


def test_a_refused_plan_exits_with_the_error_response_code(monkeypatch) -> None:
    refused = admin_pb2.DefineBranchesResponse(error=common_pb2.Error(
        code=ErrorCode.BRANCH_INVALID, reason="family 'gcd' is not in the task mix"))
    monkeypatch.setattr(admin, "_call", lambda method, request: refused)
    result = CliRunner().invoke(admin.app, ["branches", "plan", str(PLANS / "plan-seed0.json"),
                                            "--apply"])
    assert result.exit_code == ExitCode.ADMIN_ERROR_RESPONSE
    assert "BRANCH_INVALID (146): family 'gcd'" in result.output


@pytest.mark.parametrize("args", [
    ["branches", "plan", "/nonexistent/plan.json"],
    ["branches", "plan", str(PLANS / "plan-seed0.json"), "--split", "nope"],
    ["branches", "assign"],
    ["branches", "assign", "abc"],                          # no branch, no --none
    ["branches", "assign", "abc", "b0", "--none"],          # both
    ["branches", "assign", "abc", "--round-robin"],
])
def test_usage_errors(monkeypatch, args) -> None:
    monkeypatch.setattr(admin, "_call", lambda *a: pytest.fail("no call on a usage error"))
    result = CliRunner().invoke(admin.app, args)
    assert result.exit_code == ExitCode.USAGE, result.output


@pytest.mark.parametrize(("args", "expected"), [
    (["branches", "assign", "abc", "b1"], admin_pb2.AssignBranchRequest(
        node_ids=["abc"], branch="b1")),
    (["branches", "assign", "abc", "--none"], admin_pb2.AssignBranchRequest(node_ids=["abc"])),
    (["branches", "unassign", "abc", "def"], admin_pb2.AssignBranchRequest(
        node_ids=["abc", "def"])),
    (["branches", "assign", "--round-robin"], admin_pb2.AssignBranchRequest(round_robin=True)),
])
def test_assign_requests(monkeypatch, args, expected) -> None:
    sent = []

    def call(method, request):
        sent.append((method, request))
        return admin_pb2.AssignBranchResponse(assignments=[
            admin_pb2.NodeBranch(node_id="abc" * 10, branch=expected.branch)])

    monkeypatch.setattr(admin, "_call", call)
    result = CliRunner().invoke(admin.app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert sent == [("AssignBranch", expected)]
    assert json.loads(result.output)["assignments"][0]["branch"] == expected.branch
