"""docs/demo.md's table is regenerated from committed demo reports."""

import json
from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]


def _module():
    return load_script("experiments/summarize_demo.py")


def _report(seed, significant):
    g = {"n": 132, "before": 0.5, "after": 0.75, "gained": 40, "lost": 7, "p_value": 1.2e-6}
    s = {"before": 0.25, "after": 0.5, "ci_low": 0.2, "ci_high": 0.3, "p_value": 5e-5}
    return {"settings": {"seed": seed}, "wall_seconds": 700.4,
            "heldout": {"client": "full", "significant": significant},
            "clients": {"full": {"greedy": g, "sampled": s}, "lora": {"error": "x"}}}


def test_table_rows_from_reports(tmp_path):
    mod = _module()
    for seed, sig in ((1, False), (0, True)):
        (tmp_path / f"seed{seed}").mkdir()
        (tmp_path / f"seed{seed}" / "report.json").write_text(json.dumps(_report(seed, sig)))
    text = "# Demo\n<!-- table:demo -->\nold\n<!-- /table -->\nafter\n"
    out = mod.regenerate(text, tmp_path)
    rows = [line for line in out.splitlines() if line.startswith("| 0") or line.startswith("| 1")]
    # greedy: d = 33/132 = 0.25, se = sqrt(47 - 33**2/132)/132 = sqrt(38.75)/132 = 0.04716
    assert rows[0] == ("| 0 | full | 132 | 0.500 → 0.750 (+40/−7) [+0.158, +0.342] | 1.2e-06 "
                       "| 0.250 → 0.500 [+0.200, +0.300] | 5e-05 | yes | 700 |")
    assert rows[1] == "| 0 | lora | – | – | – | – | – | – | – |"
    assert "| **no** |" in rows[2]
    assert out.endswith("<!-- /table -->\nafter\n") and "old" not in out
    with pytest.raises(ValueError):
        mod.regenerate("no marker", tmp_path)


def test_docs_demo_table_is_current():
    mod = _module()
    text = (ROOT / "docs" / "demo.md").read_text()
    assert mod.regenerate(text) == text
