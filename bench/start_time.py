"""Cold vs warm start of the embedded models: process start -> policy loaded -> first rollout.

For each ``--model``, in a fresh temporary ``FTIS_CACHE_DIR`` (so the first run is cold:
GGUF assembly where needed + dequantization + safetensors/tokenizer save), then again
with that cache (warm). Every measurement runs in its own subprocess, so interpreter
start-up and imports count, as they do for ``ftis-client start``. Clocks start in the
parent just before the child is spawned.

Per run:

* ``load_s``: process start -> policy loaded (``load_policy``: resolve, convert/load,
  model card incl. tokenizer fingerprint);
* ``first_rollout_s``: process start -> first rollout done: one group of G completions
  (default G = 8, 48 new tokens) of a ``chain_sum`` task, rendered like a client's lease
  (chat template or plain prompt with stop strings);
* ``rollout_s`` and ``tokens``: that rollout alone and the tokens it generated.

Usage: python bench/start_time.py [--model smollm2-135m gemma3-270m] [--group-size 8]
       [--max-new-tokens 48] [--warm-runs 2] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def child(model: str, group_size: int, max_new_tokens: int, threads: int) -> None:
    t0 = float(os.environ["FTIS_BENCH_T0"])
    import torch

    if threads:
        torch.set_num_threads(threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    from ftis.client.models.loader import load_policy
    from ftis.client.rollout.sampler import SamplingSettings, sample_groups
    from ftis.tasks import TaskSource, render_messages
    from ftis.tasks.source import DEFAULT_TASKS

    policy = load_policy(model)
    load_s = time.time() - t0
    task = TaskSource(DEFAULT_TASKS, seed=0).draw()
    prompt, _ = policy.prompt_token_ids(render_messages(task.question))
    t1 = time.perf_counter()
    res = sample_groups(policy.model, [prompt], group_size,
                        SamplingSettings(max_new_tokens=max_new_tokens), policy.eos_token_ids,
                        policy.tokenizer.pad_token_id, torch.Generator().manual_seed(0),
                        stop_strings=policy.stop_strings, decode=policy.decode)
    rollout_s = time.perf_counter() - t1
    print(json.dumps({"load_s": load_s, "first_rollout_s": time.time() - t0,
                      "rollout_s": rollout_s, "tokens": res.generated_tokens}))


def run_child(model: str, cache: str, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, FTIS_CACHE_DIR=cache, HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, __file__, "--child", model, "--group-size", str(args.group_size),
           "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    env["FTIS_BENCH_T0"] = repr(time.time())
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{model}: child failed\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--warm-runs", type=int, default=2, help="warm runs (median reported)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.group_size, args.max_new_tokens, args.threads)
        return
    results = []
    for model in args.model:
        cache = tempfile.mkdtemp(prefix="ftis-start-")
        try:
            cold = run_child(model, cache, args)
            warm = [run_child(model, cache, args) for _ in range(args.warm_runs)]
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        results.append({"model": model, "start": "cold", **cold})
        if warm:
            results.append({"model": model, "start": "warm", **{
                k: statistics.median(w[k] for w in warm) for k in warm[0]}})
        print(f"{model}: cold {cold['load_s']:.1f} s, "
              f"warm {results[-1]['load_s']:.1f} s", file=sys.stderr)
    head = (f"{'model':<16}{'start':<7}{'load_s':>9}{'first_rollout_s':>17}{'rollout_s':>11}"
            f"{'tokens':>8}")
    print(f"G = {args.group_size}, {args.max_new_tokens} new tokens, chain_sum; "
          f"{os.cpu_count()} CPUs; warm = median of {args.warm_runs}")
    print(head)
    for r in results:
        print(f"{r['model']:<16}{r['start']:<7}{r['load_s']:>9.1f}{r['first_rollout_s']:>17.1f}"
              f"{r['rollout_s']:>11.1f}{int(r['tokens']):>8}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
