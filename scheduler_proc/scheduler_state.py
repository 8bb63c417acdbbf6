"""What a step is planned from, in one object: the request queues, the device and CPU block
pools, the plans being built, the counters and the limits. The Scheduler is one (it adds the
step loop); preemption and scheduling ahead receive it, and change the queues only through
the operations it and they define."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from spmd_runtime.scheduler_proc.bucket_planner import BucketPlanner
from spmd_runtime.scheduler_proc.cpu_block_pool import CpuBlockPool
from spmd_runtime.scheduler_proc.kv_cache_manager import KVCacheManager
from spmd_runtime.scheduler_proc.plan_builder import PlanBuilder
from spmd_runtime.scheduler_proc.policy import Policy
from spmd_runtime.scheduler_proc.request import Request
from spmd_runtime.scheduler_proc.speculation import Speculator
from spmd_runtime.scheduler_proc.thermal import ThermalControl


@dataclass
class SchedulerCounters:
    num_steps: int = 0
    num_finished: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_swaps_out: int = 0
    num_swaps_in: int = 0
    num_soft_resets: int = 0
    num_worker_restarts: int = 0

    @property
    def num_preemptions(self) -> int:
        return self.num_swaps_out + self.num_soft_resets


class SchedulerState:
    def __init__(self, kv: KVCacheManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, policy: Policy, planner: BucketPlanner | None,
                 thermal: ThermalControl, num_cpu_blocks: int) -> None:
        self.kv = kv
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = policy
        # With buckets, every step is a prompt or a decode step that fits a bucket.
        self.planner = planner
        self.thermal = thermal
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[int, Request] = {}
        self.counters = SchedulerCounters()
        self.plans = PlanBuilder(planner)
        # Speculative decoding's proposer and counters (None: off; the Scheduler sets it).
        self.speculator: Speculator | None = None
        # Finished requests whose blocks are freed at the next maintenance (or when short).
        self._finished_unfreed: list[Request] = []

    def allocate(self, request: Request, num_new_tokens: int, hits: list = (),
                 reserve: int = 0) -> bool:
        """Allocate; when short of blocks, first take back those of finished requests whose
        freeing was deferred to maintenance, rather than preempt or stall."""
        if self.kv.allocate_slots(request, num_new_tokens, hits, reserve):
            return True
        if not self._finished_unfreed:
            return False
        self._free_finished()
        return self.kv.allocate_slots(request, num_new_tokens, hits, reserve)

    def _free_finished(self) -> None:
        for request in self._finished_unfreed:
            self.kv.free(request)
        self._finished_unfreed.clear()
