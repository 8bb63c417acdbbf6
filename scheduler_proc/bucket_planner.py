"""Bucketed steps: each step is a prompt step or a decode step whose batch fits one of the
buckets every worker has warmed up, and the plan names that bucket so every rank pads alike.
A packed phase (protocol.buckets) has no buckets: its steps run unpadded, limited only by the
token budget."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from spmd_runtime.protocol.buckets import PhaseBuckets
from spmd_runtime.protocol.step_shape import DECODE, PROMPT, Phase, StepShape
from spmd_runtime.scheduler_proc.policy import Policy
from spmd_runtime.scheduler_proc.request import Request

log = logging.getLogger("spmd.scheduler")

@dataclass
class BucketCounters:
    batches_outside_buckets: int = 0   # ran unpadded: larger than the largest bucket
    padded_tokens: int = 0             # padding rows/positions the workers computed
    computed_tokens: int = 0           # real tokens of bucketed and packed steps

    @property
    def padding_waste(self) -> float:
        return self.padded_tokens / self.computed_tokens if self.computed_tokens else 0.0


def phase_of(request: Request) -> Phase:
    return Phase.of(request.num_tokens - request.num_computed_tokens)


class BucketPlanner:
    def __init__(self, buckets: dict[Phase, PhaseBuckets], policy: Policy) -> None:
        self.buckets = buckets
        self.policy = policy
        self.max_bs = {phase: max((b for b, _ in pb.buckets), default=0)
                       for phase, pb in buckets.items()}
        self.max_len = {phase: max((s for _, s in pb.buckets), default=0)
                        for phase, pb in buckets.items()}
        self.counters = BucketCounters()
        self._last_phase = Phase.PROMPT

    def pick_phase(self, running: Sequence[Request], head_of_swapped: Request | None,
                   has_waiting: bool) -> Phase:
        """prefill_first: a prompt step whenever prefill work exists. fifo: decodes first, but
        prompt and decode steps alternate while both have work, so neither starves."""
        # Whether each request decodes (phase_of, inlined: this walks every running request).
        decoding = {r.num_tokens - r.num_computed_tokens == 1 for r in running}
        if head_of_swapped is not None:
            decoding.add(phase_of(head_of_swapped) is DECODE)
        if not has_waiting and False not in decoding:
            return DECODE
        if True not in decoding or self.policy == "prefill_first":
            return PROMPT
        return self._last_phase.other

    def take(self, phase: Phase, request: Request, num_tokens: int, num_seqs: int,
             longest: int) -> tuple[int, int]:
        """How many of its next `num_tokens` tokens the request computes in a step of `phase`
        that would then hold `num_seqs` sequences, and the step's length dimension with it
        (chunk length for a prompt step, context length for a decode step; `longest` before
        it). (0, longest) where no bucket would fit it."""
        if phase is DECODE:
            num_new, length = 1, request.num_computed_tokens + 1
        else:
            num_new = num_tokens if self.buckets[phase].packed else min(num_tokens,
                                                                        self.max_len[phase])
            length = num_new
        length = max(longest, length)
        return (num_new, length) if self.fits(phase, num_seqs, length) else (0, longest)

    def fits(self, phase: Phase, num_seqs: int, longest: int) -> bool:
        """Whether a step may hold `num_seqs` sequences, the longest `longest`: if some bucket
        has room for them; a lone sequence always may, and so may sequences longer than every
        bucket, up to the largest batch size (that step runs unpadded anyway)."""
        buckets = self.buckets[phase]
        if num_seqs == 1 or buckets.packed:
            return True
        if buckets.is_grid and num_seqs <= self.max_bs[phase] and longest <= self.max_len[phase]:
            return True
        if buckets.find(num_seqs, longest) is not None:
            return True
        return longest > self.max_len[phase] and num_seqs <= self.max_bs[phase]

    def shape_for(self, phase: Phase, num_seqs: int, longest: int, num_tokens: int
                  ) -> StepShape | None:
        """The bucket a finished step runs as (None: packed, or outside every bucket;
        unpadded either way)."""
        self._last_phase = phase
        if self.buckets[phase].packed:
            self.counters.computed_tokens += num_tokens
            return None
        bucket = self.buckets[phase].find(num_seqs, longest)
        if bucket is None:
            self.counters.batches_outside_buckets += 1
            if self.counters.batches_outside_buckets == 1:
                log.warning("a %s batch of %d sequences (longest %d) is larger than every "
                            "bucket: it runs unpadded; raise the bucket maxima (further ones "
                            "are counted in stats, batches_outside_buckets)", phase, num_seqs,
                            longest)
            return None
        shape = StepShape(phase, *bucket)
        self.counters.padded_tokens += shape.num_tokens - num_tokens
        self.counters.computed_tokens += num_tokens
        return shape
