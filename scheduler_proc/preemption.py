"""Preemption: taking running requests off the batch (swapped out to the CPU pool when it has
room, else soft reset), bringing swapped ones back, and checking the victims a policy picks."""
from __future__ import annotations

import logging

from spmd_runtime.scheduler_proc.plan_builder import StepDraft
from spmd_runtime.scheduler_proc.request import Request, RequestStatus
from spmd_runtime.scheduler_proc.scheduler_state import SchedulerState
from spmd_runtime.scheduler_proc.thermal import ThermalPolicy, select_victims

log = logging.getLogger("spmd.scheduler")


def checked_victims(policy: ThermalPolicy, running: list[Request], n: int) -> list[Request]:
    """The policy's n victims among the running requests; a policy that returns anything but n
    distinct running requests is overruled (lru order), so a buggy plugin cannot stop the
    engine nor evict what does not run."""
    victims = policy.select_victims(list(running), n)
    running_ids = {id(r) for r in running}
    if len(victims) == n and len({id(r) for r in victims}) == n \
            and all(id(r) in running_ids for r in victims):
        return victims
    log.error("%s.select_victims must return %d distinct running requests, got %r: "
              "evicting in lru order instead", type(policy).__name__, n, victims)
    return select_victims(running, n, "lru")


def preempt(scheduler: SchedulerState, request: Request) -> None:
    """Take a running request off the batch: swap it out if the CPU pool has room for its
    computed blocks, else soft reset it (recomputed later from prompt + output)."""
    scheduler.running.remove(request)
    scheduler.plans.forget(request)
    num_computed_blocks = -(-request.num_computed_tokens // scheduler.kv.block_size)
    cpu_blocks = scheduler.cpu_pool.allocate(num_computed_blocks) if num_computed_blocks else None
    if cpu_blocks is not None:
        # Blocks that left a sliding window are nobody's KV any more: their CPU copies stay
        # unwritten, and the request attends past them when it is back. A model mixing full
        # and windowed layers copies each CPU block from both pools.
        scheduler.plans.swap_out.extend(live_pairs(request.block_ids, cpu_blocks))
        if request.sliding is not None:
            scheduler.plans.swap_out_sliding.extend(live_pairs(request.sliding.block_ids,
                                                               cpu_blocks))
        request.cpu_block_ids = cpu_blocks
        request.status = RequestStatus.SWAPPED
        scheduler.swapped.append(request)
        scheduler.counters.num_swaps_out += 1
    else:
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        scheduler.waiting.appendleft(request)
        scheduler.counters.num_soft_resets += 1
    scheduler.kv.free(request)


def allocate_or_preempt(scheduler: SchedulerState, request: Request, num_new: int,
                        draft: StepDraft) -> bool:
    """Blocks for a running request's next tokens, preempting the newest running requests not
    yet in this step until they fit; False if the request itself had to be preempted."""
    while not scheduler.allocate(request, num_new):
        victim = next(r for r in reversed(scheduler.running)
                      if r.request_id not in draft.num_scheduled)
        preempt(scheduler, victim)
        draft.preempted = True
        if victim is request:
            return False
    return True


def restore_swapped(scheduler: SchedulerState, request: Request, draft: StepDraft) -> None:
    """A swapped request got fresh device blocks: its computed blocks are copied back into the
    first ones before the forward pass, and its CPU blocks are free again."""
    draft.swap_in.extend(live_pairs(request.block_ids, request.cpu_block_ids))
    if request.sliding is not None:
        draft.swap_in_sliding.extend(live_pairs(request.sliding.block_ids, request.cpu_block_ids))
    scheduler.cpu_pool.free(request.cpu_block_ids)
    request.cpu_block_ids = []
    scheduler.counters.num_swaps_in += 1


def live_pairs(device_blocks: list[int], cpu_blocks: list[int]) -> list[tuple[int, int]]:
    """(device block, CPU block) of each block of context a table holds (not one a window
    freed), as far as there are CPU blocks."""
    return [pair for pair in zip(device_blocks, cpu_blocks, strict=False) if pair[0] >= 0]
