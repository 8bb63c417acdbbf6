"""Turns a StepPlan into model inputs, runs the forward pass over the paged cache, and samples."""
from __future__ import annotations

import logging
import time

import torch
from spmd_runtime.protocol.messages import StepPlan
from spmd_runtime.protocol.step_shape import Phase, StepShape
from spmd_runtime.runtime.layers.attention_backend import TORCH, AttentionBackend
from spmd_runtime.runtime.models.layer_pieces import LayerPieces
from spmd_runtime.runtime.models.llama import LlamaForCausalLM
from spmd_runtime.worker_proc.drafting import Drafter
from spmd_runtime.worker_proc.graphs import BucketGraph, StaticInputs
from spmd_runtime.worker_proc.logprobs import (
    LogprobRows,
    prompt_logprobs,
    read_logprobs,
    sampled_logprobs,
    verified_logprobs,
)
from spmd_runtime.worker_proc.penalties import penalize, penalize_requests
from spmd_runtime.worker_proc.runner_graphs import GraphRunner
from spmd_runtime.worker_proc.sampler import sample_on_device
from spmd_runtime.worker_proc.speculative import verify_proposals
from spmd_runtime.worker_proc.step_inputs import StepInputs, kv_groups
from spmd_runtime.worker_proc.step_state import (
    UNREAD_TOKEN,
    LaunchedStep,
    PreparedStep,
    RequestState,
    StepOutput,
)
from spmd_runtime.worker_proc.swap_space import SwapSpace
from spmd_runtime.worker_proc.token_masks import apply_token_masks, expand_masks, split_masks

log = logging.getLogger("spmd.worker")

HOST = torch.device("cpu")


def split_verifying(sample_rows: list[int], sample_ids: list[int], proposals: dict[int, list[int]]
                    ) -> tuple[list[int], list[int], list[tuple[int, int, list[int]]]]:
    """The sampling rows of requests that sample as usual, and (request id, last row,
    proposals) of those that verify proposals."""
    rows, ids, spec = [], [], []
    for row, request_id in zip(sample_rows, sample_ids, strict=True):
        if request_id in proposals:
            spec.append((request_id, row, proposals[request_id]))
        else:
            rows.append(row)
            ids.append(request_id)
    return rows, ids, spec


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, seed: int | None = None,
                 num_cpu_blocks: int = 0, scratch_block: int | None = None,
                 attention: AttentionBackend = TORCH) -> None:
        self.model = model
        self.kv_caches = kv_caches
        # A block no request ever gets (the last one unless told): padding rows read and
        # write it, and decode groups pad their block tables with it.
        self.scratch_block = (kv_caches[0][0].shape[0] // block_size - 1
                              if scratch_block is None else scratch_block)
        self.block_size = block_size
        self.device = device
        self.requests: dict[int, RequestState] = {}
        # Their block ids, the worker's only record of them (decode batches gather rows); a
        # model mixing full and sliding-window layers keeps its windowed layers' apart.
        groups = kv_groups(model.config, kv_caches, block_size, self.scratch_block)
        self.block_tables = groups[0].tables
        self.sliding_tables = groups[1].tables if len(groups) > 1 else None
        self.swap_space = SwapSpace(kv_caches, num_cpu_blocks, block_size,
                                    model.config.sliding_layers if len(groups) > 1 else ())
        # Its components: input building (with the attention backend chosen once for the
        # worker, runtime/layers/attention_backend.py), and compilation, warmup and graphs.
        self.inputs = StepInputs(self.requests, groups, block_size, device, attention)
        self.graph_runner = GraphRunner(model, kv_caches, self.inputs)
        # --speculative draft: the draft model that proposes (worker_proc.drafting).
        self.drafter: Drafter | None = None
        # The step launched last (the device's idle time before the next one).
        self._last_launched: LaunchedStep | None = None
        # Draws for requests without a seed of their own; seeded requests use per-position seeds.
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @property
    def attention(self) -> AttentionBackend:
        return self.inputs.attention

    @attention.setter
    def attention(self, backend: AttentionBackend) -> None:
        self.inputs.attention = backend

    @property
    def graphs(self) -> dict[StepShape, BucketGraph]:
        """Captured graphs by their bucket (the graph runner's)."""
        return self.graph_runner.graphs

    def apply_plan_state(self, plan: StepPlan) -> list[tuple[int, int]]:
        """Update per-request state from the plan; returns (request id, tokens) in plan order."""
        sliding = self.sliding_tables
        for request_id in plan.dropped_request_ids:
            self.requests.pop(request_id, None)
            self.block_tables.remove(request_id)
            if sliding is not None:
                sliding.remove(request_id)
        scheduled = []
        for new in plan.new_requests:
            self.requests[new.request_id] = RequestState(
                list(new.token_ids), new.num_computed_tokens, new.params, new.num_prompt_tokens)
            self.block_tables.add(new.request_id, new.block_ids)
            if sliding is not None:
                sliding.add(new.request_id, new.sliding_block_ids)
            scheduled.append((new.request_id, new.num_scheduled_tokens))
        for request_id, num_tokens, new_blocks in zip(
                plan.cached_request_ids, plan.cached_num_scheduled_tokens,
                plan.cached_new_block_ids, strict=True):
            if new_blocks:
                self.block_tables.append(request_id, new_blocks)
            scheduled.append((request_id, num_tokens))
        for request_id, new_blocks in plan.cached_new_sliding_block_ids:
            sliding.append(request_id, new_blocks)
        # Proposals are inputs after the request's last token until verified (launch).
        for request_id, proposals in plan.spec_token_ids:
            self.requests[request_id].token_ids.extend(proposals)
        return scheduled

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step to its sampled tokens."""
        return self.finish(self.launch(self.prepare(plan)))

    def can_prepare_ahead(self, plan: StepPlan) -> bool:
        """Whether `plan` may be prepared while the step before it still runs: not with KV
        swaps, whose host-side copies must see that step's blocks complete."""
        return not (plan.swap_out or plan.swap_in or plan.swap_out_sliding or plan.swap_in_sliding)

    @torch.inference_mode()
    def prepare(self, plan: StepPlan) -> PreparedStep:
        """Apply the plan's state changes and build its inputs on the host. Nothing here reads
        the device, so it can run while the step before is in flight: a token that step samples
        is an UNREAD_TOKEN here, recorded for launch() to fill in on the device."""
        started = time.perf_counter()
        # Offload before the plan's state changes (a block swapped out may be handed to another
        # request in the same step), swap in after.
        self.swap_space.swap_out(plan.swap_out, plan.swap_out_sliding)
        scheduled = self.apply_plan_state(plan)
        self.swap_space.swap_in(plan.swap_in, plan.swap_in_sliding)
        proposals = dict(plan.spec_token_ids)
        if self.drafter is not None and scheduled:
            proposals.update(self.drafter.propose(scheduled, dict(plan.draft_lengths)))
        self.inputs.sort_for_attention(scheduled)
        graph = self.graph_runner.graph_for(plan.bucket, scheduled) if scheduled else None
        inputs, sample_rows, sample_ids = None, [], []
        if graph is not None:
            inputs, sample_rows, sample_ids = self.graph_runner.prepare_for_graph(scheduled,
                                                                                  plan.bucket)
        elif scheduled:
            input_ids, positions, batch, sample_rows, sample_ids = self.inputs.build(
                scheduled, plan.bucket, HOST)
            inputs = StaticInputs(input_ids, positions, batch)
        unread_positions, unread_rows, offset = [], [], 0
        for request_id, num_tokens in scheduled:
            state = self.requests[request_id]
            if state.unread is not None and state.num_computed_tokens <= state.unread[0] \
                    < state.num_computed_tokens + num_tokens:
                unread_positions.append(offset + state.unread[0] - state.num_computed_tokens)
                unread_rows.append(state.unread[1])
            offset += num_tokens
        spec = []
        if proposals:
            sample_rows, sample_ids, spec = split_verifying(sample_rows, sample_ids, proposals)
        return PreparedStep(scheduled=scheduled, bucket=plan.bucket, graph=graph, inputs=inputs,
                            sample_rows=sample_rows, sample_ids=sample_ids, spec=spec,
                            unread_positions=unread_positions, unread_rows=unread_rows,
                            token_masks=dict(plan.token_masks), draft_after=plan.draft_after,
                            prepare_ms=(time.perf_counter() - started) * 1e3)

    @torch.inference_mode()
    def launch(self, step: PreparedStep, in_flight: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's forward pass and sampling on the device; on CUDA this returns
        before they run. `in_flight`: the step launched before, not finished yet, whose sampled
        tokens this step's inputs take where prepare() left UNREAD_TOKEN."""
        launched_at = time.perf_counter()
        cuda = self.device.type == "cuda"
        started = done = None
        if cuda:
            started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            started.record()
        if not step.scheduled:
            if done is not None:
                done.record()
            return LaunchedStep(sample_ids=[], token_slots=[], tokens=None, host_tokens=None,
                                prepare_ms=step.prepare_ms, num_compilations=0,
                                launched_at=launched_at, started=started, done=done,
                                finished_at=launched_at)
        if step.unread_positions and (in_flight is None or in_flight.tokens is None):
            raise RuntimeError("the step's inputs need the tokens of a step in flight: launch "
                               "it with in_flight=")
        hidden, kept, num_compilations = self._forward(step, in_flight)
        row_length = (step.bucket.length if step.graph is not None
                      and step.bucket.phase is Phase.PROMPT else None)
        prompt = prompt_logprobs(self.model, hidden, step.scheduled, self.requests, row_length)
        tokens, host_tokens, token_slots, sampled = self._sample(step, hidden, cuda, in_flight,
                                                                 kept)
        verified, verified_records = (self._verify(step.spec, hidden, step.token_masks)
                                      if step.spec else ([], None))
        for request_id, num_tokens in step.scheduled:
            self.requests[request_id].num_computed_tokens += num_tokens
        finished_at = time.perf_counter()
        previous, idle_ms = self._last_launched, None
        if done is not None:
            done.record()
        elif previous is not None:
            # On CPU the step ran in this call: the device (the host) was idle from the end
            # of the step before to the start of this one, input preparation included.
            idle_ms = max(0.0, (launched_at - previous.finished_at) * 1e3)
        launched = LaunchedStep(sample_ids=step.sample_ids, token_slots=token_slots,
                                tokens=tokens, host_tokens=host_tokens,
                                prepare_ms=step.prepare_ms, num_compilations=num_compilations,
                                launched_at=launched_at, started=started, done=done,
                                finished_at=finished_at, idle_ms=idle_ms,
                                previous=previous if cuda else None,
                                overlapped=in_flight is not None,
                                logprobs=[sampled, prompt, verified_records],
                                spec_token_ids=verified, draft_after=step.draft_after)
        self._last_launched = launched
        return launched

    def _forward(self, step: PreparedStep,
                 in_flight: LaunchedStep | None) -> tuple[torch.Tensor, bool, int]:
        """The step's hidden states (a captured graph replayed, or the model run eagerly),
        whether they are the sampled rows alone (_kept_rows), and 1 if a shape compiled."""
        if step.graph is not None:
            step.graph.load(step.inputs)
            self._fill_unread(step.graph.inputs.input_ids, step, in_flight)
            return step.graph.replay(), False, 0
        inputs = step.inputs.to(self.device)
        self._fill_unread(inputs.input_ids, step, in_flight)
        pieces, num_compilations = self.graph_runner.pieces_for(step.bucket,
                                                                len(inputs.input_ids))
        keep = self._kept_rows(step, len(inputs.input_ids), pieces)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.batch,
                            pieces, keep)
        return hidden, keep is not None, num_compilations

    def _kept_rows(self, step: PreparedStep, num_tokens: int,
                   pieces: LayerPieces) -> torch.Tensor | None:
        """The rows the model's last layer finishes: the sampled ones, where the step reads no
        other (no prompt logprobs, no proposals to verify), they are fewer than its tokens and
        the layers run eagerly (a compiled piece would compile again for their count); None
        for every row."""
        if (step.spec or not step.sample_rows or len(step.sample_rows) >= num_tokens
                or pieces is self.graph_runner.compiled
                or any(self.requests[r].params.prompt_logprobs is not None
                       for r, _ in step.scheduled)):
            return None
        return self._sample_rows(step)

    def _sample_rows(self, step: PreparedStep) -> torch.Tensor:
        """The step's sampled rows as an index tensor on the device."""
        return torch.tensor(step.sample_rows).to(self.device, non_blocking=True)

    def _sample(self, step: PreparedStep, hidden: torch.Tensor, cuda: bool,
                in_flight: LaunchedStep | None, kept: bool = False):
        """Sample the rows that end a request's known tokens, on the device; each such request
        gets an UNREAD_TOKEN placeholder until the step is finished. kept: hidden holds those
        rows alone, in order (the model ran with _kept_rows)."""
        token_slots: list[tuple[RequestState, int]] = []
        if not step.sample_rows:
            return None, None, token_slots, None
        states = [self.requests[r] for r in step.sample_ids]
        # Greedy rows without penalties or logprobs need no float32 logits (a mask's -inf is
        # exact in any dtype): the largest logit is the same one.
        greedy = all(s.params.temperature == 0.0 and not s.params.penalized and
                     s.params.logprobs is None for s in states)
        if not kept:
            hidden = hidden[self._sample_rows(step)]
        # Unconstrained greedy rows may take their tokens from the head without any logits.
        tokens = self.model.greedy_tokens(hidden) if greedy and not any(
            r in step.token_masks for r in step.sample_ids) else None
        logprobs = None
        if tokens is None:
            raw_logits = self.model.compute_logits(hidden, float32=not greedy)
            logits = penalize_requests(raw_logits, states, in_flight.tokens if in_flight else None)
            logits = apply_token_masks(logits, step.sample_ids, step.token_masks)
            tokens = sample_on_device(logits, [s.params for s in states],
                                      [len(s.token_ids) for s in states], self.generator)
            logprobs = sampled_logprobs(raw_logits, states, step.sample_ids, tokens)
        host_tokens = tokens
        if cuda:
            host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host_tokens.copy_(tokens, non_blocking=True)
        for row, state in enumerate(states):
            state.unread = (len(state.token_ids), row)
            token_slots.append((state, len(state.token_ids)))
            state.token_ids.append(UNREAD_TOKEN)
        return tokens, host_tokens, token_slots, logprobs

    def _verify(self, spec: list[tuple[int, int, list[int]]], hidden: torch.Tensor,
                masks: dict[int, bytes]) -> tuple[list[tuple[int, list[int]]], LogprobRows | None]:
        """Verify each request's proposals against the model's logits at its rows; its tokens
        become the accepted proposals and the model's next token (sampled, so on the host
        now), and only its last token and the accepted proposals stay computed. Row i of a
        penalized request counts the proposals before it as outputs, and a constrained one's
        refuses what its grammar does after them; the records of the emitted tokens of those
        asking for logprobs come back too."""
        rows = torch.tensor([r for _, last, proposals in spec
                             for r in range(last - len(proposals), last + 1)], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        outputs, runs, first = [], [], 0
        for request_id, _, proposals in spec:
            state, k = self.requests[request_id], len(proposals)
            del state.token_ids[-k:]
            block = logits[first:first + k + 1]
            if state.params.penalized:
                block = penalize(block, [state.params] * (k + 1),
                                 [state.token_ids + proposals[:i] for i in range(k + 1)],
                                 [state.num_prompt_tokens] * (k + 1))
            if request_id in masks:
                allowed = expand_masks(split_masks(masks[request_id], k + 1), block.shape[1],
                                       block.device)
                block = block.masked_fill(~allowed, float("-inf"))
            tokens = verify_proposals(block, proposals, state.params, len(state.token_ids),
                                      self.generator)
            if state.params.logprobs is not None:
                runs.append((request_id, first, state.params.logprobs, tokens))
            first += k + 1
            state.token_ids.extend(tokens)
            # launch() adds the scheduled 1 + k: the rejected proposals are not computed.
            state.num_computed_tokens -= k + 1 - len(tokens)
            outputs.append((request_id, tokens))
        return outputs, verified_logprobs(logits, runs)

    def _fill_unread(self, input_ids: torch.Tensor, step: PreparedStep,
                     in_flight: LaunchedStep | None) -> None:
        """Write the in-flight step's sampled tokens into this step's inputs, on the device."""
        if not step.unread_positions:
            return
        positions = torch.tensor(step.unread_positions).to(self.device, non_blocking=True)
        rows = torch.tensor(step.unread_rows).to(self.device, non_blocking=True)
        input_ids.index_copy_(0, positions, in_flight.tokens.index_select(0, rows))

    def finish(self, step: LaunchedStep) -> StepOutput:
        """Wait for a launched step and read its sampled tokens into the request states."""
        if step.done is not None:
            step.done.synchronize()
        tokens = step.host_tokens.tolist() if step.host_tokens is not None else []
        for (state, index), token in zip(step.token_slots, tokens, strict=True):
            # The state may be gone from self.requests by now (dropped by a plan prepared
            # since): writing to it is harmless.
            state.token_ids[index] = token
            if state.unread is not None and state.unread[0] == index:
                state.unread = None
        device_ms, idle_ms = (step.finished_at - step.launched_at) * 1e3, step.idle_ms
        if step.done is not None:
            device_ms = step.started.elapsed_time(step.done)
            previous = step.previous
            if previous is not None and previous.done is not None:
                idle_ms = max(0.0, previous.done.elapsed_time(step.started))
            step.previous = None        # keep no chain of earlier steps alive
        drafted = self.drafter.propose_after(step.draft_after) \
            if step.draft_after and self.drafter is not None else []
        return StepOutput(step.sample_ids, tokens, step.prepare_ms, device_ms,
                          step.num_compilations, idle_ms, step.overlapped,
                          read_logprobs(step.logprobs), step.spec_token_ids, drafted)

