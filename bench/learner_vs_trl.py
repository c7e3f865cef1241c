"""One GRPO learner step, FTIS vs TRL's GRPOTrainer, same model/shape/dtype, CPU.

Each side runs in its own subprocess (so peak RSS is its own), both in this run:

* FTIS: ``sample_groups`` (generation with sampler log-probs) + ``Learner.step`` (one
  forward with grad that also yields lp_old, the F-TIS loss, backward, AdamW step);
* TRL: ``GRPOTrainer`` with the equivalent configuration (see docs/benchmarks.md):
  same prompts, G, completion length (forced: EOS suppressed on both sides), float32,
  temperature 1 / top-p 1 / top-k 0, beta = 0 (no reference model), one iteration per
  generation, token-level ("dapo") loss, one optimizer step per generation batch.

Both sides use the same reward function (a deterministic parity of the completion text,
so every group has reward variance and both sides back-propagate every sample).
Prints the median step time and peak RSS of each, their ratios (FTIS / TRL), and the
breakdown of the FTIS step.

Usage: python bench/learner_vs_trl.py [--reps 5] [--prompts 2] [--group-size 8]
       [--completion-len 48] [--threads 2]
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

QUESTIONS = [
    "State the final answer to the following arithmetic problem: 3 + 4 =",
    "State the final answer to the following arithmetic problem: 9 - 2 =",
    "State the final answer to the following arithmetic problem: 5 + 8 =",
    "State the final answer to the following arithmetic problem: 6 - 7 =",
]


def parity_reward(text: str) -> float:
    return float(len(text) % 2)


def _messages(q: str) -> list[dict[str, str]]:
    from ftis.tasks import render_messages

    return render_messages(q)


def _model_dir() -> str:
    from ftis.client.models.registry import materialize, resolve

    return str(materialize(resolve("smollm2-135m")))


def worker_ftis(args: argparse.Namespace) -> dict:
    import torch

    from ftis.client.learner.batch import RolloutGroup
    from ftis.client.learner.trainer import Learner, LearnerConfig
    from ftis.client.models.loader import load_policy
    from ftis.client.rollout.sampler import SamplingSettings, sample_groups

    pol = load_policy(_model_dir())
    pad = pol.tokenizer.pad_token_id
    learner = Learner(pol.model, LearnerConfig(learning_rate=1e-6,
                                               micro_batch_size=args.prompts * args.group_size),
                      pad)
    settings = SamplingSettings(max_new_tokens=args.completion_len)
    gen = torch.Generator().manual_seed(0)
    steps = []
    for rep in range(args.reps + 1):
        qs = [QUESTIONS[(rep * args.prompts + i) % len(QUESTIONS)] for i in range(args.prompts)]
        prompts = [pol.prompt_token_ids(_messages(q))[0] for q in qs]
        t0 = time.perf_counter()
        res = sample_groups(pol.model, prompts, args.group_size, settings, [], pad, gen)
        t1 = time.perf_counter()
        groups = []
        for p, grp in zip(prompts, res.completions, strict=True):
            rewards = [parity_reward(pol.decode(c.token_ids)) for c in grp]
            groups.append(RolloutGroup(p, [c.token_ids for c in grp],
                                       [c.logprobs for c in grp], rewards, local=True))
        m = learner.step(groups)
        t2 = time.perf_counter()
        assert res.generated_tokens == args.prompts * args.group_size * args.completion_len
        steps.append({"total": t2 - t0, "generation": t1 - t0,
                      "logprob_forward": m.get("forward_seconds", 0.0),
                      "backward": m.get("backward_seconds", 0.0),
                      "optimizer": m.get("optimizer_seconds", 0.0),
                      "rewards_and_packing": (t2 - t1) - m.get("learner_seconds", 0.0),
                      "samples": m["samples"], "tokens": res.generated_tokens})
    return {"steps": steps[1:], "peak_rss_mb": _peak_rss_mb()}


def worker_trl(args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    path = _model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n = (args.reps + 1) * args.prompts
    ds = Dataset.from_list([{"prompt": _messages(QUESTIONS[i % len(QUESTIONS)])}
                            for i in range(n)])

    def reward(completions, **kwargs):  # noqa: ANN001, ANN003 - TRL's reward signature
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [parity_reward(t) for t in texts]

    batch = args.prompts * args.group_size
    cfg = GRPOConfig(
        output_dir=os.path.join(args.tmp, "trl"), per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, num_generations=args.group_size,
        max_completion_length=args.completion_len,
        generation_kwargs={"min_new_tokens": args.completion_len},
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-6, beta=0.0,
        loss_type="dapo", num_iterations=1, epsilon=0.2, max_steps=args.reps + 1,
        logging_steps=1, save_strategy="no", report_to=[], bf16=False, fp16=False,
        seed=0, shuffle_dataset=False, mask_truncated_completions=False,
        dataloader_num_workers=0, disable_dropout=True, max_grad_norm=1.0,
    )

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, *a, **k):  # noqa: ANN002, ANN003
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):  # noqa: ANN002, ANN003
            self.times.append(time.perf_counter() - self.t0)

    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=ds,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history
               if "completions/mean_length" in h]
    return {"steps": [{"total": t} for t in timer.times[1:]], "peak_rss_mb": _peak_rss_mb(),
            "mean_completion_length": statistics.mean(lengths) if lengths else None}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--completion-len", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", choices=["ftis", "trl"])
    ap.add_argument("--tmp", default="runs/bench")
    ap.add_argument("--json-out", default="runs/bench/learner_vs_trl.json")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if args.worker:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch.manual_seed(0)
        result = (worker_ftis if args.worker == "ftis" else worker_trl)(args)
        print("RESULT " + json.dumps(result))
        return

    os.makedirs(args.tmp, exist_ok=True)
    results = {}
    for side in ("ftis", "trl"):
        cmd = [sys.executable, __file__, "--worker", side, *sys.argv[1:]]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   OMP_NUM_THREADS=str(args.threads))
        print(f"running {side} ...", flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if out.returncode != 0 or line is None:
            print(out.stdout[-3000:], out.stderr[-5000:], file=sys.stderr)
            raise SystemExit(f"{side} worker failed ({out.returncode})")
        results[side] = json.loads(line[len("RESULT "):])

    med = {s: statistics.median(x["total"] for x in results[s]["steps"]) for s in results}
    rss = {s: results[s]["peak_rss_mb"] for s in results}
    print()
    print(f"shape: {args.prompts} prompts x G={args.group_size}, {args.completion_len} completion "
          f"tokens each, float32, {args.threads} threads, {args.reps} timed steps (+1 warm-up)")
    print(f"{'':24}{'FTIS':>10}{'TRL':>10}{'FTIS/TRL':>10}")
    print(f"{'median step time (s)':24}{med['ftis']:10.2f}{med['trl']:10.2f}"
          f"{med['ftis'] / med['trl']:10.2f}")
    print(f"{'peak RSS (MiB)':24}{rss['ftis']:10.0f}{rss['trl']:10.0f}"
          f"{rss['ftis'] / rss['trl']:10.2f}")
    print(f"TRL mean completion length: {results['trl'].get('mean_completion_length')} "
          f"(FTIS: {args.completion_len}, forced)")
    print("\nFTIS step breakdown (median seconds):")
    for k in ("generation", "logprob_forward", "backward", "optimizer", "rewards_and_packing"):
        v = statistics.median(x[k] for x in results["ftis"]["steps"])
        print(f"  {k:22}{v:8.2f}  ({100 * v / med['ftis']:4.0f}%)")
    os.makedirs(os.path.dirname(args.json_out), exist_ok=True)
    with open(args.json_out, "w") as fh:
        json.dump({"args": vars(args), "median_step_s": med, "peak_rss_mb": rss,
                   "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
