"""Process-wide set-up shared by every command that runs a node (start, attack)."""

from __future__ import annotations

import os
import time

from ftis.client.node.config import ClientConfig

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
