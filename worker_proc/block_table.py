"""The worker's one record of every request's KV block ids: a padded row of a host tensor, so a
decode batch's tables are a single row gather, and the same ids as a Python list, so building
a step's slot mapping reads list items rather than converting a tensor per token."""
from __future__ import annotations

import torch


class BlockTables:
    """Rows of block ids, padded with `filler` (a block no request owns, which attention masks
    or the kernel's context lengths hide). Row 0 is never given out: all filler, it is the
    table of a padding row."""

    PADDING_ROW = 0

    def __init__(self, filler: int, num_rows: int = 64, num_cols: int = 16) -> None:
        self.filler = filler
        self.table = torch.full((num_rows, num_cols), filler, dtype=torch.int64)
        self.rows: dict[int, int] = {}
        # Each request's row of `table` as a list: kept in step with it by add/append/remove.
        self.ids: dict[int, list[int]] = {}
        self.free_rows = list(range(num_rows - 1, self.PADDING_ROW, -1))

    def add(self, request_id: int, block_ids: list[int]) -> None:
        """A request the worker did not hold (or holds anew: its old row is dropped)."""
        self.remove(request_id)
        if not self.free_rows:
            self._grow(rows=self.table.shape[0])
        self.rows[request_id] = self.free_rows.pop()
        self.ids[request_id] = []
        self.append(request_id, block_ids)

    def append(self, request_id: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        if block_ids[0] < 0:
            # A request that comes back with blocks freed from a sliding window (FREED_BLOCK,
            # always the first ones): its attention never reads them.
            block_ids = [self.filler if block < 0 else block for block in block_ids]
        ids = self.ids[request_id]
        start = len(ids)
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow(cols=max(end, 2 * self.table.shape[1]) - self.table.shape[1])
        self.table[self.rows[request_id], start:end] = torch.tensor(block_ids, dtype=torch.int64)
        ids.extend(block_ids)

    def remove(self, request_id: int) -> None:
        row = self.rows.pop(request_id, None)
        if row is None:
            return
        self.table[row, :len(self.ids.pop(request_id))] = self.filler
        self.free_rows.append(row)

    def row(self, request_id: int) -> int:
        return self.rows[request_id]

    def block_ids(self, request_id: int) -> list[int]:
        """The request's block ids in order; the caller reads the list and must not change it."""
        return self.ids[request_id]

    def gather(self, rows: list[int], num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
        """[len(rows), num_blocks]: each row's first num_blocks blocks, filler past its end."""
        width = self.table.shape[1]
        tables = self.table[:, :num_blocks].index_select(0, torch.tensor(rows, dtype=torch.int64))
        if num_blocks > width:
            tables = torch.cat([tables, tables.new_full((len(rows), num_blocks - width),
                                                        self.filler)], dim=1)
        return tables.to(dtype)

    def _grow(self, rows: int = 0, cols: int = 0) -> None:
        old_rows, old_cols = self.table.shape
        table = torch.full((old_rows + rows, old_cols + cols), self.filler, dtype=torch.int64)
        table[:old_rows, :old_cols] = self.table
        self.table = table
        self.free_rows.extend(range(old_rows + rows - 1, old_rows - 1, -1))
