"""Process-wide set-up shared by every command that runs a node (start, attack)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from ftis.client.node.config import ClientConfig
from ftis.client.node.memory import format_size

_IMPORTED_AT = time.monotonic()


def configure_runtime(cfg: ClientConfig, use_gpu: bool = True) -> None:
    """Quiet transformers, set torch's CPU threads (``cfg.threads``) and seed.

    ``use_gpu=False`` (the ``use_gpu`` volunteer setting) hides every CUDA device from
    this process (``CUDA_VISIBLE_DEVICES=""``; CUDA starts lazily, after this call).
    """
    if not use_gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)


class DeviceUnavailableError(ValueError):
    """The requested CUDA device is not visible to this process."""


def choose_device(requested: str, cuda_memory: Sequence[int],
                  needed: int | None = None) -> tuple[str, str]:
    """The torch device a node runs on, from the ``device`` setting.

    Args:
        requested: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``
            (:attr:`~ftis.client.node.config.ClientConfig.device`).
        cuda_memory: total memory (bytes) of each CUDA device visible to this process;
            empty when torch has no CUDA, no driver is found, or ``use_gpu = false`` hid
            them.
        needed: the round's estimated peak on the device (bytes,
            :func:`~ftis.client.node.memory.device_round_peak`), ``None`` when unknown.
            ``"auto"`` takes the first GPU only when this fits in its memory: a model
            that does not fit runs on the CPU, slowly, rather than failing there.

    Returns:
        ``(device, note)``: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``, and a one-line note
        when ``"auto"`` passed over a visible GPU (else ``""``).

    Raises:
        DeviceUnavailableError: ``cuda`` with no visible GPU, or ``cuda:N`` with N at or
            above the number visible.
        ValueError: any other ``requested`` value.
    """
    if requested == "cpu":
        return "cpu", ""
    if requested == "auto":
        if not cuda_memory:
            return "cpu", ""
        if needed is not None and needed > cuda_memory[0]:
            return "cpu", (f"a round needs about {format_size(needed)}, more than the "
                           f"GPU's {format_size(cuda_memory[0])}: running on the CPU "
                           "(--device cuda tries the GPU anyway)")
        return "cuda", ""
    if requested == "cuda" or requested.startswith("cuda:"):
        index = 0 if requested == "cuda" else int(requested.split(":", 1)[1])
        if index >= len(cuda_memory):
            seen = (f"{len(cuda_memory)} CUDA device(s) visible" if cuda_memory else
                    "no CUDA device is visible (torch without CUDA, no driver, or the "
                    "use_gpu setting is false)")
            raise DeviceUnavailableError(f"device {requested!r} requested but {seen}")
        return requested, ""
    raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {requested!r}")


def resolve_device(requested: str, needed: int | None = None) -> tuple[str, str]:
    """:func:`choose_device` for the CUDA devices torch sees now and their total memory
    (call it after :func:`configure_runtime`, which may hide them)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    memory = [torch.cuda.get_device_properties(i).total_memory for i in range(count)]
    return choose_device(requested, memory, needed)


def set_threads(threads: int | None) -> None:
    """Set torch's CPU threads (``threads`` setting) between rounds; ``None``: leave them."""
    if threads:
        import torch

        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def seconds_since_process_start() -> float:
    """Wall seconds since this process started (interpreter start-up and imports included).

    Read from ``/proc/self/stat`` (Linux); elsewhere (or on failure) the age of the
    ``ftis.client.node.runtime`` import, which undercounts by the imports before it.
    """
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT
