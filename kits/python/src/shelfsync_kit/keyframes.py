"""Reading keyframes back from the KEYFRAMES stream with direct gets: the places
that have one, a place's latest complete keyframe, and its parts in order, one
part in memory at a time. The twin of `shelfsync_feed::keyframes`."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import AsyncIterator, List, Optional, Tuple

from google.protobuf.message import DecodeError
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from .errors import CorruptError, FeedError
from .proto import shelfsync_pb2 as pb
from .subjects import PlaceKey, Subjects

#: How long a reader waits for a keyframe being written: 600 x 100 ms.
WAIT_STEPS = 600
WAIT_STEP = 0.1


@dataclass
class LatestKeyframe:
    """The final part of a complete keyframe and its stream sequence."""

    last: pb.KeyframeBatch
    last_seq: int


class KeyframeReader:
    def __init__(self, nc: Client, subjects: Subjects, *, api_prefix: str = "$JS.API",
                 timeout: float = 10.0) -> None:
        self._nc = nc
        self._jsm = nc.jsm(prefix=api_prefix, timeout=timeout)
        self._api = api_prefix
        self._timeout = timeout
        self._subjects = subjects
        self._stream = subjects.keyframes_stream()

    async def places(self, brand: Optional[int], place: Optional[int]) -> List[PlaceKey]:
        """Places with at least one keyframe message, within the filter (every
        page of the stream's subject list)."""
        flt = self._subjects.keyframes_filter(brand, place)
        out: List[PlaceKey] = []
        offset = 0
        while True:
            req = json.dumps({"subjects_filter": flt, "offset": offset}).encode()
            try:
                resp = await self._nc.request(f"{self._api}.STREAM.INFO.{self._stream}", req,
                                              timeout=self._timeout)
            except Exception as e:  # noqa: BLE001 - any failure is the same to a caller
                raise FeedError(f"listing keyframe subjects: {e}") from e
            info = json.loads(resp.data)
            if "error" in info:
                raise FeedError(f"listing keyframe subjects: {info['error']}")
            subjects = (info.get("state") or {}).get("subjects") or {}
            for subject in subjects:
                tokens = subject.rsplit(".", 2)
                try:
                    out.append(PlaceKey(int(tokens[1]), int(tokens[2])))
                except (ValueError, IndexError):
                    continue
            offset += len(subjects)
            total = info.get("total", 0)
            if not subjects or offset >= total:
                break
        return sorted(set(out))

    async def _last_part(self, brand: int, place: int) -> Optional[Tuple[pb.KeyframeBatch, int]]:
        subject = self._subjects.keyframes(brand, place)
        try:
            msg = await self._jsm.get_msg(self._stream, subject=subject, direct=True)
        except NotFoundError:
            return None
        except Exception as e:  # noqa: BLE001
            raise FeedError(f"reading {subject}: {e}") from e
        try:
            return pb.KeyframeBatch.FromString(msg.data or b""), msg.seq
        except DecodeError as e:
            raise CorruptError(f"{subject} #{msg.seq}: {e}") from e

    async def latest(self, brand: int, place: int) -> Optional[LatestKeyframe]:
        """The latest complete keyframe of a place. If one is being written right
        now, waits (up to about a minute) for it to complete."""
        for _ in range(WAIT_STEPS):
            got = await self._last_part(brand, place)
            if got is None:
                return None
            last, seq = got
            if last.last:
                return LatestKeyframe(last, seq)
            await asyncio.sleep(WAIT_STEP)
        raise FeedError(
            f"keyframe on {self._subjects.keyframes(brand, place)} did not complete in time"
        )

    async def of_mark(self, brand: int, place: int, mark: pb.KeyframeMark) -> Optional[LatestKeyframe]:
        """The keyframe a change-stream marker announces (same `keyframe_id` and
        `as_of`), waiting (up to about a minute) for it to complete. None: a newer
        keyframe replaced it, or it never completed."""
        for _ in range(WAIT_STEPS):
            got = await self._last_part(brand, place)
            if got is not None:
                last, seq = got
                if last.keyframe_id == mark.keyframe_id and last.as_of == mark.as_of:
                    if last.last:
                        return LatestKeyframe(last, seq)
                elif last.as_of > mark.as_of:
                    return None
            await asyncio.sleep(WAIT_STEP)
        return None

    async def parts(self, latest: LatestKeyframe) -> AsyncIterator[pb.KeyframeBatch]:
        """The parts of a keyframe in order, from its first part (read with
        direct gets, next by subject); parts of other keyframes are skipped."""
        k = latest.last
        subject = self._subjects.keyframes(k.brand_id, k.place_id)
        seq = latest.last_seq if k.part == 0 else k.first_seq
        while True:
            try:
                msg = await self._jsm.get_msg(self._stream, seq=max(seq, 1), subject=subject,
                                              direct=True, next=True)
            except Exception as e:  # noqa: BLE001 - a part that vanished is an error too
                raise FeedError(f"reading {subject} from #{seq}: {e!r}") from e
            seq = msg.seq + 1
            try:
                batch = pb.KeyframeBatch.FromString(msg.data or b"")
            except DecodeError as e:
                raise CorruptError(f"{subject} #{msg.seq}: {e}") from e
            if batch.keyframe_id != k.keyframe_id:
                # A part of another keyframe (an aborted run) sits in between.
                continue
            yield batch
            if batch.last:
                return
