"""Volunteer settings (issue 14): the model and its file, precedence, validation, the
pure pause decision, the upload token bucket, the round gate, and the CLI."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import datetime

import pytest
from typer.testing import CliRunner

from ftis.client.settings.gate import RoundGate
from ftis.client.settings.model import (
    SettingsError,
    VolunteerSettings,
    env_name,
    parse_time_windows,
    read_settings_file,
    resolve_settings,
    settings_path,
    write_settings_file,
)
from ftis.client.settings.probes import parse_loginctl
from ftis.client.settings.schedule import MachineSnapshot, Pacing, decide
from ftis.client.settings.throttle import TokenBucket


@pytest.fixture()
def config_home(tmp_path, monkeypatch):
    """A private user config dir (platformdirs honours XDG_CONFIG_HOME on Linux) and no
    FTIS_<KEY> variables from the caller's environment."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for key in VolunteerSettings.keys():
        monkeypatch.delenv(env_name(key), raising=False)
    return tmp_path / "config"


def at(hh: int, mm: int = 0) -> datetime:
    return datetime(2026, 3, 4, hh, mm)


def snap(hh: int = 12, mm: int = 0, **kw) -> MachineSnapshot:
    return MachineSnapshot(now=at(hh, mm), **kw)


# -- the model and its file -----------------------------------------------------------------
def test_settings_file_is_in_the_user_config_dir(config_home):
    assert settings_path() == config_home / "ftis" / "settings.toml"


def test_file_round_trip_keeps_only_the_keys_set(config_home):
    values = {"idle_minutes": 5, "pause_on_battery": False, "time_windows": "22:00-07:00",
              "max_upload_rate": "512KiB", "threads": 2}
    path = write_settings_file(values)
    assert read_settings_file(path) == values
    text = path.read_text()
    assert "cpu_percent" not in text and 'time_windows = "22:00-07:00"' in text
    resolved = resolve_settings(env={})
    assert resolved.settings.idle_minutes == 5 and resolved.sources["idle_minutes"] == "file"
    assert resolved.sources["cpu_percent"] == "default"
    assert resolved.settings.upload_bytes_per_second == 512 * 1024


def test_defaults_come_from_the_model_alone(config_home):
    resolved = resolve_settings(env={})
    assert resolved.settings == VolunteerSettings()
    assert set(resolved.sources.values()) == {"default"}
    for key, field in VolunteerSettings.model_fields.items():
        assert field.description, f"{key} has no help text"


def test_precedence_flag_over_env_over_file_over_default(config_home):
    write_settings_file({"idle_minutes": 1, "cpu_percent": 50, "threads": 3})
    env = {"FTIS_IDLE_MINUTES": "2", "FTIS_CPU_PERCENT": "60"}
    resolved = resolve_settings({"idle_minutes": 3, "cpu_percent": None}, env=env)
    s, src = resolved.settings, resolved.sources
    assert (s.idle_minutes, src["idle_minutes"]) == (3, "flag")
    assert (s.cpu_percent, src["cpu_percent"]) == (60, "env")  # None flag = not given
    assert (s.threads, src["threads"]) == (3, "file")
    assert (s.pause_on_battery, src["pause_on_battery"]) == (True, "default")


def test_env_booleans_and_unset_words(config_home):
    resolved = resolve_settings(env={"FTIS_PAUSE_ON_BATTERY": "no", "FTIS_USE_GPU": "0",
                                     "FTIS_MAX_MEMORY": "none"})
    assert resolved.settings.pause_on_battery is False and resolved.settings.use_gpu is False
    assert resolved.settings.max_memory is None and resolved.sources["max_memory"] == "env"


@pytest.mark.parametrize(("layer", "key", "value", "expected"), [
    ("env", "idle_minutes", "soon", "FTIS_IDLE_MINUTES: idle_minutes = 'soon'"),
    ("env", "cpu_percent", "150", "less than or equal to 100"),
    ("flag", "time_windows", "22:00-25:00", "'25:00' in '22:00-25:00' is not a time of day"),
    ("flag", "time_windows", "08:00-08:00", "is empty"),
    ("flag", "time_windows", "22:00", "is not HH:MM-HH:MM"),
    ("flag", "max_memory", "lots", "cannot read 'lots' as a memory size"),
    ("flag", "max_upload_rate", "fast", "cannot read 'fast' as a rate"),
    ("flag", "threads", "0", "--threads: threads = '0': Input should be greater than"),
])
def test_validation_errors_name_the_source_key_and_rule(config_home, layer, key, value,
                                                        expected):
    flags, env = ({key: value}, {}) if layer == "flag" else ({}, {env_name(key): value})
    with pytest.raises(SettingsError, match=None) as info:
        resolve_settings(flags, env=env)
    assert expected in str(info.value)


def test_bad_file_names_the_file_and_the_key(config_home):
    path = settings_path()
    path.parent.mkdir(parents=True)
    path.write_text("idle_minutes = 5\nspeed = 3\n")
    with pytest.raises(SettingsError, match=r"settings\.toml: unknown setting 'speed'"):
        resolve_settings(env={})
    path.write_text("idle_minutes = [\n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        resolve_settings(env={})


def test_time_windows_parse_and_cross_midnight():
    night, noon = parse_time_windows("22:00-07:00, 12:00-13:00")
    assert [str(night), str(noon)] == ["22:00-07:00", "12:00-13:00"]
    assert night.contains(23 * 60) and night.contains(0) and night.contains(6 * 60 + 59)
    assert not night.contains(7 * 60) and not night.contains(21 * 60 + 59)
    assert noon.contains(12 * 60) and not noon.contains(13 * 60)
    (late,) = parse_time_windows("18:00-24:00")
    assert late.contains(23 * 60 + 59) and not late.contains(0)


# -- the pause decision (pure) --------------------------------------------------------------
def test_default_settings_always_run():
    d = decide(VolunteerSettings(), snap(on_battery=None, idle_seconds=None))
    assert d.may_run and d.reasons == () and d.notes == () and d.reason == ""


def test_time_windows_crossing_midnight():
    s = VolunteerSettings(time_windows="22:00-07:00")
    assert decide(s, snap(23, 30)).may_run
    assert decide(s, snap(0, 0)).may_run
    assert decide(s, snap(6, 59)).may_run
    d = decide(s, snap(7, 0))
    assert not d.may_run and "outside the time windows 22:00-07:00" in d.reason
    assert "next opens at 22:00" in d.reason
    assert d.retry_after_s == pytest.approx(15 * 3600)
    assert decide(s, snap(21, 59)).retry_after_s == pytest.approx(60)


def test_next_window_is_the_nearest_one():
    s = VolunteerSettings(time_windows="22:00-07:00,12:00-13:00")
    d = decide(s, snap(9, 30))
    assert "next opens at 12:00" in d.reason and d.retry_after_s == pytest.approx(2.5 * 3600)
    assert decide(s, snap(12, 30)).may_run


def test_battery():
    s = VolunteerSettings()
    d = decide(s, snap(on_battery=True))
    assert not d.may_run and "on battery" in d.reason and d.retry_after_s is None
    assert decide(s, snap(on_battery=False)).may_run
    assert decide(s, snap(on_battery=None)).may_run  # no battery: a desktop
    assert decide(VolunteerSettings(pause_on_battery=False), snap(on_battery=True)).may_run


def test_idle():
    s = VolunteerSettings(idle_minutes=5)
    d = decide(s, snap(idle_seconds=120.0))
    assert not d.may_run and "machine in use (idle 2.0 of 5 min)" in d.reason
    assert decide(s, snap(idle_seconds=300.0)).may_run
    assert decide(VolunteerSettings(), snap(idle_seconds=0.0)).may_run


def test_idle_unknown_runs_and_says_why():
    s = VolunteerSettings(idle_minutes=5)
    d = decide(s, snap(idle_seconds=None, idle_unavailable="no graphical session"))
    assert d.may_run
    assert d.notes == ("idle detection unavailable: no graphical session; idle_minutes 5 "
                       "is not applied",)


def test_finish_then_pause_holds_until_turned_off():
    d = decide(VolunteerSettings(finish_then_pause=True), snap())
    assert not d.may_run and d.reason.startswith("finish_then_pause is on")
    assert decide(VolunteerSettings(finish_then_pause=False), snap()).may_run


def test_cpu_percent_rests_in_proportion_to_the_last_round():
    s = VolunteerSettings(cpu_percent=25)
    assert decide(s, snap(), Pacing(None)).may_run  # before the first round
    d = decide(s, snap(), Pacing(last_round_seconds=10.0, seconds_since_round=5.0))
    assert not d.may_run and d.retry_after_s == pytest.approx(25.0)  # rest 30 s, 5 done
    assert "cpu_percent 25: resting 25 s after a 10 s round" in d.reason
    assert decide(s, snap(), Pacing(10.0, 30.0)).may_run
    assert decide(VolunteerSettings(), snap(), Pacing(10.0, 0.0)).may_run


def test_every_holding_rule_is_listed():
    s = VolunteerSettings(finish_then_pause=True, idle_minutes=1, time_windows="01:00-02:00")
    d = decide(s, snap(12, on_battery=True, idle_seconds=0.0))
    assert len(d.reasons) == 4


def test_loginctl_idle_hint():
    now = 1_000_000_000_000
    assert parse_loginctl("Type=x11\nIdleHint=no\nIdleSinceHint=0\n", now) == 0.0
    assert parse_loginctl(f"IdleHint=yes\nIdleSinceHint={now - 90_000_000}\n", now) == 90.0
    assert parse_loginctl("IdleHint=yes\nIdleSinceHint=0\n", now) is None
    assert parse_loginctl("", now) is None


# -- the upload token bucket ----------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_bucket_allows_a_burst_then_paces_at_the_rate():
    clock = FakeClock()
    bucket = TokenBucket(1000, burst=2000, clock=clock)
    assert bucket.reserve(1500) == 0.0
    assert bucket.reserve(1000) == pytest.approx(0.5)  # 500 left: 500 more at 1000 B/s
    clock.sleep(0.5)
    assert bucket.reserve(1000) == pytest.approx(1.0)


def test_bucket_lets_a_message_larger_than_the_burst_through_at_the_rate():
    clock = FakeClock()
    bucket = TokenBucket(1000, burst=1000, clock=clock)
    assert bucket.consume(5000, sleep=clock.sleep) == pytest.approx(4.0)
    assert bucket.reserve(0) == pytest.approx(0.0)  # the debt is paid exactly


def test_bucket_long_run_rate_never_exceeds_the_cap():
    clock = FakeClock()
    bucket = TokenBucket(10_000, clock=clock)
    start, sent = clock(), 0
    for size in [3000, 50_000, 10, 20_000, 7000] * 20:
        bucket.consume(size, sleep=clock.sleep)
        sent += size
        assert sent <= bucket.burst + bucket.rate * (clock() - start) + 1e-6


def test_bucket_refills_only_up_to_the_burst():
    clock = FakeClock()
    bucket = TokenBucket(100, burst=100, clock=clock)
    clock.sleep(3600)
    assert bucket.reserve(100) == 0.0 and bucket.reserve(100) == pytest.approx(1.0)


def test_bucket_rejects_non_positive_rates():
    with pytest.raises(ValueError, match="positive"):
        TokenBucket(0)


def test_submit_waits_for_the_bucket():
    from ftis.client.swarm.connection import SwarmConnection
    from ftis.protocol.identity import NodeIdentity
    from ftis.v1 import bundle_pb2

    waits = []

    class Recorder(TokenBucket):
        def consume(self, nbytes: int, sleep: Callable[[float], None] | None = None) -> float:
            waits.append(nbytes)
            return 0.0

    conn = SwarmConnection("127.0.0.1:1", NodeIdentity.generate(), bundle_pb2.ModelCard())
    conn.upload_limit = Recorder(1000)
    conn._call = lambda fn, request, method=None, accept=None: "sent"  # no network
    env = bundle_pb2.SignedEnvelope(payload=b"x" * 300)
    assert conn.submit_envelope(env) == "sent"
    conn.close()
    assert waits == [env.ByteSize()]


# -- the round gate -------------------------------------------------------------------------
def test_gate_pauses_until_the_settings_allow_and_rests_for_cpu_percent(config_home):
    clock = FakeClock()
    battery = {"on": True}
    changes = []

    def resolve():
        return resolve_settings({"cpu_percent": 50}, env={})

    gate = RoundGate(resolve, lambda need_idle: snap(on_battery=battery["on"]),
                     on_change=changes.append, poll_seconds=10, clock=clock,
                     sleep=lambda s: (clock.sleep(s), battery.update(on=clock() < 130)))
    gate()  # waits while on battery
    assert clock() >= 130 and [d.may_run for d in changes] == [False, True]
    assert "on battery" in changes[0].reason
    clock.sleep(8)  # a round of 8 s
    changes.clear()
    before = clock()
    gate()  # rests 8 s (cpu_percent 50)
    assert clock() - before == pytest.approx(8.05, abs=0.01)
    assert "cpu_percent 50" in changes[0].reason


def test_gate_keeps_the_previous_settings_after_a_bad_edit(config_home):
    write_settings_file({"idle_minutes": 0})
    gate = RoundGate(lambda: resolve_settings(env={}), lambda need_idle: snap())
    assert gate().may_run
    settings_path().write_text("idle_minutes = 'soon'\n")
    assert gate().may_run and "idle_minutes = 'soon'" in gate.settings_error


# -- the CLI --------------------------------------------------------------------------------
def test_settings_cli_show_set_unset_reset(config_home):
    from ftis.client.cli.main import app

    runner = CliRunner()
    result = runner.invoke(app, ["settings", "set", "idle_minutes", "10"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["settings", "set", "time_windows", "22:00-07:00"])
    assert result.exit_code == 0, result.output
    assert read_settings_file() == {"idle_minutes": 10, "time_windows": "22:00-07:00"}
    result = runner.invoke(app, ["settings", "show", "--json"])
    assert result.exit_code == 0, result.output
    import json

    shown = json.loads(result.stdout)["settings"]
    assert shown["idle_minutes"] == {"value": 10, "source": "file", "env": "FTIS_IDLE_MINUTES"}
    assert shown["cpu_percent"]["source"] == "default"
    result = runner.invoke(app, ["settings", "show"])
    assert "idle_minutes" in result.stdout and str(settings_path()) in result.stdout.replace(
        "\n", "")

    result = runner.invoke(app, ["settings", "set", "cpu_percent", "0"])
    assert result.exit_code == 2 and "greater than or equal to 1" in result.output
    result = runner.invoke(app, ["settings", "set", "speed", "1"])
    assert result.exit_code == 2 and "unknown setting 'speed'" in result.output
    assert read_settings_file() == {"idle_minutes": 10, "time_windows": "22:00-07:00"}

    assert runner.invoke(app, ["settings", "unset", "idle_minutes"]).exit_code == 0
    assert read_settings_file() == {"time_windows": "22:00-07:00"}
    assert runner.invoke(app, ["settings", "reset"]).exit_code == 0
    assert not settings_path().exists()


def test_start_has_one_flag_per_setting_with_help_from_the_model():
    from ftis.client.cli import start
    from ftis.client.cli.main import app
    from ftis.lab.cli import attack

    params = inspect.signature(start.start).parameters
    assert set(VolunteerSettings.keys()) <= set(params)
    assert all(params[k].default is None for k in VolunteerSettings.keys())
    assert set(params) <= set(inspect.signature(attack.attack).parameters)
    result = CliRunner().invoke(app, ["start", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for key in VolunteerSettings.keys():
        assert "--" + key.replace("_", "-") in result.output
    text = " ".join(result.output.replace("│", " ").split())
    assert "(env FTIS_IDLE_MINUTES, default 0)" in text
    assert "--no-pause-on-battery" in text


def test_start_rejects_a_bad_setting_before_loading_anything(config_home):
    from ftis.client.cli.main import app

    result = CliRunner().invoke(app, ["start", "--time-windows", "9-5"])
    assert result.exit_code == 2
    assert "--time-windows: time_windows = '9-5'" in result.output
