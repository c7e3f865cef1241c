"""The volunteer settings: one pydantic model, one file, one precedence rule.

Every setting is a field of :class:`VolunteerSettings` (its default, help text and
validation live there and nowhere else). A setting's value comes from, highest first:

1. a flag of ``ftis-client start`` (``--idle-minutes 5``, derived from the field name);
2. an environment variable ``FTIS_<KEY>`` (``FTIS_IDLE_MINUTES=5``, :func:`env_name`);
3. the settings file, ``<user config dir>/ftis/settings.toml`` (:func:`settings_path`,
   platformdirs; ``$XDG_CONFIG_HOME/ftis/settings.toml`` on Linux), edited with
   ``ftis-client settings set KEY VALUE``;
4. the field's default.

The file holds only the keys that were set, so a default that changes in a later
release reaches every volunteer who did not choose otherwise.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import platformdirs
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ftis.client.node.config import ClientConfig

#: Prefix of the settings' environment variables (``FTIS_<KEY>``).
ENV_PREFIX = "FTIS_"
SETTINGS_FILE_NAME = "settings.toml"
Source = Literal["flag", "env", "file", "default"]


class SettingsError(ValueError):
    """A setting has a bad value, an unknown key, or the settings file cannot be read.

    The message names where the value came from (flag, environment variable or file
    path), the key, the value and what is accepted.
    """


def settings_path() -> Path:
    """``<user config dir>/ftis/settings.toml`` (platformdirs' ``user_config_dir``;
    on Linux ``$XDG_CONFIG_HOME/ftis`` or ``~/.config/ftis``)."""
    return Path(platformdirs.user_config_dir("ftis")) / SETTINGS_FILE_NAME


@dataclass(frozen=True)
class TimeWindow:
    """A daily window ``[start, end)`` in minutes after local midnight (0-1440).

    ``end < start`` crosses midnight (``22:00-07:00``).
    """

    start: int
    end: int

    def contains(self, minute: int) -> bool:
        """True if ``minute`` (0-1439 after local midnight) lies in the window."""
        if self.start < self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end

    def __str__(self) -> str:
        return f"{_hhmm(self.start)}-{_hhmm(self.end)}"


def _hhmm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


_CLOCK = re.compile(r"([01]?[0-9]|2[0-4]):([0-5][0-9])")


def _minute_of(text: str, spec: str) -> int:
    m = _CLOCK.fullmatch(text.strip())
    if m is None or (int(m.group(1)) == 24 and m.group(2) != "00"):
        raise ValueError(f"{text.strip()!r} in {spec!r} is not a time of day; use HH:MM "
                         "(00:00-24:00), e.g. 22:00-07:00,12:00-13:00")
    return int(m.group(1)) * 60 + int(m.group(2))


def parse_time_windows(spec: str) -> list[TimeWindow]:
    """Windows of ``"22:00-07:00,12:00-13:00"`` (comma-separated ``HH:MM-HH:MM``, local
    time; a window may cross midnight; ``24:00`` may end one).

    Raises:
        ValueError: a window is not ``HH:MM-HH:MM``, a time is out of range, or a
            window is empty (start equals end).
    """
    windows = []
    for part in spec.split(","):
        if not part.strip():
            raise ValueError(f"empty window in {spec!r}; use e.g. 22:00-07:00,12:00-13:00")
        if part.count("-") != 1:
            raise ValueError(f"{part.strip()!r} in {spec!r} is not HH:MM-HH:MM, e.g. "
                             "22:00-07:00")
        start_text, end_text = part.split("-")
        start, end = _minute_of(start_text, spec), _minute_of(end_text, spec)
        if start == 1440:
            raise ValueError(f"{part.strip()!r}: a window cannot start at 24:00")
        if start == end % 1440:
            raise ValueError(f"{part.strip()!r} is empty (it starts where it ends); unset "
                             "time_windows to run at any time of day")
        windows.append(TimeWindow(start, end))
    return windows


def _bytes_per_second(text: str) -> int:
    from ftis.client.node.memory import parse_size

    try:
        return parse_size(text.removesuffix("/s"))
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a rate; use bytes per second with an "
                         "optional unit, e.g. 512KiB, 1MB, 250000") from None


class VolunteerSettings(BaseModel):
    """How much of the machine the volunteer gives, and when (BOINC's computing
    preferences, Folding@home's power and pause settings).

    All rules are applied between rounds: a round in progress is never cut short.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    idle_minutes: int = Field(
        0, ge=0, le=24 * 60,
        description="start a round only after the keyboard and mouse have been idle this "
        "many minutes (0 = also while the machine is in use)")
    pause_on_battery: bool = Field(
        True, description="pause while the machine runs on battery")
    threads: int | None = Field(
        None, ge=1, le=1024,
        description="CPU threads for torch (unset = torch's default, about one per core)")
    cpu_percent: int = Field(
        100, ge=1, le=100,
        description="percent of wall time spent working: after a round of T seconds the "
        "node rests T x (100 - p) / p seconds (100 = no rest)")
    max_memory: str | None = Field(
        None, description=ClientConfig.model_fields["max_memory"].description)
    use_gpu: bool = Field(
        True, description="let the client see CUDA GPUs (off hides them, "
        "CUDA_VISIBLE_DEVICES=''); takes effect at the next start")
    max_upload_rate: str | None = Field(
        None, description="cap on the bundle upload rate in bytes per second, with an "
        "optional unit: 512KiB, 1MB, 250000 (unset = no cap)")
    time_windows: str | None = Field(
        None, description="run only inside these daily windows, local time, e.g. "
        "22:00-07:00,12:00-13:00 (a window may cross midnight; unset = any time)")
    finish_then_pause: bool = Field(
        False, description="finish the round in progress, then pause until this is "
        "turned off again (ftis-client settings set finish_then_pause false)")

    @field_validator("max_memory")
    @classmethod
    def _check_max_memory(cls, v: str | None) -> str | None:
        from ftis.client.node.memory import checked_size

        return checked_size(v)  # ValueError with the accepted forms

    @field_validator("max_upload_rate")
    @classmethod
    def _check_rate(cls, v: str | None) -> str | None:
        if v is not None:
            _bytes_per_second(v)
        return v

    @field_validator("time_windows")
    @classmethod
    def _check_windows(cls, v: str | None) -> str | None:
        if v is not None:
            parse_time_windows(v)
        return v

    @property
    def windows(self) -> list[TimeWindow]:
        """:attr:`time_windows` parsed (empty: no time rule)."""
        return parse_time_windows(self.time_windows) if self.time_windows else []

    @property
    def upload_bytes_per_second(self) -> int | None:
        """:attr:`max_upload_rate` in bytes/s (``None``: no cap)."""
        return None if self.max_upload_rate is None else _bytes_per_second(
            self.max_upload_rate)

    @classmethod
    def keys(cls) -> list[str]:
        """Every setting's key, in definition order."""
        return list(cls.model_fields)

    @classmethod
    def help_of(cls, key: str) -> str:
        """The help text of ``key`` (its field description)."""
        return cls.model_fields[key].description or ""


def env_name(key: str) -> str:
    """Environment variable of a setting: ``idle_minutes -> FTIS_IDLE_MINUTES``."""
    return ENV_PREFIX + key.upper()


def check_key(key: str, where: str) -> None:
    """Raises :class:`SettingsError` (listing the keys) if ``key`` is not a setting."""
    if key not in VolunteerSettings.model_fields:
        raise SettingsError(f"{where}: unknown setting {key!r}; one of "
                            f"{', '.join(VolunteerSettings.keys())}")


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    msg = str(err["msg"]).removeprefix("Value error, ")
    return msg


def check_value(key: str, value: object, where: str) -> Any:
    """Validate one setting; returns the value as the model stores it.

    Args:
        key: the setting's key.
        value: the raw value (a string from a flag, env or ``settings set``, or a
            parsed TOML value); the strings ``""``, ``none`` and ``unset`` mean unset
            for the settings that may be unset.
        where: where the value came from, for the message (``"FTIS_THREADS"``).

    Raises:
        SettingsError: unknown key or invalid value.
    """
    check_key(key, where)
    field = VolunteerSettings.model_fields[key]
    if isinstance(value, str) and value.strip().lower() in ("", "none", "unset") \
            and field.default is None:
        value = None
    try:
        return getattr(VolunteerSettings.model_validate({key: value}), key)
    except ValidationError as exc:
        raise SettingsError(f"{where}: {key} = {value!r}: {_first_error(exc)}") from None


def read_settings_file(path: Path | None = None) -> dict[str, Any]:
    """The settings stored in ``path`` (default :func:`settings_path`); ``{}`` if absent.

    Raises:
        SettingsError: the file is not TOML, or holds an unknown key or a bad value.
    """
    path = path or settings_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read: {exc}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from None
    return {k: check_value(k, v, str(path)) for k, v in raw.items()}


def write_settings_file(values: Mapping[str, Any], path: Path | None = None) -> Path:
    """Write ``values`` (only the keys set) to ``path`` atomically; returns the path.

    Raises:
        SettingsError: unknown key or bad value (nothing is written).
    """
    path = path or settings_path()
    checked = {k: check_value(k, v, str(path)) for k, v in values.items()}
    lines = ["# FTIS volunteer settings: ftis-client settings show | set KEY VALUE | unset KEY",
             "# Flags of `ftis-client start` and FTIS_<KEY> variables override these.", ""]
    for key in VolunteerSettings.keys():
        if key in checked and checked[key] is not None:
            lines.append(f"{key} = {json.dumps(checked[key])}")  # TOML-compatible scalars
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class ResolvedSettings:
    """The settings in force and where each value came from."""

    settings: VolunteerSettings
    sources: dict[str, Source]

    def rows(self) -> list[tuple[str, Any, Source]]:
        """``(key, value, source)`` for every setting, in definition order."""
        return [(k, getattr(self.settings, k), self.sources[k])
                for k in VolunteerSettings.keys()]


def resolve_settings(flags: Mapping[str, Any] | None = None,
                     env: Mapping[str, str] | None = None,
                     path: Path | None = None) -> ResolvedSettings:
    """The settings in force: flags > ``FTIS_<KEY>`` env > settings file > default.

    Args:
        flags: values given on the command line (``None`` values are ignored).
        env: the environment (default ``os.environ``).
        path: the settings file (default :func:`settings_path`).

    Raises:
        SettingsError: an unknown key or a bad value in any layer; the message names
            the flag, variable or file.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, Source] = {k: "default" for k in VolunteerSettings.keys()}
    for key, value in read_settings_file(path).items():
        values[key], sources[key] = value, "file"
    for key in VolunteerSettings.keys():
        if env_name(key) in env:
            values[key] = check_value(key, env[env_name(key)], env_name(key))
            sources[key] = "env"
    for key, value in (flags or {}).items():
        if value is not None:
            values[key] = check_value(key, value, "--" + key.replace("_", "-"))
            sources[key] = "flag"
    return ResolvedSettings(VolunteerSettings(**values), sources)


def format_value(value: Any) -> str:
    """A setting's value as shown by ``settings show`` and ``status``."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
