"""One exit-code table for ftis-coordinator, ftis-client and ftis-admin.

The table (``ftis.protocol.exit_codes``) is consistent, docs/exit-codes.md is generated
from it, and the programs' source exits only with codes from it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ftis.protocol.exit_codes import (
    EXIT_CODE_HELP,
    PROGRAM_PREFIX,
    PROGRAM_RANGES,
    ExitCode,
    exit_code_name,
    exit_codes,
    markdown,
    program_of,
)

ROOT = Path(__file__).resolve().parents[2]
#: source roots of the three programs, their shared package and the lab (whose
#: ``ftis-lab`` shares the client's codes)
PACKAGE_ROOTS = (ROOT / "proto", ROOT / "coordinator", ROOT / "client", ROOT / "lab")
PROGRAM_DIRS = (ROOT / "client" / "ftis" / "client", ROOT / "coordinator" / "ftis" / "coordinator",
                ROOT / "proto" / "ftis", ROOT / "lab" / "ftis" / "lab")
#: files that must hold exit sites (so the scan below cannot pass vacuously)
EXPECTED_EXIT_FILES = {
    "client/ftis/client/cli/start.py", "lab/ftis/lab/cli/demo.py",
    "lab/ftis/lab/cli/attack.py", "lab/ftis/lab/cli/experiment.py",
    "coordinator/ftis/coordinator/cli/main.py", "coordinator/ftis/coordinator/admin_cli/main.py",
}


# --- the table ------------------------------------------------------------------------


def test_docs_exit_codes_md_is_current():
    text = (ROOT / "docs" / "exit-codes.md").read_text()
    assert text == markdown(), (
        "docs/exit-codes.md is stale: python -m ftis.protocol.exit_codes --markdown "
        "> docs/exit-codes.md")


def test_every_code_is_unique_and_has_one_line_of_help():
    codes = exit_codes()
    assert len(set(codes.values())) == len(codes), f"duplicate values: {codes}"
    assert set(EXIT_CODE_HELP) == set(codes.values())
    for name, code in codes.items():
        assert 0 <= code <= 255, name  # process exit statuses are one byte
        help_text = EXIT_CODE_HELP[code]
        assert help_text.strip() and "\n" not in help_text and "|" not in help_text, name
        assert exit_code_name(code) == name


def test_no_two_programs_share_a_code():
    spans = [(program, r) for program, ranges in PROGRAM_RANGES.items() for r in ranges]
    for i, (p1, r1) in enumerate(spans):
        for p2, r2 in spans[i + 1:]:
            assert not set(r1) & set(r2), f"{p1} and {p2} overlap"
    for name, code in exit_codes().items():
        owners = [p for p, ranges in PROGRAM_RANGES.items() if any(code in r for r in ranges)]
        assert owners == [program_of(code)] and len(owners) == 1, (name, owners)
        prefixes = [p for p, prefix in PROGRAM_PREFIX.items() if name.startswith(prefix)]
        # a program's own codes carry its prefix; shared codes carry none
        assert prefixes == ([] if owners[0] == "shared" else owners), (name, code, prefixes)
    assert program_of(0) == program_of(1) == program_of(2) == "shared"
    assert ExitCode.INTERRUPTED == 130  # the shell's 128 + SIGINT


def test_table_cannot_be_instantiated():
    with pytest.raises(TypeError):
        ExitCode()


def test_old_client_names_alias_the_table():
    from ftis.client.cli import exit_codes as old

    table = set(exit_codes().values())
    names = {k: v for k, v in vars(old).items() if k.isupper()}
    assert names and set(names.values()) <= table
    assert old.REJECTED == ExitCode.CLIENT_REJECTED and old.INTERRUPTED == ExitCode.INTERRUPTED


# --- the programs exit only with codes from the table ---------------------------------

_EXIT_FUNCS = {"exit", "_exit", "quit", "Exit", "SystemExit"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _module_path(module: str) -> Path | None:
    parts = module.split(".")
    for root in PACKAGE_ROOTS:
        for candidate in (root.joinpath(*parts).with_suffix(".py"),
                          root.joinpath(*parts, "__init__.py")):
            if candidate.is_file():
                return candidate
    return None


class _Source:
    """One parsed file with parent links."""

    def __init__(self, path: Path, text: str | None = None) -> None:
        self.path = path
        self.tree = ast.parse(text if text is not None else path.read_text())
        for parent in ast.walk(self.tree):
            for child in ast.iter_child_nodes(parent):
                child.parent = parent  # type: ignore[attr-defined]

    def enclosing_function(self, node: ast.AST) -> ast.FunctionDef | None:
        while (node := getattr(node, "parent", None)) is not None:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                return node
        return None

    def function(self, name: str) -> ast.FunctionDef | None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return node
        return None

    def imported_from(self, name: str) -> str | None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if any((a.asname or a.name) == name for a in node.names):
                    return node.module
        return None


def _own_nodes(func: ast.AST):
    """Nodes of ``func``'s body, not descending into nested functions or classes."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
                          | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


class ExitChecker:
    """Checks that every exit site's status is provably a code of the table.

    Accepted: ``ExitCode.NAME``; ``exit_codes.NAME`` of the old client module;
    ``int(x)`` of an accepted ``x``; a parameter of the enclosing function whose every
    call in the file passes an accepted value; a local variable whose every assignment
    is accepted; a call of a function (same file, or imported from the programs'
    packages) whose every ``return`` is accepted. Anything else, integer literals
    included, is reported.
    """

    def __init__(self) -> None:
        from ftis.client.cli import exit_codes as old

        self.table = exit_codes()
        self.old = {k: v for k, v in vars(old).items() if k.isupper()}
        self.sources: dict[Path, _Source] = {}
        self.problems: list[str] = []
        self.sites: set[Path] = set()

    def source(self, path: Path) -> _Source:
        if path not in self.sources:
            self.sources[path] = _Source(path)
        return self.sources[path]

    def where(self, src: _Source, node: ast.AST) -> str:
        try:
            rel = src.path.relative_to(ROOT)
        except ValueError:
            rel = src.path
        return f"{rel}:{getattr(node, 'lineno', '?')}"

    def check_file(self, src: _Source) -> None:
        for node in ast.walk(src.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "ExitCode" and node.attr not in self.table:
                    self.problems.append(f"{self.where(src, node)}: ExitCode.{node.attr} "
                                         "is not in the table")
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            if not name or name.split(".")[-1] not in _EXIT_FUNCS:
                continue
            self.sites.add(src.path)
            args = [*node.args, *(k.value for k in node.keywords if k.arg in (
                "code", "status", "exit_code"))]
            if not args:
                continue  # no argument: status 0, ExitCode.OK
            if not self.accepted(src, args[0], node, depth=0):
                self.problems.append(f"{self.where(src, node)}: {name}({ast.unparse(args[0])})"
                                     " does not exit with a code of the table")

    def accepted(self, src: _Source, expr: ast.AST, site: ast.AST, depth: int) -> bool:
        if depth > 6:
            return False
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            if expr.value.id == "ExitCode":
                return expr.attr in self.table
            if expr.value.id == "exit_codes":
                return expr.attr in self.old
            return False
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
            if expr.func.id == "int" and len(expr.args) == 1:
                return self.accepted(src, expr.args[0], site, depth + 1)
            return self.returns_accepted(src, expr.func.id, depth + 1)
        if isinstance(expr, ast.Name):
            func = src.enclosing_function(site)
            if func is None:
                return False
            params = [a.arg for a in (*func.args.posonlyargs, *func.args.args,
                                      *func.args.kwonlyargs)]
            if expr.id in params:
                return self.calls_accepted(src, func, params.index(expr.id), expr.id, depth + 1)
            values = [n.value for n in _own_nodes(func) if isinstance(n, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == expr.id for t in n.targets)]
            return bool(values) and all(self.accepted(src, v, v, depth + 1) for v in values)
        return False

    def calls_accepted(self, src: _Source, func: ast.FunctionDef, index: int, name: str,
                       depth: int) -> bool:
        calls = [n for n in ast.walk(src.tree) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name) and n.func.id == func.name]
        if not calls:
            return False
        for call in calls:
            given = [k.value for k in call.keywords if k.arg == name]
            arg = given[0] if given else (call.args[index] if index < len(call.args) else None)
            if arg is None or not self.accepted(src, arg, call, depth):
                return False
        return True

    def returns_accepted(self, src: _Source, name: str, depth: int) -> bool:
        target, func = src, src.function(name)
        if func is None:
            module = src.imported_from(name)
            path = _module_path(module) if module else None
            if path is None:
                return False
            target = self.source(path)
            func = target.function(name)
            if func is None:
                return False
        returns = [n for n in _own_nodes(func) if isinstance(n, ast.Return)]
        return bool(returns) and all(
            r.value is not None and self.accepted(target, r.value, r, depth) for r in returns)


def _program_files():
    for directory in PROGRAM_DIRS:
        for path in sorted(directory.rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                yield path


def test_programs_exit_only_with_codes_of_the_table():
    checker = ExitChecker()
    for path in _program_files():
        checker.check_file(checker.source(path))
    assert not checker.problems, "\n".join(checker.problems)
    found = {str(p.relative_to(ROOT)) for p in checker.sites}
    assert EXPECTED_EXIT_FILES <= found, EXPECTED_EXIT_FILES - found


@pytest.mark.parametrize(("snippet", "ok"), [
    ("import typer\ndef f():\n    raise typer.Exit(3)\n", False),
    ("import sys\nsys.exit(1)\n", False),
    ("raise SystemExit(ExitCode.NOT_A_CODE)\n", False),
    ("def f():\n    raise typer.Exit(code)\n", False),
    ("def g(x):\n    return 4\ndef f():\n    raise typer.Exit(g(1))\n", False),
    ("def d(code):\n    raise typer.Exit(code)\nd(ExitCode.USAGE)\nd(7)\n", False),
    ("import sys\nsys.exit(ExitCode.UNEXPECTED)\n", True),
    ("def d(code):\n    raise typer.Exit(int(code))\nd(ExitCode.ADMIN_UNREACHABLE)\n", True),
    ("def g():\n    if x:\n        return ExitCode.OK\n    return ExitCode.CLIENT_REJECTED\n"
     "def f():\n    c = g()\n    raise typer.Exit(c)\n", True),
    ("def f():\n    raise typer.Exit()\n", True),
])
def test_the_scan_catches_codes_outside_the_table(tmp_path, snippet, ok):
    checker = ExitChecker()
    checker.check_file(_Source(tmp_path / "x.py", snippet))
    assert (not checker.problems) is ok, checker.problems


# --- the programs' behaviour at their exits -------------------------------------------


def test_coordinator_usage_error_exit_code(tmp_path):
    from typer.testing import CliRunner

    from ftis.coordinator.cli.main import app

    result = CliRunner().invoke(app, ["serve", "--listen", "nonsense", "--admin-listen",
                                      "127.0.0.1:0", "--db", str(tmp_path / "c.db")])
    assert result.exit_code == ExitCode.USAGE, result.output
    result = CliRunner().invoke(app, ["serve", "--no-such-flag"])
    assert result.exit_code == ExitCode.USAGE


def test_admin_exit_codes(monkeypatch):
    from typer.testing import CliRunner

    from ftis.coordinator.admin_cli import main as admin
    from ftis.protocol.errors import ErrorCode
    from ftis.v1 import admin_pb2, common_pb2

    result = CliRunner().invoke(admin.app, ["--admin", "127.0.0.1:1", "--timeout", "0.2",
                                            "stats"])
    assert result.exit_code == ExitCode.ADMIN_UNREACHABLE, result.output

    refused = admin_pb2.GetNodeResponse(
        error=common_pb2.Error(code=ErrorCode.NODE_UNKNOWN, reason="no such node"))
    monkeypatch.setattr(admin, "_call", lambda method, request: refused)
    result = CliRunner().invoke(admin.app, ["nodes", "show", "zzzz"])
    assert result.exit_code == ExitCode.ADMIN_ERROR_RESPONSE, result.output
