"""Every request's KV block ids as one row of a numpy array, written as blocks are added.

A step's block table for the attention kernel is then one gather of the scheduled requests' rows
(`StepInputs.prepare`), instead of a Python list of every block id of every request rebuilt each step and copied
row by row, which with hundreds of decoding sequences is a large share of the engine's host time per step (profile
the sim backend with every cost 0 to see it). A row belongs to a
request from its first block until it is freed (vLLM's persistent block table, kept by the KV cache manager here,
since that is what knows when blocks change).
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, max_blocks_per_row: int = 64, rows: int = 64) -> None:
        self.ids = np.zeros((max(rows, 1), max(max_blocks_per_row, 1)), dtype=np.int32)
        self._free_rows = list(range(self.ids.shape[0] - 1, -1, -1))  # popped from the end: row 0 first
        self.row_of: dict[str, int] = {}

    def row(self, request_id: str) -> int:
        """The request's row, taken from the free rows (the table grows when none is left)."""
        row = self.row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                old = self.ids.shape[0]
                self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
                self._free_rows = list(range(2 * old - 1, old - 1, -1))
            row = self.row_of[request_id] = self._free_rows.pop()
        return row

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        """Block ids for positions [start, start + len) of the row."""
        end = start + len(block_ids)
        if end > self.ids.shape[1]:  # a longer request than the table was sized for
            cols = max(end, 2 * self.ids.shape[1])
            self.ids = np.pad(self.ids, ((0, 0), (0, cols - self.ids.shape[1])))
        self.ids[row, start:end] = block_ids

    def release(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
