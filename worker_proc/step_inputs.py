"""A step's model inputs, built on the host from the plan and the worker's request states:
token ids, positions, KV slots and the attention batch (decode groups over block tables,
prefill chunks), padded to the step's bucket where it has one; and the one-prompt-per-row
layout a prompt graph reads."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.protocol.step_shape import Phase, StepShape
from spmd_runtime.runtime.layers.attention import (
    AttentionBatch,
    DecodeGroup,
    PrefillChunk,
    band_mask,
)
from spmd_runtime.runtime.layers.attention_backend import AttentionBackend
from spmd_runtime.worker_proc.block_table import BlockTables
from spmd_runtime.worker_proc.graphs import StaticInputs
from spmd_runtime.worker_proc.step_state import RequestState

# Single-token queries are attended in groups of this many, longest context first.
DECODE_GROUP_SIZE = 8


@dataclass
class KVGroup:
    """Layers that share block tables: every layer of most models; a model mixing full and
    sliding-window layers (Gemma 2 and 3) has a group of each, with block ids of its own (the
    windowed group frees the blocks its window leaves)."""

    tables: BlockTables
    scratch_block: int              # the block padding writes to and tables are padded with
    window: int | None = None       # the group's sliding window (None: full attention)


def kv_groups(config: ModelConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              block_size: int, scratch_block: int) -> list[KVGroup]:
    """The KV groups of a model: one (with its window, if every layer has one), or for a model
    mixing full and windowed layers, the full layers' then the windowed layers' (whose caches
    have blocks of their own; their scratch block is their last)."""
    if not config.sliding_layers or config.all_layers_slide:
        window = config.sliding_window if config.sliding_layers else None
        return [KVGroup(BlockTables(scratch_block), scratch_block, window)]
    sliding_scratch = kv_caches[config.sliding_layers[0]][0].shape[0] // block_size - 1
    return [KVGroup(BlockTables(scratch_block), scratch_block),
            KVGroup(BlockTables(sliding_scratch), sliding_scratch, config.sliding_window)]


class StepInputs:
    """Builds inputs for the ModelRunner that owns it (and its graph runner), from the request
    states and the block tables it shares with it: an attention batch per KV group (the second
    one as the first's `sliding`)."""

    def __init__(self, requests: dict[int, RequestState], groups: list[KVGroup],
                 block_size: int, device: torch.device, attention: AttentionBackend) -> None:
        self.requests = requests
        self.groups = groups
        self.block_size = block_size
        self.device = device
        # The worker's attention backend: decode groups read the cache in place or gather it.
        self.attention = attention

    def sort_for_attention(self, scheduled: list[tuple[int, int]]) -> None:
        """The order build() needs: single-token queries first (the decode groups are the first
        rows), longest context first, so attention can group them."""
        scheduled.sort(key=lambda item: (item[1] != 1, -self.requests[item[0]].num_computed_tokens))

    def build(self, scheduled: list[tuple[int, int]], bucket: StepShape | None = None,
              device: torch.device | None = None):
        """(input ids, positions, AttentionBatch, sample rows, sample request ids) of the
        scheduled (request id, token count) pairs, padded to `bucket` where given, on `device`
        (the worker's by default)."""
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[int] = []
        spans: list[tuple[int, int, int, int]] = []     # (request id, start, end, first row)
        for request_id, num_tokens in scheduled:
            state = self.requests[request_id]
            start = state.num_computed_tokens
            end = start + num_tokens
            spans.append((request_id, start, end, len(input_ids)))
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            if end == len(state.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_ids.append(request_id)
        pad_start = num_padding = None
        if bucket is not None:
            pad_start = len(input_ids)
            num_padding = bucket.num_tokens - pad_start
            input_ids.extend([0] * num_padding)
            positions.extend([0] * num_padding)
        device = device or self.device
        batches = [self._group_batch(group, spans, bucket, pad_start, device)
                   for group in self.groups]
        batch = batches[0]
        batch.sliding = batches[1] if len(batches) > 1 else None
        return (torch.tensor(input_ids, device=device), torch.tensor(positions, device=device),
                batch, sample_rows, sample_ids)

    def _group_batch(self, group: KVGroup, spans: list[tuple[int, int, int, int]],
                     bucket: StepShape | None, pad_start: int | None,
                     device: torch.device) -> AttentionBatch:
        """The attention batch of one KV group: its slots, decode groups and prefill chunks."""
        block_size, tables = self.block_size, group.tables
        slots: list[int] = []
        decode_rows: list[int] = []        # block-table rows
        decode_lengths: list[int] = []
        prefill_specs: list[tuple[int, int, int, list[int]]] = []
        decode_step = bucket is not None and bucket.phase is Phase.DECODE
        for request_id, start, end, offset in spans:
            table = tables.block_ids(request_id)
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(start, end))
            if end - start == 1 or decode_step:
                # A decode step's tokens are single-token queries, a request verifying
                # proposals one per token: each attends to its context up to itself, whose KV
                # the layer writes (all the step's slots) before attention reads it.
                row = tables.row(request_id)
                decode_rows.extend([row] * (end - start))
                decode_lengths.extend(range(start + 1, end + 1))
            else:
                prefill_specs.append((offset, end - start, start, table))
        if bucket is not None:
            num_padding = bucket.num_tokens - pad_start
            scratch = group.scratch_block * block_size
            slots.extend(scratch + i % block_size for i in range(num_padding))
            if bucket.phase is Phase.DECODE:
                # Padding rows attend to the scratch block's first slot only.
                decode_rows.extend([BlockTables.PADDING_ROW] * num_padding)
                decode_lengths.extend([1] * num_padding)
        return AttentionBatch(
            block_size=block_size, slot_mapping=torch.tensor(slots, device=device),
            decodes=self.decode_groups(tables, decode_rows, decode_lengths, bucket, device,
                                       group.window),
            prefills=self.prefill_chunks(prefill_specs, device, group.window),
            pad_start=pad_start, backend=self.attention, window=group.window)

    def decode_group(self, tables: BlockTables, first: int, rows: list[int], lengths: list[int],
                     num_blocks: int, device: torch.device,
                     window: int | None = None) -> DecodeGroup:
        """Single-token queries `first`..`first + len(rows)` over `num_blocks` context blocks
        each, from those block-table rows; tables are padded with the scratch block, which the
        mask (or for the kernel, the context lengths) hides. Under a window, the mask (or the
        kernel's starts) hides the context before each query's last `window` tokens too: those
        blocks may be freed and given to other requests already."""
        starts = [max(0, length - window) for length in lengths] if window else None
        if self.attention.reads_cache_in_place:
            gathered = tables.gather(rows, num_blocks, torch.int32)
            return DecodeGroup(first, len(rows), gathered.view(-1).to(device), None,
                               torch.tensor(lengths, dtype=torch.int32, device=device),
                               None if starts is None else
                               torch.tensor(starts, dtype=torch.int32, device=device))
        blocks = tables.gather(rows, num_blocks, torch.int64).view(-1)
        context = torch.arange(num_blocks * self.block_size)
        mask = context < torch.tensor(lengths)[:, None]
        if starts is not None:
            mask &= context >= torch.tensor(starts)[:, None]
        return DecodeGroup(first, len(rows), blocks.to(device),
                           mask.view(len(rows), 1, 1, -1).to(device))

    def decode_groups(self, tables: BlockTables, rows: list[int], lengths: list[int],
                      bucket: StepShape | None, device: torch.device,
                      window: int | None = None) -> list[DecodeGroup]:
        """The decode path: single-token queries grouped for attention."""
        block_size = self.block_size
        if bucket is not None and bucket.phase is Phase.DECODE:
            # One group of the bucket's shape: its batch size in rows over its context length.
            return [self.decode_group(tables, 0, rows, lengths, bucket.length // block_size,
                                      device, window)]
        if self.attention.reads_cache_in_place and rows:
            # The kernel reads each sequence's own context length: one group, no grouping.
            return [self.decode_group(tables, 0, rows, lengths, -(-max(lengths) // block_size),
                                      device, window)]
        return [self.decode_group(
            tables, first, rows[first:first + DECODE_GROUP_SIZE],
            lengths[first:first + DECODE_GROUP_SIZE],
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
                prefills.append(PrefillChunk(offset, length, None,
                                             band_mask(length, window, device)))
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
                                         mask.to(device), first_key=first_block * block_size,
                                         position=start))
        return prefills

    def prompt_rows(self, scheduled: list[tuple[int, int]], num_rows: int,
                    row_length: int, device: torch.device
                    ) -> tuple[StaticInputs, list[int], list[int]]:
        """Fresh prompts (or their first chunks) one per row of `row_length` positions."""
        size = num_rows * row_length
        input_ids, positions = [0] * size, [0] * size
        sample_rows, sample_ids = [], []
        for row, (request_id, num_tokens) in enumerate(scheduled):
            state, base = self.requests[request_id], row * row_length
            input_ids[base:base + num_tokens] = state.token_ids[:num_tokens]
            positions[base:base + num_tokens] = range(num_tokens)
            if num_tokens == len(state.token_ids):
                sample_rows.append(base + num_tokens - 1)
                sample_ids.append(request_id)
        batches = [AttentionBatch(block_size=self.block_size,
                                  slot_mapping=self._row_slots(group, scheduled, size,
                                                               row_length, device),
                                  decodes=[], prefills=[], prompt_rows=row_length,
                                  window=group.window)
                   for group in self.groups]
        batch = batches[0]
        batch.sliding = batches[1] if len(batches) > 1 else None
        inputs = StaticInputs(torch.tensor(input_ids, device=device),
                              torch.tensor(positions, device=device), batch)
        return inputs, sample_rows, sample_ids

    def _row_slots(self, group: KVGroup, scheduled: list[tuple[int, int]], size: int,
                   row_length: int, device: torch.device) -> torch.Tensor:
        """prompt_rows' KV slots in one group: each prompt's own, the scratch block's elsewhere."""
        block_size = self.block_size
        scratch = group.scratch_block * block_size
        slots = [scratch + i % block_size for i in range(size)]
        for row, (request_id, num_tokens) in enumerate(scheduled):
            table, base = group.tables.block_ids(request_id), row * row_length
            slots[base:base + num_tokens] = [table[p // block_size] * block_size + p % block_size
                                             for p in range(num_tokens)]
        return torch.tensor(slots, device=device)
