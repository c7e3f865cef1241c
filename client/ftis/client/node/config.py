"""Typed client configuration: one source of defaults, CLI flags and ``FTIS_CLIENT_*``
environment variables override them (flags win)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import platformdirs
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

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
    peft: Literal["none", "lora"] = "none"
    lora_rank: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    local_groups: int = Field(2, ge=1, le=64, description="I: own groups per round")
    external_groups: int = Field(2, ge=0, le=64, description="J: relayed groups per round")
    group_size: int = Field(8, ge=2, le=64, description="G: completions per prompt")
    rounds: int = Field(10, ge=0, description="rounds to run; 0 = until stopped")
    method: Method = "ftis"
    truncation: float = Field(2.0, gt=0, description="C: importance-weight cap")
    filter_threshold: float = Field(50.0, gt=0, description="g: F-TIS divergence threshold")
    divergence: Literal["kl_learner_gen", "kl_gen_learner"] = "kl_learner_gen"
    aggregation: Literal["token", "sequence"] = "token"
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
    eval_every: int = Field(0, ge=0, description="greedy held-out evaluation every k rounds")
    eval_config: Path | None = Field(None, description="JSON EvalConfig (sets, size, seed)")

    @property
    def effective_learning_rate(self) -> float:
        if self.learning_rate is not None:
            return self.learning_rate
        return 1e-5 if self.peft == "lora" else 1e-6
