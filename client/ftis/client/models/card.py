"""Model cards: what a bundle's receivers and the coordinator learn about its policy."""

from __future__ import annotations

from typing import Any

from ftis.protocol.fingerprint import tokenizer_fingerprint
from ftis.v1 import bundle_pb2


def fingerprint_of(tokenizer: Any) -> str:
    """Tokenizer fingerprint (64 hex) of a ``transformers`` fast tokenizer: of its
    backend's ``to_str()``, the text the client uploads, so the coordinator recomputes
    the same value (:mod:`ftis.protocol.fingerprint`: the whole encode/decode pipeline,
    not padding or truncation).

    Raises:
        TypeError: if the tokenizer has no ``backend_tokenizer`` (slow tokenizers).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer")
    return tokenizer_fingerprint(backend.to_str())


def logical_numel(param: Any) -> int:
    """Number of weights ``param`` stands for.

    bitsandbytes ``Params4bit`` store two 4-bit values per uint8 (``numel`` is half the
    real count); the original shape is kept in ``quant_state.shape``.
    """
    state = getattr(param, "quant_state", None)
    shape = getattr(state, "shape", None)
    if shape is not None:
        n = 1
        for d in shape:
            n *= int(d)
        return n
    return param.numel()


def build_model_card(
    model: Any, tokenizer: Any, *, base_model: str, peft: str, quantization: str,
    tokenizer_json: str | None = None,
) -> bundle_pb2.ModelCard:
    """ModelCard of a loaded (possibly PEFT-wrapped) causal LM.

    ``parameter_count`` counts the base model's parameters (LoRA weights excluded), with
    4-bit quantized weights counted at their logical shape (:func:`logical_numel`);
    ``dtype`` is the first floating-point parameter's dtype (for QLoRA the compute dtype,
    the packed 4-bit storage is uint8); ``vocab_size`` is the embedding size, the bound
    on valid token ids. ``tokenizer_json`` (the backend's ``to_str()``, if the caller
    already has it) avoids serializing a large tokenizer a second time.
    """
    params = list(model.named_parameters())
    total = sum(logical_numel(p) for n, p in params if "lora_" not in n)
    trainable = sum(p.numel() for _, p in params if p.requires_grad)
    first = next((p for p in model.parameters() if p.is_floating_point()),
                 next(model.parameters()))
    dtype = str(first.dtype).removeprefix("torch.")
    vocab = int(model.get_input_embeddings().weight.shape[0])
    return bundle_pb2.ModelCard(
        base_model=base_model,
        parameter_count=total,
        peft=peft,
        dtype=dtype,
        quantization=quantization,
        tokenizer_fingerprint=(tokenizer_fingerprint(tokenizer_json)
                               if tokenizer_json is not None else fingerprint_of(tokenizer)),
        vocab_size=vocab,
        trainable_parameter_count=trainable,
    )
