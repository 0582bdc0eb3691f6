from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CommandKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMAND_KIND_UNSPECIFIED: _ClassVar[CommandKind]
    COMMAND_KIND_SAVE: _ClassVar[CommandKind]
    COMMAND_KIND_PATCH: _ClassVar[CommandKind]
    COMMAND_KIND_DELETE: _ClassVar[CommandKind]

class ChangeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHANGE_KIND_UNSPECIFIED: _ClassVar[ChangeKind]
    CHANGE_KIND_CREATED: _ClassVar[ChangeKind]
    CHANGE_KIND_UPDATED: _ClassVar[ChangeKind]
    CHANGE_KIND_DELETED: _ClassVar[ChangeKind]
COMMAND_KIND_UNSPECIFIED: CommandKind
COMMAND_KIND_SAVE: CommandKind
COMMAND_KIND_PATCH: CommandKind
COMMAND_KIND_DELETE: CommandKind
CHANGE_KIND_UNSPECIFIED: ChangeKind
CHANGE_KIND_CREATED: ChangeKind
CHANGE_KIND_UPDATED: ChangeKind
CHANGE_KIND_DELETED: ChangeKind

class RecordKey(_message.Message):
    __slots__ = ("brand_id", "place_id", "product_id")
    BRAND_ID_FIELD_NUMBER: _ClassVar[int]
    PLACE_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCT_ID_FIELD_NUMBER: _ClassVar[int]
    brand_id: int
    place_id: int
    product_id: str
    def __init__(self, brand_id: _Optional[int] = ..., place_id: _Optional[int] = ..., product_id: _Optional[str] = ...) -> None: ...

class Record(_message.Message):
    __slots__ = ("key", "data", "state", "generation", "absent", "deleted", "created_at", "updated_at")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ABSENT_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    key: RecordKey
    data: bytes
    state: bytes
    generation: int
    absent: bool
    deleted: bool
    created_at: int
    updated_at: int
    def __init__(self, key: _Optional[_Union[RecordKey, _Mapping]] = ..., data: _Optional[bytes] = ..., state: _Optional[bytes] = ..., generation: _Optional[int] = ..., absent: bool = ..., deleted: bool = ..., created_at: _Optional[int] = ..., updated_at: _Optional[int] = ...) -> None: ...

class Product(_message.Message):
    __slots__ = ("title", "category", "price", "old_price", "currency", "stock", "images", "description")
    TITLE_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    OLD_PRICE_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    STOCK_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    title: str
    category: str
    price: int
    old_price: int
    currency: str
    stock: int
    images: _containers.RepeatedScalarFieldContainer[str]
    description: str
    def __init__(self, title: _Optional[str] = ..., category: _Optional[str] = ..., price: _Optional[int] = ..., old_price: _Optional[int] = ..., currency: _Optional[str] = ..., stock: _Optional[int] = ..., images: _Optional[_Iterable[str]] = ..., description: _Optional[str] = ...) -> None: ...

class RecordState(_message.Message):
    __slots__ = ("hidden", "reasons", "decided_by", "decided_at")
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    DECIDED_BY_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    hidden: bool
    reasons: _containers.RepeatedScalarFieldContainer[str]
    decided_by: str
    decided_at: int
    def __init__(self, hidden: bool = ..., reasons: _Optional[_Iterable[str]] = ..., decided_by: _Optional[str] = ..., decided_at: _Optional[int] = ...) -> None: ...

class Origin(_message.Message):
    __slots__ = ("source", "import_id", "published_at")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    IMPORT_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_AT_FIELD_NUMBER: _ClassVar[int]
    source: str
    import_id: str
    published_at: int
    def __init__(self, source: _Optional[str] = ..., import_id: _Optional[str] = ..., published_at: _Optional[int] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("key", "kind", "data", "state", "clear_data_fields", "clear_state_fields", "expected_updated_at", "generation", "origin")
    KEY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CLEAR_DATA_FIELDS_FIELD_NUMBER: _ClassVar[int]
    CLEAR_STATE_FIELDS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    key: RecordKey
    kind: CommandKind
    data: bytes
    state: bytes
    clear_data_fields: _containers.RepeatedScalarFieldContainer[int]
    clear_state_fields: _containers.RepeatedScalarFieldContainer[int]
    expected_updated_at: int
    generation: int
    origin: Origin
    def __init__(self, key: _Optional[_Union[RecordKey, _Mapping]] = ..., kind: _Optional[_Union[CommandKind, str]] = ..., data: _Optional[bytes] = ..., state: _Optional[bytes] = ..., clear_data_fields: _Optional[_Iterable[int]] = ..., clear_state_fields: _Optional[_Iterable[int]] = ..., expected_updated_at: _Optional[int] = ..., generation: _Optional[int] = ..., origin: _Optional[_Union[Origin, _Mapping]] = ...) -> None: ...

class Sweep(_message.Message):
    __slots__ = ("brand_id", "place_id", "generation", "source", "import_id", "guard", "release_held")
    BRAND_ID_FIELD_NUMBER: _ClassVar[int]
    PLACE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    IMPORT_ID_FIELD_NUMBER: _ClassVar[int]
    GUARD_FIELD_NUMBER: _ClassVar[int]
    RELEASE_HELD_FIELD_NUMBER: _ClassVar[int]
    brand_id: int
    place_id: int
    generation: int
    source: str
    import_id: str
    guard: SweepGuard
    release_held: bool
    def __init__(self, brand_id: _Optional[int] = ..., place_id: _Optional[int] = ..., generation: _Optional[int] = ..., source: _Optional[str] = ..., import_id: _Optional[str] = ..., guard: _Optional[_Union[SweepGuard, _Mapping]] = ..., release_held: bool = ...) -> None: ...

class SweepGuard(_message.Message):
    __slots__ = ("accepted", "max_fraction", "missing")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MAX_FRACTION_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    max_fraction: float
    missing: bool
    def __init__(self, accepted: _Optional[int] = ..., max_fraction: _Optional[float] = ..., missing: bool = ...) -> None: ...

class SweepOutcome(_message.Message):
    __slots__ = ("sweep", "status", "reason", "live", "candidates", "marked_absent", "decided_at", "command_seq")
    SWEEP_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    MARKED_ABSENT_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    COMMAND_SEQ_FIELD_NUMBER: _ClassVar[int]
    sweep: Sweep
    status: str
    reason: str
    live: int
    candidates: int
    marked_absent: int
    decided_at: int
    command_seq: int
    def __init__(self, sweep: _Optional[_Union[Sweep, _Mapping]] = ..., status: _Optional[str] = ..., reason: _Optional[str] = ..., live: _Optional[int] = ..., candidates: _Optional[int] = ..., marked_absent: _Optional[int] = ..., decided_at: _Optional[int] = ..., command_seq: _Optional[int] = ...) -> None: ...

class CommandBatch(_message.Message):
    __slots__ = ("partition", "commands", "sweeps", "origin")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    SWEEPS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    partition: int
    commands: _containers.RepeatedCompositeFieldContainer[Command]
    sweeps: _containers.RepeatedCompositeFieldContainer[Sweep]
    origin: Origin
    def __init__(self, partition: _Optional[int] = ..., commands: _Optional[_Iterable[_Union[Command, _Mapping]]] = ..., sweeps: _Optional[_Iterable[_Union[Sweep, _Mapping]]] = ..., origin: _Optional[_Union[Origin, _Mapping]] = ...) -> None: ...

class Change(_message.Message):
    __slots__ = ("key", "before", "after", "kind", "changed_data_fields", "changed_state_fields", "origin", "before_omitted")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CHANGED_DATA_FIELDS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_STATE_FIELDS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    BEFORE_OMITTED_FIELD_NUMBER: _ClassVar[int]
    key: RecordKey
    before: Record
    after: Record
    kind: ChangeKind
    changed_data_fields: _containers.RepeatedScalarFieldContainer[int]
    changed_state_fields: _containers.RepeatedScalarFieldContainer[int]
    origin: Origin
    before_omitted: bool
    def __init__(self, key: _Optional[_Union[RecordKey, _Mapping]] = ..., before: _Optional[_Union[Record, _Mapping]] = ..., after: _Optional[_Union[Record, _Mapping]] = ..., kind: _Optional[_Union[ChangeKind, str]] = ..., changed_data_fields: _Optional[_Iterable[int]] = ..., changed_state_fields: _Optional[_Iterable[int]] = ..., origin: _Optional[_Union[Origin, _Mapping]] = ..., before_omitted: bool = ...) -> None: ...

class ChangeBatch(_message.Message):
    __slots__ = ("changes", "partition", "command_seq", "part", "keyframe")
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    COMMAND_SEQ_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    KEYFRAME_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[Change]
    partition: int
    command_seq: int
    part: int
    keyframe: KeyframeMark
    def __init__(self, changes: _Optional[_Iterable[_Union[Change, _Mapping]]] = ..., partition: _Optional[int] = ..., command_seq: _Optional[int] = ..., part: _Optional[int] = ..., keyframe: _Optional[_Union[KeyframeMark, _Mapping]] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("command", "reason", "detail", "key", "origin", "raw", "sweep", "raw_encoding")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    SWEEP_FIELD_NUMBER: _ClassVar[int]
    RAW_ENCODING_FIELD_NUMBER: _ClassVar[int]
    command: Command
    reason: str
    detail: str
    key: RecordKey
    origin: Origin
    raw: bytes
    sweep: SweepOutcome
    raw_encoding: str
    def __init__(self, command: _Optional[_Union[Command, _Mapping]] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ..., key: _Optional[_Union[RecordKey, _Mapping]] = ..., origin: _Optional[_Union[Origin, _Mapping]] = ..., raw: _Optional[bytes] = ..., sweep: _Optional[_Union[SweepOutcome, _Mapping]] = ..., raw_encoding: _Optional[str] = ...) -> None: ...

class RejectionBatch(_message.Message):
    __slots__ = ("rejections",)
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    rejections: _containers.RepeatedCompositeFieldContainer[Rejection]
    def __init__(self, rejections: _Optional[_Iterable[_Union[Rejection, _Mapping]]] = ...) -> None: ...

class OutboxEntry(_message.Message):
    __slots__ = ("subject", "msg_id", "payload", "msg_type", "traceparent", "tracestate", "stream_floor", "baggage")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    MSG_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    MSG_TYPE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FLOOR_FIELD_NUMBER: _ClassVar[int]
    BAGGAGE_FIELD_NUMBER: _ClassVar[int]
    subject: str
    msg_id: str
    payload: bytes
    msg_type: str
    traceparent: str
    tracestate: str
    stream_floor: int
    baggage: str
    def __init__(self, subject: _Optional[str] = ..., msg_id: _Optional[str] = ..., payload: _Optional[bytes] = ..., msg_type: _Optional[str] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ..., stream_floor: _Optional[int] = ..., baggage: _Optional[str] = ...) -> None: ...

class KeyframeBatch(_message.Message):
    __slots__ = ("keyframe_id", "brand_id", "place_id", "part", "records", "last", "total", "digest", "as_of", "command_seq", "changes_seq", "first_seq", "tombstone_cutoff")
    KEYFRAME_ID_FIELD_NUMBER: _ClassVar[int]
    BRAND_ID_FIELD_NUMBER: _ClassVar[int]
    PLACE_ID_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    AS_OF_FIELD_NUMBER: _ClassVar[int]
    COMMAND_SEQ_FIELD_NUMBER: _ClassVar[int]
    CHANGES_SEQ_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONE_CUTOFF_FIELD_NUMBER: _ClassVar[int]
    keyframe_id: str
    brand_id: int
    place_id: int
    part: int
    records: _containers.RepeatedCompositeFieldContainer[Record]
    last: bool
    total: int
    digest: int
    as_of: int
    command_seq: int
    changes_seq: int
    first_seq: int
    tombstone_cutoff: int
    def __init__(self, keyframe_id: _Optional[str] = ..., brand_id: _Optional[int] = ..., place_id: _Optional[int] = ..., part: _Optional[int] = ..., records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., last: bool = ..., total: _Optional[int] = ..., digest: _Optional[int] = ..., as_of: _Optional[int] = ..., command_seq: _Optional[int] = ..., changes_seq: _Optional[int] = ..., first_seq: _Optional[int] = ..., tombstone_cutoff: _Optional[int] = ...) -> None: ...

class KeyframeMark(_message.Message):
    __slots__ = ("keyframe_id", "total", "digest", "as_of", "tombstone_cutoff")
    KEYFRAME_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    AS_OF_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONE_CUTOFF_FIELD_NUMBER: _ClassVar[int]
    keyframe_id: str
    total: int
    digest: int
    as_of: int
    tombstone_cutoff: int
    def __init__(self, keyframe_id: _Optional[str] = ..., total: _Optional[int] = ..., digest: _Optional[int] = ..., as_of: _Optional[int] = ..., tombstone_cutoff: _Optional[int] = ...) -> None: ...

class KeyframeRequest(_message.Message):
    __slots__ = ("keyframe_id", "brand_id", "place_id")
    KEYFRAME_ID_FIELD_NUMBER: _ClassVar[int]
    BRAND_ID_FIELD_NUMBER: _ClassVar[int]
    PLACE_ID_FIELD_NUMBER: _ClassVar[int]
    keyframe_id: str
    brand_id: int
    place_id: int
    def __init__(self, keyframe_id: _Optional[str] = ..., brand_id: _Optional[int] = ..., place_id: _Optional[int] = ...) -> None: ...

class KeyframeReply(_message.Message):
    __slots__ = ("keyframe_id", "places", "records", "error", "replica")
    KEYFRAME_ID_FIELD_NUMBER: _ClassVar[int]
    PLACES_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    keyframe_id: str
    places: int
    records: int
    error: str
    replica: int
    def __init__(self, keyframe_id: _Optional[str] = ..., places: _Optional[int] = ..., records: _Optional[int] = ..., error: _Optional[str] = ..., replica: _Optional[int] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("brand_id", "place_id", "product_ids", "limit", "after", "cursor")
    BRAND_ID_FIELD_NUMBER: _ClassVar[int]
    PLACE_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCT_IDS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    brand_id: int
    place_id: int
    product_ids: _containers.RepeatedScalarFieldContainer[str]
    limit: int
    after: str
    cursor: str
    def __init__(self, brand_id: _Optional[int] = ..., place_id: _Optional[int] = ..., product_ids: _Optional[_Iterable[str]] = ..., limit: _Optional[int] = ..., after: _Optional[str] = ..., cursor: _Optional[str] = ...) -> None: ...

class ReadReply(_message.Message):
    __slots__ = ("records", "missing", "error", "next_after", "next_cursor")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    NEXT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[Record]
    missing: _containers.RepeatedScalarFieldContainer[str]
    error: str
    next_after: str
    next_cursor: str
    def __init__(self, records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., missing: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ..., next_after: _Optional[str] = ..., next_cursor: _Optional[str] = ...) -> None: ...

class SweepsRequest(_message.Message):
    __slots__ = ("import_id", "brand_id", "place_ids")
    IMPORT_ID_FIELD_NUMBER: _ClassVar[int]
    BRAND_ID_FIELD_NUMBER: _ClassVar[int]
    PLACE_IDS_FIELD_NUMBER: _ClassVar[int]
    import_id: str
    brand_id: int
    place_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, import_id: _Optional[str] = ..., brand_id: _Optional[int] = ..., place_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SweepsReply(_message.Message):
    __slots__ = ("outcomes", "pending", "error")
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[SweepOutcome]
    pending: _containers.RepeatedScalarFieldContainer[int]
    error: str
    def __init__(self, outcomes: _Optional[_Iterable[_Union[SweepOutcome, _Mapping]]] = ..., pending: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ...) -> None: ...

class DeadEntriesRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class DeadEntry(_message.Message):
    __slots__ = ("partition", "entry")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    partition: int
    entry: OutboxEntry
    def __init__(self, partition: _Optional[int] = ..., entry: _Optional[_Union[OutboxEntry, _Mapping]] = ...) -> None: ...

class DeadEntriesReply(_message.Message):
    __slots__ = ("entries", "error")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[DeadEntry]
    error: str
    def __init__(self, entries: _Optional[_Iterable[_Union[DeadEntry, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...

class RedriveRequest(_message.Message):
    __slots__ = ("partitions", "msg_ids")
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    MSG_IDS_FIELD_NUMBER: _ClassVar[int]
    partitions: _containers.RepeatedScalarFieldContainer[int]
    msg_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, partitions: _Optional[_Iterable[int]] = ..., msg_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RedriveReply(_message.Message):
    __slots__ = ("replica", "redriven", "error")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REDRIVEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    replica: int
    redriven: int
    error: str
    def __init__(self, replica: _Optional[int] = ..., redriven: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class RebaseRequest(_message.Message):
    __slots__ = ("partitions", "applied_seq", "drop_step")
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQ_FIELD_NUMBER: _ClassVar[int]
    DROP_STEP_FIELD_NUMBER: _ClassVar[int]
    partitions: _containers.RepeatedScalarFieldContainer[int]
    applied_seq: int
    drop_step: bool
    def __init__(self, partitions: _Optional[_Iterable[int]] = ..., applied_seq: _Optional[int] = ..., drop_step: bool = ...) -> None: ...

class RebaseReply(_message.Message):
    __slots__ = ("replica", "rebased", "refused", "error")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REBASED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    replica: int
    rebased: _containers.RepeatedScalarFieldContainer[int]
    refused: _containers.RepeatedScalarFieldContainer[int]
    error: str
    def __init__(self, replica: _Optional[int] = ..., rebased: _Optional[_Iterable[int]] = ..., refused: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ...) -> None: ...

class MasterCard(_message.Message):
    __slots__ = ("region", "product_id", "min_price", "offers", "cheapest", "currency")
    REGION_FIELD_NUMBER: _ClassVar[int]
    PRODUCT_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_PRICE_FIELD_NUMBER: _ClassVar[int]
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    CHEAPEST_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    region: str
    product_id: str
    min_price: int
    offers: int
    cheapest: RecordKey
    currency: str
    def __init__(self, region: _Optional[str] = ..., product_id: _Optional[str] = ..., min_price: _Optional[int] = ..., offers: _Optional[int] = ..., cheapest: _Optional[_Union[RecordKey, _Mapping]] = ..., currency: _Optional[str] = ...) -> None: ...

class CategoryFlip(_message.Message):
    __slots__ = ("brand_id", "place_id", "category", "non_empty")
    BRAND_ID_FIELD_NUMBER: _ClassVar[int]
    PLACE_ID_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    NON_EMPTY_FIELD_NUMBER: _ClassVar[int]
    brand_id: int
    place_id: int
    category: str
    non_empty: bool
    def __init__(self, brand_id: _Optional[int] = ..., place_id: _Optional[int] = ..., category: _Optional[str] = ..., non_empty: bool = ...) -> None: ...

class AggregateChange(_message.Message):
    __slots__ = ("card", "category", "at")
    CARD_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    card: MasterCard
    category: CategoryFlip
    at: int
    def __init__(self, card: _Optional[_Union[MasterCard, _Mapping]] = ..., category: _Optional[_Union[CategoryFlip, _Mapping]] = ..., at: _Optional[int] = ...) -> None: ...

class TopRequest(_message.Message):
    __slots__ = ("brand_id", "place_id", "category", "limit", "exclude")
    BRAND_ID_FIELD_NUMBER: _ClassVar[int]
    PLACE_ID_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    brand_id: int
    place_id: int
    category: str
    limit: int
    exclude: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, brand_id: _Optional[int] = ..., place_id: _Optional[int] = ..., category: _Optional[str] = ..., limit: _Optional[int] = ..., exclude: _Optional[_Iterable[str]] = ...) -> None: ...

class Recommendation(_message.Message):
    __slots__ = ("product_id", "category", "price", "old_price", "stock", "discount")
    PRODUCT_ID_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    OLD_PRICE_FIELD_NUMBER: _ClassVar[int]
    STOCK_FIELD_NUMBER: _ClassVar[int]
    DISCOUNT_FIELD_NUMBER: _ClassVar[int]
    product_id: str
    category: str
    price: int
    old_price: int
    stock: int
    discount: float
    def __init__(self, product_id: _Optional[str] = ..., category: _Optional[str] = ..., price: _Optional[int] = ..., old_price: _Optional[int] = ..., stock: _Optional[int] = ..., discount: _Optional[float] = ...) -> None: ...

class TopReply(_message.Message):
    __slots__ = ("items", "error")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Recommendation]
    error: str
    def __init__(self, items: _Optional[_Iterable[_Union[Recommendation, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...
