"""``check_structure`` finds every offending log-prob and token id and names the first
in order: a NaN anywhere (which ``min``/``max`` would skip, so a faster check must not
rely on them alone), infinities, values beyond float32's range of valid log-probs, and
two offenders in one completion. Expected codes and reasons by hand."""

from __future__ import annotations

import math

import pytest

from ftis.protocol.bundles import MIN_LOGPROB, BundleLimits, check_structure
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.v1 import bundle_pb2

LIMITS = BundleLimits(group_size=1, max_new_tokens=8, vocab_size=100)


def _bundle(logprobs: list[float], token_ids: list[int] | None = None,
            prompt: list[int] | None = None) -> bundle_pb2.Bundle:
    ids = token_ids if token_ids is not None else [1] * len(logprobs)
    return bundle_pb2.Bundle(
        sampling=bundle_pb2.SamplingParams(temperature=1.0, top_p=1.0),
        prompt_token_ids=prompt if prompt is not None else [5, 6],
        completions=[bundle_pb2.Completion(token_ids=ids, logprobs=logprobs, text="x")])


def _code(b: bundle_pb2.Bundle) -> tuple[int, str]:
    with pytest.raises(FtisError) as info:
        check_structure(b, LIMITS)
    return info.value.code, info.value.reason


@pytest.mark.parametrize(("logprobs", "code", "named"), [
    ([-1.0, math.nan, -2.0], ErrorCode.LOGPROB_NOT_FINITE, "nan"),  # min/max skip a NaN
    ([-1.0, -2.0, math.nan], ErrorCode.LOGPROB_NOT_FINITE, "nan"),
    ([math.nan, -1.0], ErrorCode.LOGPROB_NOT_FINITE, "nan"),
    ([-1.0, -math.inf], ErrorCode.LOGPROB_NOT_FINITE, "-inf"),
    ([-1.0, math.inf, -math.inf], ErrorCode.LOGPROB_NOT_FINITE, "inf"),  # sum is NaN
    ([-1.0, 0.5, math.nan], ErrorCode.LOGPROB_POSITIVE, "0.5"),  # the first in order
    ([-1.0, math.nan, 0.5], ErrorCode.LOGPROB_NOT_FINITE, "nan"),
    ([-1e38, -1e38, -1e38], ErrorCode.LOGPROB_TOO_SMALL, "-1e+38"),  # float32 range
    ([-1.0, -101.0, 0.5], ErrorCode.LOGPROB_TOO_SMALL, "-101"),
])
def test_every_offender_is_found_and_the_first_is_named(logprobs, code, named) -> None:
    got, reason = _code(_bundle(logprobs))
    assert got == code and named in reason, reason


def test_valid_edges_pass() -> None:
    check_structure(_bundle([MIN_LOGPROB, 0.0, -0.0, -1e-30]), LIMITS)
    check_structure(_bundle([-1.0, -1.0], token_ids=[0, 99], prompt=[0, 99]), LIMITS)


def test_token_ids_out_of_range_are_named() -> None:
    assert _code(_bundle([-1.0] * 3, token_ids=[1, 100, -1])) == (
        ErrorCode.TOKEN_OUT_OF_VOCAB, "completion 0: token id 100 outside [0, 100)")
    assert _code(_bundle([-1.0], prompt=[5, -1]))[0] == ErrorCode.TOKEN_OUT_OF_VOCAB
    assert _code(_bundle([-1.0], prompt=[100]))[0] == ErrorCode.TOKEN_OUT_OF_VOCAB
