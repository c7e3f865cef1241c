"""One source for every client default (issue 14, section 5).

The loss, learner, sampling and LoRA settings are pydantic models; ``ClientConfig``
copies their fields and ``ftis-client start`` derives its flags (default, choices, help)
from ``ClientConfig``, so a default or an enumeration changes in exactly one place.
"""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from ftis.client.cli import config_flags
from ftis.client.cli.main import app
from ftis.client.learner import config as learner_config
from ftis.client.learner import loss as loss_mod
from ftis.client.learner.config import (
    LORA_LEARNING_RATE,
    SUMMED_FILTER_THRESHOLD,
    LearnerConfig,
    LossConfig,
)
from ftis.client.models import loader, peft
from ftis.client.models.peft import LoraSettings
from ftis.client.node.config import NOT_EXPOSED, SECTIONS, ClientConfig, section_field
from ftis.client.rollout import sampler
from ftis.client.rollout.settings import SamplingSettings

SECTION_MODELS = (LossConfig, LearnerConfig, SamplingSettings, LoraSettings)


@pytest.fixture()
def clean_env(tmp_path, monkeypatch):
    """No FTIS_CLIENT_* / FTIS_* variables from the caller; a private config dir."""
    import os

    for key in list(os.environ):
        if key.startswith("FTIS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, ["start", "--help", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.replace("│", " ").split())


def _captured_start(monkeypatch, argv: list[str], env: dict[str, str] | None = None
                    ) -> ClientConfig:
    """Run ``ftis-client start ARGV`` up to the node: the ClientConfig it would run."""
    from ftis.client.cli import start

    seen: list[ClientConfig] = []
    monkeypatch.setattr(start, "run", lambda cfg, flags=None: seen.append(cfg) or 0)
    result = CliRunner().invoke(app, ["start", *argv], env=env)
    assert result.exit_code == 0, result.output
    (cfg,) = seen
    return cfg


# ------------------------------------------------------------------ one source of defaults


def test_every_section_field_is_a_client_field_or_named_as_not_exposed():
    mapped = {(model.__name__, theirs) for model, fields in SECTIONS.values()
              for theirs in fields.values()}
    for model in SECTION_MODELS:
        for name in model.model_fields:
            key = (model.__name__, name)
            assert key in mapped or f"{model.__name__}.{name}" in NOT_EXPOSED, key
    for model, fields in SECTIONS.values():
        for ours, theirs in fields.items():
            assert ours in ClientConfig.model_fields and theirs in model.model_fields


def test_client_defaults_equal_the_section_models_defaults():
    """Same default, bounds and help for every copied field (but the two documented
    ``None``-means-derived ones, checked through their effective values)."""
    cfg = ClientConfig()
    derived = {"filter_threshold", "learning_rate"}
    for model, fields in SECTIONS.values():
        for ours, theirs in fields.items():
            mine, source = ClientConfig.model_fields[ours], model.model_fields[theirs]
            if ours in derived:
                assert mine.default is None
                continue
            assert mine.get_default(call_default_factory=True) == type(
                mine.get_default(call_default_factory=True))(
                    source.get_default(call_default_factory=True)), ours
            if model is LossConfig and ours == "temperature":
                continue  # copied from SamplingSettings, the sampler's; the loss reuses it
            assert mine.description == source.description, ours
            if ours != "lora_targets":  # a list on the CLI; its validator checks the same
                assert mine.metadata == source.metadata, ours
    assert cfg.loss == LossConfig()
    assert cfg.learner == LearnerConfig()  # full fine-tune: the paper's 1e-6
    assert cfg.sampling == SamplingSettings()
    assert cfg.lora_settings == LoraSettings()
    assert cfg.effective_learning_rate == LearnerConfig().learning_rate == 1e-6
    assert ClientConfig(peft="lora").effective_learning_rate == LORA_LEARNING_RATE


@pytest.mark.parametrize(("peft", "parameters", "expected"), [
    ("none", 134_515_008, 1e-5),  # the embedded SmolLM2-135M: the size that learns at 1e-5
    ("none", 268_098_176, 1e-5),  # Gemma 3 270M
    ("none", 999_999_999, 1e-5),
    ("none", 1_000_000_000, 1e-6),  # from 1B: the paper's (1.5B-3B models)
    ("none", 3_000_000_000, 1e-6),
    ("none", None, 1e-6),  # size unknown: the paper's
    ("lora", 134_515_008, 2e-4),
    ("qlora", 7_000_000_000, 2e-4),
])
def test_the_default_learning_rate_follows_the_peft_kind_and_the_model_size(
        peft, parameters, expected) -> None:
    cfg = ClientConfig(peft=peft)
    assert cfg.learning_rate_for(parameters) == expected
    assert cfg.learner_for(parameters).learning_rate == expected
    given = ClientConfig(peft=peft, learning_rate=3e-5)  # a given rate always wins
    assert given.learning_rate_for(parameters) == 3e-5
    legacy = ClientConfig(divergence="kl_learner_gen").loss
    assert legacy.filter_threshold == SUMMED_FILTER_THRESHOLD == 50.0


def test_sampling_default_is_the_clis_64_tokens():
    """SamplingSettings said 96 while every client ran with ClientConfig's 64."""
    assert SamplingSettings().max_new_tokens == ClientConfig().max_new_tokens == 64
    assert ClientConfig().sampling.max_new_tokens == 64
    assert LossConfig().temperature == SamplingSettings().temperature  # one T, two users


def test_changing_a_model_default_changes_the_client_and_cli_default(monkeypatch):
    """The copy takes the model's field as it is: patch LossConfig's truncation and the
    ClientConfig field built from it, then the start flag built from that, follow."""
    patched = section_field(LossConfig, "truncation", default=3.5)
    monkeypatch.setitem(LossConfig.model_fields, "truncation", patched)
    copied = section_field(LossConfig, "truncation")
    assert copied.default == 3.5 and copied.metadata == patched.metadata
    monkeypatch.setitem(ClientConfig.model_fields, "truncation", copied)
    assert "(default 3.5; env FTIS_CLIENT_TRUNCATION)" in config_flags.flag_help("truncation")
    (param,) = [p for p in config_flags.config_parameters() if p.name == "truncation"]
    option = typing.get_args(param.annotation)[1]
    assert "default 3.5" in option.help and param.default is None


def test_no_restated_defaults_in_the_flag_declarations():
    """start's flags are generated: its own parameters are only --verbose and the
    plumbing; every ClientConfig field but the volunteer settings' is a flag."""
    from ftis.client.cli import start

    own = start.start.__signature__.parameters  # type: ignore[attr-defined]
    flags = {p.name for p in config_flags.config_parameters()}
    assert flags == set(ClientConfig.model_fields) - config_flags.NOT_FLAGS
    assert all(own[name].default is None for name in flags)


# ------------------------------------------------------------------ help shows the model


def test_start_help_shows_the_models_defaults_and_choices(clean_env):
    text = _help()
    lr = ClientConfig.model_fields["learning_rate"].description
    assert lr is not None and f"{LearnerConfig().learning_rate:g}" in lr
    assert f"{LORA_LEARNING_RATE:g}" in lr
    assert ("AdamW learning rate (unset: for a full fine-tune 1e-05 below 1B parameters, "
            "else 1e-06, the paper's") in " ".join(text.split())
    assert "0.0002 for LoRA and QLoRA" in text
    method_default = ClientConfig.model_fields["method"].default
    assert method_default == LossConfig().method == "ftis"
    assert ("learner objective (one of " + " | ".join(learner_config.METHODS)
            + f"; default {method_default}; env FTIS_CLIENT_METHOD)") in text
    assert (f"unset: {learner_config.DEFAULT_FILTER_THRESHOLD} for k1_mean/k3_mean, "
            f"{SUMMED_FILTER_THRESHOLD:g}, the paper's g, for kl_learner_gen/kl_gen_learner"
            in text)
    assert "one of " + " | ".join(learner_config.DIVERGENCES) + "; default k1_mean" in text
    assert "one of " + " | ".join(peft.PEFT_KINDS) + "; default none" in text
    assert "(default 64; env FTIS_CLIENT_MAX_NEW_TOKENS)" in text
    assert "(default 2; env FTIS_CLIENT_TRUNCATION)" in text
    assert "DAPO's clip-higher" in text
    for flag in ("--clip-eps", "--clip-eps-low", "--clip-eps-high", "--learning-rate",
                 "--filter-threshold", "--lora-targets", "--qlora-double-quant",
                 "--cross-tokenizer", "--idle-minutes", "--threads", "--max-memory"):
        assert flag in text, flag


# ------------------------------------------------------------------ enumerations


@pytest.mark.parametrize(("values", "alias"), [
    (learner_config.METHODS, learner_config.Method),
    (learner_config.DIVERGENCES, learner_config.Divergence),
    (learner_config.PER_TOKEN_DIVERGENCES, learner_config.PerTokenDivergence),
    (learner_config.SUMMED_DIVERGENCES, learner_config.SummedDivergence),
    (learner_config.AGGREGATIONS, learner_config.Aggregation),
    (learner_config.CROSS_TOKENIZER_MODES, learner_config.CrossTokenizer),
    (peft.PEFT_KINDS, peft.PeftKind),
])
def test_enumeration_tuples_are_derived_from_their_literal(values, alias):
    assert values == typing.get_args(alias)


def test_every_user_of_an_enumeration_reads_the_one_literal():
    import ftis.lab.experiment.matrix as matrix

    # re-exports are the same objects, not copies
    assert loss_mod.METHODS is learner_config.METHODS
    assert loss_mod.DIVERGENCES is learner_config.DIVERGENCES
    assert loss_mod.AGGREGATIONS is learner_config.AGGREGATIONS
    assert loss_mod.LossConfig is LossConfig
    assert loader.PEFT_KINDS is peft.PEFT_KINDS and loader.LoraSettings is LoraSettings
    assert sampler.SamplingSettings is SamplingSettings
    # the fields' types are the aliases
    fields = ClientConfig.model_fields
    assert fields["method"].annotation is learner_config.Method
    assert fields["divergence"].annotation is learner_config.Divergence
    assert fields["aggregation"].annotation is learner_config.Aggregation
    assert fields["cross_tokenizer"].annotation is learner_config.CrossTokenizer
    assert fields["peft"].annotation is peft.PeftKind
    assert LossConfig.model_fields["method"].annotation is learner_config.Method
    # the CLI's choices and the lab's are read from them
    assert config_flags.choices("method") == learner_config.METHODS
    assert config_flags.choices("peft") == peft.PEFT_KINDS
    assert config_flags.choices("divergence") == learner_config.DIVERGENCES
    assert matrix.ClientMethod is learner_config.Method
    assert matrix.METHOD_CHOICES == ("alone", *learner_config.METHODS)
    assert matrix.ClientRole.model_fields["peft"].annotation is peft.PeftKind


def test_memory_estimate_rejects_the_same_peft_kinds():
    from ftis.client.node.memory import Architecture, estimate_peak_memory

    arch = Architecture(parameters=10_000, linears=(("l.0.q_proj", 16, 16),),
                        vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=1,
                        num_heads=2, num_kv_heads=2, head_dim=8)
    for kind in peft.PEFT_KINDS:
        assert estimate_peak_memory(arch, peft=kind).total > 0
    # the estimate's defaults are the client's (one source)
    assert estimate_peak_memory(arch, peft="lora") == estimate_peak_memory(
        arch, peft="lora", lora_rank=ClientConfig().lora_rank,
        lora_targets=ClientConfig().lora_targets, local_groups=ClientConfig().local_groups,
        external_groups=ClientConfig().external_groups, group_size=ClientConfig().group_size,
        max_new_tokens=ClientConfig().max_new_tokens,
        micro_batch_size=ClientConfig().micro_batch_size)
    with pytest.raises(ValueError, match="none, lora, qlora"):
        estimate_peak_memory(arch, peft="int8")


# ------------------------------------------------------------------ clip-higher


def test_clip_higher_reaches_the_loss_config():
    cfg = ClientConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    assert (cfg.loss.clip_eps_low, cfg.loss.clip_eps_high) == (0.2, 0.28)
    # the shorthand sets both; a specific bound wins over it
    assert (ClientConfig(clip_eps=0.1).loss.clip_eps_low,
            ClientConfig(clip_eps=0.1).loss.clip_eps_high) == (0.1, 0.1)
    both = ClientConfig(clip_eps=0.1, clip_eps_high=0.3).loss
    assert (both.clip_eps_low, both.clip_eps_high) == (0.1, 0.3)
    with pytest.raises(ValueError):
        ClientConfig(clip_eps_low=1.0)


def test_clip_higher_from_the_command_line_and_environment(clean_env, monkeypatch):
    cfg = _captured_start(monkeypatch, ["--clip-eps-low", "0.2", "--clip-eps-high", "0.28"])
    assert (cfg.loss.clip_eps_low, cfg.loss.clip_eps_high) == (0.2, 0.28)
    assert cfg.learner.loss.clip_eps_high == 0.28  # what the node's Learner gets
    cfg = _captured_start(monkeypatch, ["--clip-eps", "0.15"],
                          env={"FTIS_CLIENT_CLIP_EPS_HIGH": "0.3"})
    assert (cfg.loss.clip_eps_low, cfg.loss.clip_eps_high) == (0.15, 0.3)


def test_node_builds_its_learner_and_sampler_from_the_config():
    """VolunteerNode takes cfg.learner and cfg.sampling (no field-by-field restatement)."""
    import inspect

    from ftis.client.node.runner import VolunteerNode

    source = inspect.getsource(VolunteerNode.__init__)
    assert "config.learner" in source and "config.sampling" in source
    assert "clip_eps" not in source


# ------------------------------------------------------------------ precedence


def test_flag_over_env_over_model_default(clean_env, monkeypatch):
    cfg = _captured_start(monkeypatch, [])
    assert cfg.method == LossConfig().method and cfg.truncation == LossConfig().truncation
    env = {"FTIS_CLIENT_METHOD": "tis", "FTIS_CLIENT_TRUNCATION": "3",
           "FTIS_CLIENT_LORA_TARGETS": "q_proj,v_proj"}
    cfg = _captured_start(monkeypatch, [], env=env)
    assert (cfg.method, cfg.truncation, cfg.lora_targets) == ("tis", 3.0, ["q_proj", "v_proj"])
    cfg = _captured_start(monkeypatch, ["--method", "nois", "--lora-targets", "k_proj"],
                          env=env)
    assert (cfg.method, cfg.truncation, cfg.lora_targets) == ("nois", 3.0, ["k_proj"])
    assert cfg.lora_settings.target_modules == ("k_proj",)


def test_an_unknown_choice_is_a_usage_error(clean_env, monkeypatch):
    from ftis.client.cli import start
    from ftis.protocol.exit_codes import ExitCode

    monkeypatch.setattr(start, "run", lambda cfg, flags=None: 0)
    result = CliRunner().invoke(app, ["start", "--method", "ppo"])
    assert result.exit_code == ExitCode.USAGE
    assert "method" in result.output


def test_lab_reads_the_clients_defaults():
    from ftis.lab.cli import demo
    from ftis.lab.experiment.matrix import ClientRole, ExperimentConfig

    role = ClientRole(name="a")
    assert (role.model, role.peft) == (ClientConfig().model, ClientConfig().peft)
    exp = ExperimentConfig(pairings=[{"name": "p", "clients": [{"name": "a"}]}])
    assert exp.group_size == ClientConfig().group_size
    assert exp.temperature == ClientConfig().temperature
    import inspect

    params = inspect.signature(demo.demo).parameters
    for name in ("model", "group_size", "method"):
        default = params[name].default
        assert default == ClientConfig.model_fields[name].default, name


def test_section_models_are_frozen_and_validate():
    for model in SECTION_MODELS:
        assert issubclass(model, BaseModel) and model.model_config.get("frozen")
    with pytest.raises(ValueError):
        LossConfig(method="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SamplingSettings(top_p=1.5)
    with pytest.raises(ValueError):
        LoraSettings(target_modules=())
