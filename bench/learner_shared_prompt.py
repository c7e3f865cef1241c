#!/usr/bin/env python3
"""The learner's forward + backward with each group's prompt run once against every
completion run with its prompt (``LearnerConfig.share_prompt``), on the embedded
SmolLM2-135M at the demo's shape, alternating in one process.

Shape: I + J = 6 groups of G = 8 completions, each group's prompt the chat template
over a real ``products`` question (2 terms, 1 digit; about 50 tokens), completion
lengths drawn uniformly from 8 to 32 tokens (the demo's cap is 32 and EOS ends most rows
early), micro-batches of 8, float32, ``--threads`` torch threads. Each repetition times
``Learner._backward`` (forward and backward over all micro-batches, no optimizer step)
once per setting, in alternating order (ABBA...), after one warm-up of each.

Prints every repetition, then the mean of the per-repetition ratios shared / whole with
a 95 % t-interval and the exact sign test (``bench/ab_pairs.py``), and the largest
difference between the two settings' gradients relative to the largest gradient entry.

Usage: ``python bench/learner_shared_prompt.py --reps 6 --threads 1``
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_pairs import sign_test, t_interval  # noqa: E402

from ftis.client.learner.batch import Sample  # noqa: E402
from ftis.client.learner.trainer import Learner, LearnerConfig  # noqa: E402
from ftis.client.models.loader import load_policy  # noqa: E402
from ftis.tasks import TaskSource, TaskSpec  # noqa: E402


def build_samples(policy, groups: int, group_size: int, seed: int) -> list[Sample]:
    """``groups`` x ``group_size`` samples with real prompts and random completions."""
    spec = TaskSpec(dataset="products", config={"min_terms": 2, "max_terms": 2,
                                                "min_digits": 1, "max_digits": 1})
    source = TaskSource([spec], seed=seed)
    rng = random.Random(seed)
    vocab = policy.model.config.vocab_size
    samples = []
    for g in range(groups):
        prompt, _ = policy.prompt_token_ids([{"role": "user",
                                              "content": source.draw().question}])
        for k in range(group_size):
            n = rng.randint(8, 32)
            ids = [rng.randrange(vocab) for _ in range(n)]
            samples.append(Sample(prompt, ids, [-1.0] * n, 1.0 if k % 2 else -1.0,
                                  local=g < groups - 2))
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    policy = load_policy(args.model)
    samples = build_samples(policy, args.groups, args.group_size, seed=0)
    prompt_len = sum(len(s.prompt_ids) for s in samples) / len(samples)
    comp_len = sum(len(s.completion_ids) for s in samples) / len(samples)
    print(f"# {args.model}, {args.groups} groups x {args.group_size}, prompt {prompt_len:.1f} "
          f"tokens, completion {comp_len:.1f} tokens (mean), micro-batch 8, "
          f"{args.threads} thread(s), {args.reps} repetitions after a warm-up of each")
    learners = {share: Learner(policy.model, LearnerConfig(share_prompt=share), 0)
                for share in (True, False)}

    def timed(share: bool) -> tuple[float, list[torch.Tensor]]:
        learner = learners[share]
        learner.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        learner._backward(samples)  # noqa: SLF001
        seconds = time.perf_counter() - t0
        grads = [p.grad.detach().clone() for p in learner.params]
        learner.optimizer.zero_grad(set_to_none=True)
        return seconds, grads

    _, g_shared = timed(True)
    _, g_whole = timed(False)
    scale = max(float(g.abs().max()) for g in g_whole)
    diff = max(float((a - b).abs().max()) for a, b in zip(g_shared, g_whole, strict=True))
    ratios = []
    for rep in range(args.reps):
        order = (True, False) if rep % 2 == 0 else (False, True)
        t = {share: timed(share)[0] for share in order}
        ratios.append(t[True] / t[False])
        print(f"rep {rep + 1}: shared {t[True]:.2f} s, whole {t[False]:.2f} s, "
              f"ratio {ratios[-1]:.3f}")
    mean, lo, hi = t_interval(ratios)
    below = sum(r < 1 for r in ratios)
    print(f"# gradient difference: max |shared - whole| = {diff:.2e} "
          f"({diff / scale:.1e} of the largest entry)")
    print(f"# n = {len(ratios)} repetitions; ratio shared/whole {mean:.3f} "
          f"[{lo:.3f}, {hi:.3f}] (95 % t); shared faster in {below} of {len(ratios)}, "
          f"sign test p = {sign_test(below, len(ratios) - below):.4f}")
    print(f"shared_over_whole={mean:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
