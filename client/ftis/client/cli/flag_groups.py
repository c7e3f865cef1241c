"""Typer flags generated from a settings model, handed to a command as one dict.

:func:`add_flag_group` is the one mechanism behind ``start``'s configuration flags
(:mod:`ftis.client.cli.config_flags`) and the volunteer-setting flags
(:mod:`ftis.client.settings.options`).
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any


def add_flag_group(func: Callable[..., Any], flags: list[inspect.Parameter], keyword: str,
                   *, first: bool) -> Callable[..., Any]:
    """Give ``func`` the keyword-only parameters ``flags`` (typer options); the values
    given reach it as one dict in its ``keyword`` argument (``None`` = not given).

    Args:
        func: the command; it takes ``keyword`` and none of the flags' names.
        flags: ``inspect.Parameter`` objects whose annotations carry ``typer.Option``.
        keyword: the name of ``func``'s dict parameter.
        first: the flags come before ``func``'s own parameters (else after).

    Raises:
        TypeError: ``func`` already has a parameter named like a flag.
    """
    own = inspect.signature(func, eval_str=True)
    hints = typing.get_type_hints(func, include_extras=True)
    keys = {p.name for p in flags}
    clash = keys & set(own.parameters)
    if clash:
        raise TypeError(f"{func.__name__} already has parameters {sorted(clash)}")

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Any:
        given = {k: kwargs.pop(k, None) for k in keys}
        return func(**kwargs, **{keyword: given})

    rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in own.parameters.values() if p.name != keyword]
    params = [*flags, *rest] if first else [*rest, *flags]
    wrapper.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {**{k: v for k, v in hints.items() if k not in (keyword, "return")},
                               **{p.name: p.annotation for p in params}}
    del wrapper.__wrapped__  # typer must read the signature above, not func's
    return wrapper
