"""May a round start now, and if not, why: a pure function of a machine snapshot.

No I/O here: :mod:`ftis.client.settings.probes` takes the snapshot, and
:mod:`ftis.client.settings.gate` sleeps and asks again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from ftis.client.settings.model import TimeWindow, VolunteerSettings


@dataclass(frozen=True)
class MachineSnapshot:
    """What the probes saw at one moment.

    Attributes:
        now: local wall-clock time.
        idle_seconds: seconds since the last keyboard or mouse input; ``None`` when the
            platform cannot tell (then ``idle_unavailable`` says why).
        on_battery: True on battery, False on mains power, ``None`` with no battery or
            when the platform cannot tell.
        idle_unavailable: why idle time is unknown (shown by ``status``).
    """

    now: datetime
    idle_seconds: float | None = None
    on_battery: bool | None = None
    idle_unavailable: str | None = None


@dataclass(frozen=True)
class Pacing:
    """The node's recent work, for ``cpu_percent``.

    Attributes:
        last_round_seconds: wall seconds the last round took (``None`` before the first).
        seconds_since_round: wall seconds since it ended.
    """

    last_round_seconds: float | None = None
    seconds_since_round: float = 0.0


@dataclass(frozen=True)
class Decision:
    """The answer of :func:`decide`.

    Attributes:
        may_run: True if a round may start now.
        reasons: why not, one line per rule that holds the node (empty if it may run).
        notes: rules that could not be applied and why (e.g. idle detection
            unavailable); they never hold the node.
        retry_after_s: seconds after which the answer may change by the clock alone
            (rest time or the next window), ``None`` if it waits on the machine.
    """

    may_run: bool
    reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    retry_after_s: float | None = None

    @property
    def reason(self) -> str:
        """The reasons in one line (empty if the node may run)."""
        return "; ".join(self.reasons)


@dataclass
class _Collect:
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    retry: list[float] = field(default_factory=list)


def _minute(now: datetime) -> int:
    return now.hour * 60 + now.minute


def seconds_until_window(now: datetime, windows: list[TimeWindow]) -> float:
    """Seconds from ``now`` until the next window opens (0 if inside one)."""
    minute = _minute(now)
    if any(w.contains(minute) for w in windows):
        return 0.0
    into_minute = now.second + now.microsecond / 1e6
    waits = [((w.start - minute) % 1440) * 60 - into_minute for w in windows]
    return max(min(waits), 0.0)


def decide(settings: VolunteerSettings, snapshot: MachineSnapshot,
           pacing: Pacing | None = None) -> Decision:
    """Whether a round may start now under ``settings``; pure (no I/O, no clock).

    Rules, each of which can hold the node: ``finish_then_pause``; ``time_windows``
    (``now`` outside every window); ``pause_on_battery`` (only when the snapshot says
    on battery); ``idle_minutes`` (only when idle time is known: where it is not, the
    rule is skipped and a note says so, rather than blocking forever); ``cpu_percent``
    (rest after a round). All reasons that hold are listed.
    """
    pacing = pacing or Pacing()
    c = _Collect()
    if settings.finish_then_pause:
        c.reasons.append("finish_then_pause is on (ftis-client settings set "
                         "finish_then_pause false to resume)")
    windows = settings.windows
    if windows:
        wait = seconds_until_window(snapshot.now, windows)
        if wait > 0:
            opens = min(windows, key=lambda w: (w.start - _minute(snapshot.now)) % 1440)
            c.reasons.append(f"outside the time windows {settings.time_windows} (next "
                             f"opens at {str(opens).split('-')[0]})")
            c.retry.append(wait)
    if settings.pause_on_battery and snapshot.on_battery:
        c.reasons.append("on battery (pause_on_battery)")
    if settings.idle_minutes:
        if snapshot.idle_seconds is None:
            why = snapshot.idle_unavailable or "this platform cannot tell"
            c.notes.append(f"idle detection unavailable: {why}; idle_minutes "
                           f"{settings.idle_minutes} is not applied")
        elif snapshot.idle_seconds < settings.idle_minutes * 60:
            c.reasons.append(f"machine in use (idle {snapshot.idle_seconds / 60:.1f} of "
                             f"{settings.idle_minutes} min)")
    if settings.cpu_percent < 100 and pacing.last_round_seconds:
        rest = pacing.last_round_seconds * (100 - settings.cpu_percent) / settings.cpu_percent
        left = rest - pacing.seconds_since_round
        if left > 0:
            c.reasons.append(f"cpu_percent {settings.cpu_percent}: resting {left:.0f} s "
                             f"after a {pacing.last_round_seconds:.0f} s round")
            c.retry.append(left)
    return Decision(may_run=not c.reasons, reasons=tuple(c.reasons), notes=tuple(c.notes),
                    retry_after_s=min(c.retry) if c.retry else None)
