"""The change feed: what a Python consumer of shelfsync changes runs. The twin of
the Rust kit `shelfsync_feed::ChangeFeed` (shared/feed/src/lib.rs), with the
same semantics:

- **bootstrap** (`Bootstrap.KEYFRAME`, the default): the latest complete
  keyframe of every place in the filter is handed to `apply` as `SNAPSHOT`
  updates; if there is none yet, a `KeyframeRequest` asks storage for one;
- **tail**: a durable JetStream pull consumer with explicit acks on
  `<prefix>.changes.<brand|*>.<place|*>`, starting just after the oldest of
  those keyframes' `changes_seq` (no gap; what the snapshot had is skipped by
  `updated_at`);
- **newer-only**: a record version is delivered only if its
  `after.updated_at` is newer than the one delivered before, whatever
  JetStream redelivers;
- **digest** per place, checked at every keyframe marker; a drifted place is
  reset, reloaded from the marker's keyframe, and the place's changes between
  the keyframe's `changes_seq` and the marker applied again (`drift_repairs`);
- **acks after** `apply` returned; `TransientError` (or any other exception)
  naks with a 1 s delay, `PoisonError` terminates the message.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import nats.errors
from google.protobuf.message import DecodeError
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from .errors import FeedError, HandlerError, PoisonError, TransientError
from .keyframes import KeyframeReader, LatestKeyframe
from .proto import shelfsync_pb2 as pb
from .state import FeedState
from .subjects import PlaceKey, Subjects, place_of_subject
from .update import Update

log = logging.getLogger("shelfsync_kit")

#: How long a feed created by a keyframe bootstrap survives its process (the
#: server deletes it after this long without a pull).
INACTIVE_THRESHOLD = 3600.0
#: How long a redelivery waits after a `TransientError`.
NAK_DELAY = 1.0
#: How long a bootstrap waits for storage to answer a keyframe request.
KEYFRAME_REQUEST_TIMEOUT = 600.0


class Handler(Protocol):
    """A consumer of record updates (the Rust kit's `Handler` trait)."""

    async def apply(self, updates: Sequence[Update]) -> None:
        """Applies updates, in order: the changes of one message, or one keyframe
        part. Must be idempotent per record version. Raise `TransientError` to
        have the message redelivered, `PoisonError` to drop it."""
        ...

    async def reset_place(self, place: PlaceKey) -> None:
        """Forgets everything about a place: a keyframe of it follows."""
        ...


class Bootstrap(enum.Enum):
    #: Load the latest keyframes, then tail from where they were taken. The
    #: durable consumer is recreated at every start (the state is in memory).
    KEYFRAME = "keyframe"
    #: No snapshot: resume the durable consumer (new changes only when it is
    #: created). For stateless services whose replicas share one consumer.
    RESUME = "resume"


@dataclass
class FeedConfig:
    #: Durable consumer name: one per service, and per instance with KEYFRAME.
    name: str
    #: `nats.prefix` of the deployment.
    prefix: str = "shelfsync"
    brand: Optional[int] = None
    place: Optional[int] = None
    bootstrap: Bootstrap = Bootstrap.KEYFRAME
    #: Ask storage for a keyframe when a bootstrap finds none.
    request_keyframe_if_missing: bool = True
    #: How many storage replicas answer such a request: `storage.replicas`.
    keyframe_responders: int = 1
    ack_wait: float = 30.0
    #: Messages in flight to this consumer.
    max_ack_pending: int = 1000
    #: Messages pulled per request, and how long a pull waits when idle (also
    #: how long `run` may take to notice its stop event).
    fetch_batch: int = 100
    fetch_timeout: float = 1.0
    #: JetStream API prefix (another domain: `$JS.<domain>.API`).
    api_prefix: str = "$JS.API"
    #: Timeout of JetStream API calls.
    request_timeout: float = 10.0


@dataclass
class FeedStatus:
    """Counters a service exposes (readiness, metrics, tests)."""

    #: True once the bootstrap is done (or was not needed): the feed is live.
    bootstrapped: bool = False
    #: Records delivered to the handler (snapshot ones included).
    delivered: int = 0
    #: Changes skipped as not newer than what was delivered.
    duplicates: int = 0
    keyframe_checks: int = 0
    drift_repairs: int = 0
    poison: int = 0
    #: CHANGES stream sequence of the last message handled.
    position: int = 0

    def as_metrics(self) -> Dict[str, float]:
        """The counters under the Rust kit's metric names."""
        return {
            "shelfsync_feed_delivered_total": self.delivered,
            "shelfsync_feed_duplicates_total": self.duplicates,
            "shelfsync_feed_keyframe_checks_total": self.keyframe_checks,
            "shelfsync_feed_drift_repairs_total": self.drift_repairs,
            "shelfsync_feed_poison_total": self.poison,
            "shelfsync_feed_position": self.position,
        }


def _now_us() -> int:
    return time.time_ns() // 1000


async def request_keyframe(
    nc: Client,
    subjects: Subjects,
    place: Optional[PlaceKey],
    replicas: int,
    timeout: float,
) -> List[pb.KeyframeReply]:
    """Asks storage for a keyframe now, of every place (`place=None`) or of one,
    and waits for the replies of `replicas` storage replicas (one for a single
    place). Returns the replies received before `timeout`."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        brand_id, place_id = (place.brand_id, place.place_id) if place else (0, 0)
        # Named here, so that every replica answering uses the same id.
        req = pb.KeyframeRequest(keyframe_id=f"kf-{_now_us()}", brand_id=brand_id, place_id=place_id)
        await nc.publish(subjects.ctl_keyframe(), req.SerializeToString(), reply=inbox)
        await nc.flush()
        want = 1 if place else max(replicas, 1)
        replies: List[pb.KeyframeReply] = []
        deadline = time.monotonic() + timeout
        while len(replies) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                break
            replies.append(pb.KeyframeReply.FromString(msg.data))
        return replies
    finally:
        await sub.unsubscribe()


class ChangeFeed:
    """A running subscription to the change stream.

    `await feed.run(handler, stop)` bootstraps (per the config), then applies
    changes until `stop` is set. Run again after a stop, it resumes where it
    stopped with the state it had (no second bootstrap).
    """

    def __init__(self, nc: Client, cfg: FeedConfig) -> None:
        self.nc = nc
        self.cfg = cfg
        self.subjects = Subjects(cfg.prefix)
        self.js = nc.jetstream(prefix=cfg.api_prefix, timeout=cfg.request_timeout)
        self.jsm = nc.jsm(prefix=cfg.api_prefix, timeout=cfg.request_timeout)
        self.state = FeedState()
        self.status = FeedStatus()

    def _reader(self) -> KeyframeReader:
        return KeyframeReader(self.nc, self.subjects, api_prefix=self.cfg.api_prefix,
                              timeout=self.cfg.request_timeout)

    async def run(self, handler: Handler, stop: Optional[asyncio.Event] = None) -> None:
        stop = stop or asyncio.Event()
        start: Optional[int] = None
        if self.cfg.bootstrap is Bootstrap.KEYFRAME and not self.status.bootstrapped:
            # A bootstrap can wait long for a keyframe: a stop ends it.
            booting = asyncio.ensure_future(self._bootstrap(handler))
            stopping = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({booting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
            if not booting.done():
                booting.cancel()
                try:
                    await booting
                except (asyncio.CancelledError, Exception):  # noqa: BLE001
                    pass
                return
            start = booting.result()
        psub = await self._consumer(start)
        self.status.bootstrapped = True
        log.info("change feed %s live: %d records, %d places, start %s",
                 self.cfg.name, len(self.state), self.state.places(), start)
        try:
            while not stop.is_set():
                try:
                    msgs = await psub.fetch(batch=self.cfg.fetch_batch, timeout=self.cfg.fetch_timeout)
                except nats.errors.TimeoutError:
                    continue
                except Exception as e:  # noqa: BLE001 - a pull that failed is pulled again
                    log.warning("feed %s: pull failed (%r); retrying", self.cfg.name, e)
                    await asyncio.sleep(0.2)
                    continue
                for i, msg in enumerate(msgs):
                    if stop.is_set():
                        # Not handled: redelivered now rather than after ack_wait.
                        for rest in msgs[i:]:
                            await _quietly(rest.nak())
                        break
                    await self._handle(msg, handler)
        finally:
            await _quietly(psub.unsubscribe())

    async def lag(self) -> int:
        """Messages of the consumer not yet delivered plus delivered and not yet acked."""
        info = await self.jsm.consumer_info(self.subjects.changes_stream(), self.cfg.name)
        return (info.num_pending or 0) + (info.num_ack_pending or 0)

    # --- bootstrap ----------------------------------------------------------

    async def _bootstrap(self, handler: Handler) -> int:
        """Loads the latest keyframe of every place; returns the CHANGES stream
        sequence to tail from."""
        reader = self._reader()
        places = await reader.places(self.cfg.brand, self.cfg.place)
        if not places and self.cfg.request_keyframe_if_missing:
            log.info("feed %s: no keyframe yet: asking storage for one", self.cfg.name)
            one = (PlaceKey(self.cfg.brand, self.cfg.place)
                   if self.cfg.brand is not None and self.cfg.place is not None else None)
            try:
                await request_keyframe(self.nc, self.subjects, one, self.cfg.keyframe_responders,
                                       KEYFRAME_REQUEST_TIMEOUT)
            except Exception as e:  # noqa: BLE001
                raise FeedError(f"keyframe request: {e!r}") from e
            places = await reader.places(self.cfg.brand, self.cfg.place)
        start: Optional[int] = None
        for place in places:
            latest = await reader.latest(place.brand_id, place.place_id)
            if latest is None:
                continue
            seq = latest.last.changes_seq
            try:
                await self._load_keyframe(reader, latest, handler)
            except HandlerError as e:
                raise FeedError(f"handler failed during bootstrap: {e!r}") from e
            start = seq if start is None else min(start, seq)
        return start or 0

    async def _load_keyframe(self, reader: KeyframeReader, latest: LatestKeyframe,
                             handler: Handler) -> None:
        """Replaces a place with a keyframe of it."""
        place = PlaceKey(latest.last.brand_id, latest.last.place_id)
        await handler.reset_place(place)
        self.state.reset_place(place)
        async for part in reader.parts(latest):
            updates = [u for u in map(Update.from_snapshot, part.records) if u is not None]
            await handler.apply(updates)
            for u in updates:
                self.state.record(place, u.key.product_id, u.after.updated_at, u.after.deleted)
            self.status.delivered += len(updates)

    async def _consumer(self, start: Optional[int]):
        stream = self.subjects.changes_stream()
        config = ConsumerConfig(
            durable_name=self.cfg.name,
            filter_subject=self.subjects.changes_filter(self.cfg.brand, self.cfg.place),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.cfg.ack_wait,
            max_ack_pending=self.cfg.max_ack_pending,
        )
        try:
            if start is not None:
                # The state is rebuilt from keyframes at every start: the old
                # position means nothing now.
                try:
                    await self.jsm.delete_consumer(stream, self.cfg.name)
                except NotFoundError:
                    pass
                if start == 0:
                    config.deliver_policy = DeliverPolicy.ALL
                else:
                    config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
                    config.opt_start_seq = start + 1
                # An instance that disappears leaves no consumer behind.
                config.inactive_threshold = INACTIVE_THRESHOLD
                await self.jsm.add_consumer(stream, config)
            else:
                try:
                    await self.jsm.consumer_info(stream, self.cfg.name)
                except NotFoundError:
                    config.deliver_policy = DeliverPolicy.NEW
                    if self.cfg.bootstrap is Bootstrap.KEYFRAME:
                        config.inactive_threshold = INACTIVE_THRESHOLD
                    await self.jsm.add_consumer(stream, config)
            return await self.js.pull_subscribe_bind(durable=self.cfg.name, stream=stream)
        except Exception as e:  # noqa: BLE001
            raise FeedError(f"consumer {self.cfg.name}: {e!r}") from e

    # --- the message loop ---------------------------------------------------

    async def _handle(self, msg: Msg, handler: Handler) -> None:
        try:
            seq = msg.metadata.sequence.stream
        except Exception:  # noqa: BLE001 - not a JetStream message
            seq = None
        if seq is not None:
            # A redelivery must not move the position back.
            self.status.position = max(self.status.position, seq)
        try:
            await self._handle_inner(msg, seq, handler)
        except PoisonError as e:
            log.warning("feed %s: poison message on %s dropped: %s", self.cfg.name, msg.subject, e)
            self.status.poison += 1
            await _quietly(msg.term())
            return
        except Exception as e:  # noqa: BLE001 - TransientError and anything unexpected
            log.warning("feed %s: handler failed; will retry: %r", self.cfg.name, e)
            await _quietly(msg.nak(delay=NAK_DELAY))
            return
        await _quietly(msg.ack())

    async def _handle_inner(self, msg: Msg, seq: Optional[int], handler: Handler) -> None:
        try:
            batch = pb.ChangeBatch.FromString(msg.data)
        except DecodeError as e:
            raise PoisonError(f"not a ChangeBatch: {e}") from e
        if batch.HasField("keyframe"):
            place = place_of_subject(msg.subject)
            if place is None:
                raise PoisonError(f"bad change subject {msg.subject}")
            self.status.keyframe_checks += 1
            drift = self.state.check(place, batch.keyframe)
            if drift is not None:
                log.warning(
                    "feed %s: place %s drifted from its keyframe (ours %s, keyframe %s, id %s): "
                    "resyncing", self.cfg.name, place, drift.ours, drift.theirs,
                    batch.keyframe.keyframe_id)
                if seq is None:
                    raise PoisonError("marker without JetStream metadata")
                await self._resync(place, batch.keyframe, seq, handler)
            return
        await self._apply_changes(batch, handler)

    async def _apply_changes(self, batch: pb.ChangeBatch, handler: Handler) -> None:
        """Hands the handler the changes of a batch that are newer than what it
        has (also within the batch), and remembers them."""
        updates: List[Update] = []
        seen_here: Dict[Tuple[int, int, str], int] = {}
        for c in batch.changes:
            u = Update.from_change(c)
            if u is None:
                continue
            pid = c.key.product_id if c.HasField("key") else ""
            at = u.after.updated_at
            k = (u.key.brand_id, u.key.place_id, pid)
            prev = seen_here.get(k)
            newer = self.state.is_newer(u.place, pid, at) if prev is None else at > prev
            if newer:
                seen_here[k] = at
                updates.append(u)
            else:
                self.status.duplicates += 1
        if not updates:
            return
        await handler.apply(updates)
        for u in updates:
            self.state.record(u.place, u.key.product_id, u.after.updated_at, u.after.deleted)
        self.status.delivered += len(updates)

    async def _resync(self, place: PlaceKey, mark: pb.KeyframeMark, marker_seq: int,
                      handler: Handler) -> None:
        reader = self._reader()
        try:
            keyframe = await reader.of_mark(place.brand_id, place.place_id, mark)
        except FeedError as e:
            raise TransientError(str(e)) from e
        if keyframe is None:
            # Replaced by a newer keyframe (its own marker comes later), or never
            # completed: the next keyframe repairs the place.
            log.warning("feed %s: keyframe %s of the marker not found complete; place %s stays "
                        "as it is", self.cfg.name, mark.keyframe_id, place)
            return
        try:
            await self._load_keyframe(reader, keyframe, handler)
        except FeedError as e:
            raise TransientError(str(e)) from e
        # The keyframe is the place when storage froze it; the marker comes later
        # in the stream. What changed in between is applied again.
        await self._replay(place, keyframe.last.changes_seq + 1, marker_seq, handler)
        self.status.drift_repairs += 1

    async def _replay(self, place: PlaceKey, start: int, until: int, handler: Handler) -> None:
        """Applies the changes of a place stored in `[start, until)`, newer-only."""
        stream = self.subjects.changes_stream()
        subject = self.subjects.changes(place.brand_id, place.place_id)
        seq = max(start, 1)
        while seq < until:
            try:
                msg = await self.jsm.get_msg(stream, seq=seq, subject=subject, next=True)
            except NotFoundError:
                break
            except Exception as e:  # noqa: BLE001
                raise TransientError(f"replaying {subject} from #{seq}: {e!r}") from e
            if msg.seq >= until:
                break
            seq = msg.seq + 1
            try:
                batch = pb.ChangeBatch.FromString(msg.data or b"")
            except DecodeError as e:
                log.warning("%s #%d: not a ChangeBatch; skipped: %s", subject, msg.seq, e)
                continue
            if not batch.HasField("keyframe"):
                await self._apply_changes(batch, handler)


async def _quietly(aw) -> None:
    """Awaits an ack, nak, term or unsubscribe whose failure only means a
    redelivery (skipped by `updated_at`)."""
    try:
        await aw
    except Exception as e:  # noqa: BLE001
        log.debug("ignored: %r", e)
