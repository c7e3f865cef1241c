"""``ftis-client start --device cuda`` end to end: a real coordinator process, the client
CLI in its own process, two rounds on the GPU, bundles accepted.

Skipped without a visible CUDA device, like the rest of ``tests/gpu`` (run there with
``pytest --noconftest tests/gpu``). The tiny random model earns no reward, so every group
has zero variance and no learner step runs: the learner on CUDA is
``test_cuda_learner.py``'s; this test is the command's path (device choice, loading,
generation, submission, checkpoints, metrics).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/serve_process.py
from serve_process import start_serve, stop_serve  # noqa: E402


def test_start_runs_its_rounds_on_the_gpu(tmp_path):
    from ftis.client.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny-llama", seed=0)
    db = tmp_path / "coord.db"
    proc, ready = start_serve(tmp_path, db=db)
    out = tmp_path / "node"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTIS_")}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1")
    try:
        run = subprocess.run(
            [sys.executable, "-m", "ftis.client.cli.main", "start", "--coordinator",
             ready["listen"], "--model", str(model), "--out", str(out), "--key-file",
             str(out / "key.pem"), "--rounds", "2", "--local-groups", "2",
             "--external-groups", "0", "--group-size", "4", "--max-new-tokens", "8"],
            capture_output=True, text=True, env=env, timeout=300)
        said = " ".join((run.stdout + run.stderr).split())
        assert run.returncode == 0, said
        assert ", on cuda" in said  # --device auto chose the GPU
        rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rounds] == [1, 2]
        assert all(r["peak_gpu_mb"] > 0 for r in rounds)
        assert (out / "checkpoints" / "latest").exists()
        # `ftis-client status` reads where the model ran from the node's state file
        assert json.loads((out / "node_state.json").read_text())["device"] == "cuda"
        with sqlite3.connect(db) as con:
            (stored,) = con.execute("SELECT count(*) FROM bundles").fetchone()
        assert stored == 4  # 2 rounds x 2 groups, each verified and stored
    finally:
        stop_serve(proc)
