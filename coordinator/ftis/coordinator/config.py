"""Coordinator settings: the single source of defaults.

Precedence, highest first: explicit keyword arguments (the CLI flags) > environment
variables ``FTIS_COORDINATOR_<FIELD>`` (lists such as ``TASKS`` as JSON) > the
``--config`` file (JSON, or TOML when the name ends in ``.toml``) > the defaults below.
"""

from __future__ import annotations

import contextvars
import ipaddress
import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ftis.coordinator.reputation import ReputationConfig
from ftis.coordinator.spot_check import SpotCheckSettings
from ftis.protocol.bundles import MAX_BUNDLE_BYTES
from ftis.tasks.source import DEFAULT_TASKS, TaskSpec

MIB = 1024 * 1024
#: Bytes a SubmitBundle/UploadTokenizer request may carry beyond its payload limit.
REQUEST_OVERHEAD_BYTES = 64 * 1024

# Values read from a --config file; seen by the settings source below while a
# CoordinatorConfig is being built by :func:`load_config`.
_FILE_VALUES: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "ftis_coordinator_file_values", default=None
)


class ConfigError(ValueError):
    """A configuration file that cannot be read or parsed."""


def parse_host_port(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` (``"[::1]:7000"`` for IPv6) into ``(host, port)``.

    Raises:
        ValueError: if the port is missing or outside ``[0, 65535]`` (0 = any free port).
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} outside [0, 65535]")
    return host, port


class _FileSource(PydanticBaseSettingsSource):
    """Settings source for the values of a ``--config`` file (lowest priority)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return (_FILE_VALUES.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_FILE_VALUES.get() or {})


#: ``reputation.audit_reporters`` when the config names seed nodes for audit-based
#: probation (``audit_seed_nodes``) and leaves it unset: the k that docs/reputation.md
#: and the security runs use (two receivers agreeing).
AUDIT_REPORTERS_WITH_SEEDS = 2


class CoordinatorConfig(BaseSettings):
    """Everything the coordinator can be told.

    Attributes:
        listen: ``HOST:PORT`` of the volunteer ``Swarm`` service (port 0 = any free port).
        admin_listen: ``HOST:PORT`` of the operator ``Admin`` service (keep it on loopback).
        db: SQLAlchemy URL (``sqlite:///PATH``, ``sqlite://`` in memory,
            ``postgresql://...``) or a plain path, which means an SQLite file.
        tasks: ReasoningGYM task mix handed out in leases.
        task_seed: seed of the task mix (dataset ``k`` uses ``task_seed + k``).
        heldout_fraction: share of operand keys kept out of every lease
            (:mod:`ftis.tasks.split`), so that an evaluation with the same fraction is
            disjoint by operands from training; 0 = lease everything.
        lease_ttl_s: seconds from issuing a lease to its deadline.
        max_outstanding_leases: unanswered, unexpired leases one node may hold.
        task_number_block: task numbers each process reserves from the database's draw
            counter at once (one counter update per block; an unused rest after a
            crash leaves a gap in the numbers, i.e. skipped tasks).
        min_group_size, max_group_size: allowed G per lease request.
        max_new_tokens_limit: largest ``max_new_tokens`` a lease may ask for.
        max_bundle_bytes: largest accepted envelope payload, bytes.
        register_clock_skew_s: allowed ``|server time - registration timestamp|``, seconds.
        heartbeat_interval_s: heartbeat period suggested to clients, seconds.
        require_tokenizer: refuse LeaseTasks (and SubmitBundle) with TOKENIZER_REQUIRED
            while the node's tokenizer fingerprint has no uploaded tokenizer; with it,
            every completion's text is checked against the decoded tokens.
        max_tokenizer_gz_bytes: largest gzip'd ``tokenizer.json`` UploadTokenizer accepts.
        max_tokenizer_json_bytes: largest decompressed ``tokenizer.json`` (zip-bomb bound).
        tokenizer_cache_size: loaded tokenizers kept in memory (LRU).
        bundles_per_minute, bundle_bytes_per_minute: SubmitBundle quota per node.
        pulls_per_minute: PullBundles quota per node.
        pull_bytes_per_minute: envelope bytes of relay pages served per node and minute
            (a full page of 64 bundles of 8 x 256 tokens is about 1.5 MiB): a page is cut
            to the bytes left, and a node with none left is refused RATE_LIMITED.
        reports_per_minute: ReportMetrics quota per node.
        heartbeats_per_minute: Heartbeat quota per node (clients send one every
            ``heartbeat_interval_s``).
        connection_refusals_per_s, connection_refusal_burst: refused requests one
            connection (one gRPC peer ``HOST:PORT``) may cause per second and at once;
            beyond them its requests are answered RATE_LIMITED after
            ``connection_delay_s`` seconds, undecoded
            (:class:`~ftis.coordinator.quotas.ConnectionBudget`).
        connection_max_handling: requests of one connection decoded or handled at once;
            the next is refused at once (RATE_LIMITED, counted against the connection's
            budget), so one connection cannot take every handler thread.
        connection_delay_s: seconds a request over its connection's budget waits while at
            most 16 of that connection's requests wait (more: proportionally longer).
        host_refusals_per_s, host_refusal_burst: the same budget for all connections of
            one host together (an IPv4 address or an IPv6 /64), so that reconnecting does
            not refill it; volunteers behind one NAT address share it, hence 5x the
            connection's. ``host_refusal_exempt``: networks without a host budget
            (default loopback: the machine's own processes).
        swarm_server: ``"aio-inline"`` (default): the volunteer service runs on a
            ``grpc.aio`` server in an event-loop thread; the handlers of Heartbeat,
            LeaseTasks, SubmitBundle and PullBundles run on the loop itself, each in a
            greenlet that yields to the loop while it waits for the group commit or a
            worker process (no thread hand-offs; :mod:`ftis.coordinator.waiting`), the
            other methods in a pool of ``swarm_handler_threads``; any number of requests
            over budget wait as coroutines. ``"aio"``: the same server with every handler
            in the pool. ``"threads"``: a thread-pool ``grpc.server``, at most
            ``swarm_delay_threads`` requests waiting in refusal delays at once. Measured
            on ``make bench-coordinator`` (N = 32, SQLite): ``"aio-inline"`` 1.39x the
            throughput of ``"threads"`` with one worker and 1.13x with two, ``"aio"``
            0.86x (docs/coordinator.md, "The volunteer listener").
        swarm_handler_threads: threads the volunteer handlers run in (``"aio-inline"``:
            the pool of the methods not run on the loop; ``"aio"``: the pool
            the event loop hands decoded requests to; ``"threads"``: at most this many of
            the server's worker threads decode and handle requests at once).
        swarm_delay_threads: ``"threads"`` only: extra worker threads that hold the late
            answers of connections over their refusal budget (a sleeping thread: no CPU,
            about 100 KiB of memory once used), so that many requests in flight on one
            connection wait instead of being answered at once; beyond this many waiting
            (all connections together) requests over budget are answered at once.
        rescoring_workers: worker processes that re-score submitted completions (0: in
            the serving thread).
        rescoring_budget_s: seconds one bundle's re-score may take before the bundle is
            rejected with SCORING_TIMEOUT (an honest bundle takes milliseconds).
        rescoring_inline_chars: a bundle whose completions hold at most this many
            characters, on a task with a linear-time scorer, is re-scored in the serving
            thread instead of a worker (at most 3.0 ms measured at the default 32,768; a
            G = 8 bundle of 1024-token completions is about 32,000); 0: every bundle goes
            to the workers (docs/threat-model.md, "Expensive scoring").
        tokenizer_uploads_per_minute: UploadTokenizer quota per node.
        registrations_per_minute: new node ids accepted per minute, all peers together.
        registrations_per_host_per_minute: new node ids per minute from one peer host.
        max_request_bytes: serialized size above which Register, Heartbeat, LeaseTasks,
            PullBundles and ReportMetrics requests are refused before decoding
            (REQUEST_TOO_LARGE). SubmitBundle allows ``max_bundle_bytes`` + 64 KiB and
            UploadTokenizer ``max_tokenizer_gz_bytes`` + 64 KiB.
        max_receive_message_bytes: gRPC transport limit (RESOURCE_EXHAUSTED status
            above it); 0 = the largest per-method limit (see :attr:`grpc_max_receive_bytes`).
        spot_checks: log-prob spot checks against model weights the coordinator holds
            (:class:`~ftis.coordinator.spot_check.SpotCheckSettings`; off while it names
            no model).
        reputation: the reputation policy (:class:`ReputationConfig`); once changed
            through the admin API the stored value in the ``settings`` table wins.
        audit_seed_nodes: node ids whose audit counts as passed (set when they register)
            under audit-based probation (``reputation.audit_reporters`` > 0): the
            operator's bootstrap, since audits need established receivers of the same
            tokenizer and a new swarm has none (docs/reputation.md "Audit-based
            probation"). Seeds still need ``probation_bundles`` verified bundles.
    """

    model_config = SettingsConfigDict(env_prefix="FTIS_COORDINATOR_", extra="forbid")

    listen: str = "127.0.0.1:7000"
    admin_listen: str = "127.0.0.1:7001"
    db: str = "ftis-coordinator.db"
    tasks: list[TaskSpec] = Field(default_factory=lambda: list(DEFAULT_TASKS), min_length=1)
    task_seed: int = 0
    heldout_fraction: float = Field(default=0.0, ge=0, lt=1)
    lease_ttl_s: float = Field(default=600, gt=0)
    max_outstanding_leases: int = Field(default=64, ge=1)
    task_number_block: int = Field(default=64, ge=1, le=1_000_000)
    min_group_size: int = Field(default=2, ge=1)
    max_group_size: int = Field(default=64, ge=1)
    max_new_tokens_limit: int = Field(default=1024, ge=1)
    max_bundle_bytes: int = Field(default=MAX_BUNDLE_BYTES, ge=1024)
    register_clock_skew_s: float = Field(default=300, ge=0)
    heartbeat_interval_s: float = Field(default=30, gt=0)
    require_tokenizer: bool = True
    max_tokenizer_gz_bytes: int = Field(default=32 * MIB, ge=1024)
    max_tokenizer_json_bytes: int = Field(default=64 * MIB, ge=1024)
    tokenizer_cache_size: int = Field(default=8, ge=1)
    bundles_per_minute: float = Field(default=120, gt=0)
    bundle_bytes_per_minute: int = Field(default=64 * MIB, ge=1024)
    pulls_per_minute: float = Field(default=600, gt=0)
    pull_bytes_per_minute: int = Field(default=64 * MIB, ge=MIB)
    reports_per_minute: float = Field(default=60, gt=0)
    heartbeats_per_minute: float = Field(default=60, gt=0)
    connection_refusals_per_s: float = Field(default=10, gt=0)
    connection_refusal_burst: float = Field(default=20, gt=0)
    connection_delay_s: float = Field(default=0.25, ge=0, le=10)
    connection_max_handling: int = Field(default=8, ge=1, le=256)
    host_refusals_per_s: float = Field(default=50, gt=0)
    host_refusal_burst: float = Field(default=100, gt=0)
    host_refusal_exempt: list[str] = Field(default_factory=lambda: ["127.0.0.0/8", "::1/128"])
    swarm_server: Literal["aio", "aio-inline", "threads"] = "aio-inline"
    swarm_handler_threads: int = Field(default=32, ge=2, le=256)
    swarm_delay_threads: int = Field(default=256, ge=1, le=4096)
    rescoring_workers: int = Field(default=1, ge=0, le=64)
    rescoring_budget_s: float = Field(default=2.0, gt=0, le=60)
    rescoring_inline_chars: int = Field(default=32_768, ge=0, le=1 << 20)
    tokenizer_uploads_per_minute: float = Field(default=4, gt=0)
    registrations_per_minute: float = Field(default=30, gt=0)
    registrations_per_host_per_minute: float = Field(default=10, gt=0)
    max_request_bytes: int = Field(default=1 * MIB, ge=1024)
    max_receive_message_bytes: int = Field(default=0, ge=0)
    spot_checks: SpotCheckSettings = Field(default_factory=SpotCheckSettings)
    reputation: ReputationConfig = Field(default_factory=ReputationConfig)
    audit_seed_nodes: list[str] = Field(default_factory=list, max_length=1024)

    @model_validator(mode="before")
    @classmethod
    def _audit_with_seeds(cls, data: Any) -> Any:
        """Naming ``audit_seed_nodes`` turns audit-based probation on: a config that
        names seeds and does not set ``reputation.audit_reporters`` gets
        :data:`AUDIT_REPORTERS_WITH_SEEDS` (seeds mean nothing without the audit).
        Held weights alone (``spot_checks.models``) do not turn it on: nodes of a card
        the coordinator does not hold would then wait on probation for receivers of
        their tokenizer that may never exist (docs/reputation.md, "Audit-based
        probation"). A ``ReputationConfig`` object is taken as it is."""
        if not isinstance(data, dict) or not data.get("audit_seed_nodes"):
            return data
        rep = data.get("reputation")
        if not (rep is None or isinstance(rep, dict)) or "audit_reporters" in (rep or {}):
            return data
        return {**data, "reputation": {**(rep or {}),
                                       "audit_reporters": AUDIT_REPORTERS_WITH_SEEDS}}

    @field_validator("listen", "admin_listen")
    @classmethod
    def _address(cls, value: str) -> str:
        parse_host_port(value)
        return value

    @field_validator("host_refusal_exempt")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for network in value:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError as exc:
                raise ValueError(f"host_refusal_exempt: {network!r} is not a network "
                                 f"(e.g. 127.0.0.0/8)") from exc
        return value

    @field_validator("max_group_size")
    @classmethod
    def _group_range(cls, value: int, info: Any) -> int:
        low = info.data.get("min_group_size", 1)
        if value < low:
            raise ValueError(f"max_group_size {value} < min_group_size {low}")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _FileSource(settings_cls))

    @property
    def method_request_limits(self) -> dict[str, int]:
        """Largest serialized request per Swarm method, checked before decoding."""
        small = self.max_request_bytes
        return {
            "Register": small,
            "Heartbeat": small,
            "LeaseTasks": small,
            "PullBundles": small,
            "ReportMetrics": small,
            "SubmitBundle": self.max_bundle_bytes + REQUEST_OVERHEAD_BYTES,
            "UploadTokenizer": self.max_tokenizer_gz_bytes + REQUEST_OVERHEAD_BYTES,
        }

    @property
    def grpc_max_receive_bytes(self) -> int:
        """gRPC ``max_receive_message_length`` of the Swarm listener."""
        if self.max_receive_message_bytes:
            return self.max_receive_message_bytes
        return max(self.method_request_limits.values())

    @property
    def db_url(self) -> str:
        """The database as an SQLAlchemy URL (a plain path becomes ``sqlite:///ABSPATH``)."""
        if "://" in self.db:
            return self.db
        return "sqlite:///" + str(Path(self.db).expanduser().resolve())


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Values of a JSON or TOML (``*.toml``) configuration file.

    Raises:
        ConfigError: if the file cannot be read, does not parse, or is not a mapping.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table/object at the top level")
    return data


def load_config(config_file: str | Path | None = None, **overrides: Any) -> CoordinatorConfig:
    """Build a :class:`CoordinatorConfig` from defaults, file, environment and overrides.

    Args:
        config_file: optional JSON/TOML file.
        overrides: field values (e.g. CLI flags); ``None`` values are ignored.

    Raises:
        ConfigError: unreadable file.
        pydantic.ValidationError: invalid values.
    """
    file_values = read_config_file(config_file) if config_file is not None else {}
    token = _FILE_VALUES.set(file_values)
    try:
        return CoordinatorConfig(**{k: v for k, v in overrides.items() if v is not None})
    finally:
        _FILE_VALUES.reset(token)
