"""``ftis-client settings``: show and edit the volunteer settings file.

``show`` lists every setting in force with its source (flag, env, file, default);
``set KEY VALUE``, ``unset KEY`` and ``reset`` edit the file
(``<user config dir>/ftis/settings.toml``), which a running node re-reads between
rounds. Keys, defaults and help come from
:class:`ftis.client.settings.model.VolunteerSettings`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ftis.client.settings.model import (
    SettingsError,
    VolunteerSettings,
    check_key,
    check_value,
    env_name,
    format_value,
    read_settings_file,
    resolve_settings,
    settings_path,
    write_settings_file,
)
from ftis.protocol.exit_codes import ExitCode

console = Console()
err = Console(stderr=True)
_KEYS = ", ".join(VolunteerSettings.keys())
app = typer.Typer(help="Show and edit the volunteer settings (when and how much this "
                  "machine works). Keys: " + _KEYS, no_args_is_help=True)


def _fail(exc: SettingsError) -> typer.Exit:
    err.print(str(exc), style="red", soft_wrap=True, markup=False, highlight=False)
    return typer.Exit(ExitCode.USAGE)


def settings_table(rows: Sequence[tuple[str, object, str]]) -> Table:
    """A table of ``(key, value, source)`` rows with each setting's help."""
    table = Table(show_header=True, header_style="bold", box=None)
    for column in ("setting", "value", "source", "meaning"):
        table.add_column(column, overflow="fold")
    for key, value, source in rows:
        table.add_row(key, format_value(value), source, VolunteerSettings.help_of(key))
    return table


@app.command("show")
def show(as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False) -> None:
    """The settings in force (file, FTIS_<KEY> variables, defaults) and their sources."""
    try:
        resolved = resolve_settings()
    except SettingsError as exc:
        raise _fail(exc) from None
    if as_json:
        print(json.dumps({"file": str(settings_path()),
                          "settings": {k: {"value": v, "source": s, "env": env_name(k)}
                                       for k, v, s in resolved.rows()}}, indent=1))
        return
    console.print(f"settings file: {settings_path()}")
    console.print(settings_table(resolved.rows()))
    console.print("flags of `ftis-client start` override these for one run.")


@app.command("set")
def set_(key: Annotated[str, typer.Argument(help=_KEYS)],
         value: Annotated[str, typer.Argument(help="the new value (e.g. 5, true, 6GiB, "
                                                   "22:00-07:00)")]) -> None:
    """Store KEY = VALUE in the settings file (validated first)."""
    try:
        stored = read_settings_file()
        stored[key] = check_value(key, value, f"settings set {key}")
        path = write_settings_file(stored)
    except SettingsError as exc:
        raise _fail(exc) from None
    console.print(f"{key} = {format_value(stored[key])} ({path})")
    if env_name(key) in os.environ:
        err.print(f"note: {env_name(key)} is set in this environment and overrides the file")


@app.command("unset")
def unset(key: Annotated[str, typer.Argument(help=_KEYS)]) -> None:
    """Remove KEY from the settings file (back to its default)."""
    try:
        check_key(key, "settings unset")
        stored = read_settings_file()
        stored.pop(key, None)
        path = write_settings_file(stored)
    except SettingsError as exc:
        raise _fail(exc) from None
    default = VolunteerSettings.model_fields[key].default
    console.print(f"{key} unset: default {format_value(default)} ({path})")


@app.command("reset")
def reset() -> None:
    """Remove every setting from the file (all back to their defaults)."""
    path = settings_path()
    path.unlink(missing_ok=True)
    console.print(f"all settings back to their defaults ({path} removed)")


@app.command("path")
def path() -> None:
    """Print the settings file's path."""
    print(settings_path())
