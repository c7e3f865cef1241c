"""The coordinator's config: naming audit seed nodes turns audit-based probation on
unless the operator set it; everything else stays as set."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftis.coordinator.config import AUDIT_REPORTERS_WITH_SEEDS, load_config
from ftis.coordinator.reputation import ReputationConfig, audit_bootstrap_problem


@pytest.mark.parametrize("toml, expected", [
    ("", 0),  # no bootstrap: off (nobody could pass an audit)
    ('audit_seed_nodes = ["a" ]', AUDIT_REPORTERS_WITH_SEEDS),
    ('[spot_checks]\nmodels = ["smollm2-135m"]', 0),  # held weights alone: as set
    ('audit_seed_nodes = ["a"]\n[reputation]\nprobation_bundles = 3',
     AUDIT_REPORTERS_WITH_SEEDS),  # other reputation settings keep the default on
    ('audit_seed_nodes = ["a"]\n[reputation]\naudit_reporters = 0', 0),  # explicit wins
    ('[reputation]\naudit_reporters = 3\n[spot_checks]\nmodels = ["x"]', 3),
])
def test_audit_is_on_by_default_when_the_config_names_seed_nodes(
        tmp_path: Path, toml: str, expected: int) -> None:
    path = tmp_path / "c.toml"
    path.write_text(toml + "\n")
    cfg = load_config(path)
    assert cfg.reputation.audit_reporters == expected
    assert cfg.reputation.probation_bundles == (3 if "probation_bundles" in toml else 5)
    # what the default turns on always has its bootstrap
    seeds = len(cfg.audit_seed_nodes)
    assert audit_bootstrap_problem(cfg.reputation, seeds, cfg.spot_checks.enabled, 0) is None


def test_overrides_and_objects_are_taken_as_given() -> None:
    assert load_config(audit_seed_nodes=["a"]).reputation.audit_reporters == 2
    got = load_config(audit_seed_nodes=["a"], reputation=ReputationConfig(audit_reporters=0))
    assert got.reputation.audit_reporters == 0
    assert load_config(audit_seed_nodes=["a"],
                       reputation={"audit_reporters": 1}).reputation.audit_reporters == 1
