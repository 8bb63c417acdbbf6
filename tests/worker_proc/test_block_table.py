"""BlockTables: each request's blocks as a padded row; gathers give the rows a decode batch needs."""
from __future__ import annotations

import torch
from spmd_runtime.worker_proc.block_table import BlockTables

FILLER = 99


def test_gather_pads_with_the_filler_and_truncates_to_the_width() -> None:
    tables = BlockTables(FILLER, num_rows=4, num_cols=4)
    tables.add(7, [1, 2, 3])
    tables.add(8, [4])
    rows = [tables.row(7), tables.row(8), BlockTables.PADDING_ROW]
    assert tables.gather(rows, 2, torch.int64).tolist() == [[1, 2], [4, FILLER], [FILLER, FILLER]]
    # Wider than the table: filler columns beyond it.
    assert tables.gather(rows, 6, torch.int32).tolist() == [
        [1, 2, 3, FILLER, FILLER, FILLER], [4] + [FILLER] * 5, [FILLER] * 6]
    assert tables.gather(rows, 6, torch.int32).dtype == torch.int32


def test_appends_grow_the_columns_and_new_requests_grow_the_rows() -> None:
    tables = BlockTables(FILLER, num_rows=2, num_cols=2)
    tables.add(1, [10, 11])
    tables.append(1, [12, 13, 14])
    for request_id in range(2, 6):          # past the one free row: the table grows
        tables.add(request_id, [request_id * 100])
    assert tables.gather([tables.row(1)], 5, torch.int64).tolist() == [[10, 11, 12, 13, 14]]
    assert [tables.gather([tables.row(r)], 2, torch.int64).tolist() for r in range(2, 6)] == [
        [[r * 100, FILLER]] for r in range(2, 6)]
    assert len({tables.row(r) for r in range(1, 6)}) == 5
    assert BlockTables.PADDING_ROW not in {tables.row(r) for r in range(1, 6)}
    assert tables.gather([BlockTables.PADDING_ROW], 5, torch.int64).tolist() == [[FILLER] * 5]


def test_a_removed_row_is_reused_clean_and_a_re_added_request_starts_over() -> None:
    tables = BlockTables(FILLER, num_rows=2, num_cols=4)
    tables.add(1, [5, 6, 7])
    row = tables.row(1)
    tables.remove(1)
    tables.add(2, [8])
    assert tables.row(2) == row
    assert tables.gather([row], 4, torch.int64).tolist() == [[8, FILLER, FILLER, FILLER]]
    tables.add(2, [9, 10])                  # held anew (e.g. swapped back in): replaced
    assert tables.gather([tables.row(2)], 3, torch.int64).tolist() == [[9, 10, FILLER]]
    tables.remove(3)                        # unknown: nothing to do


def test_block_ids_are_the_row_as_a_list_through_appends_removals_and_re_adds() -> None:
    tables = BlockTables(FILLER, num_rows=2, num_cols=2)
    tables.add(1, [5, 6])
    tables.append(1, [7])
    tables.append(1, [])
    assert tables.block_ids(1) == [5, 6, 7]
    assert tables.gather([tables.row(1)], 3, torch.int64).tolist() == [tables.block_ids(1)]
    tables.add(1, [8])                      # held anew: the old ids are gone
    assert tables.block_ids(1) == [8]
    tables.remove(1)
    tables.add(2, [9])                      # the same row, reused
    assert tables.block_ids(2) == [9]
    assert tables.gather([tables.row(2)], 3, torch.int64).tolist() == [[9, FILLER, FILLER]]
