"""Step plans as the workers receive them: new requests in full, running ones as deltas, and
what the workers hold (which requests, how many of their blocks) so that only deltas travel."""
from __future__ import annotations

from dataclasses import dataclass, field

from spmd_runtime.protocol.messages import NewRequestData, StepPlan
from spmd_runtime.protocol.step_shape import Phase, StepShape
from spmd_runtime.scheduler_proc.bucket_planner import BucketPlanner
from spmd_runtime.scheduler_proc.request import Request


@dataclass
class ScheduledStep:
    """What the scheduler decided for one step, kept until the result comes back."""

    plan: StepPlan
    num_scheduled: dict[int, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled.values())


@dataclass
class StepDraft:
    """The plan of the step being scheduled, filled in as requests are picked."""

    num_scheduled: dict[int, int] = field(default_factory=dict)
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_ids: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    cached_blocks: list[list[int]] = field(default_factory=list)
    # A model mixing full and sliding-window layers: (request id, new blocks) of the windowed
    # layers' tables that grew.
    cached_sliding_blocks: list[tuple[int, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_in_sliding: list[tuple[int, int]] = field(default_factory=list)   # windowed layers' pool
    preempted: bool = False
    phase: Phase | None = None      # with buckets: the phase of every request in the step
    longest: int = 0                # with buckets: the step's length dimension so far
    # Speculative decoding: (request id, proposed tokens) of the requests verifying proposals.
    spec: list[tuple[int, list[int]]] = field(default_factory=list)
    # ... and (request id, number of tokens) of those whose draft model proposes in the workers.
    draft_lengths: list[tuple[int, int]] = field(default_factory=list)
    # ... and (request id, number of tokens) of those whose draft model proposes after the step.
    draft_after: list[tuple[int, int]] = field(default_factory=list)


def _empty_plan(**extra) -> StepPlan:
    return StepPlan(step_id=-1, new_requests=[], cached_request_ids=[],
                    cached_num_scheduled_tokens=[], cached_new_block_ids=[], **extra)


class PlanBuilder:
    """Encodes drafts into plans, and keeps the workers' work that waits for the next plan that
    reaches them: requests to forget and blocks to offload."""

    def __init__(self, planner: BucketPlanner | None) -> None:
        self.planner = planner
        self.next_step_id = 0
        self.dropped: list[int] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_out_sliding: list[tuple[int, int]] = []     # the windowed layers' pool's

    def add_running(self, request: Request, num_new: int, draft: StepDraft) -> None:
        """A request the workers hold: only its token count and new blocks travel."""
        draft.num_scheduled[request.request_id] = num_new
        draft.cached_ids.append(request.request_id)
        draft.cached_tokens.append(num_new)
        num_blocks = len(request.block_ids)
        if num_blocks > request.num_blocks_sent:
            draft.cached_blocks.append(request.block_ids[request.num_blocks_sent:])
            request.num_blocks_sent = num_blocks
        else:
            draft.cached_blocks.append([])
        table = request.sliding
        if table is not None and len(table.block_ids) > table.num_blocks_sent:
            draft.cached_sliding_blocks.append((request.request_id,
                                                table.block_ids[table.num_blocks_sent:]))
            table.num_blocks_sent = len(table.block_ids)

    def add_new(self, request: Request, num_new: int, draft: StepDraft) -> None:
        """A request joining the batch: the workers get all they need to know about it."""
        draft.num_scheduled[request.request_id] = num_new
        draft.new_requests.append(NewRequestData(
            request_id=request.request_id, token_ids=request.all_token_ids,
            block_ids=list(request.block_ids), num_computed_tokens=request.num_computed_tokens,
            num_scheduled_tokens=num_new, params=request.params,
            num_prompt_tokens=len(request.prompt_token_ids),
            sliding_block_ids=[] if request.sliding is None else list(request.sliding.block_ids)))
        request.num_blocks_sent = len(request.block_ids)
        if request.sliding is not None:
            request.sliding.num_blocks_sent = len(request.sliding.block_ids)
        request.known_to_workers = True

    def forget(self, request: Request) -> None:
        """The workers drop the request with the next plan; it travels in full if it returns."""
        if request.known_to_workers:
            self.dropped.append(request.request_id)
            request.known_to_workers = False
        request.num_blocks_sent = 0
        if request.sliding is not None:
            request.sliding.num_blocks_sent = 0

    def finalize(self, draft: StepDraft) -> ScheduledStep:
        """The plan of this step. A step that computes nothing is never sent: the workers' work
        it would carry (requests to forget, swap-outs) waits for housekeeping_plan."""
        if not draft.num_scheduled:
            return ScheduledStep(plan=_empty_plan())
        plan = StepPlan(step_id=self.next_step_id, new_requests=draft.new_requests,
                        cached_request_ids=draft.cached_ids,
                        cached_num_scheduled_tokens=draft.cached_tokens,
                        cached_new_block_ids=draft.cached_blocks,
                        dropped_request_ids=self.dropped, swap_out=self.swap_out,
                        swap_in=draft.swap_in, swap_out_sliding=self.swap_out_sliding,
                        swap_in_sliding=draft.swap_in_sliding, bucket=self._bucket(draft),
                        spec_token_ids=draft.spec, draft_lengths=draft.draft_lengths,
                        draft_after=draft.draft_after,
                        cached_new_sliding_block_ids=draft.cached_sliding_blocks)
        self.clear()
        self.next_step_id += 1
        return ScheduledStep(plan=plan, num_scheduled=draft.num_scheduled)

    def housekeeping_plan(self) -> StepPlan | None:
        """A plan that computes nothing, so idle or stalled workers still forget finished
        requests and offload preempted ones."""
        if not self.dropped and not self.swap_out:
            return None
        plan = _empty_plan(dropped_request_ids=self.dropped, swap_out=self.swap_out,
                           swap_out_sliding=self.swap_out_sliding)
        self.clear()
        return plan

    def clear(self) -> None:
        """No work waits for the workers any more: a plan carries it, or the workers were replaced
        (they hold nothing, so there is nothing to tell them)."""
        self.dropped = []
        self.swap_out = []
        self.swap_out_sliding = []

    def _bucket(self, draft: StepDraft) -> StepShape | None:
        if self.planner is None or draft.phase is None:
            return None
        num_tokens = sum(draft.num_scheduled.values())
        return self.planner.shape_for(draft.phase,
                                      draft.phase.batch_size(len(draft.num_scheduled), num_tokens),
                                      draft.longest, num_tokens)
