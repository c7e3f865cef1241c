"""What one simulated swarm is, and what it reports (no ``flwr`` here).

A :class:`SwarmSpec` fixes everything a run depends on: the learners' model and settings,
their seeds and Ed25519 identities (derived from the seed, so a simulated and a native
swarm of the same spec have the same node ids), and the coordinator's configuration.
Both swarms report a :class:`SwarmSummary`; :func:`compare` says where two differ.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, Field

from ftis.client.node.config import ClientConfig
from ftis.coordinator.config import CoordinatorConfig, load_config
from ftis.protocol.identity import NodeIdentity

#: The model name that builds a tiny random Llama (:mod:`ftis.client.models.tiny`).
TINY = "tiny"


class SwarmSpec(BaseModel):
    """One swarm: N learners with the same settings, ``rounds`` rounds in lock step.

    Attributes:
        learners: N, the number of learners (ClientApps / native clients).
        rounds: rounds every learner runs.
        model: :data:`TINY` (a tiny random Llama built from ``model_seed``), or anything
            ``ftis-client start --model`` takes (alias, .gguf, directory).
        model_seed: seed of the tiny model's weights (all learners start equal).
        seed: learner ``i`` samples with seed ``seed + i`` and signs with a key derived
            from ``(seed, i)``.
        local_groups, external_groups, group_size, max_new_tokens, method,
            learning_rate, temperature, peft: the learners' ``ftis-client start``
            settings (:class:`~ftis.client.node.config.ClientConfig`).
        threads: torch CPU threads per learner.
        coordinator: :class:`~ftis.coordinator.config.CoordinatorConfig` fields (e.g.
            ``tasks``, ``task_seed``, quotas); ``db`` is chosen by the runner.
        out: output folder (the learners' ``metrics.jsonl``, the coordinator's database,
            ``summary.json``).
    """

    learners: int = Field(2, ge=1, le=4096)
    rounds: int = Field(2, ge=1)
    model: str = TINY
    model_seed: int = 0
    seed: int = 0
    local_groups: int = Field(1, ge=1, le=64)
    external_groups: int = Field(2, ge=0, le=64)
    group_size: int = Field(4, ge=2, le=64)
    max_new_tokens: int = Field(8, ge=1)
    method: str = "ftis"
    learning_rate: float | None = 1e-3
    temperature: float = 1.0
    peft: str = "none"
    threads: int = Field(1, ge=1)
    coordinator: dict[str, Any] = Field(default_factory=dict)
    out: Path = Path("runs/simulate")

    def identity(self, index: int) -> NodeIdentity:
        """Learner ``index``'s Ed25519 key, derived from ``(seed, index)`` (SHA-256)."""
        raw = hashlib.sha256(f"ftis-simulate/{self.seed}/{index}".encode()).digest()
        return NodeIdentity(Ed25519PrivateKey.from_private_bytes(raw))

    def client_config(self, index: int, model_path: str) -> ClientConfig:
        """Learner ``index``'s :class:`ClientConfig` (output in ``out/learners/INDEX``).

        Args:
            model_path: what to load (the built tiny model's folder for :data:`TINY`).
        """
        folder = self.out / "learners" / f"{index:04d}"
        return ClientConfig(
            coordinator="simulated", model=model_path, peft=self.peft,  # type: ignore[arg-type]
            rounds=self.rounds, local_groups=self.local_groups,
            external_groups=self.external_groups, group_size=self.group_size,
            max_new_tokens=self.max_new_tokens, method=self.method,  # type: ignore[arg-type]
            learning_rate=self.learning_rate, temperature=self.temperature,
            seed=self.seed + index, threads=self.threads, out=folder,
            key_file=folder / "node_key.pem", checkpoint_every=max(self.rounds, 1))

    def coordinator_config(self, db: str) -> CoordinatorConfig:
        """The coordinator's configuration on database ``db``: the defaults of
        ``ftis-coordinator serve``, except that the per-node and per-host quotas are
        lifted (:data:`~ftis.lab.harness.coordinator.UNLIMITED_QUOTAS`: every learner of
        a simulation registers from one host at once and runs rounds as fast as its
        model allows, which volunteers' throttles are not meant for), then
        :attr:`coordinator` (set quotas there to study them)."""
        from ftis.lab.harness.coordinator import UNLIMITED_QUOTAS

        return load_config(None, **{**UNLIMITED_QUOTAS, **self.coordinator, "db": db})


@dataclass
class LearnerRound:
    """One learner's round as both swarms report it (``metrics.jsonl`` values).

    Attributes:
        node_id: the learner's node id (hex).
        round: 1-based round number.
        metrics: the round's metrics (``reward_mean`` in [0, 1], ``generated_tokens``,
            ``external_groups_used``, ``loss``, ... as the volunteer client reports).
    """

    node_id: str
    round: int
    metrics: dict[str, float]


@dataclass
class SwarmSummary:
    """What a finished swarm reports.

    Attributes:
        rounds: every learner's rounds, in (round, learner index) order.
        bundles_accepted: bundles the coordinator stored.
        bundles_rejected: submissions it refused.
        verified_rewards: per learner node id, the verified rewards of its stored
            bundles in the order stored (floats in [0, 1]).
        reputations: per learner node id, its reputation score in [0, 1] at the end.
        wall_s: seconds from the first round's start to the last round's end.
        setup_s: seconds before the first round (engine start, registration).
    """

    rounds: list[LearnerRound] = field(default_factory=list)
    bundles_accepted: int = 0
    bundles_rejected: int = 0
    verified_rewards: dict[str, list[float]] = field(default_factory=dict)
    reputations: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    setup_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SwarmSummary:
        data = json.loads(text)
        data["rounds"] = [LearnerRound(**r) for r in data["rounds"]]
        return cls(**data)

    def learner_rounds_per_minute(self) -> float:
        """Learner-rounds per wall minute of the rounds (setup excluded)."""
        return 60.0 * len(self.rounds) / self.wall_s if self.wall_s > 0 else 0.0


#: Round metrics that must be equal in two swarms of the same spec: they are counts and
#: verified rewards, set by what was sampled and what the coordinator decided.
EXACT_METRICS = ("generated_tokens", "reward_mean", "bundles_submitted",
                 "local_groups_informative", "external_groups_used", "samples",
                 "groups_zero_variance", "train_tokens", "updated")
#: Round metrics of the learner's update, equal up to float summation order.
CLOSE_METRICS = ("loss", "grad_norm")


def compare(a: SwarmSummary, b: SwarmSummary, *, metric_tol: float = 1e-4,
            reputation_tol: float = 1e-3) -> list[str]:
    """Where two swarms of the same spec differ beyond noise (empty: they agree).

    Equal: the stored and refused bundle counts, every learner's verified rewards in
    order, every round's :data:`EXACT_METRICS`. Within ``metric_tol`` (absolute): the
    :data:`CLOSE_METRICS`. Within ``reputation_tol`` (absolute, on scores in [0, 1]):
    the final reputations (the coordinator decays evidence with wall time, which the two
    runs spend differently).

    Returns:
        one line per difference.
    """
    diffs: list[str] = []
    for name in ("bundles_accepted", "bundles_rejected"):
        if getattr(a, name) != getattr(b, name):
            diffs.append(f"{name}: {getattr(a, name)} != {getattr(b, name)}")
    if a.verified_rewards != b.verified_rewards:
        diffs.append(f"verified_rewards: {a.verified_rewards} != {b.verified_rewards}")
    if set(a.reputations) != set(b.reputations):
        diffs.append(f"reputations of different nodes: {sorted(a.reputations)} != "
                     f"{sorted(b.reputations)}")
    for node, score in a.reputations.items():
        other = b.reputations.get(node, math.nan)
        if not abs(score - other) <= reputation_tol:
            diffs.append(f"reputation of {node[:12]}: {score:.6f} != {other:.6f}")
    rounds_a = {(r.node_id, r.round): r.metrics for r in a.rounds}
    rounds_b = {(r.node_id, r.round): r.metrics for r in b.rounds}
    if set(rounds_a) != set(rounds_b):
        diffs.append(f"different learner rounds: {len(rounds_a)} vs {len(rounds_b)}")
    for key in sorted(set(rounds_a) & set(rounds_b)):
        ma, mb = rounds_a[key], rounds_b[key]
        for name in EXACT_METRICS:
            if ma.get(name) != mb.get(name):
                diffs.append(f"{key[0][:12]} round {key[1]} {name}: {ma.get(name)} != "
                             f"{mb.get(name)}")
        for name in CLOSE_METRICS:
            x, y = ma.get(name, math.nan), mb.get(name, math.nan)
            if not (abs(x - y) <= metric_tol or (math.isnan(x) and math.isnan(y))):
                diffs.append(f"{key[0][:12]} round {key[1]} {name}: {x} != {y}")
    return diffs
