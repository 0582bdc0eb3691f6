"""What a handler receives: one record's new version, with its `Product` and
`RecordState` decoded from the bytes the `Record` carries. The twin of
`shelfsync_feed::update`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from google.protobuf.message import DecodeError

from .proto import shelfsync_pb2 as pb
from .subjects import PlaceKey


class UpdateKind(enum.Enum):
    CREATED = "created"
    UPDATED = "updated"
    DELETED = "deleted"
    #: Loaded from a keyframe (bootstrap, or the repair of a place).
    SNAPSHOT = "snapshot"


def product_of(record: pb.Record) -> pb.Product:
    """The record's `Product` (`data` holds its serialized bytes). Empty if the
    bytes do not decode (a newer, incompatible schema)."""
    try:
        return pb.Product.FromString(record.data)
    except DecodeError:
        return pb.Product()


def state_of(record: pb.Record) -> pb.RecordState:
    """The record's `RecordState` (`state` holds its serialized bytes)."""
    try:
        return pb.RecordState.FromString(record.state)
    except DecodeError:
        return pb.RecordState()


def is_live(record: pb.Record) -> bool:
    """Present in the latest full import and not deleted."""
    return not record.absent and not record.deleted


def is_visible(record: pb.Record) -> bool:
    """Live and not hidden by a validator."""
    s = state_of(record)
    return is_live(record) and not (s.HasField("hidden") and s.hidden)


def is_offered(record: pb.Record) -> bool:
    """Visible with a positive stock."""
    p = product_of(record)
    return is_visible(record) and p.HasField("stock") and p.stock > 0


@dataclass
class Update:
    """A record's new version, as the kit delivers it to a handler."""

    key: pb.RecordKey
    after: pb.Record
    kind: UpdateKind
    #: The previous version as storage saw it; None for a creation or a snapshot.
    before: Optional[pb.Record] = None
    origin: Optional[pb.Origin] = None
    #: The change did not fit in one broker message: `before` has its key, flags
    #: and timestamps but no `data` or `state` (`before_product` is None).
    before_omitted: bool = False
    _product: Optional[pb.Product] = field(default=None, repr=False, compare=False)
    _state: Optional[pb.RecordState] = field(default=None, repr=False, compare=False)

    @staticmethod
    def from_change(c: pb.Change) -> Optional["Update"]:
        if not c.HasField("after"):
            return None
        if c.HasField("key"):
            key = c.key
        elif c.after.HasField("key"):
            key = c.after.key
        else:
            return None
        kind = {
            pb.CHANGE_KIND_CREATED: UpdateKind.CREATED,
            pb.CHANGE_KIND_DELETED: UpdateKind.DELETED,
        }.get(c.kind, UpdateKind.UPDATED)
        return Update(
            key=key,
            after=c.after,
            kind=kind,
            before=c.before if c.HasField("before") else None,
            origin=c.origin if c.HasField("origin") else None,
            before_omitted=c.before_omitted,
        )

    @staticmethod
    def from_snapshot(r: pb.Record) -> Optional["Update"]:
        if not r.HasField("key"):
            return None
        return Update(key=r.key, after=r, kind=UpdateKind.SNAPSHOT)

    @property
    def place(self) -> PlaceKey:
        return PlaceKey(self.key.brand_id, self.key.place_id)

    @property
    def product_id(self) -> str:
        return self.key.product_id

    @property
    def updated_at(self) -> int:
        return self.after.updated_at

    @property
    def product(self) -> pb.Product:
        """The new version's `Product`, decoded from `after.data`."""
        if self._product is None:
            self._product = product_of(self.after)
        return self._product

    @property
    def state(self) -> pb.RecordState:
        """The new version's `RecordState`, decoded from `after.state`."""
        if self._state is None:
            self._state = state_of(self.after)
        return self._state

    @property
    def before_product(self) -> Optional[pb.Product]:
        """The previous `Product`; None for a creation, a snapshot, or when
        storage omitted it (`before_omitted`: read the record if you need it)."""
        if self.before is None or self.before_omitted:
            return None
        return product_of(self.before)

    @property
    def before_state(self) -> Optional[pb.RecordState]:
        if self.before is None or self.before_omitted:
            return None
        return state_of(self.before)
