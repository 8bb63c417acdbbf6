"""Scheduling ahead: the next step of a plain decode continuation, planned while the current
step still runs, so the workers start it without waiting for its result to be read."""
from __future__ import annotations

from spmd_runtime.protocol.step_shape import Phase
from spmd_runtime.scheduler_proc.plan_builder import ScheduledStep, StepDraft
from spmd_runtime.scheduler_proc.policy import running_order
from spmd_runtime.scheduler_proc.request import Request
from spmd_runtime.scheduler_proc.scheduler_state import SchedulerState


def plan_ahead(scheduler: SchedulerState, step: ScheduledStep) -> ScheduledStep | None:
    """The step after `step`, planned while `step` still runs, before its result: the
    workers then start it as soon as they finish `step`, without waiting for the scheduler
    to read the result, stream it and plan. None where that cannot be planned blind.

    Only a plain continuation qualifies: every running request is in `step` and samples a
    token at its end (a decode or a prompt's last chunk); those that end there by length
    (max_tokens, max_model_len) are left out of the next step, the others go on in it;
    nothing waits to be admitted or swapped in or out; the hottest device is not near the
    thermal target (ThermalControl.near_target: so the batch reacts to a crossing within
    two steps, as when planning step by step); the blocks for one more token each are free
    without preempting. Each then computes the token `step` samples, which the workers hold
    (the plan only says one token). A request that `step` ends (EOS, a stop token) has
    computed one token for nothing; its result is ignored (update skips requests no longer
    running) and the workers drop it with the next plan, having finished writing its blocks
    before they read any later plan."""
    continuing = _continuing(scheduler, step)
    if continuing is None:
        return None
    # Context of each decode after `step`: what it has computed, plus `step`, plus one.
    longest = max(r.num_computed_tokens + n + 1 for r, n in continuing)
    planner = scheduler.planner
    if planner is not None and not planner.fits(Phase.DECODE, len(continuing), longest):
        return None
    for request, num_tokens in continuing:
        # Blocks allocated before a refusal stay the request's: it needs them next anyway.
        if not scheduler.allocate(request, num_tokens + 1):
            return None
    draft = StepDraft(phase=Phase.DECODE if planner is not None else None)
    for request, _ in continuing:
        scheduler.plans.add_running(request, 1, draft)
    draft.longest = longest
    return scheduler.plans.finalize(draft)


def _continuing(scheduler: SchedulerState, step: ScheduledStep) -> list[tuple[Request, int]] | None:
    """The running requests with their tokens in `step`, in scheduling order, where all of
    them continue as plain decodes after it and nothing else wants in; else None."""
    # A constrained request's next mask depends on the token `step` samples, and proposals on
    # all its tokens (speculative decoding, in a batch small enough to speculate; a draft model
    # always reads every token): planned after.
    speculator = scheduler.speculator
    if speculator is not None and (speculator.method == "draft"
                                   or speculator.active(len(scheduler.running))):
        return None
    if (scheduler.waiting or scheduler.swapped or scheduler.plans.swap_out or scheduler.constrained
            or scheduler.thermal.near_target() or not step.num_scheduled
            or len(step.num_scheduled) != len(scheduler.running)
            or len(scheduler.running) > min(scheduler.max_num_seqs,
                                            scheduler.max_num_batched_tokens)):
        return None
    continuing: list[tuple[Request, int]] = []
    for request in running_order(scheduler.running, scheduler.policy):
        num_tokens = step.num_scheduled.get(request.request_id)
        if num_tokens is None or not request.samples_after(num_tokens):
            return None
        # One that `step` ends by length is known to end: the next step goes on without it.
        if not ends_by_length(scheduler, request):
            continuing.append((request, num_tokens))
    return continuing or None


def ends_by_length(scheduler: SchedulerState, request: Request) -> bool:
    """Whether the token a request samples next is its last: max_tokens or max_model_len."""
    return (len(request.output_token_ids) + 1 >= request.params.max_tokens
            or request.num_tokens + 1 >= scheduler.max_model_len)
