"""Every attacker as a real process against a real coordinator, next to two honest tiny
clients (CI version of ``ftis-lab security-experiment``: eight attackers share one
swarm to
keep it under two minutes on two cores; process start-up dominates).

Asserted: no honest node is ever quarantined or banned and none of their bundles is
rejected; each attacker is banned or quarantined, or every one of its bad bundles /
requests is rejected with the expected code (for the log-prob forgers, which the
coordinator cannot see, its bundles must at least be flagged by receivers' feedback);
no attacker bundle stored while it was quarantined reaches an honest learner.
"""

from __future__ import annotations

import json

import pytest

from ftis.lab.experiment.security import SecuritySettings, run_security_experiment

pytestmark = pytest.mark.integration

ROUNDS = 4
#: one swarm: 2 honest + 8 attackers = 10 registrations, the per-host quota per minute on
#: loopback. Left to the full experiment: logprob_inflate (bounded like deflate, and only
#: shrinks its own influence) and flooder (it saturates both CPU cores); replay_frame is
#: a known gap (xfail in tests/unit/test_attacks_unit.py).
GROUPS = [["text_mismatch", "fabricated_prompt", "replay", "reward_liar", "garbage",
           "logprob_deflate", "sybil_burst", "false_reporter"]]
#: caught by the coordinator alone: banned on the first signed inconsistent bundle
PROOF = {"text_mismatch": "TEXT_MISMATCH", "fabricated_prompt": "PROMPT_MISMATCH"}


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("security")
    settings = SecuritySettings(
        out=out, groups=GROUPS, rounds=ROUNDS, model=str(tiny_model_dir), baseline=False,
        timeout_s=240,
        attack_args={"sybil_burst": ["--sybils", "40"],
                     # foreign replays frame their victim: a known gap, tested in
                     # tests/unit/test_attacks_unit.py (xfail)
                     "replay": ["--replay-foreign", "0"]})
    records = run_security_experiment(settings)
    return out, {r["kind"]: r for r in records}


def test_outputs_written(results):
    out, recs = results
    assert set(recs) == {k for g in GROUPS for k in g}
    assert (out / "results.md").read_text().count("\n|") >= len(recs) + 1
    assert (out / "rewards.png").stat().st_size > 1000
    lines = (out / "results.jsonl").read_text().splitlines()
    assert {json.loads(line)["kind"] for line in lines} == set(recs)


def test_no_false_positives(results):
    _, recs = results
    for kind, r in recs.items():
        assert r["false_positives"] == 0, (kind, r["false_positive_nodes"])
        assert r["honest_rejected_bundles"] == 0, kind
        honest_codes = {n: c for n, c in r["exit_codes"].items() if n.startswith("honest")}
        assert set(honest_codes.values()) == {0}, (kind, honest_codes)


@pytest.mark.parametrize("kind", sorted(PROOF))
def test_signed_inconsistent_bundles_get_banned(results, kind):
    r = results[1][kind]
    assert r["banned_end"], r
    assert r["codes"].get(PROOF[kind], 0) >= 1, r["codes"]
    assert r["accepted"] == 0 and r["attacker_groups_learned"] == 0


def test_reward_liar_quarantined_and_never_learned_from(results):
    r = results[1]["reward_liar"]
    assert r["verdict"] in ("quarantined", "banned"), r
    assert r["reputation_end"] < 0.3
    # quarantined from its first bundle on: nothing it stored may reach a learner
    assert r["attacker_groups_learned"] == 0


def test_replay_rejected_or_banned(results):
    r = results[1]["replay"]
    assert r["codes"].get("BUNDLE_REPLAYED", 0) >= 1, r["codes"]
    # a verbatim copy under its own lease carries a foreign prompt: proof, ban
    assert r["banned_end"] or r["codes"].get("PROMPT_MISMATCH", 0) == 0, r


def test_garbage_rejected_with_codes(results):
    r = results[1]["garbage"]
    assert r["accepted"] == 0
    assert {"PAYLOAD_MALFORMED", "PAYLOAD_TYPE_INVALID", "SIGNATURE_INVALID",
            "ENVELOPE_MALFORMED", "AUTH_INVALID", "AUTH_EXPIRED"} <= set(r["codes"]), r["codes"]


def test_sybil_burst_throttled(results):
    r = results[1]["sybil_burst"]
    assert r["codes"].get("register:REGISTRATION_THROTTLED", 0) > 0, r["codes"]
    assert r["sybils_admitted"] <= 10, r  # the per-host registration quota per minute


def test_false_reports_do_not_hurt_honest_nodes(results):
    r = results[1]["false_reporter"]
    assert r["evidence_kinds"].get("false_report", 0) >= 1, r["evidence_kinds"]
    assert r["false_positives"] == 0


def test_logprob_forger_flagged_by_receivers(results):
    r = results[1]["logprob_deflate"]
    # the coordinator cannot check sampler log-probs; receivers that learned from the
    # forged groups must report them (negative feedback evidence)
    if r["attacker_groups_learned"]:
        assert r["negative_feedback"] >= 1, r


def test_no_quarantined_bundle_reaches_honest_learners(results):
    for kind, r in results[1].items():
        if r["released"]:
            # a node released from quarantine (e.g. at the end of probation) may have
            # bundles stored while quarantined relayed afterwards: the relay filters on
            # the sender's standing at pull time (docs/security-results.md, gaps)
            continue
        assert r["quarantined_bundles_learned"] == 0, kind
