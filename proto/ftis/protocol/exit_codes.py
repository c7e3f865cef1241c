"""The one exit-code table of ``ftis-coordinator``, ``ftis-client`` and ``ftis-admin``.

Every process exit status of the three programs is a constant of :class:`ExitCode`
with a one-line help text in :data:`EXIT_CODE_HELP` (modelled on Flower's
``flwr.common.exit.ExitCode``). Each program owns a range, so a status names its
meaning without knowing which program exited:

=========  ==========================================================================
0-19       shared by all three (0 success, 1 unexpected error, 2 usage)
20-49      ``ftis-coordinator`` (names ``COORDINATOR_*``)
50-79      ``ftis-client`` (names ``CLIENT_*``)
80-99      ``ftis-admin`` (names ``ADMIN_*``)
100-127    unassigned
128-159    shared, the shell convention 128 + N for "stopped by signal N"
=========  ==========================================================================

``docs/exit-codes.md`` is generated from this module::

    python -m ftis.protocol.exit_codes --markdown > docs/exit-codes.md

and ``tests/unit/test_exit_codes.py`` checks that the committed file is current, that
the table is consistent, and (by scanning the source) that the programs exit only with
codes from it. Add a code here, regenerate the document, never renumber.
"""

from __future__ import annotations

import argparse


class ExitCode:
    """Process exit statuses of the FTIS programs (plain ``int`` constants)."""

    # Shared (0-19)
    OK = 0
    UNEXPECTED = 1
    USAGE = 2

    # ftis-coordinator (20-49)
    COORDINATOR_BIND = 20
    COORDINATOR_DATABASE = 21
    COORDINATOR_WORKER = 22
    COORDINATOR_SPOT_CHECK_MODELS = 23

    # ftis-client (50-79)
    CLIENT_COORDINATOR_UNREACHABLE = 50
    CLIENT_MODEL_NOT_FOUND = 51
    CLIENT_REJECTED = 52
    CLIENT_MEMORY_BUDGET = 53
    CLIENT_SWARM_FAILED = 54
    CLIENT_FALSE_POSITIVE = 55
    CLIENT_SERVICE = 56
    CLIENT_DEVICE_UNAVAILABLE = 57

    # ftis-admin (80-99)
    ADMIN_UNREACHABLE = 80
    ADMIN_ERROR_RESPONSE = 81
    ADMIN_CALL_FAILED = 82

    # Shared, stopped by a signal (128 + N)
    INTERRUPTED = 130

    def __new__(cls) -> ExitCode:
        """Prevent instantiation."""
        raise TypeError(f"{cls.__name__} cannot be instantiated.")


#: One line of help per code: what happened and, where useful, what to do.
EXIT_CODE_HELP: dict[int, str] = {
    # Shared (0-19)
    ExitCode.OK: (
        "Success. ftis-coordinator: stopped normally, including on SIGINT or SIGTERM "
        "(graceful stop: running calls get up to 5 s); ftis-client start: all requested "
        "rounds done; ftis-lab demo: finished and wrote its report; ftis-lab "
        "attack: rounds done or the attacker was banned (an expected outcome)."
    ),
    ExitCode.UNEXPECTED: (
        "Unexpected error; the traceback is on stderr (Python's status for an uncaught "
        "exception, and click's after `Aborted!` on Ctrl-C outside the client's rounds)."
    ),
    ExitCode.USAGE: (
        "Bad command line (click's own status for usage errors), configuration file "
        "(`--config`), environment setting (`FTIS_COORDINATOR_*`, `FTIS_CLIENT_*`), "
        "volunteer setting (`ftis-client settings set`, its file, `FTIS_<KEY>`), task "
        "mix, experiment config or attack kind."
    ),
    # ftis-coordinator (20-49)
    ExitCode.COORDINATOR_BIND: (
        "A listener address (`--listen` or `--admin-listen`) cannot be bound, e.g. the "
        "port is in use."
    ),
    ExitCode.COORDINATOR_DATABASE: (
        "The database (`--db`) cannot be opened, reached or initialised."
    ),
    ExitCode.COORDINATOR_WORKER: (
        "A worker process of `serve --workers N` exited; the others were stopped. Its "
        "log lines above say why."
    ),
    ExitCode.COORDINATOR_SPOT_CHECK_MODELS: (
        "A model named in `spot_checks.models` cannot be loaded (not found locally, or "
        "the `ftis-coordinator[spot-checks]` extra with torch and ftis-client is not "
        "installed); the log says which. Fix the name or install the extra."
    ),
    # ftis-client (50-79)
    ExitCode.CLIENT_COORDINATOR_UNREACHABLE: (
        "The coordinator cannot be reached or a call failed at the gRPC level "
        "(`start`: UNAVAILABLE and DEADLINE_EXCEEDED are retried with exponential backoff "
        "and full jitter, up to 30 s apart, until the coordinator has been unreachable "
        "for `--max-outage` seconds, default 1800; the last checkpoint is kept; "
        "`ftis-lab attack`: 30 failed rounds in a row; `status`: its Heartbeat got no "
        "answer within `--timeout`, the local numbers are still shown)."
    ),
    ExitCode.CLIENT_MODEL_NOT_FOUND: (
        "`--model` is not an embedded alias, a `.gguf` file, a model directory or a hub "
        "id in the local cache."
    ),
    ExitCode.CLIENT_REJECTED: (
        "The coordinator refused the node with an error code (e.g. `NODE_BANNED`, "
        "`REGISTRATION_INVALID`; docs/error-codes.md); the message names the code "
        "(`ftis-lab attack`: only at registration or after 30 refused rounds in a row; `status`: "
        "the Heartbeat was refused, e.g. `NODE_UNKNOWN` before the node's first `start`)."
    ),
    ExitCode.CLIENT_MEMORY_BUDGET: (
        "`start --max-memory SIZE`: the estimated peak memory exceeds SIZE; checked "
        "before any weight is loaded or the coordinator contacted, the one-line message "
        "gives the estimate, its largest parts and what to change (docs/heterogeneity.md). "
        "Also before each round, before anything is leased: the round's estimated peak "
        "exceeds SIZE or the machine's total memory less 256 MiB (a round that only "
        "lacks the memory available now waits for it instead, and says so)."
    ),
    ExitCode.CLIENT_SWARM_FAILED: (
        "`ftis-lab demo`: the coordinator or a client it started failed or did not finish within "
        "`--timeout-min` (the report is still written when it can be); see `OUT/logs/`."
    ),
    ExitCode.CLIENT_FALSE_POSITIVE: (
        "`ftis-lab security-experiment`: an honest node was quarantined or banned; "
        "`OUT/results.md` names it."
    ),
    ExitCode.CLIENT_SERVICE: (
        "`service`: no background service is installed for this user (install.sh "
        "`--autostart` or setup.exe's \"Start at login\" writes one), or the platform's "
        "service manager is not reachable here (e.g. no `systemd --user` session) or "
        "refused the command; the message names the command and its answer."
    ),
    ExitCode.CLIENT_DEVICE_UNAVAILABLE: (
        "`start --device cuda` (or `cuda:N`): no such CUDA GPU is visible to the client "
        "(torch built without CUDA, no driver, the `use_gpu = false` setting hides them, "
        "or N is out of range); `--device auto`, the default, falls back to the CPU."
    ),
    # ftis-admin (80-99)
    ExitCode.ADMIN_UNREACHABLE: (
        "The coordinator's admin service (`--admin HOST:PORT`, env `FTIS_ADMIN`, default "
        "`127.0.0.1:7001`) cannot be reached within `--timeout` seconds (default 10)."
    ),
    ExitCode.ADMIN_ERROR_RESPONSE: (
        "The coordinator answered with an error code (e.g. `NODE_UNKNOWN` for `nodes "
        "show`, `ban`, `unban`); the message names it, with `--json` stdout holds "
        '`{"error": {"code", "name", "reason"}}`.'
    ),
    ExitCode.ADMIN_CALL_FAILED: (
        "An admin call failed with a gRPC status other than UNAVAILABLE or "
        "DEADLINE_EXCEEDED (e.g. UNIMPLEMENTED from an older coordinator); the message "
        "gives the status."
    ),
    # Shared, stopped by a signal (128 + N)
    ExitCode.INTERRUPTED: (
        "Stopped with Ctrl-C (SIGINT, 128 + 2). ftis-client start: the last complete "
        "checkpoint is kept and the next start resumes from it."
    ),
}

#: Which program owns which statuses (half-open ranges), in the order documented.
PROGRAM_RANGES: dict[str, tuple[range, ...]] = {
    "shared": (range(0, 20), range(128, 160)),
    "ftis-coordinator": (range(20, 50),),
    "ftis-client": (range(50, 80),),
    "ftis-admin": (range(80, 100),),
}

#: Name prefix of each program's own codes (shared codes have none).
PROGRAM_PREFIX: dict[str, str] = {
    "ftis-coordinator": "COORDINATOR_",
    "ftis-client": "CLIENT_",
    "ftis-admin": "ADMIN_",
}

_PROGRAM_INTRO: dict[str, str] = {
    "shared": (
        "Any of the three programs. `0`, `1` and `2` also come from Python and click "
        "themselves (uncaught exception, `Aborted!`, usage error); `128 + N` is the "
        "shell's convention for \"stopped by signal N\"."
    ),
    "ftis-coordinator": (
        "`ftis-coordinator serve` (also `python -m ftis.coordinator.cli.main serve`)."
    ),
    "ftis-client": (
        "`ftis-client start`, `status`, `settings` and `models list`; also the research "
        "tooling `ftis-lab demo`, `attack`, `security-experiment` and `experiment`, which "
        "shares these codes."
    ),
    "ftis-admin": (
        "Operator CLI over the admin service (`--admin HOST:PORT`, env `FTIS_ADMIN`, "
        "default `127.0.0.1:7001`)."
    ),
}


def exit_codes() -> dict[str, int]:
    """``{name: code}`` of every constant of :class:`ExitCode`, in definition order."""
    return {k: v for k, v in vars(ExitCode).items() if k.isupper() and isinstance(v, int)}


def exit_code_name(code: int) -> str:
    """Symbolic name of an exit status, e.g. ``20 -> "COORDINATOR_BIND"``."""
    for name, value in exit_codes().items():
        if value == code:
            return name
    return f"UNKNOWN_{code}"


def program_of(code: int) -> str | None:
    """The program whose range holds ``code`` (``"shared"`` for shared ones)."""
    for program, ranges in PROGRAM_RANGES.items():
        if any(code in r for r in ranges):
            return program
    return None


def _range_text(ranges: tuple[range, ...]) -> str:
    return ", ".join(f"{r.start}–{r.stop - 1}" for r in ranges)


def markdown() -> str:
    """The text of ``docs/exit-codes.md``."""
    lines = [
        "# Exit codes",
        "",
        "<!-- Generated by `python -m ftis.protocol.exit_codes --markdown > "
        "docs/exit-codes.md`",
        "     from proto/ftis/protocol/exit_codes.py; edit that file, not this one. -->",
        "",
        "One table for `ftis-coordinator`, `ftis-client` and `ftis-admin`: each program "
        "owns a range, so a status means the same thing whichever program exited with it. "
        "Defined in `proto/ftis/protocol/exit_codes.py` (`ftis.protocol.exit_codes.ExitCode`); "
        "codes are never renumbered.",
        "",
        "| Range | Program |",
        "|---|---|",
    ]
    for program, ranges in PROGRAM_RANGES.items():
        lines.append(f"| {_range_text(ranges)} | {program} |")
    lines.append("| 100–127, 160–255 | unassigned |")
    by_program: dict[str, list[tuple[str, int]]] = {p: [] for p in PROGRAM_RANGES}
    for name, code in exit_codes().items():
        by_program[program_of(code) or "shared"].append((name, code))
    for program, codes in by_program.items():
        title = "Shared" if program == "shared" else program
        lines += ["", f"## {title} ({_range_text(PROGRAM_RANGES[program])})", "",
                  _PROGRAM_INTRO[program], "",
                  "| Code | Name | Meaning |", "|---:|---|---|"]
        for name, code in sorted(codes, key=lambda item: item[1]):
            lines.append(f"| {code} | `{name}` | {EXIT_CODE_HELP[code]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ftis.protocol.exit_codes",
        description="The exit-code table of the FTIS programs.")
    parser.add_argument("--markdown", action="store_true",
                        help="print docs/exit-codes.md (default: one line per code)")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(), end="")
        return
    for name, code in exit_codes().items():
        print(f"{code:3d} {name:32s} {EXIT_CODE_HELP[code]}")


if __name__ == "__main__":
    main()
