"""Soak: one tiny-model ``ftis-client start`` against a local coordinator for an hour.

The complaints volunteers of peer swarms make most are OOM kills and nodes that die or
hang after a few hours. This benchmark runs one real client process (a tiny random
Llama built by :mod:`ftis.client.models.tiny`, full fine-tune, ``--rounds 0``: until
stopped) against a real coordinator process (SQLite file, ``letter_counting`` tasks)
for ``--minutes`` (default 60) and records, into one JSONL file:

* ``{"kind": "sample", ...}`` every ``--sample-s`` seconds (default 5): the client
  process's resident set size (``rss_mib``, MiB), open file descriptors (``fds``),
  threads, cumulative CPU seconds (``cpu_s``) and rounds finished (``rounds``), the
  coordinator's RSS and fds (``coord_rss_mib``, ``coord_fds``) and the load average;
* ``{"kind": "round", ...}`` for every round the client finished (read from its
  ``metrics.jsonl``): ``round_seconds`` (the client's own timer: heartbeat, lease,
  generation, submissions, pull, learner step) and ``interval_s`` (wall seconds since
  the previous round ended, checkpoint and metrics report included);
* a first ``config`` line and a last ``summary`` line.

The reference is measured in the same run: after ``--warmup-min`` minutes (excluded:
allocator pools, caches and the first checkpoints settle), the measured span is cut
into quarters; the first quarter is the reference. Per metric the summary gives the
first- and last-quarter medians and the least-squares slope per hour over the whole
measured span, and calls the metric flat when

* the slope is at most the tolerance per hour, and
* the last-quarter median exceeds the first by at most the same tolerance,

with tolerances (:data:`TOLERANCES`) of 2 % of the reference median per hour for RSS,
10 % for round time and 1 descriptor per hour for open fds (a constant count is
expected; any steady growth is a leak). The verdict (:data:`VERDICT`) is over the RSS
floor and the fd floor, the smallest value of the past minute (:data:`FLOOR_S`: what is
taken and given back within a round flickers in and out of the samples, a leak raises
the floor), and CPU seconds per round over the past minute (``round_cpu_s``); the RSS
samples, the RSS peak of the past minute and wall-clock ``round_seconds`` are reported
beside them. Only growth counts: a falling metric is flat.

CPU seconds per round also follow the machine: on a shared 2-core machine the same work
costs more CPU time while other processes compete for caches and memory bandwidth (the
hour-long run of 2026-11-24 had a correlation of 0.47 between the client's CPU per round
and the load average). So a **probe** process (``--probe``) does a fixed amount of the
same kind of work, a forward and backward pass of the same tiny model on a fixed batch
on one thread, every :data:`PROBE_PERIOD_S` seconds, and records its CPU seconds
(``{"kind": "probe", ...}`` lines). ``round_cpu_rel`` is the client's CPU seconds per
round divided by the median probe CPU seconds of the same minute: machine contention
raises both and cancels; a client that does more work per round raises only the first.
When probes were recorded, the verdict is over ``round_cpu_rel`` and ``round_cpu_s`` is
reported beside it; runs without probes keep ``round_cpu_s`` in the verdict.

``--analyze JSONL`` prints the summary of an earlier run. The last line is ``verdict:
flat`` or ``verdict: GROWING (...)``; the exit status is 0 when flat, 1 when not, 2 when
the client, the coordinator or the probe died during the run.

Usage: python bench/soak.py [--minutes 60] [--sample-s 5] [--warmup-min 2]
       [--out runs/soak] [--json bench/results/soak-DATE.jsonl] [--analyze JSONL]
       python bench/soak.py --probe MODEL_DIR OUT.jsonl   (the probe process alone)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Largest growth still called flat: (per hour, relative to the reference median?) per
#: metric. RSS 2 %/h and round time 10 %/h of the first quarter's median; fds 1/h.
TOLERANCES: dict[str, tuple[float, bool]] = {
    "rss_floor_mib": (0.02, True),
    "fds": (1.0, False),
    "round_cpu_s": (0.10, True),
    "round_cpu_rel": (0.10, True),
    "rss_mib": (0.02, True),
    "rss_peak_mib": (0.02, True),
    "round_seconds": (0.10, True),
}
#: Metrics the verdict is over; the others are reported beside them. RSS is bimodal
#: (about 640 MiB between rounds, up to 760 inside a learner step) and a sample lands
#: in either, so its median jumps between the two modes (+-10 MiB from one 3-minute
#: block to the next in the hour-long run); the floor, the smallest RSS of the past
#: minute, is what a leak raises. Wall-clock round time follows the other processes'
#: load on a shared machine (a 10-minute run here went from 1.08 to 1.44 s per round in
#: generation and learner compute alone while the load average went from 5 to 8); CPU
#: seconds per round do not.
VERDICT = ("rss_floor_mib", "fds", "round_cpu_s")
#: The verdict when probe records exist: CPU per round relative to the probe's.
VERDICT_PROBED = ("rss_floor_mib", "fds", "round_cpu_rel")
#: Seconds between two probe passes, and the probe's batch (rows x tokens): about
#: 0.1 s of one core for the default tiny model, a few per cent of the machine.
PROBE_PERIOD_S = 5.0
PROBE_BATCH = (8, 64)
#: Seconds over which CPU seconds per round are averaged (rounds take about 1 s).
CPU_WINDOW_S = 60.0

#: The client's shape: rounds of about a second on one CPU thread, each with a
#: heartbeat, 4 leases and bundles (8 completions of 32 tokens), a pull, a learner step
#: when some group has reward variance, a metrics report and a checkpoint. The learning
#: rate is tiny on purpose: the policy stays (nearly) the random one, so completion
#: lengths and the share of rounds with a learner update stay stationary and round time
#: can be compared across the hour (at 1e-3 the tiny model learns to give up the partial
#: credit within minutes and rounds get 3x faster; measured in the first short run).
CLIENT_ARGS = ["--rounds", "0", "--local-groups", "4", "--external-groups", "2",
               "--group-size", "8", "--max-new-tokens", "32", "--method", "ftis",
               "--peft", "none", "--learning-rate", "1e-7", "--seed", "1",
               "--checkpoint-every", "1"]
#: Quotas above a tiny model's rate (the production defaults assume real models).
COORDINATOR_CONFIG = {
    "tasks": [{"dataset": "letter_counting"}], "task_seed": 1,
    "bundles_per_minute": 1e6, "pulls_per_minute": 1e6, "reports_per_minute": 1e6,
}


#: Seconds over which floors (and peaks) of RSS and open fds are taken: descriptors and
#: memory taken and given back within a round (a checkpoint file, a learner step)
#: flicker in and out of samples; a leaked one raises the floor.
FLOOR_S = 60.0

# ------------------------------------------------------------------ analysis (pure)


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(seconds, value)`` points, in value units per hour.

    Returns 0.0 for fewer than two distinct times.
    """
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    cov = sum((t - mt) * (v - mv) for t, v in points)
    return cov / var * 3600.0


@dataclass(frozen=True)
class Trend:
    """One metric over the measured span.

    Attributes:
        metric: its name (a key of :data:`TOLERANCES`).
        n: points measured (after warm-up).
        first, last: medians of the first and the last quarter of the span.
        slope_per_h: least-squares slope over the span, units per hour.
        tolerance: largest growth called flat, units per hour (and between the medians).
        flat: ``slope_per_h <= tolerance`` and ``last - first <= tolerance``.
    """

    metric: str
    n: int
    first: float
    last: float
    slope_per_h: float
    tolerance: float
    flat: bool


def trend(metric: str, points: list[tuple[float, float]], start_s: float, end_s: float
          ) -> Trend:
    """:class:`Trend` of ``(seconds, value)`` points measured in ``[start_s, end_s]``.

    The tolerance is :data:`TOLERANCES` ``[metric]``, relative ones times the first
    quarter's median.

    Raises:
        ValueError: a quarter holds no point (run too short for ``--sample-s``).
    """
    points = [(t, v) for t, v in points if start_s <= t <= end_s]
    q = (end_s - start_s) / 4
    head = [v for t, v in points if t <= start_s + q]
    tail = [v for t, v in points if t >= end_s - q]
    if not head or not tail:
        raise ValueError(f"{metric}: no point in the first or last quarter of "
                         f"[{start_s:.0f}, {end_s:.0f}] s")
    first, last = statistics.median(head), statistics.median(tail)
    slope = slope_per_hour(points)
    tol, relative = TOLERANCES[metric]
    tolerance = tol * first if relative else tol
    return Trend(metric, len(points), first, last, slope, tolerance,
                 flat=slope <= tolerance and last - first <= tolerance)


def floor(points: list[tuple[float, float]], window_s: float = FLOOR_S, fn=min
          ) -> list[tuple[float, float]]:  # noqa: ANN001 - min or max
    """Each point's value replaced by the smallest (``fn=max``: largest) value of the
    ``window_s`` seconds up to it (points sorted by time)."""
    out = []
    for i, (t, _) in enumerate(points):
        j = i
        while j > 0 and points[j - 1][0] >= t - window_s:
            j -= 1
        out.append((t, fn(v for _, v in points[j:i + 1])))
    return out


def cpu_per_round(samples: list[dict], window_s: float = CPU_WINDOW_S
                  ) -> list[tuple[float, float]]:
    """``(t, CPU seconds per round)`` over the ``window_s`` seconds up to each sample,
    from the samples' cumulative ``cpu_s`` and ``rounds`` (windows without a finished
    round are skipped)."""
    out, j = [], 0
    for s in samples:
        while samples[j]["t"] < s["t"] - window_s:
            j += 1
        done = s["rounds"] - samples[j]["rounds"]
        if done > 0:
            out.append((s["t"], (s["cpu_s"] - samples[j]["cpu_s"]) / done))
    return out


def relative_to_probe(points: list[tuple[float, float]], probes: list[tuple[float, float]],
                      window_s: float = CPU_WINDOW_S) -> list[tuple[float, float]]:
    """Each ``(t, value)`` divided by the median probe CPU seconds of the ``window_s``
    seconds up to ``t`` (``probes``: ``(t, probe_cpu_s)``, sorted by time); points with
    no probe in their window are skipped. Dimensionless: work per round in units of the
    probe's fixed work, so that machine contention, which slows both, cancels."""
    out = []
    for t, v in points:
        window = [c for tp, c in probes if t - window_s <= tp <= t and c > 0]
        if window:
            out.append((t, v / statistics.median(window)))
    return out


def verdict_metrics(trends: list[Trend]) -> tuple[str, ...]:
    """:data:`VERDICT_PROBED` when ``round_cpu_rel`` was measured, else :data:`VERDICT`."""
    return VERDICT_PROBED if any(tr.metric == "round_cpu_rel" for tr in trends) else VERDICT


def summarize(records: list[dict], warmup_s: float) -> list[Trend]:
    """Trends from ``warmup_s`` seconds to the last record's time ``t``: the verdict's
    (:data:`VERDICT`: RSS floor and fd floor, :func:`floor`; CPU seconds per round,
    :func:`cpu_per_round`; with probe records also ``round_cpu_rel``,
    :func:`relative_to_probe`), then RSS samples, RSS peak and wall-clock round time."""
    samples = sorted((r for r in records if r.get("kind") == "sample"), key=lambda r: r["t"])
    rounds = [r for r in records if r.get("kind") == "round"]
    probes = sorted((r["t"], r["probe_cpu_s"]) for r in records if r.get("kind") == "probe")
    end = max(r["t"] for r in samples + rounds)
    # floors and peaks from measured samples only (not the start-up's)
    measured = [r for r in samples if r["t"] >= warmup_s]
    rss = [(r["t"], r["rss_mib"]) for r in measured]
    trends = [trend("rss_floor_mib", floor(rss), warmup_s, end),
              trend("fds", floor([(r["t"], r["fds"]) for r in measured]), warmup_s, end)]
    if samples and "cpu_s" in samples[0]:
        per_round = cpu_per_round(samples)
        trends.append(trend("round_cpu_s", per_round, warmup_s, end))
        if probes:
            trends.append(trend("round_cpu_rel", relative_to_probe(per_round, probes),
                                warmup_s, end))
    trends += [trend("rss_mib", rss, warmup_s, end),
               trend("rss_peak_mib", floor(rss, fn=max), warmup_s, end),
               trend("round_seconds", [(r["t"], r["round_seconds"]) for r in rounds],
                     warmup_s, end)]
    return trends


def report_lines(trends: list[Trend]) -> list[str]:
    """The summary table and the verdict line (the last)."""
    units = {"rss_floor_mib": "MiB", "rss_mib": "MiB", "rss_peak_mib": "MiB", "fds": "fds",
             "round_cpu_s": "s", "round_cpu_rel": "x", "round_seconds": "s"}
    verdict = verdict_metrics(trends)
    lines = [f"{'metric':<14} {'n':>6} {'first quarter':>14} {'last quarter':>13} "
             f"{'slope/h':>10} {'tolerance/h':>12}  flat"]
    for tr in trends:
        u = units[tr.metric]
        lines.append(f"{tr.metric:<14} {tr.n:>6} {tr.first:>10.3f} {u:<3} {tr.last:>9.3f} "
                     f"{u:<3} {tr.slope_per_h:>+10.3f} {tr.tolerance:>12.3f}  "
                     f"{'yes' if tr.flat else 'NO'}"
                     f"{'' if tr.metric in verdict else ' (not in the verdict)'}")
    growing = [tr.metric for tr in trends if not tr.flat and tr.metric in verdict]
    lines.append("verdict: flat" if not growing else f"verdict: GROWING ({', '.join(growing)})")
    return lines


# ------------------------------------------------------------------ the run


def probe(model_dir: Path, out: Path, period_s: float = PROBE_PERIOD_S) -> None:
    """Run forever: every ``period_s`` seconds one forward and backward pass of the
    model at ``model_dir`` on a fixed :data:`PROBE_BATCH` of token ids, on one thread,
    appending ``{"cpu_s": ..., "wall_s": ...}`` (this process's CPU seconds and the wall
    seconds of the pass) to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows, tokens = PROBE_BATCH
    ids = torch.randint(0, model.config.vocab_size, (rows, tokens))
    with open(out, "a") as fh:
        while True:
            c0, w0 = time.process_time(), time.perf_counter()
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            fh.write(json.dumps({"cpu_s": time.process_time() - c0,
                                 "wall_s": time.perf_counter() - w0}) + "\n")
            fh.flush()
            time.sleep(period_s)


def _proc_sample(proc) -> dict[str, float]:  # noqa: ANN001 - psutil.Process
    with proc.oneshot():
        cpu = proc.cpu_times()
        return {"rss_mib": proc.memory_info().rss / 2**20, "cpu_s": cpu.user + cpu.system,
                "fds": float(proc.num_fds()), "threads": float(proc.num_threads())}


def _new_lines(path: Path, offset: int) -> tuple[list[dict], int]:
    """Complete JSON lines of ``path`` (the client's ``metrics.jsonl``, the probe's
    output) after byte ``offset``; the new offset."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    end = data.rfind(b"\n") + 1
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()], offset + end


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--warmup-min", type=float, default=2.0)
    ap.add_argument("--hidden-size", type=int, default=256,
                    help="of the tiny random Llama (4 heads, intermediate 2x)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "soak")
    ap.add_argument("--json", type=Path, default=None,
                    help="JSONL output (default bench/results/soak-DATE[-short].jsonl)")
    ap.add_argument("--analyze", type=Path, default=None, metavar="JSONL",
                    help="only print the summary of an earlier run's JSONL (its warm-up)")
    ap.add_argument("--probe", type=Path, nargs=2, default=None, metavar=("MODEL_DIR", "OUT"),
                    help="run only the probe process (started by the soak itself)")
    ap.add_argument("--no-probe", action="store_true",
                    help="do not start the probe (the verdict is then over round_cpu_s)")
    args = ap.parse_args(argv)
    if args.probe:
        probe(*args.probe)
        return 0
    if args.analyze:
        records = [json.loads(line) for line in args.analyze.read_text().splitlines()]
        lines = report_lines(summarize(records, records[0]["warmup_min"] * 60))
        print("\n".join(lines))
        return 0 if lines[-1] == "verdict: flat" else 1

    import psutil

    from ftis.client.models.tiny import build_tiny_model
    from ftis.lab.experiment.launcher import ClientSpec, Swarm, start_client, start_coordinator

    day = dt.date.today().isoformat()
    out_json = args.json or ROOT / "bench" / "results" / (
        f"soak-{day}.jsonl" if args.minutes >= 60 else f"soak-{day}-short.jsonl")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    work = args.out
    if work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True)
    # volunteer settings of this machine's user must not pause or throttle the client
    os.environ["XDG_CONFIG_HOME"] = str(work / "config")
    for key in list(os.environ):
        if key.startswith("FTIS_") and key != "FTIS_CACHE_DIR":
            del os.environ[key]
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model_dir = build_tiny_model(work / "tiny-llama", seed=0, hidden_size=args.hidden_size,
                                 num_layers=args.layers)
    config = work / "coordinator.json"
    config.write_text(json.dumps(COORDINATOR_CONFIG))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()

    coord, listen, admin = start_coordinator(work, ["--config", str(config)])
    swarm = Swarm(out=work, coordinator=coord, listen=listen, admin=admin)
    client = start_client(swarm, ClientSpec("client", ["--model", str(model_dir),
                                                       *CLIENT_ARGS]), threads=1)
    probe_out = work / "probe.jsonl"
    prober = None if args.no_probe else subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--probe", str(model_dir),
         str(probe_out)], env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, stderr=open(work / "probe.log", "w"))  # noqa: SIM115
    t0 = time.monotonic()
    header = {"kind": "config", "date": dt.datetime.now().isoformat(timespec="seconds"),
              "commit": commit, "minutes": args.minutes, "sample_s": args.sample_s,
              "warmup_min": args.warmup_min, "hidden_size": args.hidden_size,
              "layers": args.layers, "client_args": CLIENT_ARGS,
              "probe": None if prober is None else {"period_s": PROBE_PERIOD_S,
                                                    "batch": list(PROBE_BATCH)},
              "coordinator_config": COORDINATOR_CONFIG, "cpus": os.cpu_count(),
              "python": platform.python_version(),
              "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    records: list[dict] = []
    died = ""
    pc, pk = psutil.Process(client.pid), psutil.Process(coord.pid)
    metrics, offset, last_time = work / "client" / "metrics.jsonl", 0, None
    probe_offset = 0
    print(f"soak: {args.minutes:g} min, client pid {client.pid}, coordinator {listen}, "
          f"writing {out_json}", flush=True)
    with open(out_json, "w") as fh:
        def emit(rec: dict) -> None:
            records.append(rec)
            fh.write(json.dumps(rec) + "\n")
            fh.flush()

        emit(header)
        next_sample, next_print = t0, t0 + 60
        try:
            while (now := time.monotonic()) - t0 < args.minutes * 60:
                for p, name in ((client, "client"), (coord, "coordinator"),
                                (prober, "probe")):
                    if p is not None and p.poll() is not None:
                        died = f"{name} exited with {p.returncode} (see {work}/logs)"
                if died:
                    break
                new, offset = _new_lines(metrics, offset)
                for m in new:
                    emit({"kind": "round", "t": round(now - t0, 3), "round": m["round"],
                          "round_seconds": m["round_seconds"],
                          "interval_s": None if last_time is None else m["time"] - last_time,
                          "peak_rss_mb": m.get("peak_rss_mb"),
                          "generated_tokens": m.get("generated_tokens"),
                          "updated": m.get("updated"),
                          "learner_seconds": m.get("learner_seconds"),
                          "bundles_rejected": m.get("bundles_rejected", 0.0)})
                    last_time = m["time"]
                passes, probe_offset = _new_lines(probe_out, probe_offset)
                for m in passes:
                    emit({"kind": "probe", "t": round(now - t0, 3), "probe_cpu_s": m["cpu_s"],
                          "probe_wall_s": m["wall_s"]})
                if now >= next_sample:
                    c, k = _proc_sample(pc), _proc_sample(pk)
                    emit({"kind": "sample", "t": round(now - t0, 3), **c,
                          "rounds": sum(r["kind"] == "round" for r in records),
                          "coord_rss_mib": k["rss_mib"], "coord_fds": k["fds"],
                          "load_avg_1m": os.getloadavg()[0]})
                    next_sample += args.sample_s
                if now >= next_print:
                    rounds = sum(r["kind"] == "round" for r in records)
                    print(f"  t={now - t0:6.0f} s  rounds {rounds:5d}  client RSS "
                          f"{c['rss_mib']:.1f} MiB  fds {c['fds']:.0f}", flush=True)
                    next_print += 60
                time.sleep(min(0.5, args.sample_s))
        finally:
            if prober is not None and prober.poll() is None:
                prober.kill()
                prober.wait()
            if client.poll() is None:
                # the client's graceful stop, as a service manager's (SIGINT would be
                # ignored when this benchmark was started in the background by a shell)
                client.send_signal(signal.SIGTERM)
                try:
                    client.wait(60)
                except subprocess.TimeoutExpired:
                    client.kill()
            swarm.stop()
        if died:
            emit({"kind": "summary", "error": died})
            print(f"FAILED: {died}")
            return 2
        trends = summarize(records, args.warmup_min * 60)
        rounds = [r for r in records if r["kind"] == "round"]
        lines = report_lines(trends)
        span = [r for r in rounds if r["t"] >= args.warmup_min * 60]
        q = (span[-1]["t"] - span[0]["t"]) / 4 if span else 0
        head = [r for r in span if r["t"] <= span[0]["t"] + q]
        tail = [r for r in span if r["t"] >= span[-1]["t"] - q]
        updated = [sum(bool(r["updated"]) for r in part) / max(len(part), 1)
                   for part in (head, tail)]
        lines.insert(-1, f"rounds with a learner update: {updated[0]:.0%} in the first "
                         f"quarter, {updated[1]:.0%} in the last")
        emit({"kind": "summary", "rounds": len(rounds), "updated_share": updated,
              "bundles_rejected": sum(r["bundles_rejected"] for r in rounds),
              "client_exit": client.returncode,
              "trends": [tr.__dict__ for tr in trends], "verdict": lines[-1]})
    print(f"{len(rounds)} rounds in {args.minutes:g} min; measured from "
          f"{args.warmup_min:g} min (reference: the first quarter after it)")
    print("\n".join(lines))
    return 0 if lines[-1] == "verdict: flat" else 1


if __name__ == "__main__":
    sys.exit(main())
