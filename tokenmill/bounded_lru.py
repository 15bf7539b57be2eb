"""A thread-safe map that forgets its least recently used entries past a count and, optionally, a size budget.

What the server keeps for clients across requests (stored responses, calls as written) grows with what
clients send: without a size budget a few huge conversations would hold memory that only a restart frees.
The gateway keeps where each stored response lives in one too (by count). Imports nothing of tokenmill's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedLru(Generic[K, V]):
    def __init__(self, max_entries: int, max_size: int | None = None,
                 size_of: Callable[[V], int] | None = None) -> None:
        """`max_size` bounds the sum of `size_of` over the entries (None: entries are only counted)."""
        if max_entries < 1 or (max_size is not None and (max_size < 1 or size_of is None)):
            raise ValueError("a bounded map needs room for at least one entry, and a size budget a size_of")
        self.max_entries = max_entries
        self.max_size = max_size
        self._size_of = size_of
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()  # handlers run on the event loop; tests and tools may not

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size(self) -> int:
        return self._size

    def put(self, key: K, value: V) -> None:
        """Keep `value` as the most recently used; an entry larger than the whole budget is not kept."""
        size = self._size_of(value) if self._size_of is not None else 0
        with self._lock:
            self._drop(key)
            if self._over(size):
                return
            self._entries[key] = (value, size)
            self._size += size
            while len(self._entries) > self.max_entries or self._over(self._size):
                self._drop(next(iter(self._entries)))

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def pop(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            self._drop(key)
            return None if entry is None else entry[0]

    def _over(self, size: int) -> bool:
        return self.max_size is not None and size > self.max_size

    def _drop(self, key: K) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._size -= entry[1]
