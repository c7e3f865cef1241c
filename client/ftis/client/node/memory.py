"""Peak-memory estimate of a client configuration, checked against ``--max-memory``.

A node that would be killed by the operating system (or swap the machine to a halt)
halfway through its first learner step is worse than one that refuses to start, so
``ftis-client start --max-memory 6GiB`` estimates the peak resident memory of the
configuration *before* loading any weights and exits with ``MEMORY_BUDGET`` (exit code
6) when it does not fit, naming the largest parts and what to change.

The estimate (:func:`estimate_peak_memory`) is a sum of parts, in bytes, for the phase
that peaks (``load``, ``generation`` or ``learning``; a first start that must still
dequantize a GGUF has a one-off ``conversion`` phase):

* ``baseline`` -- Python with torch, transformers, peft, grpc and the client imported;
* ``weights`` -- 4 bytes per parameter in float32; with QLoRA every ``nn.Linear`` but the
  LM head holds 4-bit NF4 codes (0.5 byte) plus one float32 scale per 64 weights
  (double quantization: an 8-bit scale plus a float32 one per 256 blocks), while
  embeddings, norms and the LM head stay float32; LoRA adapters are float32;
* ``optimizer`` -- gradients and the two AdamW moments: exactly 12 bytes per trainable
  parameter (``rank * (in + out)`` per adapted linear with LoRA);
* learning, on top of those: the larger of one micro-batch's forward + backward --
  ``logits``, ``micro_batch * (max_new_tokens + 1) * vocab * 4`` bytes times
  :data:`LOGITS_COPIES` (logits, the log-softmax row, their gradients), and
  ``activations``, per token of the micro-batch (prompt + completion) and layer
  :data:`ACTIVATION_FLOATS` float32 values (QLoRA: times
  :data:`QLORA_ACTIVATION_FACTOR`) -- and ``optimizer_step``, AdamW's
  temporaries during ``step()`` (about one float32 copy of the trainable parameters);
* generation: ``kv_cache`` -- ``2 * layers * rows * kv_heads * head_dim * (prompt +
  max_new_tokens) * 4`` bytes, with ``rows = local_groups * group_size`` (the sampler
  generates all own groups in one batch), plus ``logits`` of one step (a few
  ``rows * vocab`` float32 copies) and the prefill's activations; the AdamW moments of
  earlier steps stay allocated (8 bytes per trainable parameter);
* ``load`` -- float32 weights are views of the memory-mapped safetensors file; QLoRA
  reads the whole file and quantizes copies of its tensors (up to twice the float32
  model, measured 1.0-2.0 times, besides the 4-bit weights).

The coefficients were calibrated against the peak RSS (``ru_maxrss``) of real rounds on
SmolLM2-135M (``bench/memory_budget.py``; numbers in docs/heterogeneity.md) and round
up: the estimate is meant to be within about 25 % and on the high side. Prompt lengths
are not known before tasks are leased; :data:`DEFAULT_PROMPT_TOKENS` is assumed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GiB = 1024**3
MiB = 1024**2

#: Python + torch + transformers + peft + grpc + the client imported, plus the modules a
#: model load imports (measured 0.33 GiB after imports on Linux x86-64, torch 2.13 CPU;
#: rounded up).
BASELINE_BYTES = 500 * MiB
#: Prompt tokens assumed per rollout. ReasoningGYM prompts with SmolLM2's chat template
#: measure 39-243 tokens (chain_sum 48-78, gsm_symbolic 71-166, number_sorting 197-243).
DEFAULT_PROMPT_TOKENS = 128
#: Float32 ``[micro_batch, K + 1, vocab]`` tensors live at once in the learner's peak.
LOGITS_COPIES = 4.0
#: Bytes per token and layer of one micro-batch's forward + backward, as multiples of
#: (hidden size, intermediate size, heads * sequence length) float32 values. Calibrated
#: on SmolLM2-135M with glibc's default allocator, whose heap fragmentation (freed
#: activations of the previous micro-batch are not all reusable) is included: about 80
#: KB per token and layer where the tensors autograd keeps come to about 35 KB. The
#: same for a trainable and a frozen base (the frozen base keeps fewer tensors but
#: fragments as much).
ACTIVATION_FLOATS = (18.0, 7.0, 2.0)
#: QLoRA: bitsandbytes dequantizes every 4-bit layer to a float32 temporary in each
#: forward and backward; interleaved with the saved activations these fragment the
#: heap further (measured: 0-45 % more than LoRA's activations, 20 % assumed).
QLORA_ACTIVATION_FACTOR = 1.2
#: bitsandbytes NF4 block size (one absmax scale per block).
NF4_BLOCK = 64


class MemoryBudgetError(RuntimeError):
    """The configuration's estimated peak memory exceeds ``--max-memory``."""


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
          "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
          "kib": 1024, "mib": MiB, "gib": GiB, "tib": 1024**4}


def checked_size(text: str | None) -> str | None:
    """``text`` unchanged if it is ``None`` or a size :func:`parse_size` reads (the
    pydantic validator of the ``max_memory`` settings).

    Raises:
        ValueError: naming the accepted forms.
    """
    if text is not None:
        parse_size(text)
    return text


def parse_size(text: str | int) -> int:
    """Bytes of a size like ``"6GiB"``, ``"512MiB"``, ``"8GB"``, ``"1.5g"`` or ``"1048576"``.

    ``KiB/MiB/GiB/TiB`` are powers of 1024, ``KB/MB/GB/TB`` (and ``K/M/G/T``) powers of
    1000; case and a space before the unit do not matter.

    Raises:
        ValueError: not a positive size with one of those units.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {text!r} as a memory size; use e.g. 6GiB, 512MiB, "
                             f"8GB or a number of bytes")
        value, unit = float(m.group(1)), m.group(2).lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return size


def format_gib(n: int | float) -> str:
    """``n`` bytes in GiB with one decimal (two below 0.1 GiB)."""
    g = n / GiB
    return f"{g:.2f}" if g < 0.1 else f"{g:.1f}"


def format_size(n: int | float) -> str:
    """``n`` bytes as ``"3.1 GiB"``, or ``"512 MiB"`` below 1 GiB."""
    return f"{format_gib(n)} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


@dataclass(frozen=True)
class Architecture:
    """What the estimate needs to know about a causal LM (see :func:`architecture_of`).

    Attributes:
        parameters: distinct parameters (tied embeddings counted once).
        linears: ``(qualified name, in_features, out_features)`` of every ``nn.Linear``
            except the LM head (the layers bitsandbytes quantizes and LoRA can target).
        vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
        head_dim: from the model's config.
    """

    parameters: int
    linears: tuple[tuple[str, int, int], ...]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def linear_parameters(self) -> int:
        return sum(i * o for _, i, o in self.linears)

    def lora_parameters(self, rank: int, targets: tuple[str, ...] | list[str]) -> int:
        """Trainable parameters of rank-``rank`` LoRA on the linears named ``targets``.

        A target matches a module whose qualified name equals it or ends with
        ``"." + target`` (PEFT's rule for a list of names).
        """
        return sum(rank * (i + o) for name, i, o in self.linears
                   if any(name == t or name.endswith("." + t) for t in targets))


def architecture_of(config: Any) -> Architecture:
    """:class:`Architecture` of a ``transformers`` config, built on the meta device.

    No weights are allocated: the model is instantiated under ``torch.device("meta")``
    to count parameters and list its linear layers exactly.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    linears = tuple((name, m.in_features, m.out_features) for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and m is not head)
    params = sum(p.numel() for p in model.parameters())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    heads = int(getattr(text, "num_attention_heads", 1))
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    return Architecture(
        parameters=params, linears=linears, vocab_size=int(text.vocab_size),
        hidden_size=hidden,
        intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * hidden),
        num_layers=int(text.num_hidden_layers), num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak resident memory of a configuration.

    Attributes:
        phases: bytes per part of every phase (``"load"``, ``"generation"``,
            ``"learning"`` and, for a GGUF not converted yet, ``"conversion"``).
        phase: the phase that peaks.
        parameters: base parameters; ``trainable``: trainable parameters.
        peft: the PEFT kind estimated.
    """

    phases: dict[str, dict[str, int]]
    phase: str
    parameters: int = 0
    trainable: int = 0
    peft: str = "none"

    @property
    def breakdown(self) -> dict[str, int]:
        """Bytes per part of the peaking phase; they sum to :attr:`total`."""
        return self.phases[self.phase]

    @property
    def total(self) -> int:
        return sum(self.breakdown.values())

    def phase_total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    def summary(self) -> str:
        """``"weights 0.5, optimizer 1.6, ..."`` (GiB, largest first)."""
        parts = sorted(self.breakdown.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{k.replace('_', ' ')} {format_gib(v)}" for k, v in parts)


def estimate_peak_memory(
    arch: Architecture,
    *,
    peft: str = "none",
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] | list[str] | None = None,
    double_quant: bool = False,
    local_groups: int | None = None,
    external_groups: int | None = None,
    group_size: int | None = None,
    max_new_tokens: int | None = None,
    micro_batch_size: int | None = None,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    needs_conversion: bool = False,
    baseline: int = BASELINE_BYTES,
) -> MemoryEstimate:
    """Peak resident memory of a node with these settings (see the module docstring).

    Pure arithmetic on ``arch`` and the settings; nothing is loaded or allocated.

    Args:
        arch: the model (:func:`architecture_of`).
        peft: ``none``, ``lora`` or ``qlora``.
        lora_rank, lora_targets: LoRA settings (ignored for ``none``).
        double_quant: QLoRA with double quantization of the scales.
        local_groups, external_groups, group_size: I, J and G of a round.
        max_new_tokens, micro_batch_size: generation length and learner micro-batch.
        (``None``: the default of the :class:`~ftis.client.node.config.ClientConfig`
        field of that name, ``lora_*`` included: one source of defaults.)
        prompt_tokens: assumed prompt length (tokens).
        needs_conversion: the model is a GGUF not yet dequantized to the cache.
        baseline: bytes of the process before any model is loaded.

    Raises:
        ValueError: unknown ``peft``.
    """
    from ftis.client.models.peft import PEFT_KINDS
    from ftis.client.node.config import client_default

    if peft not in PEFT_KINDS:
        raise ValueError(f"peft must be one of {', '.join(PEFT_KINDS)}, got {peft!r}")
    lora_rank = client_default("lora_rank", lora_rank)
    lora_targets = tuple(client_default("lora_targets", lora_targets))
    local_groups = client_default("local_groups", local_groups)
    external_groups = client_default("external_groups", external_groups)
    group_size = client_default("group_size", group_size)
    max_new_tokens = client_default("max_new_tokens", max_new_tokens)
    micro_batch_size = client_default("micro_batch_size", micro_batch_size)
    f32 = 4
    n = arch.parameters
    if peft == "none":
        trainable = n
    else:
        trainable = arch.lora_parameters(lora_rank, lora_targets)
    # ---- weights
    if peft == "qlora":
        q = arch.linear_parameters
        scale_bytes = (1 / NF4_BLOCK + f32 / (NF4_BLOCK * 256)) if double_quant \
            else f32 / NF4_BLOCK
        weights = int(q * (0.5 + scale_bytes)) + (n - q) * f32
    else:
        weights = n * f32
    if peft != "none":
        weights += trainable * f32  # the adapters themselves
    optimizer = 12 * trainable  # gradient + AdamW exp_avg + exp_avg_sq, float32
    optimizer_step = trainable * f32
    # ---- learning: one micro-batch forward + backward (gradients of the earlier
    # micro-batches and the AdamW moments already allocated), or the optimizer step
    mb = min(micro_batch_size, (local_groups + external_groups) * group_size)
    seq = prompt_tokens + max_new_tokens
    logits = int(LOGITS_COPIES * mb * (max_new_tokens + 1) * arch.vocab_size * f32)
    h_mult, i_mult, s_mult = ACTIVATION_FLOATS
    per_token_layer = (h_mult * arch.hidden_size + i_mult * arch.intermediate_size
                       + s_mult * arch.num_heads * seq) * f32
    activations = int(mb * seq * arch.num_layers * per_token_layer)
    if peft == "qlora":
        activations = int(activations * QLORA_ACTIVATION_FACTOR)
    learning = {"baseline": baseline, "weights": weights, "optimizer": optimizer}
    if logits + activations >= optimizer_step:
        learning |= {"logits": logits, "activations": activations}
    else:
        learning["optimizer_step"] = optimizer_step
    # ---- generation: all local groups in one batch over a KV cache; the AdamW moments
    # of earlier steps stay allocated (gradients are freed after each step).
    rows = local_groups * group_size
    kv = 2 * arch.num_layers * rows * arch.num_kv_heads * arch.head_dim * seq * f32
    gen_logits = 4 * rows * arch.vocab_size * f32
    prefill = rows * prompt_tokens * (4 * arch.hidden_size + 2 * arch.intermediate_size) * f32
    generation = {"baseline": baseline, "weights": weights, "optimizer": 8 * trainable,
                  "kv_cache": kv, "logits": gen_logits + prefill}
    phases = {"learning": learning, "generation": generation}
    # ---- loading. Float32 weights are views of the memory-mapped safetensors file (the
    # file's pages are the weights). QLoRA reads the whole file and quantizes from
    # copies of its tensors: up to twice the float32 model besides the 4-bit weights.
    # A GGUF's first start also holds the dequantized model twice.
    phases["load"] = {"baseline": baseline, "weights": weights}
    if peft == "qlora":
        phases["load"]["load"] = 2 * n * f32
    if needs_conversion:
        phases["conversion"] = {"baseline": baseline, "conversion": 2 * n * f32}
    peak = max(phases, key=lambda k: sum(phases[k].values()))
    return MemoryEstimate(phases=phases, phase=peak, parameters=n, trainable=trainable,
                          peft=peft)


def check_memory_budget(estimate: MemoryEstimate, budget: int | None,
                        flag: str = "--max-memory") -> None:
    """Raise :class:`MemoryBudgetError` if ``estimate`` exceeds ``budget`` bytes.

    ``budget=None`` means no limit. The message is one line: the estimate, its largest
    parts, the budget and what to change.
    """
    if budget is None or estimate.total <= budget:
        return
    lighter = {"none": "--peft lora or --peft qlora", "lora": "--peft qlora"}.get(estimate.peft)
    parts = estimate.breakdown
    weighty = 4 * (parts.get("weights", 0) + parts.get("optimizer", 0)) >= estimate.total
    hints = []
    if estimate.phase == "learning":
        hints = [lighter] if lighter and weighty else []
        hints.append("a smaller --micro-batch-size or --max-new-tokens")
    elif estimate.phase == "generation":
        hints = ["fewer --local-groups, a smaller --group-size or --max-new-tokens"]
    elif estimate.phase == "load":
        hints = ["--peft qlora" if estimate.peft != "qlora" else "a smaller model"]
    else:
        hints = ["convert the GGUF once on a larger machine or use a smaller model"]
    raise MemoryBudgetError(
        f"configuration needs about {format_size(estimate.total)} at its peak "
        f"({estimate.phase}, GiB: {estimate.summary()}) but {flag} is "
        f"{format_size(budget)}; try {', or '.join(hints)}")


def _config_of(name: str) -> tuple[Any, bool]:
    """``(transformers config, needs_conversion)`` of model ``name`` without its weights.

    Reads ``config.json`` of a model directory, hub snapshot or converted GGUF copy
    (:func:`~ftis.client.models.registry.converted_dir`); a GGUF that was never converted
    has its config read from the GGUF metadata (an assembled embedded model's GGUF is
    assembled first, as the start would do anyway).
    """
    from transformers import AutoConfig

    from ftis.client.models import registry

    resolved = registry.resolve(name)
    if resolved.gguf_file is None:
        return AutoConfig.from_pretrained(resolved.path), False
    converted = registry.converted_dir(resolved)
    if converted is not None and (converted / "config.json").exists():
        return AutoConfig.from_pretrained(converted), False
    gguf = Path(resolved.path) / resolved.gguf_file
    if not gguf.exists() and resolved.prepare is not None:
        gguf = resolved.prepare()
    return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name), True


def estimate_for_config(cfg: Any, prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> MemoryEstimate:
    """:func:`estimate_peak_memory` of a :class:`~ftis.client.node.config.ClientConfig`.

    Raises:
        ModelNotFoundError: ``cfg.model`` cannot be resolved.
    """
    config, needs_conversion = _config_of(cfg.model)
    return estimate_peak_memory(
        architecture_of(config), peft=cfg.peft, lora_rank=cfg.lora_rank,
        lora_targets=tuple(cfg.lora_targets), double_quant=cfg.qlora_double_quant,
        local_groups=cfg.local_groups, external_groups=cfg.external_groups,
        group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
        micro_batch_size=cfg.micro_batch_size, prompt_tokens=prompt_tokens,
        needs_conversion=needs_conversion)


# ---------------------------------------------------------------------- before each round

#: Memory left to the rest of the machine when a round starts (bytes): a round that
#: would take the last few hundred MiB makes the machine swap or wakes the OOM killer.
ROUND_MEMORY_RESERVE = 256 * MiB
#: Seconds between checks while a round waits for memory to free up.
ROUND_MEMORY_POLL_S = 30.0


class RoundMemoryError(MemoryBudgetError):
    """A round can never fit: its estimate exceeds ``--max-memory`` or the machine's
    total memory (less :data:`ROUND_MEMORY_RESERVE`)."""


@dataclass(frozen=True)
class RoundMemoryDecision:
    """The answer of :func:`decide_round_memory`.

    Attributes:
        action: ``"run"`` (lease now), ``"wait"`` (not now, memory may free up) or
            ``"exit"`` (can never fit).
        needed: the round's estimated peak resident memory, bytes.
        extra: what the round needs beyond the process's resident memory now, bytes.
        available: memory available to new allocations now, bytes.
        reason: one line for the volunteer (empty for ``"run"``).
    """

    action: str
    needed: int
    extra: int
    available: int
    reason: str = ""


def round_hints(phase: str) -> str:
    """Flags that shrink the ``phase`` (``generation`` or ``learning``) of a round."""
    if phase == "generation":
        return "lower --local-groups, --group-size or --max-new-tokens"
    return "lower --micro-batch-size or --max-new-tokens"


def decide_round_memory(needed: int, rss: int, available: int, total: int,
                        cap: int | None = None, phase: str = "learning",
                        reserve: int = ROUND_MEMORY_RESERVE) -> RoundMemoryDecision:
    """Whether a round whose peak is estimated at ``needed`` bytes may start now.

    Pure arithmetic, all sizes in bytes:

    * ``"exit"`` when ``needed > cap`` (``--max-memory``), or ``needed > total -
      reserve``: it will never fit on this machine;
    * ``"wait"`` when ``extra = max(needed - rss, 0)`` (the process already holds
      ``rss``: weights, optimizer state, allocator pools) exceeds ``available - reserve``
      (``psutil.virtual_memory().available``): other programs hold the memory now and
      may free it (a process that already holds ``needed`` needs nothing more: waiting
      could not help);
    * ``"run"`` otherwise.

    ``phase`` names the part that peaks, for the hint in ``reason``.
    """
    extra = max(needed - rss, 0)
    mib = lambda n: f"{n / MiB:,.0f} MiB"  # noqa: E731
    hint = round_hints(phase)
    if cap is not None and needed > cap:
        return RoundMemoryDecision(
            "exit", needed, extra, available,
            f"round needs ~{mib(needed)} at its peak ({phase}), above --max-memory "
            f"{mib(cap)}; {hint}, or raise --max-memory")
    if needed > total - reserve:
        return RoundMemoryDecision(
            "exit", needed, extra, available,
            f"round needs ~{mib(needed)} at its peak ({phase}) but this machine has "
            f"{mib(total)} in all ({mib(reserve)} kept free); {hint}")
    if extra > 0 and extra > available - reserve:
        return RoundMemoryDecision(
            "wait", needed, extra, available,
            f"round needs ~{mib(extra)} more ({mib(needed)} at its peak, {phase}), "
            f"{mib(max(available - reserve, 0))} available ({mib(reserve)} kept free); "
            f"waiting for memory, or {hint}")
    return RoundMemoryDecision("run", needed, extra, available)


def round_peak(estimate: MemoryEstimate) -> tuple[int, str]:
    """``(bytes, phase)`` of the larger of a round's two phases, generation and learning
    (loading and GGUF conversion happen once, before the first round)."""
    phase = max(("generation", "learning"), key=estimate.phase_total)
    return estimate.phase_total(phase), phase


def device_round_peak(estimate: MemoryEstimate) -> int:
    """Bytes a round needs on an accelerator: :func:`round_peak` without the ``baseline``
    (the Python process and its imports, which stay in host memory). Weights, optimizer
    state, activations, logits and the key/value cache all live on the device."""
    needed, phase = round_peak(estimate)
    return needed - estimate.phases[phase].get("baseline", 0)


def memory_snapshot() -> tuple[int, int, int]:
    """``(rss, available, total)`` in bytes: this process's resident set size and
    ``psutil.virtual_memory()``'s ``available`` and ``total``."""
    import psutil

    vm = psutil.virtual_memory()
    return psutil.Process().memory_info().rss, int(vm.available), int(vm.total)


class RoundMemoryGuard:
    """Called before each round, before anything is leased: returns when the round
    fits, waits (polling every ``poll_s`` seconds, holding no lease) while it does not
    fit the memory available now, raises :class:`RoundMemoryError` when it never will.

    Args:
        needed: the round's estimated peak, bytes (:func:`round_peak`).
        phase: the phase that peaks (``generation`` or ``learning``).
        cap: ``--max-memory`` in bytes, ``None`` for none.
        probe: ``() -> (rss, available, total)`` bytes (default :func:`memory_snapshot`).
        on_wait: called with each waiting decision whose reason changed, and with
            ``None`` once the round may run after a wait.
        sleep: ``time.sleep``, replaceable in tests.
        poll_s: seconds between checks while waiting (default
            :data:`ROUND_MEMORY_POLL_S`).
        reserve: bytes left to the rest of the machine.
        recheck: called after every poll while waiting, and may block: the volunteer
            settings' pause gate (``RoundGate``), so that a node that waited for memory
            does not start its round while the settings have paused it meanwhile.
    """

    def __init__(self, needed: int, phase: str, cap: int | None = None, *,
                 probe: Any = None, on_wait: Any = None, sleep: Any = None,
                 poll_s: float | None = None, reserve: int = ROUND_MEMORY_RESERVE,
                 recheck: Any = None) -> None:
        import time

        self.needed, self.phase, self.cap = needed, phase, cap
        self.probe, self.on_wait = probe or memory_snapshot, on_wait
        self.sleep = sleep or time.sleep
        self.poll_s = ROUND_MEMORY_POLL_S if poll_s is None else poll_s
        self.reserve = reserve
        self.recheck = recheck
        #: seconds spent waiting for memory, all rounds together
        self.waited_s = 0.0

    def __call__(self) -> RoundMemoryDecision:
        """Block until the round fits; returns the decision that let it run.

        Raises:
            RoundMemoryError: it can never fit (message: the reason, with what to change).
        """
        import logging

        log = logging.getLogger(__name__)
        last_reason = None
        while True:
            rss, available, total = self.probe()
            d = decide_round_memory(self.needed, rss, available, total, self.cap,
                                    self.phase, self.reserve)
            if d.action == "exit":
                raise RoundMemoryError(d.reason)
            if d.action == "run":
                if last_reason is not None:
                    log.warning("memory available again (%s MiB); resuming",
                                f"{d.available / MiB:,.0f}")
                    if self.on_wait:
                        self.on_wait(None)
                return d
            if d.reason != last_reason:
                log.warning("%s", d.reason)
                if self.on_wait:
                    self.on_wait(d)
                last_reason = d.reason
            self.sleep(self.poll_s)
            self.waited_s += self.poll_s
            if self.recheck is not None:
                self.recheck()
