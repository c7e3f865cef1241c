"""Is a partner's pre-phase reproducible? Re-run one seed's pre-phase into a scratch
folder and compare it with the one a run already made.

    python experiments/checks/prephase_rerun.py --config experiments/ftis_drifted_partner.json \
        --run runs/ftis_methods --seed 0 --scratch /tmp/prephase_rerun

Prints the sha256 of the final checkpoint's weights and AdamW state on both sides and
whether the per-round mean rewards agree. Run it from the checkout that made the run
(the pinned worktree for E.0d), on the same kind of machine: another CPU may round
differently. Exit code 0 when both files and all rewards are identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from ftis.lab.experiment.matrix import ExperimentConfig, run_pretrain
from ftis.lab.experiment.report import read_metrics


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _rewards(checkpoints: Path) -> list[float]:
    return [rec["reward_mean"] for rec in read_metrics(checkpoints.parent / "metrics.jsonl")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--run", type=Path, required=True, help="the run's --out folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scratch", type=Path, required=True, help="where the rerun goes")
    a = ap.parse_args()
    cfg = ExperimentConfig.load(a.config)
    same = True
    for pairing in cfg.pairings:
        for k, role in enumerate(pairing.clients):
            if role.pretrain is None:
                continue
            name = f"{pairing.name}__{role.name}__s{a.seed}"
            ref = a.run / "pretrain" / name / role.name / "checkpoints"
            new = run_pretrain(cfg, pairing.name, k, role, a.seed, a.scratch)
            step = (ref / "latest").read_text().strip()
            print(f"{name}: {step}")
            for file in ("trainable.safetensors", "optimizer.safetensors"):
                x, y = _sha(ref / step / file), _sha(new / step / file)
                print(f"  {file}: run {x[:16]}  rerun {y[:16]}  "
                      f"{'identical' if x == y else 'DIFFERENT'}")
                same &= x == y
            r_ref, r_new = _rewards(ref), _rewards(new)
            print(f"  round mean rewards ({len(r_ref)} rounds): "
                  f"{'identical' if r_ref == r_new else 'DIFFERENT'}")
            same &= r_ref == r_new
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
