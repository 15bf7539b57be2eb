"""Block tables that persist across steps: one preallocated row per live request, updated incrementally.

    table [rows, width] int64   row r = the block ids of the request holding r, zero past its count
    rows sized to max_num_seqs, width to max_model_len / block_size (both grow if ever exceeded)

A request's block list only grows while it runs (the KV cache manager appends; a speculative
rollback keeps its blocks), so a step writes just the new tail of each row instead of rebuilding
the table from Python lists. A list can be replaced only by a free: the request finished or was
aborted (the core calls `forget`, which zeroes and frees the row) or was preempted (its
`num_preemptions` moves on, and the row is rewritten whole; so is a row whose id another Request
object took over, should a forget ever be missed). A cheap guard (the last known block
id still matches) rewrites any row that disagrees anyway, so the table always equals a rebuild.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenmill.engine.interfaces import ScheduledRequest
from tokenmill.engine.request import Request


class PersistentBlockTables:
    def __init__(self, max_rows: int, max_blocks: int) -> None:
        self.table = np.zeros((max(1, max_rows), max(1, max_blocks)), dtype=np.int64)
        self.rows: dict[str, int] = {}
        self._known: list[int] = [0] * self.table.shape[0]  # blocks written in each row
        self._preemptions: list[int] = [0] * self.table.shape[0]
        self._owners: list[Request | None] = [None] * self.table.shape[0]
        self._free: list[int] = list(range(self.table.shape[0] - 1, -1, -1))

    @property
    def width(self) -> int:
        return int(self.table.shape[1])

    def rows_for(self, scheduled: Sequence[ScheduledRequest]) -> np.ndarray:
        """Bring the rows of `scheduled` up to date; their row indices, in order."""
        out = np.empty(len(scheduled), dtype=np.int64)
        table, known_of, preempted_of, owners = self.table, self._known, self._preemptions, self._owners
        for i, s in enumerate(scheduled):
            request, blocks = s.request, s.block_ids
            row = self.rows.get(request.request_id)
            if row is None:
                row = self._take_row(request.request_id)
                table, known_of, preempted_of, owners = self.table, self._known, self._preemptions, self._owners
                preempted_of[row] = request.num_preemptions
            n, known = len(blocks), known_of[row]
            if known and (preempted_of[row] != request.num_preemptions or owners[row] is not request or known > n
                          or table[row, known - 1] != blocks[known - 1]):
                table[row, :known] = 0  # replaced (preemption) or disagreeing: rewrite the row whole
                known = 0
                preempted_of[row] = request.num_preemptions
            if n > known:
                if n > table.shape[1]:
                    self._grow(table.shape[0], n)
                    table = self.table
                table[row, known:n] = blocks[known:]
            known_of[row] = n
            owners[row] = request
            out[i] = row
        return out

    def forget(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is None:
            return
        self.table[row, :self._known[row]] = 0
        self._known[row] = 0
        self._owners[row] = None
        self._free.append(row)

    def reset(self) -> None:
        self.table[:] = 0
        self.rows.clear()
        n = self.table.shape[0]
        self._known, self._preemptions = [0] * n, [0] * n
        self._owners = [None] * n
        self._free = list(range(n - 1, -1, -1))

    def _take_row(self, request_id: str) -> int:
        if not self._free:
            old = self.table.shape[0]
            self._grow(2 * old, self.table.shape[1])
            self._free = list(range(2 * old - 1, old - 1, -1))
        row = self._free.pop()
        self.rows[request_id] = row
        return row

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self.table.shape
        width = max(width, old_width)
        if width > old_width:
            width = max(width, 2 * old_width)
        grown = np.zeros((rows, width), dtype=np.int64)
        grown[:old_rows, :old_width] = self.table
        self.table = grown
        self._known.extend([0] * (rows - old_rows))
        self._preemptions.extend([0] * (rows - old_rows))
        self._owners.extend([None] * (rows - old_rows))

