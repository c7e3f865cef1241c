"""``ftis-admin``: operator CLI over the coordinator's admin service.

``ftis-admin [--admin HOST:PORT] [--timeout S] COMMAND [--json]`` with commands
``nodes list``, ``nodes show NODE``, ``bundles list [--node N] [--limit K]``, ``stats``,
``ban NODE [--reason TEXT]``, ``unban NODE`` (also clears quarantine: the node's bad
reputation evidence is reset to 0), ``reputation show`` and ``reputation set``, which
has one flag per :class:`~ftis.coordinator.reputation.ReputationConfig` field, derived
from the dataclass (``--quarantine-threshold X``, ``--feedback-cap W``,
``--auto-ban-on-proof/--no-auto-ban-on-proof``, ...), and ``--set FIELD=VALUE`` for any
of them by name; and the MERIT branches (docs/merit.md): ``branches plan PLAN.json
[--split conflict_aware|random] [--apply]`` (an ``ftis-lab merit plan`` file; with
``--apply`` its branches replace the coordinator's), ``branches assign NODE BRANCH``,
``branches assign NODE --none``, ``branches assign --round-robin``, ``branches unassign
NODE...``, ``branches clear`` (drop them all) and ``branches show``. ``--json`` prints
the response as proto3 JSON (field names as in ``admin.proto``, int64 as numbers).

Exit codes (:class:`ftis.protocol.exit_codes.ExitCode`, docs/exit-codes.md): ``OK``,
``USAGE``, ``ADMIN_UNREACHABLE`` (admin service unreachable), ``ADMIN_ERROR_RESPONSE``
(the coordinator answered with an error code), ``ADMIN_CALL_FAILED`` (any other failed
call).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
import time
import typing
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer
from google.protobuf import json_format
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Table

from ftis.coordinator.admin_cli.merit_plan import SPLITS, Plan, PlanError, read_plan
from ftis.coordinator.reputation import ReputationConfig
from ftis.protocol.errors import ErrorCode, code_name
from ftis.protocol.exit_codes import ExitCode
from ftis.v1 import admin_pb2, admin_pb2_grpc

app = typer.Typer(
    name="ftis-admin",
    help="Operator CLI of the FTIS coordinator's admin service.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
nodes_app = typer.Typer(help="Registered nodes.", no_args_is_help=True)
bundles_app = typer.Typer(help="Stored bundles.", no_args_is_help=True)
reputation_app = typer.Typer(help="Reputation policy.", no_args_is_help=True)
branches_app = typer.Typer(
    help="MERIT branches: which task families each node is leased (docs/merit.md).",
    no_args_is_help=True)
app.add_typer(nodes_app, name="nodes")
app.add_typer(bundles_app, name="bundles")
app.add_typer(reputation_app, name="reputation")
app.add_typer(branches_app, name="branches")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
_console = Console()


class _Settings:
    admin: str = "127.0.0.1:7001"
    timeout: float = 10.0


_settings = _Settings()


@app.callback()
def _main(
    admin: Annotated[
        str, typer.Option(envvar="FTIS_ADMIN", help="HOST:PORT of the coordinator admin service.")
    ] = "127.0.0.1:7001",
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the coordinator.")] = 10.0,
) -> None:
    """Operator CLI of the FTIS coordinator."""
    _settings.admin = admin
    _settings.timeout = timeout


def to_dict(message: Message) -> dict[str, Any]:
    """Proto message -> JSON-ready dict (proto field names, defaults included)."""
    return json_format.MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )


def _call(method: str, request: Message) -> Any:
    """Call ``Admin.<method>``; exits ``ADMIN_UNREACHABLE`` if the coordinator cannot be
    reached, ``ADMIN_CALL_FAILED`` on another failed call."""
    channel = grpc.insecure_channel(_settings.admin)
    try:
        try:
            grpc.channel_ready_future(channel).result(timeout=_settings.timeout)
        except grpc.FutureTimeoutError:
            _die(
                ExitCode.ADMIN_UNREACHABLE,
                f"cannot reach coordinator admin service at {_settings.admin}",
            )
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            return getattr(stub, method)(request, timeout=_settings.timeout)
        except grpc.RpcError as exc:
            status = exc.code() if hasattr(exc, "code") else None
            if status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                _die(
                    ExitCode.ADMIN_UNREACHABLE,
                    f"cannot reach coordinator admin service at {_settings.admin}",
                )
            details = exc.details() if hasattr(exc, "details") else str(exc)
            _die(ExitCode.ADMIN_CALL_FAILED, f"{method} failed: {status}: {details}")
    finally:
        channel.close()


def _die(code: int, message: str) -> None:
    print(f"ftis-admin: {message}", file=sys.stderr)
    raise typer.Exit(code)


def _check_error(response: Any, as_json: bool) -> None:
    """Exit ``ADMIN_ERROR_RESPONSE`` with ``CODE_NAME (n): reason`` if the response
    carries an error."""
    error = response.error
    if error.code == ErrorCode.ERROR_CODE_UNSPECIFIED:
        return
    if as_json:
        name = code_name(error.code)
        print(json.dumps({"error": {"code": error.code, "name": name, "reason": error.reason}}))
    _die(ExitCode.ADMIN_ERROR_RESPONSE, f"{code_name(error.code)} ({error.code}): {error.reason}")


def _print_json(message: Message) -> None:
    print(json.dumps(to_dict(message), indent=2, sort_keys=True))


def _age(ms: int) -> str:
    if ms <= 0:
        return "-"
    seconds = max(0.0, time.time() - ms / 1000)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(v) for v in row))
    _console.print(table)


def node_state(node: admin_pb2.NodeInfo) -> str:
    """``banned``, ``quarantined``, ``probation`` or ``ok`` (in that precedence)."""
    if node.banned:
        return "banned"
    if node.quarantined:
        return "quarantined"
    if node.probation:
        return "probation"
    return "ok"


def _node_rows(nodes: list[admin_pb2.NodeInfo]) -> list[list[Any]]:
    return [
        [
            n.node_id,
            n.display_name,
            n.model_card.base_model,
            n.model_card.tokenizer_fingerprint[:12],
            n.policy_version,
            n.bundles_accepted,
            n.bundles_rejected,
            n.reward_mismatches,
            f"{n.reputation:.3f}",
            _age(n.last_seen_ms),
            node_state(n),
        ]
        for n in nodes
    ]


_NODE_COLUMNS = [
    "node",
    "name",
    "model",
    "tokenizer",
    "policy",
    "accepted",
    "rejected",
    "mismatches",
    "reputation",
    "last seen",
    "state",
]


def _show_node(node: admin_pb2.NodeInfo, title: str) -> None:
    _table(title, _NODE_COLUMNS, _node_rows([node]))
    if node.banned:
        _console.print(f"ban reason: {node.ban_reason}")
    _console.print(
        f"reputation: {node.reputation:.4f} (good {node.evidence_good:.3f}, "
        f"bad {node.evidence_bad:.3f}, decayed to now)"
    )


@nodes_app.command("list")
def nodes_list(as_json: JsonFlag = False) -> None:
    """List registered nodes."""
    response = _call("ListNodes", admin_pb2.ListNodesRequest())
    if as_json:
        _print_json(response)
        return
    _table("nodes", _NODE_COLUMNS, _node_rows(list(response.nodes)))


@nodes_app.command("show")
def nodes_show(
    node: Annotated[str, typer.Argument(help="Node id or unique prefix.")],
    as_json: JsonFlag = False,
) -> None:
    """Show one node, its model card, latest metrics and rejections by code."""
    response = _call("GetNode", admin_pb2.GetNodeRequest(node_id=node))
    _check_error(response, as_json)
    if as_json:
        _print_json(response)
        return
    n = response.node
    _show_node(n, f"node {n.node_id}")
    card = n.model_card
    _console.print(
        f"model card: base={card.base_model} params={card.parameter_count} peft={card.peft} "
        f"dtype={card.dtype} quant={card.quantization} vocab={card.vocab_size} "
        f"tokenizer={card.tokenizer_fingerprint}"
    )
    if n.latest_metrics:
        _table(
            f"latest metrics (step {n.latest_metrics_step})",
            ["metric", "value"],
            [[k, f"{v:.6g}"] for k, v in sorted(n.latest_metrics.items())],
        )
    if response.rejections_by_code:
        _table(
            "rejections by code",
            ["code", "count"],
            sorted([k, v] for k, v in response.rejections_by_code.items()),
        )
    if response.evidence:
        _table(
            f"evidence (newest {len(response.evidence)})",
            ["at", "kind", "weight", "reporter", "bundle", "detail"],
            [
                [
                    _age(e.at_ms),
                    e.kind,
                    f"{e.weight:+.3g}",
                    e.reporter_node_id[:12],
                    e.bundle_id[:12],
                    e.detail,
                ]
                for e in response.evidence
            ],
        )


@bundles_app.command("list")
def bundles_list(
    node: Annotated[str, typer.Option(help="Only bundles of nodes with this id prefix.")] = "",
    limit: Annotated[int, typer.Option(min=1, help="Most recent bundles to show.")] = 50,
    as_json: JsonFlag = False,
) -> None:
    """List stored bundles, newest first."""
    response = _call("ListBundles", admin_pb2.ListBundlesRequest(node_id=node, limit=limit))
    if as_json:
        _print_json(response)
        return
    _table(
        "bundles",
        [
            "seq",
            "bundle",
            "node",
            "dataset",
            "G",
            "tokens",
            "reward",
            "mismatches",
            "policy",
            "bytes",
            "stored",
        ],
        [
            [
                b.sequence,
                b.bundle_id[:12],
                b.node_id[:12],
                b.dataset,
                b.completions,
                b.completion_tokens,
                f"{b.mean_verified_reward:.3f}",
                b.reward_mismatches,
                b.policy_version,
                b.size_bytes,
                _age(b.stored_at_ms),
            ]
            for b in response.bundles
        ],
    )


@app.command()
def stats(as_json: JsonFlag = False) -> None:
    """Swarm-wide counters."""
    response = _call("Stats", admin_pb2.StatsRequest())
    if as_json:
        _print_json(response)
        return
    fields = to_dict(response)
    by_code = fields.pop("rejections_by_code", {})
    _table("stats", ["counter", "value"], [[k, v] for k, v in fields.items()])
    if by_code:
        _table("rejections by code", ["code", "count"], sorted([k, v] for k, v in by_code.items()))


def _ban_like(method: str, request: Message, as_json: bool, verb: str) -> None:
    response = _call(method, request)
    _check_error(response, as_json)
    if as_json:
        _print_json(response)
        return
    _show_node(response.node, f"{verb} {response.node.node_id}")


@app.command()
def ban(
    node: Annotated[str, typer.Argument(help="Node id or unique prefix.")],
    reason: Annotated[str, typer.Option(help="Why (stored with the ban).")] = "",
    as_json: JsonFlag = False,
) -> None:
    """Ban a node: its calls are refused and its bundles no longer relayed."""
    _ban_like("BanNode", admin_pb2.BanNodeRequest(node_id=node, reason=reason), as_json, "banned")


@app.command()
def unban(
    node: Annotated[str, typer.Argument(help="Node id or unique prefix.")],
    as_json: JsonFlag = False,
) -> None:
    """Lift a node's ban and clear its quarantine (resets its bad reputation evidence)."""
    _ban_like("UnbanNode", admin_pb2.UnbanNodeRequest(node_id=node), as_json, "unbanned")


def _show_reputation_config(config: admin_pb2.ReputationConfig, title: str) -> None:
    _table(title, ["setting", "value"], [[k, v] for k, v in to_dict(config).items()])


@reputation_app.command("show")
def reputation_show(as_json: JsonFlag = False) -> None:
    """Show the reputation policy in force."""
    response = _call("GetReputationConfig", admin_pb2.GetReputationConfigRequest())
    if as_json:
        _print_json(response)
        return
    _show_reputation_config(response.config, "reputation policy")


def _field_help() -> dict[str, str]:
    """One line of help per :class:`ReputationConfig` field, from its docstring's
    ``Attributes:`` section."""
    doc = inspect.getdoc(ReputationConfig) or ""
    out: dict[str, str] = {}
    names: list[str] = []
    in_attributes = False
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            in_attributes = True
            continue
        if not in_attributes:
            continue
        if line and not line.startswith(" "):
            break
        match = re.match(r"^ {4}([a-z_, ]+):\s*(.*)$", line)
        if match:
            names = [n.strip() for n in match.group(1).split(",")]
            for name in names:
                out[name] = match.group(2).strip()
        elif names and line.strip():
            for name in names:
                out[name] += " " + line.strip()
    return {k: v.replace("``", "") for k, v in out.items()}


def reputation_fields() -> dict[str, type]:
    """Every :class:`ReputationConfig` field and its type (``float``, ``int``, ``bool``)."""
    hints = typing.get_type_hints(ReputationConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(ReputationConfig)}


def parse_field_value(name: str, text: str) -> Any:
    """``--set name=text`` -> a value of the field's type.

    Raises:
        ValueError: unknown field or a value that is not of its type.
    """
    fields = reputation_fields()
    if name not in fields:
        raise ValueError(f"unknown setting {name!r}; settings: {', '.join(fields)}")
    kind = fields[name]
    value = text.strip()
    if kind is bool:
        lowered = value.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{name} takes true or false, got {text!r}")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name} takes a {kind.__name__}, got {text!r}") from None


def _reputation_set(**options: Any) -> None:
    """Change some settings of the reputation policy (the others are kept); persisted
    by the coordinator and applied to every node at once. Every setting has a flag, and
    --set FIELD=VALUE (repeatable) takes any of them by name."""
    as_json = bool(options.pop("as_json", False))
    assignments = options.pop("set_", None) or []
    changes = {name: value for name, value in options.items() if value is not None}
    for item in assignments:
        name, sep, text = item.partition("=")
        if not sep:
            _die(ExitCode.USAGE, f"--set expects FIELD=VALUE, got {item!r}")
        try:
            changes[name.strip()] = parse_field_value(name.strip(), text)
        except ValueError as exc:
            _die(ExitCode.USAGE, str(exc))
    if not changes:
        _die(ExitCode.USAGE, "nothing to set: give at least one setting "
             f"({', '.join('--' + n.replace('_', '-') for n in reputation_fields())} "
             "or --set FIELD=VALUE)")
    current = _call("GetReputationConfig", admin_pb2.GetReputationConfigRequest()).config
    for name, value in changes.items():
        setattr(current, name, value)
    response = _call("SetReputationConfig", admin_pb2.SetReputationConfigRequest(config=current))
    _check_error(response, as_json)
    if as_json:
        _print_json(response)
        return
    _show_reputation_config(response.config, "reputation policy (updated)")


def _reputation_set_signature() -> inspect.Signature:
    """``reputation set``'s options, one per :class:`ReputationConfig` field (a bool
    field gets ``--name/--no-name``), then ``--set`` and ``--json``."""
    helps = _field_help()
    params = []
    for name, kind in reputation_fields().items():
        flag = "--" + name.replace("_", "-")
        decl = f"{flag}/--no-{flag[2:]}" if kind is bool else flag
        option = typer.Option(decl, help=helps.get(name, name))
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Annotated[kind | None, option]))
    params.append(inspect.Parameter(
        "set_", inspect.Parameter.KEYWORD_ONLY, default=None,
        annotation=Annotated[list[str] | None, typer.Option(
            "--set", help="FIELD=VALUE for any setting by its name (repeatable).")]))
    params.append(inspect.Parameter("as_json", inspect.Parameter.KEYWORD_ONLY, default=False,
                                    annotation=JsonFlag))
    return inspect.Signature(params)


_reputation_set_sig = _reputation_set_signature()
_reputation_set.__signature__ = _reputation_set_sig  # type: ignore[attr-defined]
_reputation_set.__annotations__ = {
    p.name: p.annotation for p in _reputation_set_sig.parameters.values()}
reputation_app.command("set")(_reputation_set)


# -- MERIT branches ------------------------------------------------------------------------


def _tokens(value: float) -> str:
    return f"{value:.0f}" if value > 0 else "-"


def _show_branches(branches: list[admin_pb2.BranchInfo], title: str) -> None:
    total = sum(b.tokens for b in branches)
    _table(title, ["branch", "families", "tokens", "share", "nodes", "bundles", "defined"], [
        [b.name, ", ".join(b.families), _tokens(b.tokens),
         f"{b.tokens / total:.1%}" if total > 0 else "-", len(b.node_ids),
         b.bundles_accepted, _age(b.defined_at_ms)] for b in branches])


def _plan_dict(path: Path, plan: Plan) -> dict[str, Any]:
    return {"plan": str(path), "model": plan.model, "seed": plan.seed, "split": plan.split,
            "branches": [{"name": b.name, "families": list(b.families), "tokens": b.tokens,
                          "share": b.share} for b in plan.branches]}


@branches_app.command("plan")
def branches_plan(
    plan_file: Annotated[Path, typer.Argument(
        metavar="PLAN.json", help="Output of `ftis-lab merit plan`.")],
    split: Annotated[str, typer.Option(
        help=f"Which of the plan's splits: {' or '.join(SPLITS)}.")] = SPLITS[0],
    apply: Annotated[bool, typer.Option(
        "--apply", help="Make these the coordinator's branches (b0, b1, ...), replacing "
        "any others; nodes of dropped branches get the whole mix again.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Show the branches of a MERIT plan's split, and with --apply define them."""
    try:
        plan = read_plan(plan_file, split)
    except PlanError as exc:
        _die(ExitCode.USAGE, str(exc))
        return
    if not apply:
        if as_json:
            print(json.dumps(_plan_dict(plan_file, plan), indent=2, sort_keys=True))
            return
        seed = f", seed {plan.seed}" if plan.seed is not None else ""
        _table(f"{plan_file.name}: {plan.split} split ({plan.model}{seed})",
               ["branch", "families", "tokens", "share"],
               [[b.name, ", ".join(b.families), _tokens(b.tokens),
                 f"{b.share:.1%}" if b.tokens > 0 else "-"] for b in plan.branches])
        _console.print("not applied: add --apply to define these branches on the coordinator")
        return
    request = admin_pb2.DefineBranchesRequest(replace=True, branches=[
        admin_pb2.BranchInfo(name=b.name, families=list(b.families), tokens=b.tokens)
        for b in plan.branches])
    response = _call("DefineBranches", request)
    _check_error(response, as_json)
    if as_json:
        _print_json(response)
        return
    _show_branches(list(response.branches), f"branches (from {plan_file.name}, {plan.split})")


@branches_app.command("clear")
def branches_clear(as_json: JsonFlag = False) -> None:
    """Drop every branch: all nodes are leased from the whole task mix again."""
    response = _call("DefineBranches", admin_pb2.DefineBranchesRequest(replace=True))
    _check_error(response, as_json)
    if as_json:
        _print_json(response)
        return
    _console.print("no branches: every node is leased from the whole task mix")


@branches_app.command("show")
def branches_show(as_json: JsonFlag = False) -> None:
    """Branches, their families, nodes and accepted bundles; the task mix."""
    response = _call("ListBranches", admin_pb2.ListBranchesRequest())
    if as_json:
        _print_json(response)
        return
    _show_branches(list(response.branches), "branches")
    for b in response.branches:
        if b.node_ids:
            _console.print(f"{b.name}: " + " ".join(n[:12] for n in b.node_ids))
    used = {f for b in response.branches for f in b.families}
    free = [d for d in response.task_mix if d not in used]
    _console.print(f"task mix: {', '.join(response.task_mix)}")
    if response.branches:
        _console.print(f"families in no branch: {', '.join(free) or '-'}")
    _console.print(f"unassigned nodes (whole mix): {response.unassigned_nodes}")


def _show_assignments(response: admin_pb2.AssignBranchResponse, as_json: bool) -> None:
    _check_error(response, as_json)
    if as_json:
        _print_json(response)
        return
    _table("assignments", ["node", "branch"],
           [[a.node_id, a.branch or "(whole mix)"] for a in response.assignments])


@branches_app.command("assign")
def branches_assign(
    node: Annotated[str | None, typer.Argument(help="Node id or unique prefix.")] = None,
    branch: Annotated[str | None, typer.Argument(help="Branch name (branches show).")] = None,
    none: Annotated[bool, typer.Option(
        "--none", help="Unassign NODE: it is leased from the whole mix again.")] = False,
    round_robin: Annotated[bool, typer.Option(
        "--round-robin", help="Instead: spread every registered node that is neither "
        "assigned nor banned over the branches (fewest nodes first).")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Assign a node to a branch (NODE BRANCH), unassign it (NODE --none), or spread
    the unassigned nodes (--round-robin)."""
    if round_robin:
        if node is not None or branch is not None or none:
            _die(ExitCode.USAGE, "--round-robin takes no NODE, BRANCH or --none")
        request = admin_pb2.AssignBranchRequest(round_robin=True)
    elif node is None or (branch is None) == (not none):
        _die(ExitCode.USAGE, "give NODE BRANCH, NODE --none, or --round-robin")
        return
    else:
        request = admin_pb2.AssignBranchRequest(node_ids=[node], branch=branch or "")
    _show_assignments(_call("AssignBranch", request), as_json)


@branches_app.command("unassign")
def branches_unassign(
    nodes: Annotated[list[str], typer.Argument(help="Node ids or unique prefixes.")],
    as_json: JsonFlag = False,
) -> None:
    """Unassign nodes: they are leased from the whole task mix again."""
    response = _call("AssignBranch", admin_pb2.AssignBranchRequest(node_ids=nodes, branch=""))
    _show_assignments(response, as_json)


if __name__ == "__main__":
    app()
