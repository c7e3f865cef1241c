"""PEFT kinds and LoRA settings, defined once (issue 14, section 5).

Torch-free, so that the CLI reads the enumeration and the defaults without loading the
model stack; :mod:`ftis.client.models.loader` re-exports them. :class:`LoraSettings` is a
frozen pydantic model whose fields :class:`~ftis.client.node.config.ClientConfig` copies
as its ``lora_*`` fields (``rank -> lora_rank``, ...), so each default lives here only.

PEFT kinds (:data:`PEFT_KINDS`):

* ``none``  -- full fine-tune, float32 weights, every parameter trainable;
* ``lora``  -- float32 base frozen, LoRA adapters trainable (Hu et al. 2021);
* ``qlora`` -- the base's linear layers quantized to bitsandbytes 4-bit NF4 at load time
  (compute in float32), frozen; LoRA adapters in float32 trainable (Dettmers et al. 2023,
  arXiv 2305.14314).
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

PeftKind = Literal["none", "lora", "qlora"]
"""How a policy is trained: full fine-tune, LoRA, or QLoRA (4-bit NF4 base + LoRA)."""
PEFT_KINDS: tuple[str, ...] = get_args(PeftKind)

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoraSettings(BaseModel):
    """LoRA hyperparameters (Hu et al. 2021, arXiv 2106.09685)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(16, ge=1, description="LoRA rank r")
    alpha: int = Field(32, ge=1, description="LoRA alpha (the update is scaled by alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA branch")
    target_modules: tuple[str, ...] = Field(
        DEFAULT_LORA_TARGETS, min_length=1,
        description="module names that get LoRA adapters (comma-separated on the CLI)")
