"""Block tables as rows of one host array, kept from step to step.

A decode step at batch 256 over contexts of a few hundred tokens needs some 20,000 block ids; turning a
Python list of them into a tensor every step costs the host about a millisecond. A sequence's block table
only ever grows by appending (BlockManager.allocate_slots; freeing gives the sequence a new list), so each
table is written to its row once, then only its new blocks, and a step's tables are one gather of rows.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTableRows:
    def __init__(self, max_blocks: int, capacity: int) -> None:
        self.max_blocks = max_blocks + max_blocks % 2
        self.host = np.zeros((capacity, self.max_blocks), dtype=np.int64)
        # id(table) -> (table, its row, blocks written): the reference keeps the id from being reused.
        self._rows: dict[int, tuple[list[int], int, int]] = {}
        self._next_row = 0

    def gather(self, tables: list[list[int]]) -> torch.Tensor:
        """[len(tables), longest (rounded up to even)] int64 on the host: row i holds tables[i], then
        block ids that a context length masks out (zeros or another table's)."""
        if len(tables) > self.host.shape[0] - self._next_row:
            # Rows are handed out in order and all taken back at once: tables of finished or preempted
            # sequences are dropped here, and this step's tables rewritten.
            self._rows.clear()
            self._next_row = 0
            if len(tables) > self.host.shape[0]:
                self.host = np.zeros((2 * len(tables), self.max_blocks), dtype=np.int64)
        rows = [self._row(table) for table in tables]
        # An even width keeps every row 16-byte aligned, so a group of rows sliced off the result starts
        # aligned (Triton compiles a kernel once per alignment of its pointers).
        width = max(len(table) for table in tables)
        return torch.from_numpy(self.host[rows, : width + width % 2])

    def _row(self, table: list[int]) -> int:
        entry = self._rows.get(id(table))
        if entry is None:
            row, written = self._next_row, 0
            self._next_row += 1
        else:
            _, row, written = entry
        if written < len(table):
            self.host[row, written : len(table)] = table[written:]
            self._rows[id(table)] = (table, row, len(table))
        return row
