"""Calibrate ``ftis.client.node.memory``: estimated vs measured peak RSS per PEFT kind.

Each configuration runs in its own subprocess (so ``ru_maxrss`` is its own) with the
imports of ``ftis-client start``, loads the model with ``load_policy`` and runs
``--rounds`` rounds of the node's work without a coordinator: generation of
``local_groups x group_size`` completions (EOS suppressed, so every completion has
``max_new_tokens`` tokens: the worst case the estimate models), rewards (a parity of the
text, so every group has variance) and one learner step. Prints, per PEFT kind, the
estimate (with the real prompt length), the measured peak RSS after each phase, and the
median learner-step and generation times.

Usage: python bench/memory_budget.py [--model smollm2-135m] [--pefts none,lora,qlora]
       [--group-size 8] [--local-groups 2] [--max-new-tokens 48] [--micro-batch 8]
       [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MiB = 1024**2


def _rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size in MiB."""
    with open("/proc/self/statm") as fh:
        cur = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB
    return cur, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args: argparse.Namespace) -> dict:
    import grpc  # noqa: F401 - the client's imports, as in `ftis-client start`
    import torch

    import ftis.client.node.runner  # noqa: F401
    import ftis.client.swarm.connection  # noqa: F401
    from ftis.client.learner.trainer import Learner, LearnerConfig
    from ftis.client.models.loader import LoraSettings, load_policy
    from ftis.client.node.memory import architecture_of, estimate_peak_memory
    from ftis.client.rollout.groups import RolloutGroup
    from ftis.client.rollout.sampler import SamplingSettings, sample_groups
    from ftis.tasks import render_messages
    from ftis.tasks.source import DEFAULT_TASKS, TaskSource

    phases = {"imports": _rss_mb()}
    t0 = time.perf_counter()
    pol = load_policy(args.model, peft=args.peft, lora=LoraSettings())
    load_s = time.perf_counter() - t0
    phases["load"] = _rss_mb()
    pad = pol.tokenizer.pad_token_id
    lr = 1e-6 if args.peft == "none" else 1e-5
    learner = Learner(pol.model, LearnerConfig(learning_rate=lr,
                                               micro_batch_size=args.micro_batch), pad)
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens)
    gen = torch.Generator().manual_seed(0)
    src = TaskSource(DEFAULT_TASKS, seed=0)
    steps, prompt_len = [], 0
    for r in range(args.rounds):
        prompts = [pol.prompt_token_ids(render_messages(src.draw().question))[0]
                   for _ in range(args.local_groups)]
        prompt_len = max(prompt_len, *(len(p) for p in prompts))
        res = sample_groups(pol.model, prompts, args.group_size, settings, [], pad, gen)
        phases[f"generation{r + 1}"] = _rss_mb()
        groups = [RolloutGroup(p, [c.token_ids for c in grp], [c.logprobs for c in grp],
                               [float(len(pol.decode(c.token_ids)) % 2) for c in grp],
                               local=True)
                  for p, grp in zip(prompts, res.completions, strict=True)]
        if all(g.reward_variance_zero for g in groups):  # make sure there is a gradient
            groups[0].rewards[0] = 1.0 - groups[0].rewards[0]
        m = learner.step(groups)
        phases[f"learning{r + 1}"] = _rss_mb()
        steps.append({"generation": res.seconds, "learner": m["learner_seconds"],
                      "samples": m["samples"]})
    from transformers import AutoConfig

    arch = architecture_of(AutoConfig.from_pretrained(_model_dir(args.model)))
    est = estimate_peak_memory(
        arch, peft=args.peft, local_groups=args.local_groups, external_groups=0,
        group_size=args.group_size, max_new_tokens=args.max_new_tokens,
        micro_batch_size=args.micro_batch, prompt_tokens=prompt_len)
    return {"peft": args.peft, "phases": phases, "steps": steps, "load_seconds": load_s,
            "prompt_tokens": prompt_len, "estimate_bytes": est.total,
            "estimate_phase": est.phase, "estimate_breakdown": est.breakdown,
            "estimate_phases": {k: est.phase_total(k) for k in est.phases},
            "trainable": est.trainable,
            "card_parameters": int(pol.card.parameter_count)}


def _model_dir(name: str) -> str:
    from ftis.client.models.registry import materialize, resolve

    return str(materialize(resolve(name)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pefts", default="none,lora,qlora")
    ap.add_argument("--peft", help=argparse.SUPPRESS)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--local-groups", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", default="runs/bench/memory_budget.json")
    args = ap.parse_args()

    if args.worker:
        import torch
        import transformers

        torch.set_num_threads(args.threads)
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch.manual_seed(0)
        print("RESULT " + json.dumps(worker(args)))
        return

    results = []
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(args.threads))
    for peft in args.pefts.split(","):
        print(f"running peft={peft} ...", flush=True)
        cmd = [sys.executable, __file__, "--worker", "--peft", peft, "--model", args.model,
               "--group-size", str(args.group_size), "--local-groups", str(args.local_groups),
               "--max-new-tokens", str(args.max_new_tokens),
               "--micro-batch", str(args.micro_batch), "--rounds", str(args.rounds),
               "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if out.returncode != 0 or line is None:
            print(out.stdout[-3000:], out.stderr[-5000:], file=sys.stderr)
            raise SystemExit(f"{peft} worker failed ({out.returncode})")
        results.append(json.loads(line[len("RESULT "):]))

    print(f"\n{args.model}: {args.local_groups} groups x G={args.group_size}, "
          f"{args.max_new_tokens} new tokens (forced), micro-batch {args.micro_batch}, "
          f"{args.threads} threads, {args.rounds} rounds")
    print(f"{'peft':6}{'estimate':>10}{'peak RSS':>10}{'est/meas':>9}{'learner s':>11}"
          f"{'gen s':>8}  peak after each phase (MiB)")
    for r in results:
        peak = max(p[1] for p in r["phases"].values())
        est = r["estimate_bytes"] / MiB
        learn = statistics.median(s["learner"] for s in r["steps"][1:] or r["steps"])
        gen = statistics.median(s["generation"] for s in r["steps"][1:] or r["steps"])
        trail = " ".join(f"{k}={v[1]:.0f}" for k, v in r["phases"].items())
        print(f"{r['peft']:6}{est:10.0f}{peak:10.0f}{est / peak:9.2f}{learn:11.2f}{gen:8.2f}"
              f"  {trail}")
        print(f"{'':6}estimate ({r['estimate_phase']}): " + ", ".join(
            f"{k} {v / MiB:.0f}" for k, v in r["estimate_breakdown"].items()))
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as fh:
        json.dump({"args": vars(args), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
