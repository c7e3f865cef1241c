"""Tiny randomly initialised causal LMs with a real (small) BPE tokenizer, for tests.

``build_tiny_model(path)`` writes a directory that loads like any Hugging Face model
(``config.json``, ``model.safetensors``, ``tokenizer.json``, chat template), so tests
exercise exactly the code path of real models, in well under a second.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "State the final answer to the following arithmetic problem: 1 + 2 = 3",
    "You are a helpful assistant. Solve the problem. End your reply with the final answer.",
    "The answer is 7. So 4 + 3 = 7 and 9 - 5 = 4 and 8 - 9 = -1.",
    "Question: what is 6 + 0? Answer: 6",
    "0 1 2 3 4 5 6 7 8 9 + - = . , ? ! the a is of and to",
]


def build_tiny_tokenizer(vocab_size: int = 300, seed_text: str = ""):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on a small fixed corpus.

    Special tokens: ``<|endoftext|>`` (id 0, pad), ``<|im_start|>`` (1), ``<|im_end|>``
    (2, eos). Different ``vocab_size`` or ``seed_text`` give different fingerprints.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*_CORPUS, seed_text] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    path: str | Path,
    *,
    vocab_size: int = 300,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
    seed_text: str = "",
) -> Path:
    """Write a tiny random Llama model + tokenizer to ``path`` and return it.

    The embedding has ``len(tokenizer)`` rows (the trained vocabulary may be a little
    smaller than ``vocab_size``).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tokenizer = build_tiny_tokenizer(vocab_size, seed_text)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
