//! Reading keyframes back from the KEYFRAMES stream with direct gets: the
//! places that have one, a place's latest complete keyframe, and its parts
//! in order — one part in memory at a time.

use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;
use prost::Message;
use shelfsync_bus::Subjects;
use shelfsync_proto::{KeyframeBatch, KeyframeMark, PlaceKey};

use crate::handler::FeedError;

/// How long a reader waits for a keyframe being written: 600 × 100 ms.
const WAIT_STEPS: u32 = 600;
const WAIT_STEP: Duration = Duration::from_millis(100);

pub struct KeyframeReader {
    stream: jetstream::stream::Stream,
    subjects: Subjects,
}

/// The final part of a complete keyframe and its stream sequence.
#[derive(Debug, Clone)]
pub struct LatestKeyframe {
    pub last: KeyframeBatch,
    pub last_seq: u64,
}

impl KeyframeReader {
    pub async fn new(js: &jetstream::Context, subjects: Subjects) -> Result<Self, FeedError> {
        let stream = js
            .get_stream(subjects.keyframes_stream())
            .await
            .map_err(|e| FeedError::Nats(format!("keyframes stream: {e}")))?;
        Ok(Self { stream, subjects })
    }

    /// Places with at least one keyframe message, within the filter.
    pub async fn places(
        &self,
        brand: Option<i64>,
        place: Option<i64>,
    ) -> Result<Vec<PlaceKey>, FeedError> {
        let stream = self.stream.clone();
        let filter = self.subjects.keyframes_filter(brand, place);
        let mut subjects = stream
            .info_with_subjects(filter)
            .await
            .map_err(|e| FeedError::Nats(format!("listing keyframe subjects: {e}")))?;
        let mut out = Vec::new();
        while let Some(item) = subjects.next().await {
            let (subject, _) = item.map_err(|e| FeedError::Nats(e.to_string()))?;
            let mut tokens = subject.rsplit('.');
            let (Some(p), Some(b)) = (tokens.next(), tokens.next()) else { continue };
            if let (Ok(b), Ok(p)) = (b.parse(), p.parse()) {
                out.push(PlaceKey::new(b, p));
            }
        }
        out.sort();
        Ok(out)
    }

    /// The last keyframe part stored for a place, and its sequence.
    async fn last_part(
        &self,
        brand: i64,
        place: i64,
    ) -> Result<Option<(KeyframeBatch, u64)>, FeedError> {
        let subject = self.subjects.keyframes(brand, place);
        let msg = match self.stream.direct_get_last_for_subject(&subject).await {
            Ok(m) => m,
            Err(e) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => {
                return Ok(None);
            }
            Err(e) => return Err(FeedError::Nats(format!("reading {subject}: {e}"))),
        };
        let batch = KeyframeBatch::decode(msg.payload.as_ref())
            .map_err(|e| FeedError::Corrupt(format!("{subject} #{}: {e}", msg.sequence)))?;
        Ok(Some((batch, msg.sequence)))
    }

    /// The latest complete keyframe of a place. If one is being written right
    /// now, waits (up to about a minute) for it to complete.
    pub async fn latest(
        &self,
        brand: i64,
        place: i64,
    ) -> Result<Option<LatestKeyframe>, FeedError> {
        for _ in 0..WAIT_STEPS {
            match self.last_part(brand, place).await? {
                None => return Ok(None),
                Some((last, last_seq)) if last.last => {
                    return Ok(Some(LatestKeyframe { last, last_seq }));
                }
                Some(_) => tokio::time::sleep(WAIT_STEP).await,
            }
        }
        Err(FeedError::Nats(format!(
            "keyframe on {} did not complete in time",
            self.subjects.keyframes(brand, place)
        )))
    }

    /// The keyframe a change-stream marker announces. Storage puts the
    /// marker in the change stream as soon as it has copied the place, and
    /// publishes the parts after it, so they may still be on their way:
    /// waits (up to about a minute) for the keyframe to complete. `None`: a
    /// newer keyframe replaced it, or it never completed (its storage
    /// replica stopped half-way; the next keyframe will tell).
    pub async fn of_mark(
        &self,
        brand: i64,
        place: i64,
        mark: &KeyframeMark,
    ) -> Result<Option<LatestKeyframe>, FeedError> {
        for _ in 0..WAIT_STEPS {
            if let Some((last, last_seq)) = self.last_part(brand, place).await? {
                if last.keyframe_id == mark.keyframe_id && last.as_of == mark.as_of {
                    if last.last {
                        return Ok(Some(LatestKeyframe { last, last_seq }));
                    }
                } else if last.as_of > mark.as_of {
                    return Ok(None);
                }
            }
            tokio::time::sleep(WAIT_STEP).await;
        }
        Ok(None)
    }

    /// Reads the parts of a keyframe in order, from its first part.
    pub fn parts(&self, latest: &LatestKeyframe) -> KeyframeParts {
        let k = &latest.last;
        let first = if k.part == 0 { latest.last_seq } else { k.first_seq };
        KeyframeParts {
            stream: self.stream.clone(),
            subject: self.subjects.keyframes(k.brand_id, k.place_id),
            keyframe_id: k.keyframe_id.clone(),
            next_seq: first,
            done: false,
        }
    }
}

/// Iterator over the parts of one keyframe.
pub struct KeyframeParts {
    stream: jetstream::stream::Stream,
    subject: String,
    keyframe_id: String,
    next_seq: u64,
    done: bool,
}

impl KeyframeParts {
    pub async fn next(&mut self) -> Result<Option<KeyframeBatch>, FeedError> {
        while !self.done {
            let msg = self
                .stream
                .direct_get_next_for_subject(&self.subject, Some(self.next_seq))
                .await
                .map_err(|e| FeedError::Nats(format!("reading {}: {e}", self.subject)))?;
            self.next_seq = msg.sequence + 1;
            let batch = KeyframeBatch::decode(msg.payload.as_ref()).map_err(|e| {
                FeedError::Corrupt(format!("{} #{}: {e}", self.subject, msg.sequence))
            })?;
            if batch.keyframe_id != self.keyframe_id {
                // A part of another keyframe (an aborted run) sits in between.
                continue;
            }
            self.done = batch.last;
            return Ok(Some(batch));
        }
        Ok(None)
    }
}
