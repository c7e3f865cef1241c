#!/usr/bin/env python3
"""Cost of the submission check "every token id is one the sender's tokenizer can
decode" (``tokenizer_store.undecodable_id``), against its definition measured in the same
run: one ``id_to_token`` call per distinct id (the implementation before 2026-11-24).

On the embedded SmolLM2 tokenizer (49,152 ids), for id sets as a submission sees them:
a bundle of G x 256 sampled-like ids (uniform over the vocabulary: the most distinct ids
a bundle of that size can have) and the ``make bench-coordinator`` bundle (an ASCII
paragraph, few distinct ids). Prints milliseconds per call for both and the ratio; the
one-off cost of building the tokenizer's :class:`DecodableIds` is printed apart.

Usage: ``.venv/bin/python bench/undecodable_ids.py [--calls 300]``
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from coordinator_load_node import Material, load_tokenizer_policy  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from ftis.coordinator.tokenizer_store import DecodableIds, undecodable_id  # noqa: E402


def by_definition(tokenizer: Tokenizer, ids: set[int]) -> int | None:
    """The reference: one ``id_to_token`` per distinct id, in increasing order."""
    for token_id in sorted(ids):
        if token_id < 0 or tokenizer.id_to_token(token_id) is None:
            return token_id
    return None


def per_call_ms(fn, tokenizer: Tokenizer, ids: set[int], calls: int) -> float:
    best = float("inf")
    for _ in range(3):  # best of three blocks: the least disturbed by other processes
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(tokenizer, ids)
        best = min(best, (time.perf_counter() - t0) / calls * 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args(argv)
    _, _, tokenizer_json = load_tokenizer_policy()
    tok = Tokenizer.from_str(tokenizer_json)
    t0 = time.perf_counter()
    DecodableIds(tok)
    print(f"# DecodableIds of the SmolLM2 tokenizer: {(time.perf_counter() - t0) * 1e3:.1f} ms "
          "once per loaded tokenizer")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    rng = random.Random(0)
    sampled = {rng.randrange(vocab) for _ in range(args.group_size * args.tokens + 64)}
    material = Material.build(group_size=args.group_size, tokens=args.tokens)
    paragraph = set(material.template.prompt_token_ids)
    for c in material.template.completions:
        paragraph.update(c.token_ids)
    undecodable_id(tok, sampled)  # the one-off build, outside the timing
    print(f"{'id set':>28} {'distinct':>9} {'definition ms':>14} {'set ops ms':>11} {'ratio':>7}")
    for name, ids in (("uniform over the vocabulary", sampled), ("bench paragraph", paragraph)):
        assert undecodable_id(tok, ids) == by_definition(tok, ids)
        old = per_call_ms(by_definition, tok, ids, args.calls)
        new = per_call_ms(undecodable_id, tok, ids, args.calls)
        print(f"{name:>28} {len(ids):>9} {old:>14.4f} {new:>11.4f} {new / old:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
