"""Process-wide set-up shared by every command that runs a node (start, attack)."""

from __future__ import annotations

from ftis.client.node.config import ClientConfig


def configure_runtime(cfg: ClientConfig) -> None:
    """Quiet transformers, set torch's CPU threads (``cfg.threads``) and seed."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
