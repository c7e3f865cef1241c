"""QLoRA: a 4-bit NF4 base with float32 LoRA adapters, its model card and its checkpoints."""

from __future__ import annotations

import pytest
import torch

from ftis.client.learner.checkpoint import load_checkpoint, save_checkpoint
from ftis.client.learner.trainer import Learner, LearnerConfig
from ftis.client.models.loader import LoraSettings, load_policy, qlora_quantization
from ftis.client.node.memory import architecture_of
from ftis.client.rollout.groups import RolloutGroup

pytest.importorskip("bitsandbytes")

GROUP = RolloutGroup([1, 5, 6], [[7, 8, 2], [9, 2]], [[-1.0, -2.0, -0.5], [-3.0, -0.1]],
                     [1.0, 0.0], local=True)
IDS = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])


@pytest.fixture(scope="module")
def wider_model_dir(tmp_path_factory):
    """A tiny Llama big enough that a low-rank adapter is a small fraction of it."""
    from ftis.client.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("wide") / "tiny-wide", hidden_size=64,
                            num_layers=4, seed=3)


def _load(path, peft: str, seed: int = 0, lora: LoraSettings | None = None):
    torch.manual_seed(seed)
    return load_policy(str(path), peft=peft, lora=lora)


def test_qlora_card_counts_true_parameters_and_records_nf4(tiny_model_dir):
    import bitsandbytes as bnb

    full = _load(tiny_model_dir, "none")
    q = _load(tiny_model_dir, "qlora")
    card = q.card
    assert card.peft == "qlora"
    assert "nf4" in card.quantization and card.quantization == "bnb-nf4"
    assert card.dtype == "float32"  # the compute dtype, not the packed uint8 storage
    # packed Params4bit hold half as many elements; the card counts the real weights
    assert card.parameter_count == full.card.parameter_count
    assert sum(p.numel() for p in q.model.parameters()) < card.parameter_count
    arch = architecture_of(full.model.config)
    assert card.trainable_parameter_count == arch.lora_parameters(
        16, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert all("lora_" in n for n, p in q.model.named_parameters() if p.requires_grad)
    quantized = [m for m in q.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 7 * 2  # q k v o gate up down, 2 layers

    with torch.no_grad():
        a = full.model(IDS).logits
        b = q.model(IDS).logits  # LoRA B starts at 0: the base's logits
    diff = float((a - b).abs().max())
    # really quantized, yet close: measured max |diff| 0.10 with logits up to 0.7
    assert 1e-3 < diff < 0.3, diff


def test_qlora_quantization_label_keeps_source():
    assert qlora_quantization("none") == "bnb-nf4"
    assert qlora_quantization("gguf-q4_1-dequantized") == "gguf-q4_1-dequantized+bnb-nf4"


def test_lora_targets_are_configurable(tiny_model_dir):
    s = LoraSettings(rank=2, alpha=4, dropout=0.05, target_modules=("q_proj", "v_proj"))
    pol = _load(tiny_model_dir, "lora", lora=s)
    names = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert names and all(("q_proj" in n or "v_proj" in n) and "lora_" in n for n in names)
    arch = architecture_of(pol.model.get_base_model().config)
    assert pol.card.trainable_parameter_count == arch.lora_parameters(2, s.target_modules)
    # by hand: per layer q 2*(32+32) + v 2*(32+16), 2 layers
    assert pol.card.trainable_parameter_count == 2 * (2 * 64 + 2 * 48)


def test_sampler_runs_on_the_quantized_policy(tiny_model_dir):
    from ftis.client.rollout.sampler import SamplingSettings, sample_groups

    q = _load(tiny_model_dir, "qlora")
    res = sample_groups(q.model, [[1, 5, 6]], 3, SamplingSettings(max_new_tokens=4),
                        q.eos_token_ids, q.tokenizer.pad_token_id,
                        torch.Generator().manual_seed(0))
    comp = res.completions[0][0]
    # the recorded log-probs are the quantized policy's: re-scoring agrees
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 6, *comp.token_ids]])
        logp = torch.log_softmax(q.model(ids).logits[0, 2:-1].float(), -1)
    expected = logp.gather(-1, torch.tensor(comp.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(comp.logprobs), expected, atol=1e-4, rtol=1e-4)
    # after generating (eval, no grad) the 4-bit layers still back-propagate: every
    # adapter of the first layer gets a gradient (bitsandbytes' AVX512-BF16 inference
    # path, which has no backward, stays off)
    q.model.train()
    q.model(ids).logits.float().logsumexp(-1).sum().backward()
    grads = {n: p.grad for n, p in q.model.named_parameters()
             if p.requires_grad and "layers.0." in n and "lora_B" in n}
    assert grads and all(g is not None and float(g.abs().sum()) > 0 for g in grads.values())


def test_qlora_checkpoint_holds_only_adapters_and_resumes(tmp_path, wider_model_dir):
    lora = LoraSettings(rank=4, alpha=8)
    a = _load(wider_model_dir, "qlora", seed=0, lora=lora)
    la = Learner(a.model, LearnerConfig(learning_rate=1e-2), 0)
    la.step([GROUP])
    la.step([GROUP])
    ckpt = save_checkpoint(tmp_path, 2, a.model, la.optimizer, {"cursor": 7})

    files = [p for p in ckpt.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} <= {".safetensors", ".json"}
    base_bytes = (wider_model_dir / "model.safetensors").stat().st_size
    ckpt_bytes = sum(p.stat().st_size for p in files)
    assert ckpt_bytes < base_bytes / 4, (ckpt_bytes, base_bytes)
    from safetensors import safe_open

    with safe_open(ckpt / "trainable.safetensors", "pt") as fh:
        keys = list(fh.keys())
    assert keys and all("lora_" in k for k in keys)  # no 4-bit base weights

    b = _load(wider_model_dir, "qlora", seed=1, lora=lora)  # other random adapter init
    lb = Learner(b.model, LearnerConfig(learning_rate=1e-2), 0)
    named_a = {n: p for n, p in a.model.named_parameters() if p.requires_grad}
    named_b = {n: p for n, p in b.model.named_parameters() if p.requires_grad}
    assert any(not torch.equal(named_a[n], named_b[n]) for n in named_a)
    state = load_checkpoint(tmp_path, b.model, lb.optimizer)
    assert state["round"] == 2 and state["extra"] == {"cursor": 7}
    for n, p in named_a.items():
        assert torch.equal(p, named_b[n]), n
    assert len(la.params) == len(lb.params)
    for pa, pb in zip(la.params, lb.params, strict=True):
        sa, sb = la.optimizer.state[pa], lb.optimizer.state[pb]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"])
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert float(sa["step"]) == float(sb["step"]) == 2.0
    # the same base quantizes to the same 4-bit codes, so training continues identically
    ma, mb = la.step([GROUP]), lb.step([GROUP])
    assert ma["loss"] == mb["loss"]
    for n, p in named_a.items():
        torch.testing.assert_close(p, named_b[n], atol=0, rtol=0)
