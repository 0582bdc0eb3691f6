//! What a service gives the feed and what the feed stops with: the
//! [`Handler`] of updates and the errors of both sides.

use std::future::Future;

use shelfsync_proto::PlaceKey;

use crate::update::Update;

/// Why the feed stopped.
#[derive(Debug, thiserror::Error)]
pub enum FeedError {
    #[error("nats: {0}")]
    Nats(String),
    #[error("corrupt message: {0}")]
    Corrupt(String),
    #[error("handler failed during bootstrap: {0}")]
    Bootstrap(String),
}

/// What a handler says when it cannot apply updates.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Retry later (a dependency is down): the message is redelivered.
    #[error("transient: {0}")]
    Transient(String),
    /// Never going to work: the message is terminated and counted.
    #[error("poison: {0}")]
    Poison(String),
}

/// A consumer of record updates.
pub trait Handler: Send {
    /// Applies updates, in order. Called with the changes of one message,
    /// or with one keyframe part. Must be idempotent per record version.
    fn apply(
        &mut self,
        updates: &[Update],
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;

    /// Forgets everything about a place (a keyframe of it follows).
    fn reset_place(
        &mut self,
        place: PlaceKey,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

impl From<FeedError> for HandlerError {
    fn from(e: FeedError) -> Self {
        HandlerError::Transient(e.to_string())
    }
}
