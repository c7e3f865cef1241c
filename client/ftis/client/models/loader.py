"""Load a policy (model + tokenizer + model card), optionally wrapped with LoRA."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ftis.client.models.card import build_model_card
from ftis.client.models.registry import materialize, resolve
from ftis.tasks import render_plain_prompt
from ftis.v1 import bundle_pb2

log = logging.getLogger(__name__)

PEFT_KINDS = ("none", "lora")
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyperparameters (Hu et al. 2021, arXiv 2106.09685)."""

    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default=DEFAULT_LORA_TARGETS)


@dataclass
class Policy:
    """A loaded policy: model, tokenizer and the card that describes them."""

    model: Any
    tokenizer: Any
    card: bundle_pb2.ModelCard
    name: str

    @property
    def eos_token_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id
        ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` with special tokens kept, via the ``tokenizers`` backend.

        This is the canonical completion text of a bundle: the coordinator decodes with the
        same library and rule and rejects any difference (``TEXT_MISMATCH``).
        """
        return self.tokenizer.backend_tokenizer.decode(list(token_ids),
                                                       skip_special_tokens=False)

    @property
    def tokenizer_json(self) -> str:
        """The tokenizer's ``tokenizer.json`` text (uploaded to the coordinator)."""
        return self.tokenizer.backend_tokenizer.to_str()

    def prompt_token_ids(self, messages: list[dict[str, str]]) -> tuple[list[int], str]:
        """Token ids and text of the prompt for chat ``messages``.

        Models with a chat template get it with the generation prompt appended; others
        get :func:`ftis.tasks.render_plain_prompt`.
        """
        tok = self.tokenizer
        if tok.chat_template:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            text = render_plain_prompt(messages)
            ids = tok(text)["input_ids"]
        return list(ids), text


def load_policy(
    name: str,
    *,
    peft: str = "none",
    lora: LoraSettings | None = None,
    gradient_checkpointing: bool = False,
) -> Policy:
    """Load ``name`` (alias, .gguf file, directory or hub id) for generation and training.

    Weights load in float32 on CPU. With ``peft="lora"`` the base weights are frozen and
    LoRA adapters (``lora`` settings) are trainable.

    Raises:
        ModelNotFoundError: ``name`` cannot be found locally.
        ValueError: unknown ``peft`` kind.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if peft not in PEFT_KINDS:
        raise ValueError(f"peft must be one of {PEFT_KINDS}, got {peft!r}")
    resolved = resolve(name)
    path = materialize(resolved)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if peft == "lora":
        from peft import LoraConfig, get_peft_model

        s = lora or LoraSettings()
        model = get_peft_model(
            model,
            LoraConfig(
                r=s.rank,
                lora_alpha=s.alpha,
                lora_dropout=s.dropout,
                target_modules=list(s.target_modules),
                task_type="CAUSAL_LM",
            ),
        )
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    card = build_model_card(
        model, tokenizer, base_model=resolved.base_model, peft=peft,
        quantization=resolved.quantization,
    )
    return Policy(model=model, tokenizer=tokenizer, card=card, name=name)
