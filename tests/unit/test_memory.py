"""``--max-memory``: size parsing, the peak-memory estimate and the refusal to start."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ftis.client.node.config import ClientConfig
from ftis.client.node.memory import (
    LOGITS_COPIES,
    GiB,
    MemoryBudgetError,
    MiB,
    architecture_of,
    check_memory_budget,
    estimate_peak_memory,
    parse_size,
)


@pytest.mark.parametrize(("text", "expected"), [
    ("6GiB", 6 * 1024**3), ("512MiB", 512 * 1024**2), ("8GB", 8_000_000_000),
    ("1048576", 1048576), ("1.5g", 1_500_000_000), (" 2 gib ", 2 * 1024**3),
    ("64kib", 65536), ("3MB", 3_000_000), ("100b", 100), (4096, 4096),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "6 GiBs", "-1GB", "0", "0MiB", "1e9", "GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_size(text)


def test_config_fields(monkeypatch):
    assert ClientConfig(max_memory="2GiB").max_memory_bytes == 2 * GiB
    assert ClientConfig().max_memory_bytes is None
    with pytest.raises(ValidationError, match="memory size"):
        ClientConfig(max_memory="lots")
    cfg = ClientConfig(peft="qlora", lora_targets="q_proj, v_proj", lora_dropout=0.1)
    assert cfg.lora_targets == ["q_proj", "v_proj"]
    assert cfg.effective_learning_rate == 2e-4  # LoRA/QLoRA default
    s = cfg.lora_settings
    assert s.target_modules == ("q_proj", "v_proj") and s.dropout == 0.1 and s.rank == 16
    assert ClientConfig().lora_targets == ["q_proj", "k_proj", "v_proj", "o_proj"]
    monkeypatch.setenv("FTIS_CLIENT_LORA_TARGETS", "gate_proj,up_proj")
    assert ClientConfig().lora_targets == ["gate_proj", "up_proj"]
    with pytest.raises(ValidationError):
        ClientConfig(lora_targets="")
    with pytest.raises(ValidationError):
        ClientConfig(peft="int8")


@pytest.fixture(scope="module")
def tiny_arch(tiny_model_dir):
    from transformers import AutoConfig

    return architecture_of(AutoConfig.from_pretrained(tiny_model_dir))


def test_architecture_counts_exactly(tiny_arch, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert tiny_arch.parameters == sum(p.numel() for p in model.parameters())
    assert len(tiny_arch.linears) == 7 * 2  # no lm_head
    assert tiny_arch.linear_parameters == 2 * (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64)
    # rank 16 on q (32->32), k (32->16), v (32->16), o (32->32), 2 layers
    assert tiny_arch.lora_parameters(16, ("q_proj", "k_proj", "v_proj", "o_proj")) == \
        2 * 16 * (64 + 48 + 48 + 64)
    assert tiny_arch.lora_parameters(4, ("nothing",)) == 0


def test_estimate_parts_by_hand(tiny_arch):
    a = tiny_arch
    full = estimate_peak_memory(a, peft="none", micro_batch_size=4, max_new_tokens=10)
    assert full.trainable == a.parameters
    assert full.phases["learning"]["optimizer"] == 12 * a.parameters
    assert full.phases["learning"]["weights"] == 4 * a.parameters
    assert full.phases["learning"]["logits"] == int(LOGITS_COPIES * 4 * 11 * a.vocab_size * 4)
    lora = estimate_peak_memory(a, peft="lora", lora_rank=16)
    n_lora = 2 * 16 * (64 + 48 + 48 + 64)
    assert lora.trainable == n_lora
    assert lora.phases["learning"]["optimizer"] == 12 * n_lora
    assert lora.phases["learning"]["weights"] == 4 * (a.parameters + n_lora)
    # generation: K/V of every layer for local_groups * group_size rows
    g = estimate_peak_memory(a, peft="lora", local_groups=3, group_size=5, max_new_tokens=20,
                             prompt_tokens=30)
    head_dim = 32 // 4
    assert g.phases["generation"]["kv_cache"] == 2 * 2 * 15 * 2 * head_dim * 50 * 4
    assert g.breakdown == g.phases[g.phase] and g.total == sum(g.breakdown.values())
    assert g.total == max(g.phase_total(p) for p in g.phases)


def test_estimate_is_monotonic(tiny_arch):
    def total(**kw):
        return estimate_peak_memory(tiny_arch, **kw).total

    base = {"peft": "none", "micro_batch_size": 4, "max_new_tokens": 32}
    assert total(**base) < total(**{**base, "micro_batch_size": 8})
    assert total(**base) < total(**{**base, "max_new_tokens": 64})
    assert total(**base) < total(**{**base, "prompt_tokens": 512})
    assert total(**base) <= total(**{**base, "group_size": 32, "local_groups": 8})
    w = {p: estimate_peak_memory(tiny_arch, peft=p).phases["learning"]["weights"]
         for p in ("none", "lora", "qlora")}
    assert w["qlora"] < w["none"] < w["lora"]
    dq = estimate_peak_memory(tiny_arch, peft="qlora", double_quant=True)
    assert dq.phases["learning"]["weights"] < w["qlora"]
    opt = {p: estimate_peak_memory(tiny_arch, peft=p).phases["learning"]["optimizer"]
           for p in ("none", "lora", "qlora")}
    assert opt["lora"] == opt["qlora"] < opt["none"]
    with pytest.raises(ValueError):
        estimate_peak_memory(tiny_arch, peft="int8")


def test_smollm2_sized_config_estimate():
    """An architecture like SmolLM2-135M (built on the meta device: nothing allocated)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      tie_word_embeddings=True)
    arch = architecture_of(cfg)
    assert arch.parameters == 134_515_008
    full, lora, qlora = (estimate_peak_memory(arch, peft=p) for p in ("none", "lora", "qlora"))
    assert full.phase == lora.phase == qlora.phase == "learning"
    assert 2 * GiB < full.total < 8 * GiB
    assert full.total - lora.total > GiB  # gradients + AdamW moments of 134.5 M parameters
    assert qlora.phases["learning"]["weights"] < lora.phases["learning"]["weights"] / 2
    # short sequences, one sample per micro-batch: weights dominate; QLoRA learns in less
    # memory, but its peak is then loading (it reads the whole float32 file to quantize)
    small = {"micro_batch_size": 1, "max_new_tokens": 8, "prompt_tokens": 16}
    q_small = estimate_peak_memory(arch, peft="qlora", **small)
    l_small = estimate_peak_memory(arch, peft="lora", **small)
    assert q_small.phase_total("learning") < l_small.phase_total("learning")
    assert q_small.phase == "load" and l_small.phase == "learning"
    assert qlora.phases["load"]["load"] == 2 * 4 * arch.parameters
    assert "load" not in full.phases["load"]  # float32 weights are the mapped file


def test_budget_refusal_names_the_budget(tiny_arch):
    est = estimate_peak_memory(tiny_arch, peft="none")
    check_memory_budget(est, None)
    check_memory_budget(est, est.total)
    with pytest.raises(MemoryBudgetError) as info:
        check_memory_budget(est, 10 * MiB)
    msg = str(info.value)
    assert "\n" not in msg
    assert "--max-memory is 10 MiB" in msg
    assert "configuration needs about" in msg and "weights" in msg and "baseline" in msg
    assert "--micro-batch-size" in msg
    assert "--peft" not in msg  # a tiny model: its weights and optimizer are negligible


def test_budget_refusal_suggests_lighter_peft_when_weights_matter():
    from transformers import LlamaConfig

    arch = architecture_of(LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4))  # a 1.1 B model, on the meta device
    small = {"micro_batch_size": 1, "max_new_tokens": 16, "prompt_tokens": 32}
    msgs = {}
    for peft in ("none", "lora", "qlora"):
        with pytest.raises(MemoryBudgetError) as info:
            check_memory_budget(estimate_peak_memory(arch, peft=peft, **small), GiB)
        msgs[peft] = str(info.value)
    assert "--max-memory is 1.0 GiB" in msgs["none"]
    assert "try --peft lora or --peft qlora, or a smaller --micro-batch-size" in msgs["none"]
    assert "try --peft qlora, or" in msgs["lora"]
    assert "--peft" not in msgs["qlora"]  # already the lightest kind


def test_cli_refuses_before_connecting(tmp_path, tiny_model_dir, monkeypatch):
    from typer.testing import CliRunner

    from ftis.client.cli.main import app
    from ftis.client.swarm import connection
    from ftis.protocol.exit_codes import ExitCode

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("tried to connect")

    monkeypatch.setattr(connection.SwarmConnection, "__init__", boom)
    key = tmp_path / "key.pem"
    result = CliRunner().invoke(app, [
        "start", "--max-memory", "10MiB", "--model", str(tiny_model_dir),
        "--coordinator", "127.0.0.1:9", "--key-file", str(key), "--out", str(tmp_path / "o"),
        "--rounds", "1", "--peft", "qlora", "--lora-targets", "q_proj,v_proj",
        "--lora-dropout", "0.05", "--qlora-double-quant", "--micro-batch-size", "2"])
    assert result.exit_code == ExitCode.CLIENT_MEMORY_BUDGET == 53, result.output
    out = " ".join(result.output.split())
    assert "--max-memory is 10 MiB" in out and "configuration needs about" in out
    assert not key.exists()  # stopped before the node identity, model or connection

    bad = CliRunner().invoke(app, ["start", "--max-memory", "ten", "--model",
                                   str(tiny_model_dir), "--key-file", str(key)])
    assert bad.exit_code == ExitCode.USAGE


def test_check_memory_passes_a_generous_budget(tiny_model_dir):
    from ftis.client.cli.start import check_memory
    from ftis.protocol.exit_codes import ExitCode

    cfg = ClientConfig(model=str(tiny_model_dir), max_memory="64GiB")
    assert check_memory(cfg) == ExitCode.OK
