"""How far apart honest and fabricated log-probs are under a spot check, on the real
embedded SmolLM2-135M-Instruct (issue 13, class 1; sets ``spot_checks.tolerance_nats``).

Two measurements, both against the held base weights:

* **honest drift:** a real ``ftis-client start`` (full fine-tune, the experiments'
  settings: lr 1e-5, G = 8, T = 0.7, 32 new tokens, 4 local groups per round) runs
  ``--rounds`` rounds against an in-process coordinator that spot-checks *every* bundle
  (``established_rate`` 1) with an infinite tolerance, so nothing is refused and every
  bundle's statistic is recorded with the policy version (optimizer steps) it was sampled
  at. Round 0 is the untrained policy; later rounds show how the statistic grows as the
  volunteer's policy moves away from the held weights.
* **fabricated:** a model-less node that computes each leased answer
  (``ftis.lab.harness.trust_swarm.answer_of``) and writes it the way SmolLM2 does, with three
  claims: a constant -0.7 nats/token; the median of the true log-probs over all its
  fabricated bundles (one constant that fits the whole set, which the node cannot know
  without the model); and, per bundle, the median of that bundle's true log-probs (the
  constant that minimises the mean absolute discrepancy on that very bundle: the best
  any constant claim can do).

Writes one JSON line per bundle to ``bench/results/spot_check_margin-DATE.jsonl`` and
prints a summary: per policy version the honest mean-|d| (median and max), and the
fabricated ones (min over bundles). The margin is min(fabricated) / max(honest).

Usage: python bench/spot_check_margin.py [--rounds 10] [--tasks 24] [--out runs/spot_margin]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODEL = "smollm2-135m"
TASKS = [{"dataset": "products", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                            "max_digits": 1}},
         {"dataset": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                             "max_digits": 1}}]
CLIENT_ARGS = ["--model", MODEL, "--peft", "none", "--learning-rate", "1e-5",
               "--local-groups", "4", "--external-groups", "0", "--method", "on_policy",
               "--group-size", "8", "--max-new-tokens", "32", "--temperature", "0.7",
               "--seed", "0", "--threads", "1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tasks", type=int, default=24, help="fabricated bundles")
    ap.add_argument("--bf16-tasks", type=int, default=8,
                    help="bundles sampled by a bfloat16 copy of the model (version 0)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "spot_margin")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import grpc

    from ftis.client.models.loader import load_policy
    from ftis.coordinator.config import CoordinatorConfig
    from ftis.coordinator.server.app import CoordinatorServer
    from ftis.coordinator.spot_check import HeldModel, logprob_discrepancy
    from ftis.coordinator.spot_check_worker import load_models, recompute_logprobs
    from ftis.lab.harness.trust_swarm import Node, answer_of
    from ftis.protocol.identity import NodeIdentity
    from ftis.v1 import swarm_pb2_grpc

    if args.out.exists():  # a leftover client would resume from its checkpoints
        import shutil

        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    out_json = args.json or ROOT / "bench" / "results" / (
        f"spot_check_margin-{dt.date.today().isoformat()}.jsonl")
    server = CoordinatorServer(CoordinatorConfig(
        db=str(args.out / "coordinator.db"), listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0", tasks=TASKS, rescoring_workers=0,
        bundles_per_minute=10_000, pulls_per_minute=10_000,
        spot_checks={"models": [MODEL], "probation_rate": 1.0, "established_rate": 1.0,
                     "tolerance_nats": 1e9, "min_tokens": 1, "budget_s": 120}))
    server.start()
    checker = server.ctx.spot_checks
    assert checker is not None
    records: list[dict] = []
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "XDG_CONFIG_HOME": str(args.out / "config")}
        cmd = [sys.executable, "-m", "ftis.client.cli.main", "start",
               "--coordinator", server.address, "--out", str(args.out / "client"),
               "--key-file", str(args.out / "client" / "node_key.pem"),
               "--rounds", str(args.rounds), *CLIENT_ARGS]
        t0 = time.monotonic()
        with open(args.out / "client.log", "wb") as log:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
        print(f"client: exit {code} after {time.monotonic() - t0:.0f} s", flush=True)
        for version, d in list(checker.recent):
            records.append({"kind": "honest", "policy_version": version, "tokens": d.tokens,
                            "mean_abs": d.mean_abs, "mean_signed": d.mean_signed,
                            "max_abs": d.max_abs, "correlation": d.correlation})

        # fabricated bundles: leases from the same coordinator, answers computed
        policy = load_policy(MODEL)
        (key,) = load_models([MODEL])
        assert key == HeldModel.of_card(policy.card)
        channel = grpc.insecure_channel(server.address)
        node = Node(NodeIdentity.generate(), swarm_pb2_grpc.SwarmStub(channel), policy.card)
        assert node.register().error.code == 0
        tok = policy.tokenizer
        fabricated: list[tuple[int, str, list[float]]] = []
        for i in range(args.tasks):
            (lease,) = node.lease()
            prompt, _ = policy.prompt_token_ids([{"role": m.role, "content": m.content}
                                                 for m in lease.messages])
            text = f"The answer is {answer_of(lease)}.<|im_end|>"
            ids = tok(text, add_special_tokens=False)["input_ids"]
            (true,) = recompute_logprobs(key, prompt, [ids], 0.7, 1.0, 0)
            digits = [any(ch.isdigit() for ch in tok.decode([t])) for t in ids]
            fabricated.append((i, text, true, digits))
        pooled = statistics.median(x for _, _, true, _ in fabricated for x in true)
        for i, text, true, digits in fabricated:
            claims = {"constant_-0.7": [-0.7] * len(true),
                      "global_best_constant": [pooled] * len(true),
                      "bundle_best_constant": [statistics.median(true)] * len(true),
                      # a guess with structure: answer digits unlikely, the template likely
                      "heuristic_digits": [-1.5 if dg else -0.1 for dg in digits]}
            for name, claim in claims.items():
                d = logprob_discrepancy([claim], [true])
                records.append({"kind": "fabricated", "claim": name, "task": i,
                                "tokens": d.tokens, "mean_abs": d.mean_abs,
                                "mean_signed": d.mean_signed, "max_abs": d.max_abs,
                                "correlation": d.correlation, "text": text})
        records += _bfloat16_records(policy, key, node, args.bf16_tasks)
        channel.close()
    finally:
        server.stop(grace=1.0)
    header = {"kind": "config", "date": dt.datetime.now().isoformat(timespec="seconds"),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       capture_output=True, text=True).stdout.strip(),
              "model": MODEL, "rounds": args.rounds, "client_args": CLIENT_ARGS,
              "load_avg": list(os.getloadavg())}
    out_json.parent.mkdir(parents=True, exist_ok=True)
    with open(out_json, "w") as fh:
        for rec in [header, *records]:
            fh.write(json.dumps(rec) + "\n")
    summarize(records)
    print(f"raw: {out_json}")


def _bfloat16_records(policy, key, node, n: int) -> list[dict]:
    """Honest bundles at policy version 0 from a bfloat16 copy of the held weights (a GPU
    volunteer's compute dtype), checked against the float32 weights."""
    import copy

    import torch

    from ftis.client.rollout.sampler import SamplingSettings, sample_groups
    from ftis.coordinator.spot_check import logprob_discrepancy
    from ftis.coordinator.spot_check_worker import recompute_logprobs

    model = copy.deepcopy(policy.model).to(torch.bfloat16)
    settings = SamplingSettings(temperature=0.7, max_new_tokens=32)
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        (lease,) = node.lease()
        prompt, _ = policy.prompt_token_ids([{"role": m.role, "content": m.content}
                                             for m in lease.messages])
        group = sample_groups(model, [prompt], 8, settings, policy.eos_token_ids,
                              policy.tokenizer.pad_token_id, gen).completions[0]
        true = recompute_logprobs(key, prompt, [c.token_ids for c in group], 0.7, 1.0, 0)
        d = logprob_discrepancy([c.logprobs for c in group], true)
        out.append({"kind": "honest_bf16", "policy_version": 0, "task": i,
                    "tokens": d.tokens, "mean_abs": d.mean_abs, "mean_signed": d.mean_signed,
                    "max_abs": d.max_abs, "correlation": d.correlation})
    return out


def summarize(records: list[dict]) -> None:
    honest = [r for r in records if r["kind"] == "honest"]
    by_version: dict[int, list[float]] = {}
    for r in honest:
        by_version.setdefault(r["policy_version"], []).append(r["mean_abs"])
    corr: dict[int, list[float]] = {}
    for r in honest:
        corr.setdefault(r["policy_version"], []).append(r.get("correlation", 1.0))
    print("honest bundles: policy version, n, mean-|d| median / max (nats/token), "
          "correlation min")
    for v in sorted(by_version):
        xs = by_version[v]
        print(f"  {v:3d} {len(xs):3d} {statistics.median(xs):.4f} / {max(xs):.4f}  "
              f"{min(corr[v]):.3f}")
    bf16 = [r["mean_abs"] for r in records if r["kind"] == "honest_bf16"]
    if bf16:
        print(f"honest bfloat16 at version 0: n {len(bf16)}, mean-|d| median "
              f"{statistics.median(bf16):.4f} max {max(bf16):.4f}")
    fab = [r for r in records if r["kind"] == "fabricated"]
    for claim in sorted({r["claim"] for r in fab}):
        xs = [r["mean_abs"] for r in fab if r["claim"] == claim]
        cs = [r.get("correlation", 0.0) for r in fab if r["claim"] == claim]
        print(f"fabricated {claim}: n {len(xs)}, mean-|d| min {min(xs):.3f} median "
              f"{statistics.median(xs):.3f} nats/token; correlation max {max(cs):.3f} "
              f"median {statistics.median(cs):.3f}")


if __name__ == "__main__":
    main()
