"""``ftis-client start`` flags derived from :class:`VolunteerSettings` (one per field).

Each flag takes the field's name (``idle_minutes -> --idle-minutes``; booleans get
``--x/--no-x``), its help text plus the environment variable and default, and defaults
to ``None`` (not given), so that :func:`resolve_settings` can apply the precedence
flag > env > file > default.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer

from ftis.client.cli.flag_groups import add_flag_group
from ftis.client.settings.model import VolunteerSettings, env_name, format_value

#: Help panel of the settings' flags in ``ftis-client start --help``.
PANEL = "Volunteer settings (also FTIS_<KEY> and `ftis-client settings set`)"


def _flag_type(annotation: Any) -> type:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    return base if base in (bool, int, float) else str


def setting_parameters() -> list[inspect.Parameter]:
    """One keyword-only ``typer`` parameter per setting, default ``None``."""
    params = []
    for key, field in VolunteerSettings.model_fields.items():
        kind = _flag_type(field.annotation)
        flag = "--" + key.replace("_", "-")
        decls = [f"{flag}/--no-{flag[2:]}"] if kind is bool else [flag]
        help_text = (f"{field.description} (env {env_name(key)}, "
                     f"default {format_value(field.default)})")
        option = typer.Option(*decls, help=help_text, rich_help_panel=PANEL,
                              show_default=False)
        params.append(inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Annotated[kind | None, option]))
    return params


def with_setting_flags(func: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``func`` a flag per setting; the values given reach it as one dict in its
    ``setting_flags`` keyword (keys of :class:`VolunteerSettings`, ``None`` = not given).

    ``func``'s own parameters keep their order; the settings' flags follow.
    """
    return add_flag_group(func, setting_parameters(), "setting_flags", first=False)
