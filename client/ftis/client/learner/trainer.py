"""One F-TIS learner step on local + external rollout groups (DESIGN.md section 3, step 6).

Orchestration only; the maths is in :mod:`ftis.client.learner.loss`. With one optimizer
step per batch, ``lp_old`` equals ``lp_theta`` in value, so it is taken as
``lp_theta.detach()`` from the same forward pass (no second pass).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ftis.client.learner import loss as loss_module
from ftis.client.learner.batch import PackedBatch, Sample, micro_batches, pack
from ftis.client.learner.config import LearnerConfig
from ftis.client.learner.forward import batch_logprobs
from ftis.client.learner.loss import (
    CompletionStats,
    Reduction,
    Stat,
    group_advantages,
    policy_loss,
    sequence_level_policy_loss,
)
from ftis.client.rollout.groups import RolloutGroup


def groups_to_samples(groups: list[RolloutGroup], scale_by_std: bool) -> list[Sample]:
    """Flatten groups into samples with GRPO group-relative advantages.

    Groups with all-equal rewards are dropped: their advantages are exactly 0, so they
    add no gradient (as SAPO and DAPO's dynamic sampling do).
    """
    samples: list[Sample] = []
    for g in groups:
        if g.reward_variance_zero:
            continue
        adv = group_advantages(torch.tensor([g.rewards], dtype=torch.float32), scale_by_std)[0]
        none = [None] * len(g.completions)
        seq = g.gen_sequence_logprobs if g.gen_sequence_logprobs is not None else none
        lps_rows = g.gen_logprobs if g.gen_logprobs is not None else none
        for ids, lps, a, sq in zip(g.completions, lps_rows, adv.tolist(), seq, strict=True):
            samples.append(Sample(g.prompt_ids, ids, lps, a, g.local, g.sender, sq))
    return samples


class Learner:
    """Owns the optimizer and applies one F-TIS update per call to :meth:`step`.

    Args:
        model: causal LM whose trainable parameters (``requires_grad``) are optimised.
        config: :class:`LearnerConfig`.
        pad_token_id: id used for right padding.
    """

    def __init__(self, model: torch.nn.Module, config: LearnerConfig, pad_token_id: int) -> None:
        self.model = model
        self.config = config
        self.pad_token_id = pad_token_id
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("model has no trainable parameters")
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.learning_rate, betas=config.adam_betas,
            weight_decay=config.weight_decay,
        )
        #: where the trainable parameters live; batches are moved there
        self.device = self.params[0].device
        self.updates = 0
        #: per external sender, statistics of the last step (receiver feedback, DESIGN §3.7)
        self.sender_stats: dict[str, SenderStats] = {}

    def _forward_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        return batch_logprobs(self.model, batch, self.config.loss.temperature,
                              self.config.share_prompt)

    def step(self, groups: list[RolloutGroup],
             audit: list[RolloutGroup] | None = None) -> dict[str, float]:
        """One optimizer step on ``groups``; returns metrics (floats).

        ``audit``: audit-only groups (senders on the coordinator's audit-based
        probation): never trained on (nor is any group in ``groups`` whose
        ``meta["audit_only"]`` is set); their log-ratio statistics are recorded in
        :attr:`sender_stats` by :meth:`audit` with the weights before the update, as a
        trained external group's are (metric ``audit_completions``).

        ``on_policy`` ignores external groups. Micro-batches never mix local and external
        samples so their statistics can be reported separately. Micro-batch losses are
        re-weighted so the result equals the full-batch loss of the chosen aggregation.

        Metrics: ``groups_local``, ``groups_external``, ``groups_zero_variance``,
        ``samples``, ``loss``, ``grad_norm``, ``updated``, ``train_tokens``,
        ``learner_seconds`` (and, when there were samples, ``forward_seconds``,
        ``backward_seconds``, ``optimizer_seconds``); then every statistic the loss
        declares (:func:`~ftis.client.learner.loss.policy_loss`: ``is_weight_mean``,
        ``is_weight_max``, ``is_weight_raw_max``, ``truncated_frac``, ``filtered_frac``,
        ``divergence_mean``, ``k1_mean``, ``gate_mean``, ``gate_max``, ``clip_frac``,
        ``logratio_gen_mean``) plus ``samples_counted``, over all samples (no prefix),
        external ones (``external_``) and cross-tokenizer ones (``cross_``), each
        combined over micro-batches by its declared reduction (:class:`StatAccumulator`);
        a prefix is absent when it had no samples.
        """
        cfg = self.config
        t0 = time.perf_counter()
        # audit-only groups (a sender on the coordinator's audit-based probation) are
        # never trained on, whoever passes them here; :meth:`audit` reports them
        groups = [g for g in groups if not g.meta.get("audit_only")]
        if cfg.loss.method == "on_policy":
            groups = [g for g in groups if g.local]
        samples = groups_to_samples(groups, cfg.scale_advantages_by_std)
        self.sender_stats = {}
        audited = self.audit(audit) if audit else 0
        metrics: dict[str, float] = {
            "audit_completions": float(audited),
            "groups_local": float(sum(g.local for g in groups)),
            "groups_external": float(sum(not g.local for g in groups)),
            "groups_zero_variance": float(sum(g.reward_variance_zero for g in groups)),
            "samples": float(len(samples)),
        }
        if not samples:
            metrics.update(loss=0.0, grad_norm=0.0, learner_seconds=time.perf_counter() - t0,
                           updated=0.0, train_tokens=0.0)
            return metrics

        total_tokens = sum(len(s.completion_ids) for s in samples)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, t_forward, t_backward, acc = self._backward(samples)
        t3 = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
        finite = math.isfinite(float(grad_norm))
        if finite:
            self.optimizer.step()
            self.updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        metrics.update(
            forward_seconds=t_forward,
            backward_seconds=t_backward,
            optimizer_seconds=time.perf_counter() - t3,
            loss=loss_sum,
            grad_norm=float(grad_norm),
            updated=1.0 if finite else 0.0,
            train_tokens=float(total_tokens),
            learner_seconds=time.perf_counter() - t0,
        )
        for prefix, a in (("", acc["all"]), ("external_", acc["external"]),
                          ("cross_", acc["cross"])):
            metrics.update({prefix + k: v for k, v in a.finish().items()})
        return metrics


    def _backward(self, samples: list[Sample]
                  ) -> tuple[float, float, float, dict[str, StatAccumulator]]:
        """Accumulate the gradient of the step's loss on ``samples`` into the trainable
        parameters' ``.grad`` (the caller zeroes them first); returns the loss, the
        forward and backward seconds and the statistics per prefix (``all``,
        ``external``, ``cross``)."""
        cfg = self.config
        total_tokens = sum(len(s.completion_ids) for s in samples)
        total_seqs = len(samples)
        self.model.train()
        loss_sum = 0.0
        t_forward = t_backward = 0.0
        acc = {"all": StatAccumulator(), "external": StatAccumulator(),
               "cross": StatAccumulator()}
        # local, external token-aligned, external cross-tokenizer: never mixed in a batch
        for local, cross in ((True, False), (False, False), (False, True)):
            part = [s for s in samples
                    if s.local == local and (s.gen_sequence_logprob is not None) == cross]
            for mb in micro_batches(part, cfg.micro_batch_size, cfg.share_prompt):
                batch = pack(mb, self.pad_token_id).to(self.device)
                t1 = time.perf_counter()
                lp_theta = self._forward_logprobs(batch)
                if batch.gen_sequence_logprobs is not None:
                    cross_loss = (cfg.loss.model_copy(update={"method": "nois"})
                                  if cfg.cross_tokenizer == "nois" else cfg.loss)
                    out = sequence_level_policy_loss(
                        lp_theta, lp_theta.detach(), batch.gen_sequence_logprobs,
                        batch.advantages, batch.completion_mask, cross_loss,
                        length_normalized=cfg.cross_tokenizer == "geometric")
                else:
                    assert batch.gen_logprobs is not None  # pack sets one of the two
                    out = policy_loss(lp_theta, lp_theta.detach(), batch.gen_logprobs,
                                      batch.advantages, batch.completion_mask, cfg.loss)
                loss = out.loss
                n_tok, n_seq = batch.num_tokens, len(mb)
                scale = (n_tok / total_tokens if cfg.loss.aggregation == "token"
                         else n_seq / total_seqs)
                t2 = time.perf_counter()
                (loss * scale).backward()
                t_forward += t2 - t1
                t_backward += time.perf_counter() - t2
                if not local:
                    sums = (None if cross else
                            sender_log_ratio_sums(lp_theta, batch.gen_logprobs,
                                                  batch.completion_mask))
                    self._record_senders(mb, out.per_completion, cross, sums)
                loss_sum += float(loss.detach()) * scale
                keys = ("all",) if local else ("all", "external", "cross") if cross else (
                    "all", "external")
                for key in keys:
                    acc[key].add(out.stats, n_tok, n_seq)
        return loss_sum, t_forward, t_backward, acc

    def audit(self, groups: list[RolloutGroup]) -> int:
        """Log-ratio statistics of audit-only groups without training on them
        (docs/reputation.md "Audit-based probation"): one forward pass without gradients
        per micro-batch, the per-completion ``lp_learner - lp_gen`` sums and the F-TIS
        gate decisions added to :attr:`sender_stats` exactly as :meth:`step` records a
        trained external group's (the feedback the coordinator judges). :meth:`step`
        resets the statistics and then calls this on its ``audit`` groups, before the
        update. Cross-tokenizer groups are skipped (no token-level log-ratio exists).
        Nothing is updated.

        Returns:
            the completions audited.
        """
        cfg = self.config
        samples = [Sample(g.prompt_ids, ids, lps, 0.0, False, g.sender, None)
                   for g in groups if g.gen_logprobs is not None
                   for ids, lps in zip(g.completions, g.gen_logprobs, strict=True)]
        with torch.no_grad():
            for mb in micro_batches(samples, cfg.micro_batch_size, cfg.share_prompt):
                batch = pack(mb, self.pad_token_id).to(self.device)
                lp_theta = self._forward_logprobs(batch)
                assert batch.gen_logprobs is not None  # token-aligned samples only
                out = policy_loss(lp_theta, lp_theta, batch.gen_logprobs, batch.advantages,
                                  batch.completion_mask, cfg.loss)
                sums = sender_log_ratio_sums(lp_theta, batch.gen_logprobs,
                                             batch.completion_mask)
                self._record_senders(mb, out.per_completion, False, sums)
        return len(samples)

    def policy_gradient(self, groups: list[RolloutGroup]) -> torch.Tensor:
        """The gradient of :meth:`step`'s loss on ``groups`` with respect to the
        trainable parameters, without updating anything (MERIT's per-family gradients
        at the shared initialisation, ``ftis.lab.merit``).

        Returns:
            ``[P]`` float32, the trainable parameters' gradients flattened in
            ``self.params`` order (zeros where a parameter got none); all zeros when the
            groups hold no sample with a non-zero advantage.
        """
        samples = groups_to_samples(groups, self.config.scale_advantages_by_std)
        self.optimizer.zero_grad(set_to_none=True)
        if samples:
            self._backward(samples)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                          .detach().flatten().float() for p in self.params])
        self.optimizer.zero_grad(set_to_none=True)
        return flat

    def _record_senders(self, mb: list[Sample], per: CompletionStats, cross: bool,
                        log_ratio_sums: list[float] | None = None) -> None:
        """Per-sender sums for receiver feedback, from the loss's per-completion
        statistics (the filter decisions are the loss's own), except the log-ratio sums:
        ``log_ratio_sums`` (:func:`sender_log_ratio_sums`, float64 with per-token
        clamping), so that no sender's log-probs can make a report non-finite."""
        for i, s in enumerate(mb):
            st = self.sender_stats.setdefault(s.sender, SenderStats())
            st.completions += 1
            # what the gate decides about the sample, whatever the method (under ftis,
            # exactly the completions the loss filtered)
            st.filtered += int(per.gated[i])
            if cross:
                # Another tokenizer (often another family): a large sequence log-ratio is
                # expected there, so it is not reported as evidence about the sender; only
                # the count and the filter decisions are.
                st.cross_tokenizer_completions += 1
                continue
            n_tok = int(per.tokens[i])
            total = (float(log_ratio_sums[i]) if log_ratio_sums is not None
                     else _finite(float(per.log_ratio_sum[i])))
            st.tokens += n_tok
            st.log_ratio_sum += total
            st.truncated_tokens += int(per.truncated_tokens[i])
            if n_tok > 0:
                st.completion_log_ratio_sums.append(total)
                st.completion_tokens.append(n_tok)


def sender_log_ratio_sums(lp_old: torch.Tensor, lp_gen: torch.Tensor | None,
                          mask: torch.Tensor) -> list[float]:
    """Per completion, the sum over its tokens of ``lp_old - lp_gen`` (nats) for receiver
    feedback, safe against hostile log-probs: computed in float64 with each token's
    log-ratio clamped to ``[-20, 20]`` (the clamp :mod:`~ftis.client.learner.loss`
    applies before ``exp``; NaN counts as 0), so it is finite whatever the sender sent
    (at most 20 nats x tokens). The loss's own float32 sum is unclamped: two tokens of
    -FLT_MAX would make it infinite."""
    if lp_gen is None:
        return [0.0] * int(mask.shape[0])
    bound = loss_module._MAX_LOG_RATIO
    log_r = lp_old.detach().to(torch.float64) - lp_gen.detach().to(torch.float64)
    log_r = torch.nan_to_num(log_r, nan=0.0, posinf=bound, neginf=-bound).clamp(-bound, bound)
    zero = torch.zeros((), dtype=torch.float64, device=log_r.device)
    return torch.where(mask != 0, log_r, zero).sum(dim=-1).tolist()


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def log_ratio_stderr(sums: list[float], tokens: list[int]) -> float:
    """Standard error (nats/token) of the token-weighted mean log-ratio
    ``R = sum(sums) / sum(tokens)`` of one sender's completions, treating each completion
    as one independent draw (tokens within a completion are not independent).

    The ratio estimator's linearised (delta-method, cluster-robust) standard error
    (Cochran, *Sampling Techniques*, 3rd ed., 1977, section 6.4)::

        SE = sqrt(n / (n - 1) * sum_i (S_i - R * L_i) ** 2) / sum_i L_i

    with ``S_i`` the summed log-ratio (nats) and ``L_i`` the token count of completion
    ``i``. Shading every log-prob by the same amount moves ``R`` but not ``SE``, so
    ``R / SE`` measures how far a shift is from zero in units of its own noise (the
    coordinator's test, ``reputation.shift_detected``).

    Args:
        sums: per completion, the summed ``lp_learner - lp_gen`` (nats), finite.
        tokens: per completion, its token count (> 0), same length as ``sums``.

    Returns:
        the standard error, finite and >= 0; 0.0 for fewer than two completions (no
        spread can be estimated: the coordinator also needs a minimum count).

    Raises:
        ValueError: if the lengths differ or a token count is not positive.
    """
    if len(sums) != len(tokens):
        raise ValueError(f"{len(sums)} sums but {len(tokens)} token counts")
    if any(n <= 0 for n in tokens):
        raise ValueError("token counts must be > 0")
    n = len(sums)
    if n < 2:
        return 0.0
    total_tokens = float(sum(tokens))
    ratio = math.fsum(sums) / total_tokens
    residual = math.fsum((s - ratio * t) ** 2 for s, t in zip(sums, tokens, strict=True))
    return _finite(math.sqrt(n / (n - 1) * residual) / total_tokens)


@dataclass
class SenderStats:
    """What a receiver saw of one sender's completions in a step (sums over samples).

    ``log_ratio_sum`` is the sum over tokens of ``lp_learner - lp_gen`` (nats);
    ``filtered`` counts the completions the F-TIS gate marks (``A < 0`` and the step's
    gate statistic >= its threshold), whatever the method; ``truncated_tokens`` the
    tokens whose raw weight exceeds C. Both come from the loss's
    :class:`~ftis.client.learner.loss.CompletionStats`.
    """

    completions: int = 0
    tokens: int = 0
    log_ratio_sum: float = 0.0
    truncated_tokens: int = 0
    filtered: int = 0
    #: completions re-tokenized from another tokenizer (no token-level statistics)
    cross_tokenizer_completions: int = 0
    #: per token-aligned completion: its summed log-ratio (nats) and its token count
    completion_log_ratio_sums: list[float] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)

    @property
    def mean_log_ratio(self) -> float:
        """Mean log-ratio per token; always finite (0 if the sum ever were not)."""
        return _finite(self.log_ratio_sum / max(self.tokens, 1))

    @property
    def log_ratio_completions(self) -> int:
        """Token-aligned completions behind :attr:`mean_log_ratio`."""
        return len(self.completion_tokens)

    @property
    def log_ratio_stderr(self) -> float:
        """Standard error of :attr:`mean_log_ratio` (nats/token; :func:`log_ratio_stderr`)."""
        return log_ratio_stderr(self.completion_log_ratio_sums, self.completion_tokens)


class StatAccumulator:
    """Combines the :class:`~ftis.client.learner.loss.Stat` s of several micro-batches.

    Every statistic is combined by the :class:`~ftis.client.learner.loss.Reduction` it was
    declared with in :mod:`ftis.client.learner.loss`: token means weighted by the
    micro-batch's completion tokens, sequence means by its completions, maxima by
    ``max``. So the full-batch value is exact, and no statistic the loss produces can be
    dropped here. :meth:`finish` also reports ``samples_counted`` (completions seen).
    """

    def __init__(self) -> None:
        self.tokens = 0.0
        self.seqs = 0.0
        self.values: dict[str, float] = {}
        self.reductions: dict[str, Reduction] = {}

    def add(self, stats: dict[str, Stat], n_tok: int, n_seq: int) -> None:
        """Fold in one micro-batch's statistics (``n_tok`` tokens, ``n_seq`` completions)."""
        self.tokens += n_tok
        self.seqs += n_seq
        for name, stat in stats.items():
            red = self.reductions.setdefault(name, stat.reduction)
            if red is not stat.reduction:
                raise ValueError(f"statistic {name!r} changed reduction: {red} vs "
                                 f"{stat.reduction}")
            v = float(stat.value)
            if red is Reduction.MAX:
                self.values[name] = max(self.values.get(name, v), v)
            else:
                weight = n_tok if red is Reduction.TOKEN_MEAN else n_seq
                self.values[name] = self.values.get(name, 0.0) + v * weight

    def finish(self) -> dict[str, float]:
        """Full-batch values by name (empty when nothing was added)."""
        if not self.reductions:
            return {}
        out: dict[str, float] = {}
        for name, red in self.reductions.items():
            v = self.values[name]
            if red is Reduction.TOKEN_MEAN:
                v /= max(self.tokens, 1.0)
            elif red is Reduction.SEQ_MEAN:
                v /= max(self.seqs, 1.0)
            out[name] = v
        out["samples_counted"] = self.seqs
        return out
