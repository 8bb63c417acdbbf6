"""Turns a StepPlan into model inputs, runs the forward pass over the paged cache, and samples."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from protocol.messages import StepPlan
from protocol.sampling import SamplingParams
from runtime.bucketing import Bucket, GraphPhaseReport, PhaseBuckets, bucket_tokens, plan_graph_captures
from runtime.layers.attention import AttentionBatch, DecodeGroup, PrefillChunk
from runtime.models.llama import (
    EAGER,
    LayerPieces,
    LlamaForCausalLM,
    attention_inputs,
    mlp_inputs,
)
from worker_proc.graphs import BucketGraph, GraphCapturer, StaticInputs
from worker_proc.sampler import sample
from worker_proc.swap_space import SwapSpace

log = logging.getLogger("spmd.worker")

# Single-token queries are attended in groups of this many, longest context first.
DECODE_GROUP_SIZE = 8


@dataclass
class RequestState:
    """What a worker keeps per request between steps (the scheduler sends only deltas)."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams


@dataclass
class StepOutput:
    request_ids: list[int]
    sampled_token_ids: list[int]
    prepare_ms: float
    forward_ms: float
    num_compilations: int = 0


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, seed: int | None = None,
                 num_cpu_blocks: int = 0, scratch_block: int | None = None,
                 decode_kernel: bool = False) -> None:
        self.model = model
        # Decode attention through the Triton kernel that reads the cache in place.
        self.decode_kernel = decode_kernel
        self.kv_caches = kv_caches
        self.swap_space = SwapSpace(kv_caches, num_cpu_blocks, block_size)
        # A block no request ever gets (the last one unless told): padding rows read and
        # write it, and decode groups pad their block tables with it.
        self.scratch_block = (kv_caches[0][0].shape[0] // block_size - 1
                              if scratch_block is None else scratch_block)
        # Compiled layer pieces (--compile), and the token counts they have been run at.
        self.compiled: LayerPieces | None = None
        self.compiled_shapes: set[int] = set()
        # Captured graphs by (phase, batch size, length); a bucket without one runs eagerly.
        self.graphs: dict[tuple[str, int, int], BucketGraph] = {}
        self.warmed_up = False
        self.block_size = block_size
        self.device = device
        self.requests: dict[int, RequestState] = {}
        # Draws for requests without a seed of their own; seeded requests use per-position seeds.
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        # Masked or not, the scratch block must hold finite values (see _zero_blocks).
        self._zero_blocks([self.scratch_block])

    def _zero_blocks(self, block_ids: list[int]) -> None:
        """Clear blocks as they are handed to a request.

        The cache is allocated uninitialised (so untouched memory costs nothing), and attention
        reads whole blocks, relying on the mask for slots not written yet. A masked slot still
        multiplies its value by zero, so it must not hold NaN or inf.
        """
        if not block_ids:
            return
        index = torch.tensor(block_ids, device=self.device)
        for cache in self.kv_caches:
            for tensor in cache:
                tensor.view(-1, self.block_size * tensor.shape[1] * tensor.shape[2]).index_fill_(
                    0, index, 0.0)

    def apply_plan_state(self, plan: StepPlan) -> list[tuple[int, int]]:
        """Update per-request state from the plan; returns (request id, tokens) in plan order."""
        for request_id in plan.dropped_request_ids:
            self.requests.pop(request_id, None)
        scheduled = []
        fresh_blocks: list[int] = []
        for new in plan.new_requests:
            self.requests[new.request_id] = RequestState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens, new.params)
            # Blocks past the computed prefix are new to this request (the rest are cache hits).
            fresh_blocks.extend(new.block_ids[new.num_computed_tokens // self.block_size:])
            scheduled.append((new.request_id, new.num_scheduled_tokens))
        for request_id, num_tokens, new_blocks in zip(
                plan.cached_request_ids, plan.cached_num_scheduled_tokens,
                plan.cached_new_block_ids, strict=True):
            if new_blocks:
                self.requests[request_id].block_ids.extend(new_blocks)
                fresh_blocks.extend(new_blocks)
            scheduled.append((request_id, num_tokens))
        self._zero_blocks(fresh_blocks)
        return scheduled

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        started = time.perf_counter()
        # Offload before fresh blocks are cleared (a block swapped out may be handed to another
        # request in the same step), and swap in after (a swapped-in request's partly filled
        # last block counts as fresh).
        self.swap_space.swap_out(plan.swap_out)
        scheduled = self.apply_plan_state(plan)
        self.swap_space.swap_in(plan.swap_in)
        if not scheduled:
            return StepOutput([], [], 0.0, 0.0)
        # Single-token queries first, longest context first, so attention can group them.
        scheduled.sort(key=lambda item: (item[1] != 1, -self.requests[item[0]].num_computed_tokens))
        graph = self._graph_for(plan.bucket, scheduled)
        num_compilations = 0
        if graph is not None:
            inputs, sample_rows, sample_ids = self._prepare_for_graph(scheduled, plan.bucket)
            prepared = time.perf_counter()
            hidden = graph.run(inputs)
        else:
            input_ids, positions, batch, sample_rows, sample_ids = self._prepare(scheduled,
                                                                                 plan.bucket)
            prepared = time.perf_counter()
            pieces, num_compilations = self._pieces_for(plan.bucket, len(input_ids))
            hidden = self.model(input_ids, positions, self.kv_caches, batch, pieces)
        tokens: list[int] = []
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
            states = [self.requests[r] for r in sample_ids]
            tokens = sample(logits, [s.params for s in states],
                            [len(s.token_ids) for s in states], self.generator)
            for state, token in zip(states, tokens, strict=True):
                state.token_ids.append(token)
        for request_id, num_tokens in scheduled:
            self.requests[request_id].num_computed_tokens += num_tokens
        finished = time.perf_counter()
        return StepOutput(sample_ids, tokens, (prepared - started) * 1e3,
                          (finished - prepared) * 1e3, num_compilations)

    # ------------------------------------------------------------------ compilation and warmup

    def compile_pieces(self, num_shapes: int) -> None:
        """Compile the layers' dense pieces, one graph per token count (dynamic=False)."""
        import torch._dynamo
        # Every layer shares the pieces' code, so the limit is per shape, not per layer.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   num_shapes + 8)
        self.compiled = LayerPieces(torch.compile(attention_inputs, dynamic=False),
                                    torch.compile(mlp_inputs, dynamic=False))

    def _pieces_for(self, bucket: tuple[str, int, int] | None, num_tokens: int
                    ) -> tuple[LayerPieces, int]:
        """Compiled pieces for a bucketed batch, eager ones otherwise (a batch outside every
        bucket is not worth a compilation). Also: 1 if this shape compiles after warmup."""
        if self.compiled is None or bucket is None:
            return EAGER, 0
        new_shape = num_tokens not in self.compiled_shapes
        self.compiled_shapes.add(num_tokens)
        return self.compiled, int(new_shape and self.warmed_up)

    @torch.inference_mode()
    def warmup(self, buckets: dict[str, PhaseBuckets], free_memory) -> None:
        """Run each bucket shape once with padding only, largest first, before serving.

        The dense pieces (what compiles) depend on the token count alone and attention runs
        eagerly, so buckets with the same token count share one run: for decode, the one with
        the shortest context."""
        for phase in ("prompt", "decode"):
            shapes: dict[int, tuple[int, int]] = {}
            for bs, length in buckets[phase].buckets:
                tokens = bucket_tokens(phase, bs, length)
                if tokens not in shapes or (phase == "decode" and length < shapes[tokens][1]):
                    shapes[tokens] = (bs, length)
            order = sorted(shapes.items(), reverse=True)
            for index, (_, (bs, length)) in enumerate(order, 1):
                log.info("[Warmup][%s][%d/%d] batch_size:%d seq_len:%d free_mem:%.2f GiB",
                         phase.capitalize(), index, len(order), bs, length,
                         free_memory() / 2**30)
                input_ids, positions, batch, _, _ = self._prepare([], (phase, bs, length))
                pieces, _ = self._pieces_for((phase, bs, length), len(input_ids))
                self.model(input_ids, positions, self.kv_caches, batch, pieces)
        self.warmed_up = True

    # ------------------------------------------------------------------ graphs

    def _graph_for(self, bucket: tuple[str, int, int] | None,
                   scheduled: list[tuple[int, int]]) -> BucketGraph | None:
        """The bucket's graph, if it has one and the batch has its layout: every decode
        bucket does; a prompt graph takes fresh prompts only (no cached context to attend)."""
        graph = self.graphs.get(bucket) if bucket is not None else None
        if graph is None or bucket[0] == "decode":
            return graph
        fits = len(scheduled) <= bucket[1] and all(n <= bucket[2] for _, n in scheduled)
        fresh = all(self.requests[r].num_computed_tokens == 0 for r, _ in scheduled)
        return graph if fits and fresh else None

    def _prepare_for_graph(self, scheduled: list[tuple[int, int]], bucket: tuple[str, int, int]
                           ) -> tuple[StaticInputs, list[int], list[int]]:
        """Host tensors of the bucket's shape (copied into the graph's own by BucketGraph)."""
        host = torch.device("cpu")
        if bucket[0] == "prompt":
            return self._prepare_prompt_rows(scheduled, bucket[1], bucket[2], host)
        input_ids, positions, batch, sample_rows, sample_ids = self._prepare(scheduled, bucket, host)
        return StaticInputs(input_ids, positions, batch), sample_rows, sample_ids

    def _prepare_prompt_rows(self, scheduled: list[tuple[int, int]], num_rows: int,
                             row_length: int, device: torch.device
                             ) -> tuple[StaticInputs, list[int], list[int]]:
        """Fresh prompts (or their first chunks) one per row of `row_length` positions."""
        block_size = self.block_size
        size = num_rows * row_length
        scratch = self.scratch_block * block_size
        input_ids, positions = [0] * size, [0] * size
        slots = [scratch + i % block_size for i in range(size)]
        sample_rows, sample_ids = [], []
        for row, (request_id, num_tokens) in enumerate(scheduled):
            state, base = self.requests[request_id], row * row_length
            table = state.block_ids
            input_ids[base:base + num_tokens] = state.token_ids[:num_tokens]
            positions[base:base + num_tokens] = range(num_tokens)
            slots[base:base + num_tokens] = [table[p // block_size] * block_size + p % block_size
                                             for p in range(num_tokens)]
            if num_tokens == len(state.token_ids):
                sample_rows.append(base + num_tokens - 1)
                sample_ids.append(request_id)
        batch = AttentionBatch(block_size=block_size,
                               slot_mapping=torch.tensor(slots, device=device), decodes=[],
                               prefills=[], prompt_rows=row_length)
        inputs = StaticInputs(torch.tensor(input_ids, device=device),
                              torch.tensor(positions, device=device), batch)
        return inputs, sample_rows, sample_ids

    def _static_inputs(self, phase: str, bucket: Bucket) -> StaticInputs:
        """Padding-only inputs of a bucket's shape, on the device: what its graph reads."""
        if phase == "prompt":
            return self._prepare_prompt_rows([], bucket[0], bucket[1], self.device)[0]
        input_ids, positions, batch, _, _ = self._prepare([], (phase, *bucket))
        # The decode group covers every row, padding included: nothing to zero.
        batch.pad_start = None
        return StaticInputs(input_ids, positions, batch)

    @torch.inference_mode()
    def capture_graphs(self, buckets: dict[str, PhaseBuckets], budget_bytes: int,
                       prompt_ratio: float, strategies: dict[str, str], free_memory,
                       capturer: GraphCapturer) -> dict[str, GraphPhaseReport]:
        """Capture bucket graphs within `budget_bytes`, split between the phases and ordered
        by their strategies (runtime.bucketing.plan_graph_captures); logs each capture."""
        counters = dict.fromkeys(buckets, 0)

        def capture(phase: str, bucket: Bucket) -> int:
            counters[phase] += 1
            before = free_memory()
            log.info("[Warmup][Graph/%s][%d/%d] batch_size:%d seq_len:%d free_mem:%.2f GiB",
                     phase.capitalize(), counters[phase], len(buckets[phase].buckets), *bucket,
                     before / 2**30)
            inputs = self._static_inputs(phase, bucket)
            replay = capturer.capture(lambda: self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.batch))
            self.graphs[(phase, *bucket)] = BucketGraph(inputs, replay)
            return before - free_memory()

        reports = plan_graph_captures({p: b.buckets for p, b in buckets.items()}, budget_bytes,
                                      prompt_ratio, strategies, capture)
        for report in reports.values():
            log.info("%s", report.line())
        return reports

    def _decode_group(self, first: int, tables: list[list[int]], lengths: list[int],
                      num_blocks: int, device: torch.device) -> DecodeGroup:
        """Single-token queries `first`..`first + len(tables)` over `num_blocks` context blocks
        each; tables are padded with the scratch block, which the mask (or for the kernel, the
        context lengths) hides."""
        filler = [self.scratch_block] * num_blocks
        table_rows = [t[:num_blocks] + filler[len(t):] for t in tables]
        if self.decode_kernel:
            return DecodeGroup(first, len(tables),
                               torch.tensor(table_rows, dtype=torch.int32, device=device).view(-1),
                               None, torch.tensor(lengths, dtype=torch.int32, device=device))
        blocks = torch.tensor(table_rows, device=device).view(-1)
        context = torch.arange(num_blocks * self.block_size)
        mask = (context < torch.tensor(lengths)[:, None]).view(len(tables), 1, 1, -1)
        return DecodeGroup(first, len(tables), blocks, mask.to(device))

    def _prepare(self, scheduled: list[tuple[int, int]], bucket: tuple[str, int, int] | None = None,
                 device: torch.device | None = None):
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lengths: list[int] = []
        prefill_specs: list[tuple[int, int, int, list[int]]] = []
        for request_id, num_tokens in scheduled:
            state = self.requests[request_id]
            start = state.num_computed_tokens
            end = start + num_tokens
            table = state.block_ids
            offset = len(input_ids)
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(start, end))
            if num_tokens == 1:
                decode_tables.append(table)
                decode_lengths.append(end)
            else:
                prefill_specs.append((offset, num_tokens, start, table))
            if end == len(state.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_ids.append(request_id)

        pad_start = None
        if bucket is not None:
            phase, bucket_bs, bucket_len = bucket
            pad_start = len(input_ids)
            num_padding = bucket_tokens(phase, bucket_bs, bucket_len) - pad_start
            scratch = self.scratch_block * block_size
            input_ids.extend([0] * num_padding)
            positions.extend([0] * num_padding)
            slots.extend(scratch + i % block_size for i in range(num_padding))
            if phase == "decode":
                # Padding rows attend to the scratch block's first slot only.
                decode_tables.extend([[]] * num_padding)
                decode_lengths.extend([1] * num_padding)

        device = device or self.device
        if bucket is not None and bucket[0] == "decode":
            # One group of the bucket's shape: bucket_bs rows over bucket_len context tokens.
            decodes = [self._decode_group(0, decode_tables, decode_lengths,
                                          bucket[2] // block_size, device)]
        elif self.decode_kernel and decode_tables:
            # The kernel reads each sequence's own context length: one group, no grouping.
            decodes = [self._decode_group(0, decode_tables, decode_lengths,
                                          -(-max(decode_lengths) // block_size), device)]
        else:
            decodes = [self._decode_group(
                first, decode_tables[first:first + DECODE_GROUP_SIZE],
                decode_lengths[first:first + DECODE_GROUP_SIZE],
                -(-max(decode_lengths[first:first + DECODE_GROUP_SIZE]) // block_size), device)
                for first in range(0, len(decode_tables), DECODE_GROUP_SIZE)]
        prefills = []
        for offset, length, start, table in prefill_specs:
            if start == 0:
                prefills.append(PrefillChunk(offset, length, None, None))
                continue
            num_blocks = -(-(start + length) // block_size)
            context = torch.arange(num_blocks * block_size)
            mask = context[None, :] <= torch.arange(start, start + length)[:, None]
            prefills.append(PrefillChunk(offset, length,
                                         torch.tensor(table[:num_blocks], device=device),
                                         mask.to(device)))
        batch = AttentionBatch(
            block_size=block_size, slot_mapping=torch.tensor(slots, device=device),
            decodes=decodes, prefills=prefills, pad_start=pad_start,
            decode_kernel=self.decode_kernel)
        return (torch.tensor(input_ids, device=device), torch.tensor(positions, device=device),
                batch, sample_rows, sample_ids)
