//! Atomic batch publishing (JetStream `allow_atomic`, NATS ≥ 2.12): many
//! messages to one stream, any subjects of it, stored all or none, in order,
//! answered by one acknowledgement. On a server that fsyncs every write the
//! batch is committed as one unit, so its messages share the cost that
//! separate publishes pay one by one.
//!
//! Every message but the last is sent without a reply subject (the server
//! stages it); the last carries `Nats-Batch-Commit: 1` and is a request,
//! answered with the stream's acknowledgement of the whole batch: the
//! sequence of its last message and how many it stored. The batch's
//! messages are stored consecutively, so message `i` (from 0) of `n` is at
//! `seq - n + 1 + i`. A batch holds at most [`MAX_ATOMIC_BATCH`] messages.

use std::time::Duration;

use async_nats::HeaderMap;
use bytes::Bytes;
use serde::Deserialize;

/// Messages one atomic batch may hold (the server's default limit).
pub const MAX_ATOMIC_BATCH: usize = 1000;

const BATCH_ID: &str = "Nats-Batch-Id";
const BATCH_SEQ: &str = "Nats-Batch-Sequence";
const BATCH_COMMIT: &str = "Nats-Batch-Commit";

/// One message of an atomic batch.
#[derive(Debug, Clone)]
pub struct BatchMessage {
    pub subject: String,
    pub headers: HeaderMap,
    pub payload: Bytes,
}

/// What the stream said of a committed batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchAck {
    pub stream: String,
    /// Sequence of the batch's last message.
    pub last_seq: u64,
    /// Messages stored.
    pub count: u64,
}

impl BatchAck {
    /// The sequence of message `i` (from 0) of the batch.
    pub fn seq_of(&self, i: usize) -> u64 {
        self.last_seq + 1 + i as u64 - self.count
    }
}

/// Why an atomic batch was not stored.
#[derive(Debug, thiserror::Error)]
pub enum AtomicError {
    #[error("an atomic batch holds 1 to {MAX_ATOMIC_BATCH} messages, not {0}")]
    Size(usize),
    #[error("cannot send the batch: {0}")]
    Send(String),
    /// A message over the server's payload limit: never sent.
    #[error("a message of the batch is over the server's max payload ({0} bytes)")]
    TooLarge(usize),
    /// No answer in time: the batch may or may not be stored.
    #[error("no answer to the batch's commit within {0:?}")]
    Timeout(Duration),
    /// The stream answered and refused it (nothing of it is stored).
    #[error("the stream refused the batch: {description} (code {code}, error code {err_code})")]
    Refused { code: u16, err_code: u16, description: String },
    #[error("unreadable answer to the batch's commit: {0}")]
    Answer(String),
}

impl AtomicError {
    /// The stream refused a message as too large for it.
    pub fn is_too_large(&self) -> bool {
        matches!(self, AtomicError::TooLarge(_) | AtomicError::Refused { err_code: 10054, .. })
    }

    /// The batch repeats a `Nats-Msg-Id` the stream already holds: it was
    /// stored before (a retry of a batch whose answer was lost).
    pub fn is_duplicate(&self) -> bool {
        matches!(self, AtomicError::Refused { err_code: 10201, .. })
            || matches!(self, AtomicError::Refused { description, .. } if description.contains("duplicate"))
    }
}

#[derive(Deserialize)]
struct Answer {
    #[serde(default)]
    stream: String,
    #[serde(default)]
    seq: u64,
    #[serde(default)]
    count: u64,
    #[serde(default)]
    error: Option<ApiError>,
}

#[derive(Deserialize)]
struct ApiError {
    #[serde(default)]
    code: u16,
    #[serde(default)]
    err_code: u16,
    #[serde(default)]
    description: String,
}

/// Publishes `messages` as one atomic batch and waits for its commit's
/// acknowledgement (at most `timeout`).
pub async fn publish_atomic(
    client: &async_nats::Client,
    messages: Vec<BatchMessage>,
    timeout: Duration,
) -> Result<BatchAck, AtomicError> {
    let n = messages.len();
    if n == 0 || n > MAX_ATOMIC_BATCH {
        return Err(AtomicError::Size(n));
    }
    let max = client.server_info().max_payload;
    if let Some(m) = messages.iter().find(|m| max > 0 && m.payload.len() + 1024 > max) {
        return Err(AtomicError::TooLarge(m.payload.len()));
    }
    let id = batch_id();
    let mut reply = None;
    for (i, m) in messages.into_iter().enumerate() {
        let BatchMessage { subject, mut headers, payload } = m;
        headers.insert(BATCH_ID, id.as_str());
        headers.insert(BATCH_SEQ, (i + 1).to_string().as_str());
        if i + 1 < n {
            client
                .publish_with_headers(subject, headers, payload)
                .await
                .map_err(|e| AtomicError::Send(e.to_string()))?;
        } else {
            headers.insert(BATCH_COMMIT, "1");
            let request =
                async_nats::Request::new().headers(headers).payload(payload).timeout(Some(timeout));
            reply = Some(client.send_request(subject, request));
        }
    }
    let reply = reply.expect("a batch has a last message").await.map_err(|e| match e.kind() {
        async_nats::RequestErrorKind::TimedOut => AtomicError::Timeout(timeout),
        _ => AtomicError::Send(e.to_string()),
    })?;
    let answer: Answer =
        serde_json::from_slice(&reply.payload).map_err(|e| AtomicError::Answer(e.to_string()))?;
    if let Some(e) = answer.error {
        return Err(AtomicError::Refused {
            code: e.code,
            err_code: e.err_code,
            description: e.description,
        });
    }
    Ok(BatchAck { stream: answer.stream, last_seq: answer.seq, count: answer.count })
}

/// A batch id: unique enough (time and a counter of this process), short.
fn batch_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!("{:x}{:x}{:x}", now, std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}
