"""Sampler settings, defined once (issue 14, section 5).

Torch-free, so that the CLI reads the defaults without loading torch;
:mod:`ftis.client.rollout.sampler` re-exports :class:`SamplingSettings`. It is a frozen
pydantic model: :class:`~ftis.client.node.config.ClientConfig` copies its
``temperature`` and ``max_new_tokens`` fields (default, bounds, help), so a default
changes here only. ``max_new_tokens`` is 64, what ``ftis-client start`` has always used
(the dataclass this replaces said 96, a default no client ran with).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ftis.v1 import bundle_pb2


class SamplingSettings(BaseModel):
    """Sampler settings; ``top_k = 0`` disables top-k, ``top_p = 1`` disables nucleus.

    Training rollouts keep ``top_p = 1`` and ``top_k = 0`` (the recorded log-probs are
    then the policy's temperature-scaled ones, which the learners' importance weights
    need), so the client exposes only ``temperature`` and ``max_new_tokens`` as flags.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(1.0, gt=0, allow_inf_nan=False,
                               description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus top-p (1 = off)")
    top_k: int = Field(0, ge=0, description="top-k (0 = off)")
    max_new_tokens: int = Field(64, ge=1, le=1024,
                                description="most tokens generated per completion")

    def to_proto(self) -> bundle_pb2.SamplingParams:
        return bundle_pb2.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
        )
