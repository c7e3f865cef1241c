"""Load a policy (model + tokenizer + model card), optionally wrapped with LoRA or QLoRA.

PEFT kinds (:data:`PEFT_KINDS`, defined with :class:`LoraSettings` in
:mod:`ftis.client.models.peft` and re-exported here):

* ``none``  -- full fine-tune, float32 weights, every parameter trainable;
* ``lora``  -- float32 base frozen, LoRA adapters trainable (Hu et al. 2021);
* ``qlora`` -- the base's linear layers quantized to bitsandbytes 4-bit NF4 at load time
  (compute in float32), frozen; LoRA adapters in float32 trainable (Dettmers et al. 2023,
  arXiv 2305.14314). Embeddings, norms and the LM head stay in float32 (bitsandbytes
  leaves them unquantized). Works on CPU and, when available, on CUDA.

Because the sampler runs the loaded model, a QLoRA node's recorded log-probs are those
of its *quantized* policy; receivers' importance weights account for that difference
like any other generator/learner mismatch.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ftis.client.models.card import build_model_card
from ftis.client.models.peft import PEFT_KINDS, LoraSettings, PeftKind
from ftis.client.models.registry import materialize, resolve
from ftis.tasks import PLAIN_STOP_STRINGS, render_plain_prompt
from ftis.v1 import bundle_pb2

if TYPE_CHECKING:  # transformers and peft are imported where a policy is loaded
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

log = logging.getLogger(__name__)

#: model card ``quantization`` suffix of a QLoRA base (bitsandbytes 4-bit NormalFloat)
QLORA_QUANTIZATION = "bnb-nf4"


@dataclass
class Policy:
    """A loaded policy: model, tokenizer and the card that describes them."""

    #: the causal LM; a ``PeftModel`` wrapping it with LoRA / QLoRA adapters
    model: PreTrainedModel | PeftModel
    #: a fast (``tokenizers``-backed) tokenizer: its ``backend_tokenizer`` is uploaded
    tokenizer: PreTrainedTokenizerFast
    card: bundle_pb2.ModelCard
    name: str
    #: ``tokenizer.json`` text serialized at load time (``None``: serialize on demand)
    cached_tokenizer_json: str | None = field(default=None, repr=False)

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
    def stop_strings(self) -> list[str]:
        """Sampler stop strings: :data:`ftis.tasks.PLAIN_STOP_STRINGS` for plain prompts
        (no chat template, e.g. base models), none for chat models (they end with EOS)."""
        return [] if self.tokenizer.chat_template else list(PLAIN_STOP_STRINGS)

    @property
    def tokenizer_json(self) -> str:
        """The tokenizer's ``tokenizer.json`` text (uploaded to the coordinator)."""
        if self.cached_tokenizer_json is None:
            self.cached_tokenizer_json = self.tokenizer.backend_tokenizer.to_str()
        return self.cached_tokenizer_json

    def prompt_token_ids(self, messages: list[dict[str, str]]) -> tuple[list[int], str]:
        """Token ids and text of the prompt for chat ``messages``.

        Models with a chat template get it with the generation prompt appended; others
        get :func:`ftis.tasks.render_plain_prompt`.
        """
        tok = self.tokenizer
        if tok.chat_template:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert isinstance(text, str)  # tokenize=False: the rendered text
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            text = render_plain_prompt(messages)
            ids = tok(text)["input_ids"]
        return list(ids), text


def qlora_quantization(source: str) -> str:
    """Model card ``quantization`` of a QLoRA policy whose weights came from ``source``.

    ``"none"`` -> ``"bnb-nf4"``; a dequantized GGUF keeps its history, e.g.
    ``"gguf-q4_1-dequantized"`` -> ``"gguf-q4_1-dequantized+bnb-nf4"``.
    """
    return QLORA_QUANTIZATION if source in ("", "none") else f"{source}+{QLORA_QUANTIZATION}"


def _load_4bit(path: Any, double_quant: bool, device: str) -> PreTrainedModel:
    """``path``'s causal LM with linear layers in bitsandbytes NF4 (compute float32).

    ``device`` is ``"cpu"`` or a CUDA device (``"cuda"``, ``"cuda:1"``); bitsandbytes
    quantizes on that device while loading.
    """
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    try:
        import bitsandbytes
    except ImportError as exc:  # pragma: no cover - a dependency of the client
        raise RuntimeError("--peft qlora needs the bitsandbytes package") from exc
    qconfig = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=double_quant,
    )
    if device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=qconfig, dtype=torch.float32, device_map={"": device})
    # On AVX512-BF16 CPUs bitsandbytes repacks a layer's weights the first time it runs
    # in eval mode without grad (i.e. in the sampler) and from then on computes it in
    # bfloat16 with a kernel that has no autograd formula: after the first generation
    # no gradient would reach any adapter (torch only warns), and the learner would see
    # a different (bf16) policy than the one that sampled before. Keep every layer on
    # the dequantize + float32 path.
    for module in model.modules():
        if isinstance(module, bitsandbytes.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    # The float32 parameters left unquantized (embeddings, norms) are views of the
    # memory-mapped safetensors file, which quantization has read in full: copy them
    # out so the mapping (the whole float32 model, counted in the resident set) closes.
    with torch.no_grad():
        for param in model.parameters():
            if param.device.type == "cpu" and not isinstance(param,
                                                             bitsandbytes.nn.Params4bit):
                param.data = param.data.clone()
    gc.collect()
    return model


def load_policy(
    name: str,
    *,
    peft: PeftKind = "none",
    lora: LoraSettings | None = None,
    gradient_checkpointing: bool = False,
    double_quant: bool = False,
    device: str = "cpu",
) -> Policy:
    """Load ``name`` (alias, .gguf file, directory or hub id) for generation and training.

    Weights load in float32 on CPU. With ``peft="lora"`` the base weights are frozen and
    LoRA adapters (``lora`` settings) are trainable. With ``peft="qlora"`` the base's
    linear layers are quantized to 4-bit NF4 while loading (``double_quant`` also
    quantizes the per-block scales), prepared with ``prepare_model_for_kbit_training``
    and get the same LoRA adapters; the card records ``quantization`` ``...bnb-nf4``
    (:func:`qlora_quantization`) and ``dtype`` float32 (the compute dtype).

    ``device`` places the model (``"cpu"``, the default, ``"cuda"`` or ``"cuda:N"``;
    ``ftis-client start --device`` chooses it); the sampler follows the model's device,
    and the learner moves its CPU-built batches there (``PackedBatch.to``).

    Raises:
        ModelNotFoundError: ``name`` cannot be found locally.
        ValueError: unknown ``peft`` kind.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    if peft not in PEFT_KINDS:
        raise ValueError(f"peft must be one of {PEFT_KINDS}, got {peft!r}")
    resolved = resolve(name)
    path = materialize(resolved)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):  # its tokenizer.json is needed
        raise ValueError(f"{name}: no fast (tokenizers) tokenizer")
    quantization = resolved.quantization
    model: PreTrainedModel | PeftModel
    if peft == "qlora":
        from peft import prepare_model_for_kbit_training

        model = _load_4bit(path, double_quant, device)
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing)
        quantization = qlora_quantization(quantization)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
        if device != "cpu":
            # transformers' @wraps(Module.to) types `to` as unbound
            model = model.to(device)  # type: ignore[arg-type]
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if peft in ("lora", "qlora"):
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
    if gradient_checkpointing and peft != "qlora":  # qlora: enabled by prepare_model_...
        model.gradient_checkpointing_enable()
    # serialized once: hashed for the card here, uploaded to the coordinator later
    tokenizer_json = tokenizer.backend_tokenizer.to_str()
    card = build_model_card(
        model, tokenizer, base_model=resolved.base_model, peft=peft,
        quantization=quantization, tokenizer_json=tokenizer_json,
    )
    return Policy(model=model, tokenizer=tokenizer, card=card, name=name,
                  cached_tokenizer_json=tokenizer_json)
