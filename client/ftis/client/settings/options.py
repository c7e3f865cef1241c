"""``ftis-client start`` flags derived from :class:`VolunteerSettings` (one per field).

Each flag takes the field's name (``idle_minutes -> --idle-minutes``; booleans get
``--x/--no-x``), its help text plus the environment variable and default, and defaults
to ``None`` (not given), so that :func:`resolve_settings` can apply the precedence
flag > env > file > default.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer

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
    own = inspect.signature(func, eval_str=True)
    hints = typing.get_type_hints(func, include_extras=True)
    keys = set(VolunteerSettings.model_fields)
    clash = keys & set(own.parameters)
    if clash:
        raise TypeError(f"{func.__name__} already has parameters {sorted(clash)}")

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Any:
        given = {k: kwargs.pop(k, None) for k in keys}
        return func(**kwargs, setting_flags=given)

    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
              for p in own.parameters.values() if p.name != "setting_flags"]
    params += setting_parameters()
    wrapper.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {**{k: v for k, v in hints.items()
                                  if k not in ("setting_flags", "return")},
                               **{p.name: p.annotation for p in params}}
    del wrapper.__wrapped__  # typer must read the signature above, not func's
    return wrapper
