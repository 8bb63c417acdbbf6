"""Speculative decoding with a draft model (--speculative draft --draft-model M): a second,
smaller model of the same vocabulary, whole on every worker, proposes the tokens that the
target model then verifies (worker_proc.speculative) in the same step.

The draft model's KV cache lives in the same block ids as the target's (its own tensors, one
layer list of its own shape): the scheduler's block tables serve both. To keep that cache whole,
every step's tokens go through the draft model too (prompt chunks, decodes); a request that
speculates then runs one draft decode per proposal, greedily (its draft distribution is one-hot,
which rejection sampling takes as it is), the last one only to write its KV. A draft's mistakes
cost accepted tokens, never correctness: the target verifies every proposal. Requests whose
draft KV is missing (swapped back in: only the target's blocks travel) propose worse until
their blocks are rewritten.

A request under a structured output cannot verify proposals the scheduler has not seen (its
grammar masks each verify row after the proposals before it): its draft model proposes after
the step, once the token the step samples is known (the plan's draft_after), and the
proposals go back with the result, to be trimmed to what the grammar allows and verified in
the next step as prompt lookup's are.
"""
from __future__ import annotations

import torch
from spmd_runtime.worker_proc.sampler import greedy_tokens
from spmd_runtime.worker_proc.step_inputs import StepInputs
from spmd_runtime.worker_proc.step_state import RequestState


class Drafter:
    """The draft model and its KV cache, building its inputs with the target's StepInputs."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 inputs: StepInputs, requests: dict[int, RequestState]) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.inputs = inputs
        self.requests = requests

    @torch.inference_mode()
    def propose(self, scheduled: list[tuple[int, int]],
                lengths: dict[int, int]) -> dict[int, list[int]]:
        """Run the step's known tokens through the draft model (`scheduled`: the target's
        (request id, tokens) of the step, a drafting request counted with its proposals), then
        draft `lengths[request id]` tokens for each drafting request. The proposals are
        appended to the requests' token_ids, as the plan's n-gram proposals are."""
        known = [(rid, 1 if rid in lengths else n) for rid, n in scheduled]
        self.inputs.sort_for_attention(known)
        drafting = [rid for rid, _ in known if rid in lengths]
        proposals = {rid: [] for rid in drafting}
        next_tokens = self._forward(known, drafting)
        longest = max((lengths[rid] for rid in drafting), default=0)
        for j in range(1, longest + 1):
            going = [rid for rid in drafting if lengths[rid] >= j]
            for rid, token in zip(going, next_tokens, strict=True):
                proposals[rid].append(token)
                state = self.requests[rid]
                state.token_ids.append(token)
                state.num_computed_tokens += 1     # the draft step computes the proposal
            wanted = [rid for rid in going if lengths[rid] > j]
            next_tokens = self._forward([(rid, 1) for rid in going], wanted)
        for rid in drafting:
            self.requests[rid].num_computed_tokens -= lengths[rid]
        return proposals

    @torch.inference_mode()
    def propose_after(self, after: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
        """Once a step's tokens are read: for each (request id, k), run the request's new
        token through the draft model and draft k tokens after it, for the scheduler to trim
        to what its grammar allows and send back to verify. The request's tokens stay as
        they were; its draft KV is written up to the last proposal but one (the next step's
        tokens are run through the draft model again anyway)."""
        lengths = {rid: k for rid, k in after if rid in self.requests}
        proposals = self.propose([(rid, 1) for rid in lengths], lengths) if lengths else {}
        for rid, tokens in proposals.items():
            del self.requests[rid].token_ids[-len(tokens):]
        return list(proposals.items())

    def _forward(self, scheduled: list[tuple[int, int]], wanted: list[int]) -> list[int]:
        """One draft pass over `scheduled`; the greedy next token of each request in `wanted`
        (in its order). Every pass writes the draft KV cache of its tokens."""
        input_ids, positions, batch, sample_rows, sample_ids = self.inputs.build(scheduled)
        hidden = self.model(input_ids, positions, self.kv_caches, batch)
        row_of = dict(zip(sample_ids, sample_rows, strict=True))
        if not wanted:
            return []
        rows = torch.tensor([row_of[rid] for rid in wanted], device=hidden.device)
        return greedy_tokens(self.model.compute_logits(hidden[rows])).tolist()
