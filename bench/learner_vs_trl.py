"""FTIS vs TRL's GRPOTrainer on CPU, same model/shape/dtype: one learner step, one demo round.

Each side runs in its own subprocess (so peak RSS is its own), both in this run, one after
the other; every measurement is a median over ``--reps`` timed iterations after one
warm-up. Two modes (``--mode both`` runs both):

* ``step``: one GRPO step at a fixed shape, completion length forced (EOS suppressed on
  both sides), temperature 1, ``--threads`` torch threads (default 2). FTIS:
  ``sample_groups`` (generation with sampler log-probs) + ``Learner.step`` (one forward
  with grad that also yields lp_old, the F-TIS loss, backward, AdamW step); TRL: one
  ``GRPOTrainer`` step (its ``generate()`` + forward/backward + optimizer), equivalent
  configuration (docs/benchmarks.md): beta = 0 (no reference model), one iteration per
  generation, token-level ("dapo") loss, one optimizer step per generation batch.
* ``round``: one round of ``make demo``'s full fine-tune client, at its shape:
  SmolLM2-135M-Instruct, ReasoningGYM ``products`` (2 terms, 1 digit), temperature 0.7,
  G = 8, ``--max-new-tokens 32`` with natural EOS (both sides stop a completion at EOS),
  I = 4 own prompts + J = 2 external groups in the learner step, micro-batches of 8
  (TRL: ``per_device_train_batch_size=8`` with gradient accumulation over its generation
  batch, one optimizer step), lr 1e-5, 1 torch thread (``--round-threads``). Both sides
  train on the same (I + J) x G sequences' prompts: FTIS generates its I groups and
  receives the J external groups from the swarm (generated before the timed loop, by the
  same model, as a peer would); TRL has no swarm, so it generates all I + J groups
  itself. With ``--external-groups 0`` both generate and train the same I groups.

Rewards make every group have reward variance, so both sides back-propagate every sample
(FTIS drops zero-variance groups, TRL does not): in ``step`` mode a parity of the
completion text, in ``round`` mode 0/1 alternating within each group. Prints the median
time of each side, the ratios FTIS / TRL, peak RSS, tokens generated per side and a
breakdown (generation, forward, backward, optimizer) of both.

Usage: python bench/learner_vs_trl.py [--mode both] [--reps 5] [--prompts 2]
       [--group-size 8] [--completion-len 48] [--threads 2] [--round-prompts 4]
       [--external-groups 2] [--max-new-tokens 32] [--round-threads 1]
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
from collections.abc import Callable
from typing import Any

QUESTIONS = [
    "State the final answer to the following arithmetic problem: 3 + 4 =",
    "State the final answer to the following arithmetic problem: 9 - 2 =",
    "State the final answer to the following arithmetic problem: 5 + 8 =",
    "State the final answer to the following arithmetic problem: 6 - 7 =",
]
#: ``make demo``'s task, temperature and learning rate (full fine-tune client)
DEMO_TASK = {"dataset": "products",
             "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
DEMO_TEMPERATURE = 0.7
DEMO_LR = 1e-5
BREAKDOWN = ("generation", "forward", "backward", "optimizer", "other")


def parity_reward(text: str) -> float:
    return float(len(text) % 2)


def alternating_rewards(n: int) -> list[float]:
    """0, 1, 0, 1, ... for the n completions of consecutive groups (G even)."""
    return [float(i % 2) for i in range(n)]


def _messages(q: str) -> list[dict[str, str]]:
    from ftis.tasks import render_messages

    return render_messages(q)


def _model_dir() -> str:
    from ftis.client.models.registry import materialize, resolve

    return str(materialize(resolve("smollm2-135m")))


def _round_questions(args: argparse.Namespace) -> list[list[str]]:
    """Per round (warm-up included): I own questions followed by J external ones."""
    from ftis.tasks.source import TaskSource, TaskSpec

    per_round = args.round_prompts + args.external_groups
    entries = TaskSource([TaskSpec(**DEMO_TASK)], seed=0).distinct((args.reps + 1) * per_round)
    qs = [e.question for e in entries]
    return [qs[r * per_round : (r + 1) * per_round] for r in range(args.reps + 1)]


def worker_ftis(args: argparse.Namespace) -> dict:
    import torch

    from ftis.client.learner.loss import LossConfig
    from ftis.client.learner.trainer import Learner, LearnerConfig
    from ftis.client.models.loader import load_policy
    from ftis.client.rollout.groups import RolloutGroup
    from ftis.client.rollout.sampler import SamplingSettings, sample_groups

    pol = load_policy(_model_dir())
    pad = pol.tokenizer.pad_token_id
    gen = torch.Generator().manual_seed(0)
    if args.mode == "step":
        learner = Learner(pol.model, LearnerConfig(
            learning_rate=1e-6, micro_batch_size=args.prompts * args.group_size), pad)
        settings, eos = SamplingSettings(max_new_tokens=args.completion_len), []
        rounds = [([QUESTIONS[(rep * args.prompts + i) % len(QUESTIONS)]
                    for i in range(args.prompts)], []) for rep in range(args.reps + 1)]
    else:
        learner = Learner(pol.model, LearnerConfig(
            loss=LossConfig(temperature=DEMO_TEMPERATURE), learning_rate=DEMO_LR,
            micro_batch_size=args.micro_batch), pad)
        settings = SamplingSettings(temperature=DEMO_TEMPERATURE,
                                    max_new_tokens=args.max_new_tokens)
        eos = pol.eos_token_ids
        rounds = [(qs[: args.round_prompts], qs[args.round_prompts :])
                  for qs in _round_questions(args)]
        # the external groups of every round, generated before the timed loop (a peer's work)
        for r, (own, ext) in enumerate(rounds):
            if not ext:
                continue
            prompts = [pol.prompt_token_ids(_messages(q))[0] for q in ext]
            res = sample_groups(pol.model, prompts, args.group_size, settings, eos, pad, gen)
            rounds[r] = (own, [RolloutGroup(
                p, [c.token_ids for c in grp], [c.logprobs for c in grp],
                alternating_rewards(len(grp)), local=False, sender="peer", policy_version=0)
                for p, grp in zip(prompts, res.completions, strict=True)])
    steps = []
    for own, external in rounds:
        prompts = [pol.prompt_token_ids(_messages(q))[0] for q in own]
        t0 = time.perf_counter()
        res = sample_groups(pol.model, prompts, args.group_size, settings, eos, pad, gen)
        t1 = time.perf_counter()
        groups = []
        for p, grp in zip(prompts, res.completions, strict=True):
            rewards = ([parity_reward(pol.decode(c.token_ids)) for c in grp]
                       if args.mode == "step" else alternating_rewards(len(grp)))
            groups.append(RolloutGroup(p, [c.token_ids for c in grp],
                                       [c.logprobs for c in grp], rewards, local=True))
        m = learner.step(groups + external)
        t2 = time.perf_counter()
        if args.mode == "step":
            assert res.generated_tokens == args.prompts * args.group_size * args.completion_len
        known = t1 - t0 + sum(m.get(k, 0.0) for k in ("forward_seconds", "backward_seconds",
                                                      "optimizer_seconds"))
        steps.append({"total": t2 - t0, "generation": t1 - t0,
                      "forward": m.get("forward_seconds", 0.0),
                      "backward": m.get("backward_seconds", 0.0),
                      "optimizer": m.get("optimizer_seconds", 0.0),
                      "other": t2 - t0 - known,  # rewards, packing, loss bookkeeping
                      "samples": m["samples"], "generated_tokens": res.generated_tokens,
                      "generated_rows": len(prompts) * args.group_size,
                      "train_tokens": m.get("train_tokens", 0.0)})
    return {"steps": steps[1:], "peak_rss_mb": _peak_rss_mb()}


def worker_trl(args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    path = _model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if args.mode == "step":
        n = (args.reps + 1) * args.prompts
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
        temperature, lr = 1.0, 1e-6
        micro_batch, accumulation = args.prompts * args.group_size, 1
        completion_len, gen_kwargs = args.completion_len, {"min_new_tokens": args.completion_len}
    else:
        questions = [q for qs in _round_questions(args) for q in qs]
        temperature, lr = DEMO_TEMPERATURE, DEMO_LR
        rows = (args.round_prompts + args.external_groups) * args.group_size
        if rows % args.micro_batch:
            raise SystemExit("--micro-batch must divide (round prompts + external) x G")
        micro_batch, accumulation = args.micro_batch, rows // args.micro_batch
        completion_len, gen_kwargs = args.max_new_tokens, None
    ds = Dataset.from_list([{"prompt": _messages(q)} for q in questions])

    def reward(completions: list[Any], **kwargs: Any) -> list[float]:  # TRL's signature
        if args.mode == "round":
            return alternating_rewards(len(completions))
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [parity_reward(t) for t in texts]

    cfg = GRPOConfig(
        output_dir=os.path.join(args.tmp, "trl"),
        # one generation batch of micro_batch x accumulation rows, one optimizer step
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation,
        num_generations=args.group_size,
        max_completion_length=completion_len, generation_kwargs=gen_kwargs,
        temperature=temperature, top_p=1.0, top_k=0, learning_rate=lr, beta=0.0,
        loss_type="dapo", num_iterations=1, epsilon=0.2, max_steps=args.reps + 1,
        logging_steps=1, save_strategy="no", report_to=[], bf16=False, fp16=False,
        seed=0, shuffle_dataset=False, mask_truncated_completions=False,
        dataloader_num_workers=0, disable_dropout=True, max_grad_norm=1.0,
        # TRL defaults to activation (gradient) checkpointing, which re-runs the forward in
        # the backward; FTIS does not checkpoint, so neither side does here
        activation_checkpointing=False,
    )

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict] = []
            self.parts: dict[str, float] = {}

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.parts = {"generation": 0.0, "prepare": 0.0, "forward": 0.0,
                          "training_step": 0.0, "generated_tokens": 0, "generated_rows": 0}
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            total = time.perf_counter() - self.t0
            p = self.parts
            self.steps.append({
                "total": total, "generation": p["generation"], "forward": p["forward"],
                "backward": p["training_step"] - p["prepare"] - p["forward"],
                "optimizer": total - p["training_step"],  # clip, AdamW step, zero_grad, logs
                "other": p["prepare"] - p["generation"],  # rewards, advantages, tokenizing
                "generated_tokens": p["generated_tokens"],
                "generated_rows": p["generated_rows"]})

    timer = Timer()

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timer.parts[name] += time.perf_counter() - t
        return wrapper

    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=ds,
                          processing_class=tokenizer, callbacks=[timer])
    generate = timed("generation", trainer._generate_single_turn)

    def generate_counted(*a: Any, **k: Any) -> Any:
        out = generate(*a, **k)
        timer.parts["generated_tokens"] += sum(len(c) for c in out[0])
        timer.parts["generated_rows"] += len(out[0])
        return out

    trainer._generate_single_turn = generate_counted
    trainer._prepare_inputs = timed("prepare", trainer._prepare_inputs)
    trainer.compute_loss = timed("forward", trainer.compute_loss)
    trainer.training_step = timed("training_step", trainer.training_step)
    torch.manual_seed(0)
    trainer.train()
    return {"steps": timer.steps[1:], "peak_rss_mb": _peak_rss_mb()}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _run_side(side: str, mode: str, threads: int) -> dict:
    cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", side, "--mode", mode]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(threads))
    print(f"running {side} ({mode}) ...", flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        print(out.stdout[-3000:], out.stderr[-5000:], file=sys.stderr)
        raise SystemExit(f"{side} {mode} worker failed ({out.returncode})")
    return json.loads(line[len("RESULT "):])


def _report(mode: str, args: argparse.Namespace, results: dict) -> dict:
    def med(side: str, key: str) -> float:
        return statistics.median(x[key] for x in results[side]["steps"])

    total = {s: med(s, "total") for s in results}
    rss = {s: results[s]["peak_rss_mb"] for s in results}
    print()
    if mode == "step":
        print(f"== one learner step: {args.prompts} prompts x G={args.group_size}, "
              f"{args.completion_len} completion tokens each (forced), temperature 1, float32, "
              f"{args.threads} thread(s), {args.reps} timed steps (+1 warm-up)")
        name = "step"
    else:
        print(f"== one demo round: I={args.round_prompts} own prompts + J={args.external_groups}"
              f" external groups, G={args.group_size}, products (2 terms, 1 digit), "
              f"temperature {DEMO_TEMPERATURE}, max {args.max_new_tokens} new tokens (EOS "
              f"stops), float32, {args.round_threads} thread(s), {args.reps} timed rounds "
              f"(+1 warm-up)")
        name = "round"
    print(f"{'':28}{'FTIS':>10}{'TRL':>10}{'FTIS/TRL':>10}")
    print(f"{'median ' + name + ' time (s)':28}{total['ftis']:10.2f}{total['trl']:10.2f}"
          f"{total['ftis'] / total['trl']:10.2f}")
    print(f"{'peak RSS (MiB)':28}{rss['ftis']:10.0f}{rss['trl']:10.0f}"
          f"{rss['ftis'] / rss['trl']:10.2f}")
    rows = {s: med(s, "generated_rows") for s in results}
    toks = {s: statistics.mean(x["generated_tokens"] for x in results[s]["steps"])
            for s in results}
    print(f"{'rows generated':28}{rows['ftis']:10.0f}{rows['trl']:10.0f}")
    print(f"{'tokens generated (mean)':28}{toks['ftis']:10.0f}{toks['trl']:10.0f}")
    print(f"{'  per row':28}{toks['ftis'] / rows['ftis']:10.1f}{toks['trl'] / rows['trl']:10.1f}")
    print(f"breakdown (median seconds, share of the {name}):")
    for k in BREAKDOWN:
        f, t = med("ftis", k), med("trl", k)
        print(f"  {k:26}{f:10.2f}{t:10.2f}{f / t if t > 0.005 else float('nan'):10.2f}"
              f"   ({100 * f / total['ftis']:3.0f}% / {100 * t / total['trl']:3.0f}%)")
    gen_s = {s: med(s, "generation") for s in results}
    print(f"  {'generation s per 1k tokens':26}{1e3 * gen_s['ftis'] / toks['ftis']:10.2f}"
          f"{1e3 * gen_s['trl'] / toks['trl']:10.2f}")
    return {"median_s": total, "ratio": total["ftis"] / total["trl"], "peak_rss_mb": rss,
            "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["step", "round", "both"], default="both")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=2, help="step: prompts per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--completion-len", type=int, default=48, help="step: forced length")
    ap.add_argument("--threads", type=int, default=2, help="step: torch threads")
    ap.add_argument("--round-prompts", type=int, default=4, help="round: I own prompts")
    ap.add_argument("--external-groups", type=int, default=2, help="round: J external groups")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="round: completion cap")
    ap.add_argument("--round-threads", type=int, default=1, help="round: torch threads")
    ap.add_argument("--micro-batch", type=int, default=8,
                    help="round: sequences per forward/backward (TRL: gradient accumulation)")
    ap.add_argument("--worker", choices=["ftis", "trl"])
    ap.add_argument("--tmp", default="runs/bench")
    ap.add_argument("--json-out", default="runs/bench/learner_vs_trl.json")
    args = ap.parse_args()

    import torch

    if args.worker:
        import transformers

        torch.set_num_threads(args.threads if args.mode == "step" else args.round_threads)
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch.manual_seed(0)
        result = (worker_ftis if args.worker == "ftis" else worker_trl)(args)
        print("RESULT " + json.dumps(result))
        return

    os.makedirs(args.tmp, exist_ok=True)
    report = {"args": vars(args)}
    for mode in (("step", "round") if args.mode == "both" else (args.mode,)):
        threads = args.threads if mode == "step" else args.round_threads
        results = {side: _run_side(side, mode, threads) for side in ("ftis", "trl")}
        report[mode] = _report(mode, args, results)
    print()
    print("FTIS / TRL time: " + ", ".join(f"{m} {report[m]['ratio']:.2f}"
                                          for m in ("step", "round") if m in report))
    os.makedirs(os.path.dirname(args.json_out), exist_ok=True)
    with open(args.json_out, "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
