"""Scheduling policies: in which order running requests take the step's token budget.

Both fill the batch with running requests first and admit waiting requests (in arrival order)
with whatever budget is left; they differ in which running requests go first:

* fifo: decodes, then requests in the middle of a chunked prefill. Pushing decodes through
  first keeps inter-token latency low and finishes requests sooner.
* prefill_first: unfinished chunked prefills, then decodes. A long prompt's prefill completes
  in as few steps as possible, which reduces fragmentation when long prompts dominate.

Preemption does not depend on the policy: when a running request cannot get its next block,
the most recently admitted running request not yet scheduled in this step gives its blocks up
(it has done the least work, and older requests keep their latency).
"""
from __future__ import annotations

from typing import Literal

from spmd_runtime.scheduler_proc.request import Request

Policy = Literal["fifo", "prefill_first"]


def running_order(running: list[Request], policy: Policy) -> list[Request]:
    """The running requests (given in admission order) in the order they are scheduled."""
    prefills = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
    if not prefills:
        return list(running)
    decodes = [r for r in running if r.num_tokens - r.num_computed_tokens <= 1]
    return decodes + prefills if policy == "fifo" else prefills + decodes
