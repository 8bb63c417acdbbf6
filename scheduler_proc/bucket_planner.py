"""Bucketed steps: each step is a prompt step or a decode step whose batch fits one of the
buckets every worker has warmed up, and the plan names that bucket so every rank pads alike."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spmd_runtime.protocol.buckets import Bucket, PhaseBuckets, bucket_tokens
from spmd_runtime.scheduler_proc.policy import Policy
from spmd_runtime.scheduler_proc.request import Request


@dataclass
class BucketCounters:
    batches_outside_buckets: int = 0   # ran unpadded: larger than the largest bucket
    padded_tokens: int = 0             # padding rows/positions the workers computed
    computed_tokens: int = 0           # real tokens of bucketed steps

    @property
    def padding_waste(self) -> float:
        return self.padded_tokens / self.computed_tokens if self.computed_tokens else 0.0


def phase_of(request: Request) -> str:
    """A request with one token left to compute decodes; any other is (still) prefilling."""
    return "decode" if request.num_tokens - request.num_computed_tokens == 1 else "prompt"


class BucketPlanner:
    def __init__(self, buckets: dict[str, PhaseBuckets], policy: Policy) -> None:
        self.buckets = buckets
        self.policy = policy
        self.max_bs = {phase: max(b for b, _ in pb.buckets) for phase, pb in buckets.items()}
        self.max_len = {phase: max(s for _, s in pb.buckets) for phase, pb in buckets.items()}
        self.counters = BucketCounters()
        self._last_phase = "prompt"

    def pick_phase(self, running: Sequence[Request], head_of_swapped: Request | None,
                   has_waiting: bool) -> str:
        """prefill_first: a prompt step whenever prefill work exists. fifo: decodes first, but
        prompt and decode steps alternate while both have work, so neither starves."""
        phases = {phase_of(r) for r in running}
        if head_of_swapped is not None:
            phases.add(phase_of(head_of_swapped))
        if has_waiting:
            phases.add("prompt")
        if "prompt" not in phases:
            return "decode"
        if "decode" not in phases or self.policy == "prefill_first":
            return "prompt"
        return "decode" if self._last_phase == "prompt" else "prompt"

    def chunk_limit(self, phase: str) -> int:
        """Most tokens one sequence may compute in a step of this phase."""
        return self.max_len["prompt"] if phase == "prompt" else 1

    def length(self, phase: str, request: Request, num_new: int) -> int:
        """The bucket's length dimension: chunk length (prompt) or context length (decode)."""
        return num_new if phase == "prompt" else request.num_computed_tokens + num_new

    def fits(self, phase: str, num_seqs: int, longest: int) -> bool:
        """Whether a step may hold `num_seqs` sequences, the longest `longest`: if some bucket
        has room for them; a lone sequence always may, and so may sequences longer than every
        bucket, up to the largest batch size (that step runs unpadded anyway)."""
        if num_seqs == 1 or self.buckets[phase].find(num_seqs, longest) is not None:
            return True
        return longest > self.max_len[phase] and num_seqs <= self.max_bs[phase]

    def bucket_for(self, phase: str, num_seqs: int, longest: int, num_tokens: int) -> Bucket | None:
        """The bucket a finished step runs as (None: outside every bucket, unpadded)."""
        self._last_phase = phase
        bucket = self.buckets[phase].find(num_seqs, longest)
        if bucket is None:
            self.counters.batches_outside_buckets += 1
            return None
        self.counters.padded_tokens += bucket_tokens(phase, *bucket) - num_tokens
        self.counters.computed_tokens += num_tokens
        return bucket
