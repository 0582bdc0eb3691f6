"""The order-independent digest of a place (docs/DESIGN.md, Keyframes): the
wrapping (mod 2^64) sum, over every record, of xxh3-64 (seed 0) of the
`product_id` UTF-8 bytes followed by `updated_at` as 8 little-endian bytes. A
consumer keeps it incrementally and compares it with a keyframe marker's."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

_MASK = (1 << 64) - 1


def term(product_id: str, updated_at: int) -> int:
    """One record's term of the digest (an unsigned 64-bit integer)."""
    return xxhash.xxh3_64_intdigest(product_id.encode("utf-8") + struct.pack("<q", updated_at))


@dataclass
class Digest:
    """A running digest with its record count."""

    sum: int = 0
    count: int = 0

    def add(self, product_id: str, updated_at: int) -> None:
        self.sum = (self.sum + term(product_id, updated_at)) & _MASK
        self.count += 1

    def remove(self, product_id: str, updated_at: int) -> None:
        self.sum = (self.sum - term(product_id, updated_at)) & _MASK
        self.count = max(self.count - 1, 0)

    def replace(self, product_id: str, old: int, new: int) -> None:
        """A record moved from `old` to `new` updated_at."""
        self.sum = (self.sum - term(product_id, old) + term(product_id, new)) & _MASK
