"""Checkpoints in safetensors (no pickle): trainable weights, AdamW state, RNG, counters.

Layout of ``DIR/checkpoints/``::

    step-000012/trainable.safetensors   trainable parameters by name (full model or LoRA)
    step-000012/optimizer.safetensors   AdamW moments per trainable parameter index
    step-000012/state.json              round, updates, param groups, RNG, relay cursor, ...
    latest                              name of the newest complete checkpoint

A checkpoint is written to a temporary folder, fsynced and renamed, then ``latest`` is
replaced atomically, so a client killed at any moment resumes from the last complete one.

With LoRA or QLoRA only the adapters (and their AdamW moments) are trainable, so only
they are saved: a QLoRA checkpoint never holds the 4-bit base, which is quantized again,
deterministically, from the same source weights at every start. Adapter names and
shapes are the same for LoRA and QLoRA of one model, so either resumes the other's.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

KEEP = 2


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(
    root: str | Path,
    round_index: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
) -> Path:
    """Write checkpoint ``step-{round_index:06d}`` under ``root`` and point ``latest`` at it.

    Args:
        root: the ``checkpoints`` folder.
        round_index: rounds completed (the client's step).
        model: trainable parameters (``requires_grad``) are saved.
        optimizer: an optimizer over exactly those parameters, in ``named_parameters`` order.
        extra: JSON-serialisable state (cursor, counters) stored in ``state.json``.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{round_index:06d}"
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    params = _trainable(model)
    save_file({n: p.detach().contiguous().cpu() for n, p in params.items()},
              tmp / "trainable.safetensors")
    opt = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for idx, st in opt["state"].items():
        for key, value in st.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{idx}.{key}"] = t.detach().contiguous().cpu()
    save_file(tensors, tmp / "optimizer.safetensors")
    state = {
        "round": round_index,
        "param_names": list(params),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} | {"params": g["params"]}
                         for g in opt["param_groups"]],
        "torch_rng": torch.get_rng_state().tolist(),
        "python_rng": _jsonable_random_state(random.getstate()),
        "extra": extra,
    }
    (tmp / "state.json").write_text(json.dumps(state))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    latest_tmp = root / "latest.tmp"
    latest_tmp.write_text(name)
    os.replace(latest_tmp, root / "latest")
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(
    root: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any] | None:
    """Restore the newest complete checkpoint under ``root`` into ``model`` and ``optimizer``.

    Returns:
        The ``state.json`` dict (``round``, ``extra``, ...) or ``None`` if there is none.

    Raises:
        ValueError: the checkpoint's parameter names do not match the model (a different
            model or PEFT setting than the one that wrote it).
    """
    root = Path(root)
    latest = root / "latest"
    if not latest.exists():
        return None
    ckpt = root / latest.read_text().strip()
    state = json.loads((ckpt / "state.json").read_text())
    params = _trainable(model)
    if list(params) != state["param_names"]:
        raise ValueError(f"checkpoint {ckpt} was written for a different model or PEFT setting")
    weights = load_file(ckpt / "trainable.safetensors")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(weights[n])
    moments = load_file(ckpt / "optimizer.safetensors")
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in moments.items():
        idx, name = key.split(".", 1)
        opt_state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": opt_state, "param_groups": state["param_groups"]})
    torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
    random.setstate(_tuple_random_state(state["python_rng"]))
    return state


def _jsonable_random_state(st: tuple) -> list:
    return [st[0], list(st[1]), st[2]]


def _tuple_random_state(st: list) -> tuple:
    return (st[0], tuple(st[1]), st[2])
