#!/usr/bin/env python3
"""One client round (generation + learner step) on each of several torch devices, with a
model of the embedded SmolLM2-135M's shape (``ftis-client start --device``).

The model is built from a model directory's ``config.json`` with random weights
(float32, seed 0) and saved beside its tokenizer, then loaded through the client's own
``load_policy(..., device=D)``; nothing but the config and the tokenizer is read, so a
machine without the weights (a GPU machine with no hub access) runs it too. Random
weights rarely emit EOS, so every completion runs to the token cap: the round is at the
demo's worst-case length.

Round: 4 prompts x G = 8 completions of ``--tokens`` new tokens at T = 0.7 in one
sampler batch (``sample_groups``), then one learner step (full fine-tune, lr 1e-5,
micro-batches of 8, the default F-TIS loss) on the 4 groups with alternating rewards (so
every group has a non-zero advantage). One warm-up round per device, then ``--reps``
timed rounds; devices alternate within each repetition. Prints each device's mean
generation, learner and round seconds and every device's round time relative to the
first device's, measured in the same process; for a CUDA device also its peak allocated
memory beside the client's estimate of the round (``device_round_peak``, the number
``--device auto`` compares with the GPU's memory).

Usage: ``make bench-device``, or ``python bench/learner_device.py [--model-dir DIR]
[--devices cuda,cpu] --reps 3``
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

QUESTIONS = [
    "Solve the following multiplication: 7 * 8. Give only the result as your final answer.",
    "Solve the following multiplication: 3 * 9. Give only the result as your final answer.",
    "State the final answer to the following arithmetic problem: 4 + 5 =",
    "State the final answer to the following arithmetic problem: 6 + 2 =",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json", "special_tokens_map.json")


def random_model_dir(model_dir: Path, out: Path) -> Path:
    """``out`` holding ``model_dir``'s config and tokenizer with random float32 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)
    return out


def one_round(policy, learner, tokens: int, seed: int) -> tuple[float, float]:
    """Generation and learner seconds of one round (synchronised on CUDA)."""
    from ftis.client.rollout.groups import RolloutGroup
    from ftis.client.rollout.sampler import SamplingSettings, sample_groups

    prompts = [policy.prompt_token_ids([{"role": "user", "content": q}])[0]
               for q in QUESTIONS]
    sync = torch.cuda.synchronize if learner.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    res = sample_groups(policy.model, prompts, 8,
                        SamplingSettings(temperature=0.7, max_new_tokens=tokens),
                        policy.eos_token_ids, policy.tokenizer.pad_token_id,
                        torch.Generator().manual_seed(seed))
    sync()
    t1 = time.perf_counter()
    groups = [RolloutGroup(p, [c.token_ids for c in g], [c.logprobs for c in g],
                           [float(i % 2) for i in range(len(g))], local=True)
              for p, g in zip(prompts, res.completions, strict=True)]
    metrics = learner.step(groups)
    sync()
    t2 = time.perf_counter()
    assert metrics["updated"] == 1.0, metrics
    return t1 - t0, t2 - t1


def device_estimate(model_dir: Path, tokens: int) -> int:
    """:func:`~ftis.client.node.memory.device_round_peak` of this benchmark's round shape
    (4 own groups of 8, no external ones, micro-batches of 8, a full fine-tune), in
    bytes: what ``--device auto`` compares with the GPU's memory."""
    from ftis.client.node.config import ClientConfig
    from ftis.client.node.memory import device_round_peak, estimate_for_config

    cfg = ClientConfig(model=str(model_dir), local_groups=4, external_groups=0,
                       group_size=8, max_new_tokens=tokens, micro_batch_size=8)
    return device_round_peak(estimate_for_config(cfg))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="a model directory (config.json + tokenizer; weights not read); "
                    "default: the embedded smollm2-135m's converted directory")
    ap.add_argument("--devices", default=None, help="comma-separated torch devices "
                    "(default: cuda,cpu where CUDA is available, else cpu)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from ftis.client.learner.trainer import Learner, LearnerConfig
    from ftis.client.models.loader import load_policy

    if args.model_dir is None:
        from ftis.client.models.registry import materialize, resolve

        args.model_dir = materialize(resolve("smollm2-135m"))
    if args.devices is None:
        args.devices = "cuda,cpu" if torch.cuda.is_available() else "cpu"
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} CPU threads; "
          + (f"CUDA device {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
             else "no CUDA device"))
    with tempfile.TemporaryDirectory() as tmp:
        path = random_model_dir(args.model_dir, Path(tmp) / "model")
        estimate = device_estimate(path, args.tokens)
        runs = {}
        for device in devices:
            torch.manual_seed(0)
            policy = load_policy(str(path), device=device)
            learner = Learner(policy.model, LearnerConfig(learning_rate=1e-5,
                                                          micro_batch_size=8),
                              policy.tokenizer.pad_token_id)
            runs[device] = (policy, learner)
            print(f"# {device}: {policy.card.parameter_count:,} parameters; warm-up round "
                  f"{sum(one_round(policy, learner, args.tokens, 0)):.2f} s")
        times: dict[str, list[tuple[float, float]]] = {d: [] for d in devices}
        for rep in range(args.reps):
            order = devices if rep % 2 == 0 else devices[::-1]
            for device in order:
                policy, learner = runs[device]
                times[device].append(one_round(policy, learner, args.tokens, rep + 1))
                gen, learn = times[device][-1]
                print(f"rep {rep} {device}: generation {gen:.3f} s, learner {learn:.3f} s")
    for device in devices:
        if device.startswith("cuda"):
            peak = torch.cuda.max_memory_allocated(device)
            print(f"# {device}: peak allocated {peak / 2**20:.0f} MiB; the client's "
                  f"estimate of this round on a device (device_round_peak) "
                  f"{estimate / 2**20:.0f} MiB, {estimate / peak:.2f} x the peak")
    first = statistics.mean(g + s for g, s in times[devices[0]])
    print(f"{'device':>8} {'generation s':>13} {'learner s':>10} {'round s':>8} "
          f"{'/ ' + devices[0]:>10}")
    for device in devices:
        gen = statistics.mean(g for g, _ in times[device])
        learn = statistics.mean(s for _, s in times[device])
        print(f"{device:>8} {gen:13.3f} {learn:10.3f} {gen + learn:8.3f} "
              f"{(gen + learn) / first:10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
