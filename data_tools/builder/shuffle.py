"""The seeded shuffle of a build: a keyed bijection of 0..n-1, computed for any positions on demand.

A cycle-walking Feistel network over integers, so neither a shuffled list nor an n-sized permutation array exists;
it depends on the seed and n only, never on the numpy version or the machine.
"""

from __future__ import annotations

import hashlib

import numpy as np


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """A 64-bit mixing function (splitmix64's finaliser) of x and a round key; uint64 arithmetic wraps."""
    x = x ^ key
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Shuffle:
    """A seeded bijection of positions 0..n-1 onto rows 0..n-1, computed for any positions on demand.

    A balanced Feistel network permutes 0..2^(2h)-1 (the smallest even bit width that holds n); values that land at
    n or above are encrypted again until they fall below n (cycle walking), which keeps it a bijection of 0..n-1.
    """

    ROUNDS = 6

    def __init__(self, n: int, key: str) -> None:
        self.n = int(n)
        bits = max(2, (max(self.n, 2) - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        digest = hashlib.sha512(f"build-shards shuffle/{key}".encode()).digest()
        self.keys = [np.uint64(int.from_bytes(digest[8 * i: 8 * i + 8], "little")) for i in range(self.ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right, key) & self.mask)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = np.asarray(positions, dtype=np.uint64)
        if self.n <= 1 or x.size == 0:
            return x.astype(np.int64)
        x = self._encrypt(x)
        outside = x >= np.uint64(self.n)
        while outside.any():
            x[outside] = self._encrypt(x[outside])
            outside = x >= np.uint64(self.n)
        return x.astype(np.int64)
