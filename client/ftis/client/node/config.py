"""Typed client configuration: one source of defaults, CLI flags and ``FTIS_CLIENT_*``
environment variables override them (flags win).

Every learner, loss, sampling and LoRA setting is defined once, as a field of the pydantic
model that uses it (issue 14, section 5):

* :class:`~ftis.client.learner.config.LossConfig` -- method, truncation, filter threshold,
  divergence, clip range, aggregation (and the enumerations ``Method``, ``Divergence``, ...);
* :class:`~ftis.client.learner.config.LearnerConfig` -- learning rate, micro-batch,
  cross-tokenizer mode;
* :class:`~ftis.client.rollout.settings.SamplingSettings` -- temperature, max new tokens;
* :class:`~ftis.client.models.peft.LoraSettings` -- rank, alpha, dropout, targets
  (``lora_*`` here), and ``PeftKind``.

:class:`ClientConfig` is composed of those fields: each is copied with
:func:`section_field` (default, bounds and description; never restated), and the
properties :attr:`ClientConfig.loss`, :attr:`~ClientConfig.learner`,
:attr:`~ClientConfig.sampling` and :attr:`~ClientConfig.lora_settings` build the section
models back from a configuration. The fields stay flat rather than nested
(``cfg.method``, not ``cfg.loss.method``) because the flat names are the public contract:
the ``ftis-client start`` flags (``--method``), their documented environment variables
(``FTIS_CLIENT_METHOD``, read by pydantic-settings with no custom source) and the
experiment configs that pass flags; :data:`SECTIONS` records which field belongs to
which section, and a test holds every section field to being either a ``ClientConfig``
field or named in :data:`NOT_EXPOSED`. The ``start`` flags, their defaults and help are
derived from :class:`ClientConfig` in turn (:mod:`ftis.client.cli.config_flags`).

Three fields differ from their section's on purpose, each documented in its help:
``filter_threshold`` and ``learning_rate`` default to ``None``, meaning the default of the
chosen divergence's unit or PEFT kind (:attr:`ClientConfig.effective_filter_threshold`,
:attr:`ClientConfig.effective_learning_rate`); ``clip_eps`` is a shorthand that sets both
``clip_eps_low`` and ``clip_eps_high`` (the symmetric PPO clip), which win when given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, TypeVar

import platformdirs
from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ftis.client.learner.config import (
    DEFAULT_FILTER_THRESHOLD,
    LORA_LEARNING_RATE,
    PER_TOKEN_DIVERGENCES,
    SMALL_MODEL_LEARNING_RATE,
    SMALL_MODEL_PARAMETERS,
    SUMMED_DIVERGENCES,
    SUMMED_FILTER_THRESHOLD,
    Aggregation,
    CrossTokenizer,
    Divergence,
    LearnerConfig,
    LossConfig,
    Method,
    default_filter_threshold,
    default_learning_rate,
)
from ftis.client.models.peft import LoraSettings, PeftKind
from ftis.client.rollout.settings import SamplingSettings

__all__ = ["NOT_EXPOSED", "SECTIONS", "ClientConfig", "Method", "client_default",
           "default_key_file", "section_field"]

T = TypeVar("T")

#: section -> (its model, {ClientConfig field: the model's field}). ``temperature`` is
#: in two: the sampler's, which the learner's log-probs use too.
SECTIONS: dict[str, tuple[type[BaseModel], dict[str, str]]] = {
    "sampling": (SamplingSettings, {"temperature": "temperature",
                                    "max_new_tokens": "max_new_tokens"}),
    "loss": (LossConfig, {n: n for n in ("method", "truncation", "filter_threshold",
                                         "divergence", "clip_eps_low", "clip_eps_high",
                                         "aggregation", "temperature")}),
    "learner": (LearnerConfig, {n: n for n in ("learning_rate", "micro_batch_size",
                                               "cross_tokenizer")}),
    "lora": (LoraSettings, {"lora_rank": "rank", "lora_alpha": "alpha",
                            "lora_dropout": "dropout", "lora_targets": "target_modules"}),
}

#: Section fields that are not client settings, and why.
NOT_EXPOSED: dict[str, str] = {
    "LearnerConfig.loss": "built from the loss section",
    "LearnerConfig.weight_decay": "the paper's optimiser (AdamW, no weight decay)",
    "LearnerConfig.max_grad_norm": "the paper's optimiser (clip at 1.0)",
    "LearnerConfig.scale_advantages_by_std": "GRPO's advantages, always scaled",
    "LearnerConfig.adam_betas": "the paper's optimiser",
    "LearnerConfig.share_prompt": "always on: the same log-probs and gradient in less time "
                                  "(docs/learner.md)",
    "SamplingSettings.top_p": "training rollouts sample the full distribution",
    "SamplingSettings.top_k": "training rollouts sample the full distribution",
}


def section_field(model: type[BaseModel], name: str, **overrides: Any) -> Any:
    """A copy of ``model``'s field ``name`` -- default, bounds, description -- for a
    :class:`ClientConfig` field; ``overrides`` (``default=None``, ``description=...``)
    replace parts of it."""
    return FieldInfo.merge_field_infos(model.model_fields[name], **overrides)


def _describe(model: type[BaseModel], name: str) -> str:
    return model.model_fields[name].description or ""


def _default(model: type[BaseModel], name: str) -> Any:
    return model.model_fields[name].get_default(call_default_factory=True)


def default_key_file() -> Path:
    """``<user data dir>/ftis/node_key.pem`` (platformdirs), reused across restarts."""
    return Path(platformdirs.user_data_dir("ftis")) / "node_key.pem"


class ClientConfig(BaseSettings):
    """Settings of ``ftis-client start``. Paper defaults: C = 2, g = 50, eps = 0.2,
    lr 1e-6 for a full fine-tune (F-TIS, arXiv 2605.22537)."""

    model_config = SettingsConfigDict(env_prefix="FTIS_CLIENT_", extra="forbid")

    coordinator: str = Field("127.0.0.1:7000", description="HOST:PORT of the coordinator")
    model: str = Field("smollm2-135m", description="embedded alias (smollm2-135m), .gguf "
                       "file, model directory or Hugging Face id in the local cache")
    peft: PeftKind = Field("none", description="full fine-tune (none), LoRA, or QLoRA "
                           "(4-bit NF4 base + LoRA)")
    lora_rank: int = section_field(LoraSettings, "rank")
    lora_alpha: int = section_field(LoraSettings, "alpha")
    lora_dropout: float = section_field(LoraSettings, "dropout")
    lora_targets: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(_default(LoraSettings, "target_modules")),
        description=_describe(LoraSettings, "target_modules"))
    qlora_double_quant: bool = Field(
        False, description="QLoRA: also quantize the quantization scales")
    max_memory: str | None = Field(
        None, description="refuse to start above this estimated peak memory (6GiB, 8GB, ...)")
    local_groups: int = Field(2, ge=1, le=64, description="I: own groups per round")
    external_groups: int = Field(2, ge=0, le=64, description="J: relayed groups per round")
    external_wait_s: float = Field(
        0.0, ge=0, le=3600, description="seconds a round waits, pulling once a second, for "
        "the relay to hold J groups before its learner step (0: train on what is there; "
        "experiments that compare I/J mixes at a fixed I + J set it, so that a peer slower "
        "than the learner cannot shrink J)")
    max_sender_share: float = Field(
        0.5, gt=0, le=1, description="most of a round's batch (I + J groups) one external "
        "sender may fill")
    group_size: int = Field(8, ge=2, le=64, description="G: completions per prompt")
    rounds: int = Field(10, ge=0, description="rounds to run; 0 = until stopped")
    method: Method = section_field(LossConfig, "method")
    truncation: float = section_field(LossConfig, "truncation")
    filter_threshold: float | None = section_field(
        LossConfig, "filter_threshold", default=None,
        description=f"{_describe(LossConfig, 'filter_threshold')} (unset: "
        f"{DEFAULT_FILTER_THRESHOLD} for {'/'.join(PER_TOKEN_DIVERGENCES)}, "
        f"{SUMMED_FILTER_THRESHOLD:g}, the paper's g, for {'/'.join(SUMMED_DIVERGENCES)})")
    divergence: Divergence = section_field(LossConfig, "divergence")
    aggregation: Aggregation = section_field(LossConfig, "aggregation")
    cross_tokenizer: CrossTokenizer = section_field(LearnerConfig, "cross_tokenizer")
    clip_eps: float | None = Field(
        None, ge=0, lt=1, description="shorthand for a symmetric PPO clip: sets "
        "clip_eps_low and clip_eps_high both (each of those, when given, wins)")
    clip_eps_low: float = section_field(LossConfig, "clip_eps_low")
    clip_eps_high: float = section_field(LossConfig, "clip_eps_high")
    learning_rate: float | None = section_field(
        LearnerConfig, "learning_rate", default=None, description="AdamW learning rate "
        f"(unset: for a full fine-tune {SMALL_MODEL_LEARNING_RATE:g} below "
        f"{SMALL_MODEL_PARAMETERS / 1e9:g}B parameters, else "
        f"{_default(LearnerConfig, 'learning_rate'):g}, the paper's; "
        f"{LORA_LEARNING_RATE:g} for LoRA and QLoRA)")
    temperature: float = section_field(SamplingSettings, "temperature")
    max_new_tokens: int = section_field(SamplingSettings, "max_new_tokens")
    micro_batch_size: int = section_field(LearnerConfig, "micro_batch_size")
    seed: int = Field(0, description="seed of the sampler and of the external pool's draws")
    out: Path = Field(Path("runs/client"), description="output folder (metrics, checkpoints)")
    key_file: Path = Field(default_factory=default_key_file,
                           description="node key (PEM, 0600)")
    checkpoint_every: int = Field(1, ge=1, description="checkpoint every k rounds (and "
                                  "after the last)")
    threads: int | None = Field(None, ge=1, description="torch CPU threads")
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$", description="where the model "
        "generates and learns: auto (the first visible CUDA GPU when a round's estimated "
        "peak fits in its memory, else the CPU), cpu, cuda or cuda:N")
    display_name: str = Field("", description="name shown to the operator (default "
                              "MODEL/PEFT)")
    max_outage: float = Field(
        1800.0, ge=0, description="seconds the coordinator may stay unreachable (it retries "
        "with backoff and jitter meanwhile) before the client exits with code 50; 0 = "
        "wait forever")
    eval_every: int = Field(0, ge=0, description="greedy pass@1 on held-out and OOD sets "
                            "every k rounds (0 = off)")
    eval_config: Path | None = Field(None, description="JSON EvalConfig (sets, size, seed)")

    @model_validator(mode="before")
    @classmethod
    def _clip_shorthand(cls, data: Any) -> Any:
        """``clip_eps`` fills ``clip_eps_low`` and ``clip_eps_high`` where they are not
        given (by any source: flag, environment)."""
        if isinstance(data, dict) and data.get("clip_eps") is not None:
            data = {**data}
            for key in ("clip_eps_low", "clip_eps_high"):
                if data.get(key) is None:
                    data[key] = data["clip_eps"]
        return data

    @field_validator("lora_targets", mode="before")
    @classmethod
    def _split_targets(cls, v: object) -> object:
        if isinstance(v, str):  # "q_proj,v_proj" from the command line
            v = [t.strip() for t in v.split(",")]
        if isinstance(v, tuple):
            v = list(v)
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
    def effective_filter_threshold(self) -> float:
        """``filter_threshold``, or the default of the chosen divergence's unit
        (:func:`~ftis.client.learner.config.default_filter_threshold`)."""
        if self.filter_threshold is not None:
            return self.filter_threshold
        return default_filter_threshold(self.divergence)

    @property
    def effective_learning_rate(self) -> float:
        """:meth:`learning_rate_for` a model of unknown size."""
        return self.learning_rate_for(None)

    def learning_rate_for(self, parameter_count: int | None) -> float:
        """``learning_rate``, or the default for this PEFT kind and a base model of
        ``parameter_count`` parameters
        (:func:`~ftis.client.learner.config.default_learning_rate`)."""
        if self.learning_rate is not None:
            return self.learning_rate
        return default_learning_rate(self.peft, parameter_count)

    def _section(self, name: str, **resolved: Any) -> dict[str, Any]:
        _, fields = SECTIONS[name]
        values = {theirs: getattr(self, ours) for ours, theirs in fields.items()}
        return {**values, **resolved}

    @property
    def loss(self) -> LossConfig:
        """The :class:`LossConfig` of this configuration (distinct clip bounds included)."""
        return LossConfig(**self._section(
            "loss", filter_threshold=self.effective_filter_threshold))

    @property
    def learner(self) -> LearnerConfig:
        """The :class:`LearnerConfig` of this configuration for a model of unknown size
        (:meth:`learner_for`)."""
        return self.learner_for(None)

    def learner_for(self, parameter_count: int | None) -> LearnerConfig:
        """The :class:`LearnerConfig` of this configuration (its loss: :attr:`loss`; its
        learning rate: :meth:`learning_rate_for` ``parameter_count``)."""
        return LearnerConfig(loss=self.loss, **self._section(
            "learner", learning_rate=self.learning_rate_for(parameter_count)))

    @property
    def sampling(self) -> SamplingSettings:
        """The :class:`SamplingSettings` of this configuration's training rollouts."""
        return SamplingSettings(**self._section("sampling"))

    @property
    def lora_settings(self) -> LoraSettings:
        """:class:`LoraSettings` from the ``lora_*`` fields."""
        return LoraSettings(**self._section("lora",
                                            target_modules=tuple(self.lora_targets)))


def client_default(name: str, given: T | None) -> T:
    """``given``, or the default of :class:`ClientConfig`'s field ``name`` when it is
    ``None`` (for helpers whose keyword defaults must follow the client's)."""
    if given is not None:
        return given
    value: T = ClientConfig.model_fields[name].get_default(call_default_factory=True)
    return value
