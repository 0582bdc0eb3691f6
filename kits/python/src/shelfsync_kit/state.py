"""What the kit remembers of every record it delivered: its `updated_at` (for
newer-only apply) and whether it is a tombstone, plus a running digest per
place (for the keyframe check). Pure; no I/O. The twin of `shelfsync_feed::state`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from .digest import Digest
from .proto import shelfsync_pb2 as pb
from .subjects import PlaceKey


@dataclass
class _PlaceState:
    # product_id -> (updated_at, deleted)
    records: Dict[str, Tuple[int, bool]] = field(default_factory=dict)
    digest: Digest = field(default_factory=Digest)


@dataclass(frozen=True)
class Drift:
    """The place's digest differs from the marker's: it must be repaired."""

    ours: Digest
    theirs: Digest


class FeedState:
    def __init__(self) -> None:
        self._places: Dict[PlaceKey, _PlaceState] = {}

    def is_newer(self, place: PlaceKey, product_id: str, updated_at: int) -> bool:
        """True when `updated_at` is newer than what was delivered for the record
        (a record never seen is always newer)."""
        p = self._places.get(place)
        known = p.records.get(product_id) if p else None
        return known is None or updated_at > known[0]

    def record(self, place: PlaceKey, product_id: str, updated_at: int, deleted: bool) -> None:
        """Records that the record was delivered at `updated_at`."""
        p = self._places.setdefault(place, _PlaceState())
        known = p.records.get(product_id)
        if known is None:
            p.digest.add(product_id, updated_at)
        else:
            p.digest.replace(product_id, known[0], updated_at)
        p.records[product_id] = (updated_at, deleted)

    def updated_at(self, place: PlaceKey, product_id: str) -> Optional[int]:
        p = self._places.get(place)
        known = p.records.get(product_id) if p else None
        return None if known is None else known[0]

    def reset_place(self, place: PlaceKey) -> None:
        """Forgets a place (before loading it from a keyframe)."""
        self._places.pop(place, None)

    def digest(self, place: PlaceKey) -> Digest:
        p = self._places.get(place)
        return Digest(p.digest.sum, p.digest.count) if p else Digest()

    def check(self, place: PlaceKey, mark: pb.KeyframeMark) -> Optional[Drift]:
        """Compares the place with a keyframe marker, after dropping the tombstones
        storage purges (deleted before the marker's cutoff). None: they match."""
        p = self._places.get(place)
        if p is not None:
            expired = [
                (pid, at)
                for pid, (at, deleted) in p.records.items()
                if deleted and at < mark.tombstone_cutoff
            ]
            for pid, at in expired:
                p.digest.remove(pid, at)
                del p.records[pid]
        ours = self.digest(place)
        theirs = Digest(mark.digest, mark.total)
        return None if ours == theirs else Drift(ours, theirs)

    def __len__(self) -> int:
        """Records known, over every place."""
        return sum(len(p.records) for p in self._places.values())

    def places(self) -> int:
        return len(self._places)
