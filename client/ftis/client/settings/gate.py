"""Pause a running node between rounds, and resume it, as the settings say.

:class:`RoundGate` is called before every round (``VolunteerNode.run(before_round=)``).
It re-reads the settings (so ``ftis-client settings set ...`` reaches a running node
within a second), probes the machine, asks :func:`~ftis.client.settings.schedule.decide`
and sleeps while the answer is no. The node keeps its process, identity, model,
optimizer and round counter meanwhile; it holds no lease, because it leases tasks only
at the start of a round and answers every lease within the round (a bundle the
coordinator rejects leaves its lease to expire at its deadline; there is no release
call).

The running node's state (running or paused, and why) is written to
``OUT/node_state.json`` for ``ftis-client status`` (:func:`write_node_state`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftis.client.settings import probes
from ftis.client.settings.model import (
    ResolvedSettings,
    SettingsError,
    VolunteerSettings,
    settings_path,
)
from ftis.client.settings.schedule import Decision, MachineSnapshot, Pacing, decide

log = logging.getLogger(__name__)
NODE_STATE_FILE = "node_state.json"


class RoundGate:
    """Blocks before a round while the settings hold the node.

    Args:
        resolve: returns the settings in force (re-read on every check).
        probe: ``probe(need_idle)`` returns a :class:`MachineSnapshot`.
        on_change: called with each new decision that pauses the node (a new reason)
            and with the one that resumes it.
        on_settings: called when the settings in force change (and once at the start),
            e.g. to apply ``threads`` or ``max_upload_rate`` to the running node.
        poll_seconds: seconds between two checks while paused (sooner when the
            settings file changes, or when the clock alone will lift the pause).
        clock, sleep: monotonic seconds and sleeping (injectable for tests).
        watch: file whose modification wakes a paused node (default the settings file).
    """

    def __init__(self, resolve: Callable[[], ResolvedSettings],
                 probe: Callable[[bool], MachineSnapshot] = probes.snapshot, *,
                 on_change: Callable[[Decision], None] | None = None,
                 on_settings: Callable[[ResolvedSettings], None] | None = None,
                 poll_seconds: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 watch: Path | None = None) -> None:
        self.resolve, self.probe = resolve, probe
        self.on_change, self.on_settings = on_change, on_settings
        self.poll_seconds, self.clock, self.sleep = poll_seconds, clock, sleep
        self.watch = watch or settings_path()
        self.settings: ResolvedSettings | None = None
        self.decision: Decision | None = None
        self.paused = False
        self.settings_error: str | None = None
        self._started: float | None = None
        self._ended: float | None = None
        self._last_round: float | None = None

    def refresh(self) -> ResolvedSettings:
        """Re-read the settings; a bad edit keeps the previous ones (and is logged)."""
        try:
            resolved = self.resolve()
            self.settings_error = None
        except SettingsError as exc:
            if self.settings is None:
                raise
            if str(exc) != self.settings_error:
                log.warning("%s; keeping the previous settings", exc)
            self.settings_error = str(exc)
            return self.settings
        if self.settings is None or resolved != self.settings:
            self.settings = resolved
            if self.on_settings:
                self.on_settings(resolved)
        return resolved

    def check(self) -> Decision:
        """Decide now (no waiting)."""
        resolved = self.refresh()
        pacing = Pacing(self._last_round,
                        0.0 if self._ended is None else self.clock() - self._ended)
        snap = self.probe(resolved.settings.idle_minutes > 0)
        self.decision = decide(resolved.settings, snap, pacing)
        return self.decision

    def __call__(self) -> Decision:
        """Wait until a round may start; returns the decision that let it start."""
        now = self.clock()
        if self._started is not None:  # the previous round just ended
            self._last_round, self._ended, self._started = now - self._started, now, None
        shown: tuple[str, ...] | None = None
        while True:
            decision = self.check()
            if decision.may_run:
                if self.paused:
                    self.paused = False
                    if self.on_change:
                        self.on_change(decision)
                self._started = self.clock()
                return decision
            self.paused = True
            if decision.reasons != shown:
                shown = decision.reasons
                log.info("paused: %s", decision.reason)
                if self.on_change:
                    self.on_change(decision)
            wait = self.poll_seconds
            if decision.retry_after_s is not None:
                wait = min(wait, decision.retry_after_s + 0.05)
            self._sleep_watching(wait)

    def _mtime(self) -> float | None:
        try:
            return self.watch.stat().st_mtime
        except OSError:
            return None

    def _sleep_watching(self, seconds: float) -> None:
        """Sleep ``seconds`` in steps of at most 1 s; return early if ``watch`` changed."""
        before, end = self._mtime(), self.clock() + seconds
        while (left := end - self.clock()) > 0:
            self.sleep(min(left, 1.0))
            if self._mtime() != before:
                return


def apply_settings(conn: Any, settings: VolunteerSettings) -> None:
    """Apply the settings that can change while a node runs: ``threads``
    (``torch.set_num_threads``) and ``max_upload_rate`` (a :class:`TokenBucket` on the
    connection's :attr:`~ftis.client.swarm.connection.SwarmConnection.upload_limit`)."""
    from ftis.client.node.runtime import set_threads
    from ftis.client.settings.throttle import TokenBucket

    rate, limit = settings.upload_bytes_per_second, conn.upload_limit
    if rate is None or limit is None or limit.rate != rate:
        conn.upload_limit = None if rate is None else TokenBucket(rate)
    set_threads(settings.threads)


def node_state(out: Path, gate: RoundGate, state: str, decision: Decision | None = None,
               **fields: Any) -> None:
    """Write ``OUT/node_state.json`` for ``status``: ``state`` (running, paused,
    stopped), the pause reason and notes of ``decision``, the settings in force and
    their sources, and ``fields`` (node id, coordinator, model, round)."""
    r = gate.settings
    write_node_state(out, state=state, reason=decision.reason if decision else "",
                     notes=list(decision.notes) if decision else [],
                     settings={k: v for k, v, _ in r.rows()} if r else {},
                     sources=r.sources if r else {},
                     settings_error=gate.settings_error, **fields)


def write_node_state(out: Path, **fields: Any) -> None:
    """Write ``OUT/node_state.json`` atomically (``pid`` and ``updated`` added)."""
    record = {"pid": os.getpid(), "updated": time.time(), **fields}
    tmp = out / (NODE_STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, out / NODE_STATE_FILE)


def read_node_state(out: Path) -> dict[str, Any] | None:
    """``OUT/node_state.json`` with ``alive`` (is its process still running); ``None``
    if absent or unreadable."""
    try:
        record = json.loads((out / NODE_STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    try:
        import psutil

        record["alive"] = psutil.pid_exists(int(record.get("pid", -1)))
    except (ImportError, ValueError):
        record["alive"] = None
    return record
