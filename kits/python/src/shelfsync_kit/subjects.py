"""Subject and stream names, derived from the deployment's prefix, and the stable
partition function (the twin of `shelfsync_bus::subjects`)."""

from __future__ import annotations

import struct
from typing import NamedTuple, Optional

import xxhash


class PlaceKey(NamedTuple):
    """A place (store) of a brand (partner): the unit records are published,
    keyframed and checked by."""

    brand_id: int
    place_id: int


def partition_of(brand_id: int, place_id: int, partitions: int) -> int:
    """The command partition of a place: xxh3-64 (seed 0) of `brand_id` then
    `place_id`, each 8 little-endian bytes, modulo `partitions`. Stable across
    versions and languages (proto/golden/vectors.json)."""
    h = xxhash.xxh3_64_intdigest(struct.pack("<qq", brand_id, place_id))
    return h % max(partitions, 1)


def _stream_prefix(prefix: str) -> str:
    return "".join(c.upper() if c.isascii() and c.isalnum() else "_" for c in prefix)


def _token(v: Optional[int]) -> str:
    return "*" if v is None else str(v)


class Subjects:
    """Every subject and stream name of one deployment (`nats.prefix`)."""

    def __init__(self, prefix: str = "shelfsync") -> None:
        self.prefix = prefix
        self.stream_prefix = _stream_prefix(prefix)

    def cmd(self, partition: int) -> str:
        return f"{self.prefix}.cmd.{partition}"

    def changes(self, brand_id: int, place_id: int) -> str:
        return f"{self.prefix}.changes.{brand_id}.{place_id}"

    def changes_filter(self, brand_id: Optional[int], place_id: Optional[int]) -> str:
        """Changes of a brand and/or place (`*` where not given)."""
        return f"{self.prefix}.changes.{_token(brand_id)}.{_token(place_id)}"

    def keyframes(self, brand_id: int, place_id: int) -> str:
        return f"{self.prefix}.keyframes.{brand_id}.{place_id}"

    def keyframes_filter(self, brand_id: Optional[int], place_id: Optional[int]) -> str:
        return f"{self.prefix}.keyframes.{_token(brand_id)}.{_token(place_id)}"

    def ctl_keyframe(self) -> str:
        """Core NATS request subject: publish a keyframe now (KeyframeRequest)."""
        return f"{self.prefix}.ctl.keyframe"

    def read(self, what: str) -> str:
        """Core NATS request subjects of storage's read API (get, batch, place)."""
        return f"{self.prefix}.read.{what}"

    def cmd_stream(self) -> str:
        return f"{self.stream_prefix}_CMD"

    def changes_stream(self) -> str:
        return f"{self.stream_prefix}_CHANGES"

    def keyframes_stream(self) -> str:
        return f"{self.stream_prefix}_KEYFRAMES"


def place_of_subject(subject: str) -> Optional[PlaceKey]:
    """`(brand, place)` from `<prefix>.changes.<brand>.<place>`."""
    tokens = subject.rsplit(".", 2)
    if len(tokens) != 3:
        return None
    try:
        return PlaceKey(int(tokens[1]), int(tokens[2]))
    except ValueError:
        return None
