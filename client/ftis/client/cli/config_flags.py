"""``ftis-client start`` flags derived from :class:`ClientConfig` (one per field).

Each flag takes the field's name (``learning_rate -> --learning-rate``; booleans get
``--x/--no-x``), and its help is the field's description, its choices (read from the
``Literal`` type), its default and its environment variable, so a default or a choice
changes in one place, the model (:mod:`ftis.client.node.config`). Every flag defaults to
``None`` (not given), so that :class:`ClientConfig` applies the precedence flag > env
``FTIS_CLIENT_<FIELD>`` > default.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from ftis.client.cli.flag_groups import add_flag_group
from ftis.client.node.config import SECTIONS, ClientConfig

#: ClientConfig fields without a ``start`` flag of their own: the volunteer settings'
#: flags (:mod:`ftis.client.settings.options`) carry them.
NOT_FLAGS = frozenset({"threads", "max_memory"})

#: Help panel per section of :data:`~ftis.client.node.config.SECTIONS`.
PANELS = {"loss": "Learner (F-TIS loss)", "learner": "Learner (F-TIS loss)",
          "sampling": "Sampling", "lora": "LoRA and QLoRA"}


def env_name(field: str) -> str:
    """``FTIS_CLIENT_<FIELD>``, the environment variable of ``field``."""
    prefix = ClientConfig.model_config.get("env_prefix", "")
    return f"{prefix}{field}".upper()


def choices(field: str) -> tuple[str, ...]:
    """The values a ``Literal`` field accepts (empty for other types)."""
    annotation = ClientConfig.model_fields[field].annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return tuple(typing.get_args(annotation))
    if len(args) == 1 and typing.get_origin(args[0]) is Literal:
        return tuple(typing.get_args(args[0]))
    return ()


def format_default(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def flag_help(field: str) -> str:
    """The help of ``--field``: description, choices, default, environment variable."""
    info = ClientConfig.model_fields[field]
    tail = [f"one of {' | '.join(choices(field))}"] if choices(field) else []
    default = info.get_default(call_default_factory=True)
    if default is not None and default != "":
        tail.append(f"default {format_default(default)}")
    tail.append(f"env {env_name(field)}")
    return f"{info.description or ''} ({'; '.join(tail)})"


def _flag_type(field: str) -> type:
    annotation = ClientConfig.model_fields[field].annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if typing.get_origin(annotation) is not Literal and args else annotation
    return typing.cast(type, base) if base in (bool, int, float, Path) else str


def _panel(field: str) -> str | None:
    if field == "clip_eps":  # the shorthand of two loss fields
        return PANELS["loss"]
    for section, (_, fields) in SECTIONS.items():
        if field in fields:
            return PANELS[section]
    return None


def config_parameters() -> list[inspect.Parameter]:
    """One keyword-only ``typer`` parameter per :class:`ClientConfig` field (but
    :data:`NOT_FLAGS`), default ``None``."""
    params = []
    for key in ClientConfig.model_fields:
        if key in NOT_FLAGS:
            continue
        kind = _flag_type(key)
        flag = "--" + key.replace("_", "-")
        decls = [f"{flag}/--no-{flag[2:]}"] if kind is bool else [flag]
        option = typer.Option(*decls, help=flag_help(key), rich_help_panel=_panel(key),
                              show_default=False)
        params.append(inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Annotated[kind | None, option]))
    return params


def with_config_flags(func: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``func`` a flag per :class:`ClientConfig` field; the values given reach it as
    one dict in its ``config_flags`` keyword (``None`` = not given).

    The configuration's flags come first, then ``func``'s own parameters.
    """
    return add_flag_group(func, config_parameters(), "config_flags", first=True)
