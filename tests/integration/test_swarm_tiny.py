"""A real coordinator process and two real client processes (full fine-tune and LoRA of
the same tiny random model) over loopback: bundles flow, are verified, relayed and
learned from; a stopped client resumes from its checkpoint with the same identity."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ftis.lab.experiment.launcher import ClientSpec, launch, start_client
from ftis.lab.experiment.report import read_metrics

pytestmark = pytest.mark.integration

ROUNDS, LOCAL, EXTERNAL, G = 3, 3, 3, 8


def _admin(admin: str, *args: str) -> dict | list:
    out = subprocess.run(
        [sys.executable, "-m", "ftis.coordinator.admin_cli.main", "--admin", admin, *args,
         "--json"], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_two_clients_train_together_and_resume(tmp_path, tiny_model_dir):
    # letter_counting: random tiny models get partial credit often enough that groups
    # have reward variance, so relayed groups actually reach the learners.
    config = tmp_path / "coordinator.json"
    config.write_text(json.dumps({"tasks": [{"dataset": "letter_counting"}], "task_seed": 1}))
    common = ["--model", str(tiny_model_dir), "--rounds", str(ROUNDS), "--local-groups", str(LOCAL),
              "--external-groups", str(EXTERNAL), "--group-size", str(G), "--max-new-tokens", "12",
              "--method", "ftis"]
    specs = [ClientSpec("full", [*common, "--peft", "none", "--learning-rate", "1e-3",
                                 "--seed", "1"]),
             ClientSpec("lora", [*common, "--peft", "lora", "--learning-rate", "1e-2",
                                 "--seed", "2"])]
    swarm = launch(tmp_path / "swarm", specs, coordinator_args=["--config", str(config)])
    try:
        codes = swarm.wait_clients(timeout_s=300)
        logs = {n: (tmp_path / "swarm" / "logs" / f"{n}.log").read_text() for n in codes}
        assert codes == {"full": 0, "lora": 0}, logs

        runs = {n: read_metrics(tmp_path / "swarm" / n / "metrics.jsonl") for n in codes}
        for name, recs in runs.items():
            assert [r["round"] for r in recs] == [1, 2, 3], name
            # process start -> policy loaded, logged once per process (its first round)
            assert recs[0]["startup_seconds"] > 0 and "startup_seconds" not in recs[1]
            for r in recs:
                assert r["bundles_submitted"] == LOCAL
                assert 0.0 <= r["reward_mean"] <= 1.0
                assert "claimed_reward_mean" not in r  # honest nodes claim no rewards
                assert r["generated_tokens"] > 0 and r["tokens_per_second"] > 0
            assert (tmp_path / "swarm" / name / "checkpoints" / "latest").read_text() \
                == "step-000003"
        used = sum(r["external_groups_used"] for recs in runs.values() for r in recs)
        assert used > 0, f"no external group reached a learner: {runs}"
        node_ids = {recs[0]["node_id"] for recs in runs.values()}
        assert len(node_ids) == 2

        stats = _admin(swarm.admin, "stats")
        assert int(stats["nodes"]) == 2
        assert int(stats["bundles_accepted"]) == 2 * ROUNDS * LOCAL
        assert int(stats["bundles_rejected"]) == 0
        assert int(stats["completions"]) == 2 * ROUNDS * LOCAL * G
        bundles = _admin(swarm.admin, "bundles", "list", "--limit", "100")
        bundles = bundles["bundles"] if isinstance(bundles, dict) else bundles
        assert len(bundles) == 2 * ROUNDS * LOCAL
        assert {b["node_id"] for b in bundles} == node_ids

        # restart the full client for one more round: it resumes, keeps its node id
        swarm.clients.clear()
        resumed = ClientSpec("full", [*common[:2], "--rounds", str(ROUNDS + 1), *common[4:],
                                      "--peft", "none", "--learning-rate", "1e-3"])
        proc = start_client(swarm, resumed)
        assert proc.wait(120) == 0
        log = (tmp_path / "swarm" / "logs" / "full.log").read_text()
        assert "resumed from round 3" in log
        recs = read_metrics(tmp_path / "swarm" / "full" / "metrics.jsonl")
        assert [r["round"] for r in recs] == [1, 2, 3, 4]
        assert recs[-1]["node_id"] == runs["full"][0]["node_id"]
        assert int(_admin(swarm.admin, "stats")["nodes"]) == 2
    finally:
        swarm.stop()
