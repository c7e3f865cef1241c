"""``bench/coordinator_load.py`` (``make bench-coordinator``) for ~2 s against a real
coordinator subprocess (SQLite) with N = 2 volunteers: bundles verified, nothing
rejected, the table and the machine-readable last line well formed."""

from __future__ import annotations

import math
import re

import pytest
from script_loader import load_script


@pytest.fixture
def bench():
    """``bench/coordinator_load.py`` as a module (skipped without the embedded model)."""
    from ftis.client.models.registry import ModelNotFoundError, resolve

    try:
        resolve("smollm2-135m")
    except ModelNotFoundError as exc:
        pytest.skip(f"needs the embedded SmolLM2 package (make setup): {exc}")
    return load_script("bench/coordinator_load.py")


def _run(bench, capsys, *args: str) -> tuple[list, list[str]]:
    """``bench.main`` with N = 2 volunteers, 0.5 s warm-up and ``args``: its runs and its
    output lines (asserting it exited 0)."""
    results: list = []
    code = bench.main(["--volunteers", "2", "--warmup", "0.5", *args], results)
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0, lines[-15:]
    return results, lines


def test_two_volunteers_for_two_seconds(bench, capsys):
    results, lines = _run(bench, capsys, "--seconds", "2", "--configs", "sqlite",
                          "--repeats", "1")
    (r,) = results
    assert r.n == 2 and r.config == "sqlite, 1 worker"
    assert r.verified > 0 and r.bundles_per_s > 0
    assert not r.errors and not r.notes, (r.errors, r.notes)
    # every RPC of the loop completed in the window, the two volunteers relay each other
    assert all(r.latencies[rpc] for rpc in ("LeaseTasks", "SubmitBundle", "PullBundles"))
    assert r.relayed > 0
    assert r.coord_rss_mb > 0 and r.coord_cpu_pct > 0
    assert "errors: none" in [line.strip() for line in lines]
    m = re.fullmatch(r"bundles_per_s=(\d+\.\d+) p99_submit_ms=(\d+\.\d+)", lines[-1])
    assert m, lines[-1]
    assert float(m[1]) == pytest.approx(r.bundles_per_s, abs=0.01)
    assert float(m[2]) == pytest.approx(r.p("SubmitBundle", 99), abs=0.1)
    cpu = re.fullmatch(r"# CPU per verified bundle: coord_ms_per_bundle=(\d+\.\d+) "
                       r"gen_ms_per_bundle=(\d+\.\d+)", lines[-2])
    assert cpu, lines[-2]
    assert float(cpu[1]) == pytest.approx(r.coord_cpu_pct * 10 / r.bundles_per_s, abs=1e-3)
    assert float(cpu[2]) == pytest.approx(r.gen_cpu_pct * 10 / r.bundles_per_s, abs=1e-3)


def test_the_generator_remembers_prompts_exactly(bench):
    """The generator tokenizes each distinct chat once; what it reuses is exactly the
    client's ``Policy.prompt_token_ids`` of that chat."""
    node = load_script("bench/coordinator_load_node.py")
    material = node.Material.build(group_size=2, tokens=16)
    swarm_pb2 = node.swarm_pb2
    leases = []
    for q in ("What is 2 + 3?", "What is 7 * 6?", "What is 2 + 3?"):
        lease = swarm_pb2.TaskLease(lease_id="l", task_id="t", question=q)
        lease.messages.add(role="user", content=q)
        leases.append(lease)
    got = [material.prompt(x) for x in leases]
    want = [material.policy.prompt_token_ids([{"role": "user", "content": x.question}])
            for x in leases]
    assert got == want and got[0] is got[2] and len(material._prompts) == 2  # noqa: SLF001
    assert list(material.bundle("n", leases[1]).prompt_token_ids) == want[1][0]


def test_the_floor_is_a_reference_not_a_result(bench, capsys):
    """``--configs floor,sqlite:2``: the floor (the listener with canned replies) serves
    the same loop without errors, faster than the real coordinator; each served
    configuration is printed as a share of it, and the last line is the served one's."""
    results, lines = _run(bench, capsys, "--seconds", "2", "--configs", "floor,sqlite:2",
                          "--repeats", "1")
    floor, served = results
    assert floor.config.startswith("floor") and served.config == "sqlite, 2 workers"
    for r in results:
        assert r.verified > 0 and not r.errors and not r.notes, (r.config, r.errors, r.notes)
    assert floor.relayed > 0  # its relay pages carry the submitted envelopes
    assert floor.bundles_per_s > served.bundles_per_s
    share = [line for line in lines if line.startswith("# share of the floor")]
    assert share == [f"# share of the floor at N=2: sqlite, 2 workers: "
                     f"{served.bundles_per_s / floor.bundles_per_s:.3f} "
                     f"({served.bundles_per_s:.1f} / {floor.bundles_per_s:.1f} bundles/s)"]
    assert lines[-1].startswith(f"bundles_per_s={served.bundles_per_s:.2f} ")


def test_repeats_report_the_mean_rate_and_the_pooled_p99(bench, capsys):
    """``--repeats 2``: the best configuration runs once more on a fresh database; the
    summary line gives both rates' mean and t-interval, and the last two lines are over
    both runs (mean rate, p99 of the pooled SubmitBundle latencies, CPU of both runs
    per bundle of both runs)."""
    results, lines = _run(bench, capsys, "--seconds", "1.5", "--configs", "sqlite",
                          "--repeats", "2")
    first, second = results
    assert first.config == second.config == "sqlite, 1 worker" and first.n == second.n == 2
    assert second.verified > 0 and not second.errors and not second.notes
    assert "== repeats: sqlite, 1 worker, N=2" in lines
    rates = [first.bundles_per_s, second.bundles_per_s]
    mean = sum(rates) / 2
    half = 12.706 * abs(rates[0] - rates[1]) / 2  # t(0.975, 1) * sd / sqrt(2)
    summary = [line for line in lines if line.startswith("# repeats of ")]
    assert summary == [bench.repeats_line(results)]
    assert f"mean {mean:.1f} [{mean - half:.1f}, {mean + half:.1f}] (95 % t)" in summary[0]
    assert summary[0].endswith(" of 2")
    pooled = sorted(first.latencies["SubmitBundle"] + second.latencies["SubmitBundle"])
    p99 = pooled[math.ceil(0.99 * len(pooled)) - 1] * 1000
    m = re.fullmatch(r"bundles_per_s=(\d+\.\d+) p99_submit_ms=(\d+\.\d+)", lines[-1])
    assert m, lines[-1]
    assert float(m[1]) == pytest.approx(mean, abs=0.01)
    assert float(m[2]) == pytest.approx(p99, abs=0.1)
    cpu = re.fullmatch(r"# CPU per verified bundle: coord_ms_per_bundle=(\d+\.\d+) "
                       r"gen_ms_per_bundle=(\d+\.\d+)", lines[-2])
    assert cpu, lines[-2]
    coord_ms = sum(r.coord_cpu_pct / 100 * r.seconds for r in results) * 1000 / (
        first.verified + second.verified)
    assert float(cpu[1]) == pytest.approx(coord_ms, abs=1e-3)


def test_a_lease_count_of_three_leases_once_per_three_bundles(bench, capsys):
    """``--lease-count 3``: each volunteer calls LeaseTasks(count=3) only when it holds no
    lease and answers one lease per loop, so the window holds about a third as many
    LeaseTasks calls as SubmitBundle calls, every bundle verified and nothing refused
    (an answered or unknown lease would be refused)."""
    results, lines = _run(bench, capsys, "--seconds", "2", "--configs", "sqlite",
                          "--repeats", "1", "--lease-count", "3")
    (r,) = results
    assert r.verified > 6 and not r.errors and not r.notes, (r.errors, r.notes)
    leases, submits = len(r.latencies["LeaseTasks"]), len(r.latencies["SubmitBundle"])
    # two volunteers, each at most one lease call ahead of or behind its thirds
    assert submits / 3 - 2 <= leases <= submits / 3 + 2, (leases, submits)
    assert any("LeaseTasks count=3," in line for line in lines)
