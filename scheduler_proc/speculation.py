"""Speculative decoding in the scheduler: which decoding requests propose tokens in a step, how
many, and what became of them.

A request that speculates computes its last known token and the k tokens proposed after it in
one step, as a chunk; the workers verify the proposals against the model's own choices and
return the accepted ones followed by one token of the model's (worker_proc.speculative). Only
its last token and the accepted proposals then count as computed: the KV written for rejected
proposals is overwritten by later steps, and the blocks allocated for them stay the request's,
which grows into them.

Proposals are asked for only where verifying them is cheap and exact:
- in steps where few requests run (--speculative-disable-by-batch-size): verifying costs up to
  k times the compute of a decode, which a large batch no longer has to spare;
- for any request: penalties apply to each row with the proposals before it counted,
  logprobs are read at each row, and a grammar masks each row after the proposals before it,
  which the scheduler must therefore know: prompt lookup's are found here, and a draft
  model's, for a request under a structured output, are made after the step before
  (StepPlan.draft_after) and trimmed here to what the grammar allows;
- within the request's max_tokens and the context length, and the step's token budget;
- with buckets, in decode steps, where its 1 + k rows (one query token each, as the workers
  attend them: worker_proc.step_inputs) fit a decode bucket beside the step's other rows, so
  verify steps are padded, warmed up and captured as any decode step;
- as many as the request's last verification suggests: a request proposes
  --num-speculative-tokens at first; after a rejection, one more than it had accepted (the
  text it copies may have diverged: a wasted proposal costs a verify row), doubling again
  (up to the maximum) each time all its proposals are accepted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.step_shape import DECODE
from spmd_runtime.scheduler_proc.ngram_proposer import NgramProposer
from spmd_runtime.scheduler_proc.plan_builder import StepDraft
from spmd_runtime.scheduler_proc.request import Request


@dataclass
class SpecDecodeCounters:
    """vLLM's spec_decode counters: drafts (a request proposing in a step), tokens proposed,
    tokens accepted, and accepted tokens by their position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    """Which decoding requests propose, how many tokens (and which, for n-gram prompt lookup),
    and the counters of what became of them."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int,
                 disable_by_batch_size: int, method: str = "ngram") -> None:
        # ngram: proposals looked up here; draft: the workers' draft model proposes, the
        # scheduler only says how many.
        self.method = method
        self.proposer = NgramProposer(num_speculative_tokens, min_n, max_n) \
            if method == "ngram" else None
        self.max_proposals = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.counters = SpecDecodeCounters(accepted_per_position=[0] * num_speculative_tokens)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Speculator | None:
        if config.speculative == "off":
            return None
        return cls(config.num_speculative_tokens, config.prompt_lookup_min,
                   config.prompt_lookup_max, config.speculative_disable_by_batch_size,
                   config.speculative)

    def active(self, num_running: int) -> bool:
        """Whether a step with this many running requests proposes at all."""
        return num_running <= self.disable_by_batch_size

    def draft_room(self, request: Request, budget: int, max_model_len: int) -> int:
        """How many tokens a decoding request may propose after its last one: none where its
        sampling does not allow it, or where its outputs, its context or the step's `budget`
        (tokens left, its own last token included) leave no room; at most its draft length."""
        return max(0, min(budget - 1, request.params.max_tokens - len(request.output_token_ids) - 1,
                          max_model_len - request.num_tokens - 1,
                          request.draft_length or self.max_proposals))

    def speculate(self, scheduler, request: Request, budget: int, draft: StepDraft) -> bool:
        """A decoding request computes its last token and its proposals (n-gram: looked up
        here; draft: made by the workers), if it has some and their blocks leave one free per
        running request; else it decodes as usual (False). `scheduler`: the SchedulerState
        planning the step."""
        room = self.draft_room(request, budget, scheduler.max_model_len)
        planner, rows = scheduler.planner, scheduler.max_num_batched_tokens - budget
        if planner is not None and draft.phase is DECODE:
            # Bucketed: its 1 + k rows (a decode row each) and their context must fit a bucket
            # with the rows already in the step.
            while room and not planner.fits(DECODE, rows + 1 + room,
                                            max(draft.longest, request.num_tokens + room)):
                room -= 1
        if not room:
            return False
        if self.proposer is None and request.params.structured_output is not None:
            return self._verify_drafted(scheduler, request, room, draft)
        proposals = None if self.proposer is None else self.proposer.propose(
            request.all_token_ids, room)
        if proposals and request.params.structured_output is not None:
            # What its grammar allows, up to the first token it refuses.
            proposals = scheduler.constrained.allowed_prefix(request.request_id, proposals)
        num_proposed = room if proposals is None else len(proposals)
        if not num_proposed or not _take_rows(scheduler, request, num_proposed, 0, draft):
            return False
        if proposals is None:
            draft.draft_lengths.append((request.request_id, num_proposed))
        else:
            draft.spec.append((request.request_id, proposals))
        return True

    def _verify_drafted(self, scheduler, request: Request, room: int, draft: StepDraft) -> bool:
        """A draft model and a structured output: the request verifies what the draft model
        proposed after the step before (if anything), up to the first token its grammar refuses,
        and its draft model proposes `room` tokens after this step's (StepPlan.draft_after), with
        slots for them. False (it decodes as usual, nothing drafted) if the blocks are lacking."""
        proposals = scheduler.constrained.allowed_prefix(request.request_id, request.drafted[:room]) \
            if request.drafted else []
        request.drafted = []
        if not _take_rows(scheduler, request, len(proposals), room, draft):
            return False
        if proposals:
            draft.spec.append((request.request_id, proposals))
        draft.draft_after.append((request.request_id, room))
        return True

    def record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """A verification's outcome: the counters, and the request's next draft length."""
        request.draft_length = (min(self.max_proposals, 2 * num_proposed)
                                if num_accepted == num_proposed else num_accepted + 1)
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += num_proposed
        counters.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            counters.accepted_per_position[position] += 1


def _take_rows(scheduler, request: Request, num_proposed: int, num_after: int,
               draft: StepDraft) -> bool:
    """The request computes its last token and `num_proposed` proposals in the step, with slots
    for `num_after` tokens more (a draft model's after the step) and one free block left per
    running request; False (nothing taken) where the blocks are lacking. In a bucketed decode
    step its last row's context is the step's length dimension if it is the longest."""
    if not scheduler.kv.allocate_slots(request, 1 + num_proposed + num_after,
                                       reserve=len(scheduler.running)):
        return False
    scheduler.plans.add_running(request, 1 + num_proposed, draft)
    if draft.phase is DECODE:
        draft.longest = max(draft.longest, request.num_tokens + num_proposed)
    return True
