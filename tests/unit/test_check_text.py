"""The text check on a byte-level BPE tokenizer with special and added tokens: exact
text passes (non-ASCII included); a wrong text, an undecodable completion or prompt,
and a prompt without the leased question each get their code and name the offender."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from ftis.coordinator.verify import check_text
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.v1 import bundle_pb2

QUESTION = "What is 7 * 8?"


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["What is 7 * 8? The answer is 56.", "héllo wörld ✓ 数学 <answer>56</answer>"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(" zz", normalized=False)])
    return tok


def _bundle(tok: Tokenizer, texts: list[str]) -> bundle_pb2.Bundle:
    b = bundle_pb2.Bundle(prompt_token_ids=tok.encode(
        f"<|im_start|>user\n{QUESTION}<|im_end|>").ids)
    for t in texts:
        b.completions.add(token_ids=tok.encode(t).ids, text=t)
    return b


def test_check_text_accepts_exact_text_and_names_the_offender() -> None:
    tok = _byte_level()
    check_text(tok, _bundle(tok, ["The answer is 56.", "数学 ✓"]), QUESTION)

    b = _bundle(tok, ["The answer is 56.", "héllo"])
    b.completions[1].text = "hello"
    with pytest.raises(FtisError) as e:
        check_text(tok, b, QUESTION)
    assert e.value.code == ErrorCode.TEXT_MISMATCH and "completion 1:" in e.value.reason

    b = _bundle(tok, ["The answer is 56.", "héllo"])
    b.completions[1].token_ids.append(-1)  # the binding cannot decode a negative id
    with pytest.raises(FtisError) as e:
        check_text(tok, b, QUESTION)
    assert e.value.code == ErrorCode.TEXT_MISMATCH
    assert e.value.reason.startswith("completion 1: tokens do not decode")

    b = _bundle(tok, ["The answer is 56."])
    b.prompt_token_ids.append(-1)
    with pytest.raises(FtisError) as e:
        check_text(tok, b, QUESTION)
    assert e.value.code == ErrorCode.PROMPT_MISMATCH
    assert e.value.reason.startswith("prompt tokens do not decode")

    with pytest.raises(FtisError) as e:
        check_text(tok, _bundle(tok, ["56"]), "What is 9 * 9?")
    assert e.value.code == ErrorCode.PROMPT_MISMATCH
