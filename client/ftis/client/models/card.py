"""Model cards: what a bundle's receivers and the coordinator learn about its policy."""

from __future__ import annotations

from typing import Any

from ftis.protocol.fingerprint import tokenizer_fingerprint
from ftis.v1 import bundle_pb2


def fingerprint_of(tokenizer: Any) -> str:
    """Tokenizer fingerprint (64 hex) of a ``transformers`` fast tokenizer.

    Raises:
        TypeError: if the tokenizer has no ``backend_tokenizer`` (slow tokenizers).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer")
    return tokenizer_fingerprint(backend.to_str())


def build_model_card(
    model: Any, tokenizer: Any, *, base_model: str, peft: str, quantization: str
) -> bundle_pb2.ModelCard:
    """ModelCard of a loaded (possibly PEFT-wrapped) causal LM.

    ``parameter_count`` counts the base model's parameters (LoRA weights excluded);
    ``vocab_size`` is the embedding size, the bound on valid token ids.
    """
    params = list(model.named_parameters())
    total = sum(p.numel() for n, p in params if "lora_" not in n)
    trainable = sum(p.numel() for _, p in params if p.requires_grad)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    vocab = int(model.get_input_embeddings().weight.shape[0])
    return bundle_pb2.ModelCard(
        base_model=base_model,
        parameter_count=total,
        peft=peft,
        dtype=dtype,
        quantization=quantization,
        tokenizer_fingerprint=fingerprint_of(tokenizer),
        vocab_size=vocab,
        trainable_parameter_count=trainable,
    )
