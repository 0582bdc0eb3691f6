"""shelfsync_kit: follow shelfsync's change stream from Python (asyncio, nats-py).

The twin of the Rust ChangeFeed kit (shared/feed): implement a `Handler`
(`apply(updates)`, `reset_place(place)`), run a `ChangeFeed`; the kit
bootstraps from keyframes, tails the change stream with a durable pull
consumer, applies newer-only by `updated_at`, checks a digest per place at
every keyframe marker and repairs a drifted place. See kits/python/README.md.
"""

from .digest import Digest, term
from .errors import CorruptError, FeedError, HandlerError, PoisonError, TransientError
from .feed import Bootstrap, ChangeFeed, FeedConfig, FeedStatus, Handler, request_keyframe
from .keyframes import KeyframeReader, LatestKeyframe
from .proto import shelfsync_pb2 as pb
from .state import Drift, FeedState
from .subjects import PlaceKey, Subjects, partition_of, place_of_subject
from .update import Update, UpdateKind, is_live, is_offered, is_visible, product_of, state_of

__all__ = [
    "Bootstrap",
    "ChangeFeed",
    "CorruptError",
    "Digest",
    "Drift",
    "FeedConfig",
    "FeedError",
    "FeedState",
    "FeedStatus",
    "Handler",
    "HandlerError",
    "KeyframeReader",
    "LatestKeyframe",
    "PlaceKey",
    "PoisonError",
    "Subjects",
    "TransientError",
    "Update",
    "UpdateKind",
    "is_live",
    "is_offered",
    "is_visible",
    "partition_of",
    "pb",
    "place_of_subject",
    "product_of",
    "request_keyframe",
    "state_of",
    "term",
]
