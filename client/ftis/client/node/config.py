"""Typed client configuration: one source of defaults, CLI flags and ``FTIS_CLIENT_*``
environment variables override them (flags win)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import platformdirs
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

if TYPE_CHECKING:  # imported lazily: the loader pulls in transformers
    from ftis.client.models.loader import LoraSettings

Method = Literal["on_policy", "nois", "vis", "tis", "ftis"]


def default_key_file() -> Path:
    """``<user data dir>/ftis/node_key.pem`` (platformdirs), reused across restarts."""
    return Path(platformdirs.user_data_dir("ftis")) / "node_key.pem"


class ClientConfig(BaseSettings):
    """Settings of ``ftis-client start``. Paper defaults: C = 2, g = 50, eps = 0.2,
    lr 1e-6 for a full fine-tune (F-TIS, arXiv 2605.22537)."""

    model_config = SettingsConfigDict(env_prefix="FTIS_CLIENT_", extra="forbid")

    coordinator: str = "127.0.0.1:7000"
    model: str = "smollm2-135m"
    peft: Literal["none", "lora", "qlora"] = "none"
    lora_rank: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_targets: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="module names that get LoRA adapters (comma-separated on the CLI)")
    qlora_double_quant: bool = Field(False, description="QLoRA: also quantize the scales")
    max_memory: str | None = Field(
        None, description="refuse to start above this estimated peak memory (6GiB, 8GB, ...)")
    local_groups: int = Field(2, ge=1, le=64, description="I: own groups per round")
    external_groups: int = Field(2, ge=0, le=64, description="J: relayed groups per round")
    max_sender_share: float = Field(
        0.5, gt=0, le=1, description="most of a round's batch (I + J groups) one external "
        "sender may fill")
    group_size: int = Field(8, ge=2, le=64, description="G: completions per prompt")
    rounds: int = Field(10, ge=0, description="rounds to run; 0 = until stopped")
    method: Method = "ftis"
    truncation: float = Field(2.0, gt=0, description="C: importance-weight cap")
    filter_threshold: float | None = Field(
        None, gt=0, description="F-TIS gate threshold in the divergence's unit: delta in "
        "nats/token for k1_mean/k3_mean (default 1.0), g in summed nats for kl_* "
        "(default 50, the paper's g)")
    divergence: Literal["k1_mean", "k3_mean", "kl_learner_gen", "kl_gen_learner"] = "k1_mean"
    aggregation: Literal["token", "sequence"] = "token"
    cross_tokenizer: Literal["off", "sequence", "geometric", "nois"] = Field(
        "sequence",
        description="bundles from another tokenizer: off = ignore; sequence = re-tokenize "
        "the text, sequence-level truncated IS weight; geometric = the same weight "
        "length-normalised (GSPO-style); nois = re-tokenize, weight 1")
    clip_eps: float = Field(0.2, gt=0, lt=1)
    learning_rate: float | None = Field(
        None, gt=0, description="default 1e-6 (full) or 1e-5 (LoRA)")
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(64, ge=1, le=1024)
    micro_batch_size: int = Field(8, ge=1)
    seed: int = 0
    out: Path = Path("runs/client")
    key_file: Path = Field(default_factory=default_key_file)
    checkpoint_every: int = Field(1, ge=1)
    threads: int | None = Field(None, ge=1, description="torch CPU threads")
    display_name: str = ""
    max_outage: float = Field(
        1800.0, ge=0, description="seconds the coordinator may stay unreachable (it retries "
        "with backoff and jitter meanwhile) before the client exits with code 50; 0 = "
        "wait forever")
    eval_every: int = Field(0, ge=0, description="greedy held-out evaluation every k rounds")
    eval_config: Path | None = Field(None, description="JSON EvalConfig (sets, size, seed)")

    @field_validator("lora_targets", mode="before")
    @classmethod
    def _split_targets(cls, v: object) -> object:
        if isinstance(v, str):  # "q_proj,v_proj" from the command line
            v = [t.strip() for t in v.split(",")]
        if isinstance(v, list) and (not v or not all(isinstance(t, str) and t for t in v)):
            raise ValueError("lora_targets needs one or more non-empty module names")
        return v

    @field_validator("max_memory")
    @classmethod
    def _check_max_memory(cls, v: str | None) -> str | None:
        from ftis.client.node.memory import checked_size

        return checked_size(v)  # ValueError with the accepted forms

    @property
    def max_groups_per_sender(self) -> int:
        """Cap on one external sender's groups in a round: ``floor(max_sender_share x
        (I + J))``, at least 1 (issue 13, class 4)."""
        return max(1, int(self.max_sender_share * (self.local_groups + self.external_groups)))

    @property
    def max_memory_bytes(self) -> int | None:
        """``max_memory`` in bytes (``None``: no budget)."""
        from ftis.client.node.memory import parse_size

        return None if self.max_memory is None else parse_size(self.max_memory)

    @property
    def lora_settings(self) -> LoraSettings:
        """:class:`~ftis.client.models.loader.LoraSettings` from the ``lora_*`` fields."""
        from ftis.client.models.loader import LoraSettings

        return LoraSettings(rank=self.lora_rank, alpha=self.lora_alpha,
                            dropout=self.lora_dropout, target_modules=tuple(self.lora_targets))

    @property
    def effective_filter_threshold(self) -> float:
        """``filter_threshold``, or the default of the chosen divergence's unit: 1.0
        nat/token for the per-token statistics, 50 summed nats for the legacy ones."""
        if self.filter_threshold is not None:
            return self.filter_threshold
        return 1.0 if self.divergence in ("k1_mean", "k3_mean") else 50.0

    @property
    def effective_learning_rate(self) -> float:
        if self.learning_rate is not None:
            return self.learning_rate
        return 1e-5 if self.peft in ("lora", "qlora") else 1e-6
