"""An indexed free stack of integer ids: batch push/pop/remove, all numpy-vectorised.

``pos[id]`` is the id's index in ``stack`` or -1, so removing an arbitrary set of ids
(a parent page merging back) is O(len(set)) without scanning the stack.
"""

from __future__ import annotations

import numpy as np


class FreeStack:
    def __init__(self, capacity: int) -> None:
        self.stack = np.empty(capacity, dtype=np.int64)
        self.pos = np.full(capacity, -1, dtype=np.int64)
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def push(self, ids: np.ndarray) -> None:
        n = len(ids)
        where = np.arange(self.size, self.size + n)
        self.stack[self.size : self.size + n] = ids
        self.pos[ids] = where
        self.size += n

    def pop(self, n: int) -> np.ndarray:
        """The n most recently pushed ids (LIFO keeps recently freed pages hot)."""
        assert n <= self.size, "caller checks capacity first"
        top = self.size - n
        ids = self.stack[top : self.size][::-1].copy()
        self.pos[ids] = -1
        self.size = top
        return ids

    def remove(self, ids: np.ndarray) -> None:
        """Remove ids known to be in the stack: fill their holes with survivors from the top."""
        k = len(ids)
        if k == 0:
            return
        new_size = self.size - k
        holes = self.pos[ids]
        holes = holes[holes < new_size]
        tail = self.stack[new_size : self.size]
        self.pos[ids] = -1
        movers = tail[self.pos[tail] >= 0]
        self.stack[holes] = movers
        self.pos[movers] = holes
        self.size = new_size

    def contents(self) -> np.ndarray:
        return self.stack[: self.size]
