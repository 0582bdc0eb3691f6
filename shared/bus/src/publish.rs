//! Deduplicated JetStream publishing with a bounded number of acks in flight.
//!
//! Every message carries a deterministic `Nats-Msg-Id`, so a retry after a
//! lost ack is dropped by the stream's duplicate window instead of stored
//! twice, and the W3C trace context of the span it is published in.

use std::collections::VecDeque;

use async_nats::HeaderMap;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, publish::PublishAck};
use bytes::Bytes;

use crate::TYPE_HEADER;

/// A publish that JetStream did not acknowledge.
#[derive(Debug, thiserror::Error)]
#[error("publish to {subject} (msg id {msg_id}) failed: {source}")]
pub struct PublishFailed {
    pub subject: String,
    pub msg_id: String,
    #[source]
    pub source: async_nats::jetstream::context::PublishError,
}

/// What a failed publish says about trying again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Over the server's `max_payload` or the stream's largest message: the
    /// same bytes can never be stored.
    TooLarge,
    /// JetStream answered, and refused the message (the description).
    Refused(String),
    /// No answer (a timeout, a lost connection, no stream listening): the
    /// message may or may not be stored.
    Unknown,
}

impl PublishFailed {
    /// True when the message is too large to ever succeed.
    pub fn is_too_large(&self) -> bool {
        self.failure() == Failure::TooLarge
    }

    /// What this failure says about the message.
    pub fn failure(&self) -> Failure {
        use async_nats::jetstream::ErrorCode;
        match self.source.kind() {
            PublishErrorKind::MaxPayloadExceeded => Failure::TooLarge,
            PublishErrorKind::Other => {
                let refusal = std::error::Error::source(&self.source)
                    .and_then(|e| e.downcast_ref::<async_nats::jetstream::Error>());
                match refusal {
                    Some(e) if e.error_code() == ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM => {
                        Failure::TooLarge
                    }
                    Some(e) => Failure::Refused(e.to_string()),
                    None => Failure::Unknown,
                }
            }
            _ => Failure::Unknown,
        }
    }
}

struct InFlight {
    subject: String,
    msg_id: String,
    ack: PublishAckFuture,
}

/// Publishes and keeps at most `max_inflight` acks outstanding; waiting for
/// the oldest when full gives natural back-pressure.
pub struct Publisher {
    js: jetstream::Context,
    max_inflight: usize,
    inflight: VecDeque<InFlight>,
    /// Acks received that JetStream flagged as duplicates (already stored).
    pub duplicates: u64,
    pub published: u64,
    /// Per stream, the highest sequence an ack reported.
    last_sequence: std::collections::HashMap<String, u64>,
}

impl Publisher {
    pub fn new(js: jetstream::Context, max_inflight: usize) -> Self {
        Self {
            js,
            max_inflight: max_inflight.max(1),
            inflight: VecDeque::new(),
            duplicates: 0,
            published: 0,
            last_sequence: Default::default(),
        }
    }

    /// The highest sequence of `stream` an ack of this publisher reported
    /// (0: none yet): every message published after it lands above it.
    pub fn last_sequence(&self, stream: &str) -> u64 {
        self.last_sequence.get(stream).copied().unwrap_or(0)
    }

    /// Sends one message; returns once it is on the wire and the in-flight
    /// window has room. Errors of earlier messages surface here or in
    /// [`Publisher::flush`]. Unless `headers` carry a `traceparent`, the
    /// current span's W3C trace context is added to them.
    pub async fn publish(
        &mut self,
        subject: String,
        msg_id: String,
        msg_type: &str,
        headers: Option<HeaderMap>,
        payload: Bytes,
    ) -> Result<(), PublishFailed> {
        while self.inflight.len() >= self.max_inflight {
            self.await_oldest().await?;
        }
        let mut headers = headers.unwrap_or_default();
        // Every message continues the trace it is sent in, unless the
        // caller set a context of its own.
        if headers.get(shelfsync_telemetry::TRACEPARENT).is_none() {
            shelfsync_telemetry::inject(&mut headers);
        }
        // `headers()` replaces the whole map: set it first, then the id.
        let msg = PublishMessage::build()
            .payload(payload)
            .headers(headers)
            .message_id(&msg_id)
            .header(TYPE_HEADER, msg_type);
        let ack = self.js.send_publish(subject.clone(), msg).await;
        match ack {
            Ok(ack) => {
                self.inflight.push_back(InFlight { subject, msg_id, ack });
                Ok(())
            }
            Err(source) => Err(PublishFailed { subject, msg_id, source }),
        }
    }

    async fn await_oldest(&mut self) -> Result<Option<PublishAck>, PublishFailed> {
        let Some(f) = self.inflight.pop_front() else {
            return Ok(None);
        };
        match f.ack.await {
            Ok(ack) => {
                self.published += 1;
                if ack.duplicate {
                    self.duplicates += 1;
                }
                let last = self.last_sequence.entry(ack.stream.clone()).or_default();
                *last = (*last).max(ack.sequence);
                Ok(Some(ack))
            }
            Err(source) => Err(PublishFailed { subject: f.subject, msg_id: f.msg_id, source }),
        }
    }

    /// Waits for every outstanding ack; the first failure is returned (the
    /// rest are still awaited so nothing is left dangling).
    pub async fn flush(&mut self) -> Result<(), PublishFailed> {
        let mut first = None;
        while !self.inflight.is_empty() {
            if let Err(e) = self.await_oldest().await
                && first.is_none()
            {
                first = Some(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    pub fn inflight(&self) -> usize {
        self.inflight.len()
    }
}
