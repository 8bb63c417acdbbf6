"""A step's model inputs, built on the host from the plan and the worker's request states:
token ids, positions, KV slots and the attention batch (decode groups over block tables,
prefill chunks), padded to the step's bucket where it has one; and the one-prompt-per-row
layout a prompt graph reads."""
from __future__ import annotations

import torch
from spmd_runtime.protocol.step_shape import Phase, StepShape
from spmd_runtime.runtime.layers.attention import (
    AttentionBatch,
    DecodeGroup,
    PrefillChunk,
    causal_mask,
)
from spmd_runtime.runtime.layers.attention_backend import AttentionBackend
from spmd_runtime.worker_proc.block_table import BlockTables
from spmd_runtime.worker_proc.graphs import StaticInputs
from spmd_runtime.worker_proc.step_state import RequestState

# Single-token queries are attended in groups of this many, longest context first.
DECODE_GROUP_SIZE = 8


class StepInputs:
    """Builds inputs for the ModelRunner that owns it (and its graph runner), from the request
    states and block tables it shares with it."""

    def __init__(self, requests: dict[int, RequestState], block_tables: BlockTables,
                 block_size: int, scratch_block: int, device: torch.device,
                 attention: AttentionBackend, window: int | None = None) -> None:
        self.requests = requests
        self.block_tables = block_tables
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        # The worker's attention backend: decode groups read the cache in place or gather it.
        self.attention = attention
        # The sliding window of the model's windowed layers (None: it has none): every batch
        # then carries their `sliding` batch too.
        self.window = window

    def sort_for_attention(self, scheduled: list[tuple[int, int]]) -> None:
        """The order build() needs: single-token queries first (the decode groups are the first
        rows), longest context first, so attention can group them."""
        scheduled.sort(key=lambda item: (item[1] != 1, -self.requests[item[0]].num_computed_tokens))

    def build(self, scheduled: list[tuple[int, int]], bucket: StepShape | None = None,
              device: torch.device | None = None):
        """(input ids, positions, AttentionBatch, sample rows, sample request ids) of the
        scheduled (request id, token count) pairs, padded to `bucket` where given, on `device`
        (the worker's by default)."""
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[int] = []
        decode_rows: list[int] = []        # block-table rows
        decode_lengths: list[int] = []
        prefill_specs: list[tuple[int, int, int, list[int]]] = []
        for request_id, num_tokens in scheduled:
            state = self.requests[request_id]
            start = state.num_computed_tokens
            end = start + num_tokens
            table = self.block_tables.block_ids(request_id)
            offset = len(input_ids)
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(start, end))
            if num_tokens == 1:
                decode_rows.append(self.block_tables.row(request_id))
                decode_lengths.append(end)
            else:
                prefill_specs.append((offset, num_tokens, start, table))
            if end == len(state.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_ids.append(request_id)

        pad_start = None
        if bucket is not None:
            pad_start = len(input_ids)
            num_padding = bucket.num_tokens - pad_start
            scratch = self.scratch_block * block_size
            input_ids.extend([0] * num_padding)
            positions.extend([0] * num_padding)
            slots.extend(scratch + i % block_size for i in range(num_padding))
            if bucket.phase is Phase.DECODE:
                # Padding rows attend to the scratch block's first slot only.
                decode_rows.extend([BlockTables.PADDING_ROW] * num_padding)
                decode_lengths.extend([1] * num_padding)

        device = device or self.device

        def attention_batch(slot_mapping: torch.Tensor, window: int | None) -> AttentionBatch:
            return AttentionBatch(
                block_size=block_size, slot_mapping=slot_mapping,
                decodes=self.decode_groups(decode_rows, decode_lengths, bucket, device, window),
                prefills=self.prefill_chunks(prefill_specs, device, window), pad_start=pad_start,
                backend=self.attention, window=window)

        batch = attention_batch(torch.tensor(slots, device=device), None)
        if self.window is not None:
            batch.sliding = attention_batch(batch.slot_mapping, self.window)
        return (torch.tensor(input_ids, device=device), torch.tensor(positions, device=device),
                batch, sample_rows, sample_ids)

    def decode_group(self, first: int, rows: list[int], lengths: list[int],
                      num_blocks: int, device: torch.device,
                      window: int | None = None) -> DecodeGroup:
        """Single-token queries `first`..`first + len(rows)` over `num_blocks` context blocks
        each, from those block-table rows; tables are padded with the scratch block, which the
        mask (or for the kernel, the context lengths) hides. Under a window, the mask (or the
        kernel's starts) hides the context before each query's last `window` tokens too: those
        blocks may be freed and given to other requests already."""
        starts = [max(0, length - window) for length in lengths] if window else None
        if self.attention.reads_cache_in_place:
            tables = self.block_tables.gather(rows, num_blocks, torch.int32)
            return DecodeGroup(first, len(rows), tables.view(-1).to(device), None,
                               torch.tensor(lengths, dtype=torch.int32, device=device),
                               None if starts is None else
                               torch.tensor(starts, dtype=torch.int32, device=device))
        blocks = self.block_tables.gather(rows, num_blocks, torch.int64).view(-1)
        context = torch.arange(num_blocks * self.block_size)
        mask = context < torch.tensor(lengths)[:, None]
        if starts is not None:
            mask &= context >= torch.tensor(starts)[:, None]
        return DecodeGroup(first, len(rows), blocks.to(device),
                           mask.view(len(rows), 1, 1, -1).to(device))

    def decode_groups(self, rows: list[int], lengths: list[int],
                       bucket: StepShape | None, device: torch.device,
                       window: int | None = None) -> list[DecodeGroup]:
        """The decode path: single-token queries grouped for attention."""
        block_size = self.block_size
        if bucket is not None and bucket.phase is Phase.DECODE:
            # One group of the bucket's shape: its batch size in rows over its context length.
            return [self.decode_group(0, rows, lengths, bucket.length // block_size, device,
                                      window)]
        if self.attention.reads_cache_in_place and rows:
            # The kernel reads each sequence's own context length: one group, no grouping.
            return [self.decode_group(0, rows, lengths, -(-max(lengths) // block_size), device,
                                      window)]
        return [self.decode_group(
            first, rows[first:first + DECODE_GROUP_SIZE], lengths[first:first + DECODE_GROUP_SIZE],
            -(-max(lengths[first:first + DECODE_GROUP_SIZE]) // block_size), device, window)
            for first in range(0, len(rows), DECODE_GROUP_SIZE)]

    def prefill_chunks(self, specs: list[tuple[int, int, int, list[int]]],
                        device: torch.device, window: int | None = None) -> list[PrefillChunk]:
        """The prefill path: a chunk per prompt; one with cached context attends to it too.
        Under a window, a chunk gathers only the blocks its queries' windows reach."""
        block_size = self.block_size
        prefills = []
        for offset, length, start, table in specs:
            if start == 0:
                mask = causal_mask(length, window) if window and window < length else None
                prefills.append(PrefillChunk(offset, length, None, _to(mask, device)))
                continue
            num_blocks = -(-(start + length) // block_size)
            first_block = max(0, start - window + 1) // block_size if window else 0
            context = torch.arange(first_block * block_size, num_blocks * block_size)
            queries = torch.arange(start, start + length)[:, None]
            mask = context[None, :] <= queries
            if window:
                mask &= context[None, :] > queries - window
            prefills.append(PrefillChunk(offset, length,
                                         torch.tensor(table[first_block:num_blocks], device=device),
                                         mask.to(device)))
        return prefills

    def prompt_rows(self, scheduled: list[tuple[int, int]], num_rows: int,
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
            table = self.block_tables.block_ids(request_id)
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
        if self.window is not None:
            batch.sliding = AttentionBatch(block_size=block_size, slot_mapping=batch.slot_mapping,
                                           decodes=[], prefills=[], prompt_rows=row_length,
                                           window=self.window)
        inputs = StaticInputs(torch.tensor(input_ids, device=device),
                              torch.tensor(positions, device=device), batch)
        return inputs, sample_rows, sample_ids



def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)
