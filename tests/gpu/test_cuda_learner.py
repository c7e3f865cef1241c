"""The client's model on a CUDA GPU: loading, sampling, a learner step, a checkpoint.

Skipped without a visible CUDA device (CI and the 2-core development machine have none);
run on a GPU machine with ``pytest --noconftest tests/gpu`` (self-contained: no
PostgreSQL plugin, its own tiny model). docs/volunteers.md ("Using a GPU") records the
runs. A full fine-tune and LoRA always run; QLoRA when bitsandbytes is installed.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = [[1, 5, 6, 7], [1, 8, 9]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from ftis.client.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", hidden_size=64,
                            seed=0)


def _peft_kinds() -> list[str]:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return ["none", "lora"]
    return ["none", "lora", "qlora"]


def _groups(policy, device_generator_seed: int = 0):
    """Two groups sampled by ``policy`` (on its device), with alternating rewards so that
    every group has a non-zero advantage."""
    from ftis.client.rollout.groups import RolloutGroup
    from ftis.client.rollout.sampler import SamplingSettings, sample_groups

    res = sample_groups(policy.model, PROMPTS, 4, SamplingSettings(max_new_tokens=6),
                        policy.eos_token_ids, policy.tokenizer.pad_token_id,
                        torch.Generator().manual_seed(device_generator_seed))
    groups = []
    for prompt, group in zip(PROMPTS, res.completions, strict=True):
        rewards = [float(i % 2) for i in range(len(group))]
        groups.append(RolloutGroup(prompt, [c.token_ids for c in group],
                                   [c.logprobs for c in group], rewards, local=True))
    return groups


@pytest.mark.parametrize("peft", _peft_kinds())
def test_a_learner_step_on_cuda_matches_the_cpu_and_updates_the_weights(model_dir, peft,
                                                                        tmp_path):
    from ftis.client.learner.batch import pack
    from ftis.client.learner.checkpoint import load_checkpoint, save_checkpoint
    from ftis.client.learner.forward import batch_logprobs
    from ftis.client.learner.trainer import Learner, LearnerConfig, groups_to_samples
    from ftis.client.models.loader import load_policy

    torch.manual_seed(0)
    gpu = load_policy(str(model_dir), peft=peft, device="cuda")
    trainable = {n: p for n, p in gpu.model.named_parameters() if p.requires_grad}
    assert trainable and all(p.device.type == "cuda" for p in trainable.values())

    groups = _groups(gpu)
    # the sampler's recorded log-probs are the GPU policy's own: re-scoring agrees
    samples = groups_to_samples(groups, scale_by_std=True)
    batch = pack(samples[:4], gpu.tokenizer.pad_token_id).to("cuda")
    with torch.no_grad():
        gpu.model.eval()
        lp = batch_logprobs(gpu.model, batch, temperature=1.0)
    assert batch.gen_logprobs is not None
    torch.testing.assert_close(lp[batch.completion_mask], batch.gen_logprobs[
        batch.completion_mask], atol=1e-3, rtol=1e-3)

    if peft != "qlora":  # the same weights on the CPU give the same log-probs
        torch.manual_seed(0)
        cpu = load_policy(str(model_dir), peft=peft)
        with torch.no_grad():
            cpu.model.eval()
            lp_cpu = batch_logprobs(cpu.model, pack(samples[:4],
                                                    cpu.tokenizer.pad_token_id), 1.0)
        torch.testing.assert_close(lp.cpu()[batch.completion_mask.cpu()],
                                   lp_cpu[batch.completion_mask.cpu()],
                                   atol=1e-3, rtol=1e-3)

    learner = Learner(gpu.model, LearnerConfig(learning_rate=1e-2), gpu.tokenizer.pad_token_id)
    assert learner.device.type == "cuda"
    before = {n: p.detach().clone() for n, p in trainable.items()}
    metrics = learner.step(groups)
    assert metrics["updated"] == 1.0 and metrics["samples"] == 8.0
    assert 0.0 < metrics["grad_norm"] < float("inf")
    changed = [n for n, p in trainable.items() if not torch.equal(p, before[n])]
    assert changed, "no trainable parameter moved"
    assert all(p.device.type == "cuda" for p in trainable.values())

    # a checkpoint written from the GPU resumes into a fresh GPU policy, moments included
    save_checkpoint(tmp_path, 1, gpu.model, learner.optimizer, {"cursor": 3})
    torch.manual_seed(1)
    other = load_policy(str(model_dir), peft=peft, device="cuda")
    other_learner = Learner(other.model, LearnerConfig(learning_rate=1e-2),
                            other.tokenizer.pad_token_id)
    state = load_checkpoint(tmp_path, other.model, other_learner.optimizer)
    assert state is not None and state["extra"] == {"cursor": 3}
    for (n, p), q in zip(trainable.items(), other_learner.params, strict=True):
        assert q.device.type == "cuda" and torch.equal(p, q), n
        moments = other_learner.optimizer.state[q]
        assert moments["exp_avg"].device.type == "cuda"
        assert torch.equal(moments["exp_avg"], learner.optimizer.state[p]["exp_avg"])
    assert other_learner.step(groups)["updated"] == 1.0


def test_the_device_setting_sees_the_gpu_and_its_memory():
    from ftis.client.node.runtime import resolve_device

    total = torch.cuda.get_device_properties(0).total_memory
    assert resolve_device("auto") == ("cuda", "")
    assert resolve_device("auto", needed=total // 2) == ("cuda", "")
    device, note = resolve_device("auto", needed=total + 1)
    assert device == "cpu" and "more than the GPU's" in note
    assert resolve_device("cuda:0", needed=total + 1) == ("cuda:0", "")
