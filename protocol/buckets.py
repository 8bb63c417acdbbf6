"""Bucketing math: the few batch shapes a worker warms up and captures, and which one a batch
pads to. The scheduler derives the buckets once (engine_buckets) and hands every worker the
same ones (messages.WarmupPlan). No process reads the SPMD_*_BUCKET_* environment: it is
folded into the bucket options where the config is made (protocol/config_resolve.py).

A range (min, step, max) ramps up from min by powers of two while below step, then goes up in
steps of `step` to max: (2, 32, 64) gives 2, 4, 8, 16, 32, 64. Prompt buckets are (batch size,
sequence length) pairs; decode buckets are (batch size, context length) pairs, context in tokens
(a multiple of the KV block size, so a bucket is also a whole number of context blocks), both
the product of their two ranges, keeping only those within the token budget.

Only what changes a graph deserves a bucket dimension. Where the workers capture CUDA graphs:
- prompt steps are packed (every chunk's tokens back to back, attention per chunk) and run
  eagerly at their own size, unpadded: a packed phase has no buckets;
- an attention kernel that reads each sequence's context length from a tensor (Triton, C++)
  needs no context dimension: decode buckets keep one context length, the longest (the block
  table's width), and vary the batch size in fine steps, as GPU engines capture them.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from spmd_runtime.protocol.config import EngineConfig, step_token_budget
from spmd_runtime.protocol.step_shape import Phase

Bucket = tuple[int, int]        # (batch size, sequence or context length)

PHASES = tuple(Phase)
DIMENSIONS = ("bs", "seq")


@dataclass(frozen=True)
class BucketRange:
    min: int
    step: int
    max: int

    def __post_init__(self) -> None:
        if not (1 <= self.min and 1 <= self.step and self.min <= self.max):
            raise ValueError(f"a bucket range needs 1 <= min <= max and step >= 1, got "
                             f"(min, step, max) = ({self.min}, {self.step}, {self.max})")

    @classmethod
    def parse(cls, text: str, default: BucketRange | None = None) -> BucketRange:
        """'min,step,max', as in an engine option; with a default, parts may be left empty
        (',,16': the default's min and step, max 16)."""
        parts = text.split(",")
        try:
            if len(parts) != 3 or (default is None and not all(parts)):
                raise ValueError
            low, step, high = (int(part) if part else getattr(default, name)
                               for part, name in zip(parts, ("min", "step", "max"), strict=True))
        except ValueError:
            raise ValueError(f"a bucket range is three integers 'min,step,max' (parts left "
                             f"empty take the default), got {text!r}") from None
        return cls(low, step, high)

    def values(self) -> list[int]:
        ramp_up = []
        value = self.min
        while value < self.step and value <= self.max:
            ramp_up.append(value)
            value *= 2
        stable = range(self.step, self.max + 1, self.step)
        return sorted(set(ramp_up).union(stable))

    def __str__(self) -> str:
        return f"[{self.min}, {self.step}, {self.max}]"


@dataclass(frozen=True)
class PhaseBuckets:
    """The buckets of one phase (prompt or decode) and how to pick one for a batch. A packed
    phase has none: its steps run unpadded, chunks back to back."""

    phase: Phase
    bs: BucketRange | None
    seq: BucketRange | None
    buckets: tuple[Bucket, ...]
    packed: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", Phase(self.phase))     # "prompt" as well

    @classmethod
    def packed_steps(cls, phase: Phase) -> PhaseBuckets:
        return cls(phase, None, None, (), packed=True)

    @classmethod
    def generate(cls, phase: Phase, bs: BucketRange, seq: BucketRange,
                 max_num_batched_tokens: int) -> PhaseBuckets:
        """All (bs, seq) pairs whose tokens fit the budget: bs x seq for a prompt, bs for a
        decode (one new token per sequence)."""
        phase = Phase(phase)
        buckets = tuple((b, s) for b in bs.values() for s in seq.values()
                        if phase.tokens(b, s) <= max_num_batched_tokens)
        return cls(phase, bs, seq, buckets)

    @cached_property
    def _lookup(self) -> tuple[list[int], list[int], frozenset[Bucket]]:
        """Sorted batch sizes, sorted lengths and the set of buckets (find runs per request
        the scheduler adds to a step)."""
        return (sorted({b for b, _ in self.buckets}), sorted({s for _, s in self.buckets}),
                frozenset(self.buckets))

    @cached_property
    def is_grid(self) -> bool:
        """Whether every (batch size, length) pair of the two ranges is a bucket (none cut by
        the token budget): a batch then fits if it is within both maxima."""
        bs_values, seq_values, members = self._lookup
        return len(members) == len(bs_values) * len(seq_values)

    def find(self, batch_size: int, length: int) -> Bucket | None:
        """The smallest bucket that fits the batch in both dimensions, or None if none does."""
        bs_values, seq_values, members = self._lookup
        i = bisect.bisect_left(bs_values, batch_size)
        j = bisect.bisect_left(seq_values, length)
        if i == len(bs_values) or j == len(seq_values):
            return None
        if (bs_values[i], seq_values[j]) in members:
            return bs_values[i], seq_values[j]
        fitting = [b for b in self.buckets if b[0] >= batch_size and b[1] >= length]
        return min(fitting, key=lambda b: (b[0] * b[1], b)) if fitting else None

    def config_line(self) -> str:
        if self.packed:
            return f"{self.phase.capitalize()} steps packed: unpadded, run eagerly"
        return (f"{self.phase.capitalize()} bucket config (min, step, max) bs:{self.bs}, "
                f"seq:{self.seq}")

    def list_line(self) -> str:
        return f"Generated {len(self.buckets)} {self.phase} buckets: {list(self.buckets)}"


def capture_order(buckets: tuple[Bucket, ...] | list[Bucket], strategy: str) -> list[Bucket]:
    """The order graphs are captured in: `max_bs` (batch size descending, then length
    ascending) or `min_tokens` (batch size x length ascending)."""
    if strategy == "max_bs":
        return sorted(buckets, key=lambda b: (-b[0], b[1]))
    if strategy == "min_tokens":
        return sorted(buckets, key=lambda b: (b[0] * b[1], b))
    raise ValueError(f"unknown capture strategy {strategy!r}: use max_bs or min_tokens")


@dataclass
class GraphPhaseReport:
    """What one phase captured, for the start-up log."""

    phase: Phase
    num_buckets: int
    captured: list[Bucket]
    used_bytes: int = 0

    def line(self) -> str:
        share = 100.0 * len(self.captured) / self.num_buckets if self.num_buckets else 0.0
        return (f"Graph/{self.phase.capitalize()} captured:{len(self.captured)} ({share:.1f}%) "
                f"used_mem:{format_bytes(self.used_bytes)} buckets:{sorted(self.captured)}")


def plan_graph_captures(buckets: Mapping[Phase, Sequence[Bucket]], budget_bytes: int,
                        prompt_ratio: float, strategies: Mapping[Phase, str],
                        capture: Callable[[Phase, Bucket], int]) -> dict[Phase, GraphPhaseReport]:
    """Capture graphs phase by phase, each in its strategy's order, within a memory budget.

    The budget is split prompt_ratio : 1 - prompt_ratio. A phase captures buckets in order
    while its estimate of the next one (bytes per token of what it captured so far, times the
    bucket's batch size x length) fits what is left of its share, skipping those that do not
    (a smaller one further on may). Then a second pass offers the memory the first left unused
    to each phase in turn. `capture(phase, bucket)` captures one and returns the bytes it took;
    the phase's first capture has no estimate and always runs."""
    reports = {phase: GraphPhaseReport(phase, len(buckets.get(phase, ())), [])
               for phase in PHASES}
    queues = {phase: capture_order(list(buckets.get(phase, ())), strategies[phase])
              for phase in PHASES}
    tokens_captured = dict.fromkeys(PHASES, 0)

    def run(phase: Phase, allowance: float) -> None:
        report, skipped = reports[phase], []
        for bucket in queues[phase]:
            tokens = bucket[0] * bucket[1]
            if tokens_captured[phase]:
                estimate = report.used_bytes / tokens_captured[phase] * tokens
                if report.used_bytes + estimate > allowance:
                    skipped.append(bucket)
                    continue
            elif allowance <= 0:
                skipped.append(bucket)
                continue
            report.used_bytes += max(0, capture(phase, bucket))
            report.captured.append(bucket)
            tokens_captured[phase] += tokens
        queues[phase] = skipped

    shares = {Phase.PROMPT: budget_bytes * prompt_ratio,
              Phase.DECODE: budget_bytes * (1 - prompt_ratio)}
    for phase in PHASES:
        run(phase, shares[phase])
    for phase in PHASES:
        if queues[phase]:
            left = budget_bytes - sum(r.used_bytes for r in reports.values())
            run(phase, reports[phase].used_bytes + left)
    return reports


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(num_bytes) < 1024:
            return f"{num_bytes:.4g} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.4g} GiB"


def default_ranges(phase: Phase, *, max_num_seqs: int, max_num_batched_tokens: int,
                   max_model_len: int, block_size: int, context_from_tensors: bool = False,
                   fine_batches: bool = False) -> dict[str, BucketRange]:
    """Ranges that cover what the scheduler can plan: up to max_num_seqs sequences, prompt
    chunks up to the token budget, decode contexts up to max_model_len.

    context_from_tensors: the attention kernel reads context lengths from a tensor, so decode
    buckets have one context length, the longest. fine_batches: decode batch sizes go up in
    steps of 8 past 8 (graphs are cheap to have many of), not 32."""
    step = max(block_size, 128 // block_size * block_size)
    if phase is Phase.PROMPT:
        longest = min(max_num_batched_tokens, max_model_len)
        seq = BucketRange(min(step, longest), step, max(step, _round_up(longest, step)))
        return {"bs": BucketRange(1, 32, max(1, min(max_num_seqs, max_num_batched_tokens // seq.min))),
                "seq": seq}
    longest = max(step, _round_up(max_model_len, step))
    return {"bs": BucketRange(1, 8 if fine_batches else 32, max_num_seqs),
            "seq": BucketRange(longest, longest, longest) if context_from_tensors
            else BucketRange(step, step, longest)}


def resolve_ranges(options: Mapping[str, str], defaults: dict[str, BucketRange]
                   ) -> dict[str, BucketRange]:
    """Per dimension: the engine option ('min,step,max', parts left empty taking the
    default's; the environment's SPMD_*_BUCKET_* were folded into it where the config was
    made, protocol/config_resolve.py), else the default."""
    return {dimension: BucketRange.parse(options[dimension], defaults[dimension])
            if options.get(dimension) else defaults[dimension] for dimension in DIMENSIONS}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def execution_mode(config: EngineConfig, device_type: str) -> str:
    """--execution-mode with auto resolved: compiled on CUDA (graphs), eager on CPU. With
    speculative decoding too: a request verifying k proposals takes k + 1 rows of a decode
    bucket (scheduler_proc.speculation)."""
    if config.execution_mode == "auto":
        return "compiled" if device_type == "cuda" else "eager"
    return config.execution_mode


def compiling(config: EngineConfig, device_type: str = "cpu") -> bool:
    """Whether a CPU worker compiles its layer pieces: --execution-mode compiled, unless the
    projections are quantized (their integer GEMM runs eagerly). spmdrun makes
    --quantization auto concrete before any process starts; a scheduler started by hand with it
    takes it as none (its workers, if they keep GGUF blocks, then warm its buckets up eagerly)."""
    return (device_type != "cuda" and execution_mode(config, device_type) == "compiled"
            and config.quantization in ("none", "auto"))


def graphs_enabled(config: EngineConfig, device_type: str) -> bool:
    """Whether a worker captures CUDA graphs of its buckets: compiled on CUDA, but for GGUF
    blocks (expanded by torch operations at each product, eagerly)."""
    return (device_type == "cuda" and execution_mode(config, device_type) == "compiled"
            and config.quantization != "gguf")


def bucketing_enabled(config: EngineConfig, device_type: str = "cpu") -> bool:
    """Whether batches are padded to buckets: bucketed, or compiled where there is something
    to compile or capture (padding alone only costs)."""
    mode = execution_mode(config, device_type)
    return mode == "bucketed" or (mode == "compiled" and (
        device_type == "cuda" or compiling(config, device_type)))


def packs_prompts(config: EngineConfig, device_type: str) -> bool:
    """Whether prompt steps run packed and unpadded: where the workers capture graphs (prompt
    steps, compute-bound, gain little from a graph) and no prompt bucket is asked for."""
    asked = config.prompt_bs_bucket or config.prompt_seq_bucket
    return graphs_enabled(config, device_type) and not asked


def engine_buckets(config: EngineConfig, max_model_len: int, device_type: str = "cpu",
                   context_from_tensors: bool = False) -> dict[Phase, PhaseBuckets]:
    """The prompt and decode buckets of an engine, from its configuration, the model's
    context length, the workers' device and whether their attention reads context lengths
    from tensors; the scheduler's, which every worker then warms up."""
    options = {Phase.PROMPT: {"bs": config.prompt_bs_bucket, "seq": config.prompt_seq_bucket},
               Phase.DECODE: {"bs": config.decode_bs_bucket, "seq": config.decode_seq_bucket}}
    buckets, budget = {}, step_token_budget(config, device_type)
    for phase in PHASES:
        if phase is Phase.PROMPT and packs_prompts(config, device_type):
            buckets[phase] = PhaseBuckets.packed_steps(phase)
            continue
        defaults = default_ranges(phase, max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=budget,
                                  max_model_len=max_model_len, block_size=config.block_size,
                                  context_from_tensors=context_from_tensors,
                                  fine_batches=graphs_enabled(config, device_type))
        ranges = resolve_ranges(options[phase], defaults)
        if phase is Phase.DECODE and any(v % config.block_size for v in ranges["seq"].values()):
            raise ValueError(f"decode context buckets {ranges['seq'].values()} must be multiples "
                             f"of the KV block size {config.block_size}")
        buckets[phase] = PhaseBuckets.generate(phase, ranges["bs"], ranges["seq"], budget)
    return buckets
