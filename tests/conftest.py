"""Shared fixtures: tiny random models with real BPE tokenizers, offline hub settings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# tests/ on sys.path so tests share script_loader.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A real PostgreSQL server (fixtures postgres_server, postgres_url, postgres_database),
# started once per session by the tests that ask for it.
pytest_plugins = ["ftis.coordinator.testing.postgres"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Directory of a tiny random Llama (vocab ~300) that loads like any HF model."""
    from ftis.client.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def tiny_policy_factory(tiny_model_dir):
    from ftis.client.models.loader import load_policy

    def make(peft: str = "none"):
        import torch

        torch.manual_seed(0)
        return load_policy(str(tiny_model_dir), peft=peft)

    return make
