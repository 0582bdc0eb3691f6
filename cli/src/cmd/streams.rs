//! The suite's streams as `setup`, `stats` and the readers open them.

use anyhow::Context as _;
use async_nats::jetstream::{self, context::GetStreamErrorKind, stream::RetentionPolicy};
use serde::Serialize;
use shelfsync_settings::Settings;

use crate::CliError;

/// The suite's streams as `(role, name)`, in creation order: whatever the
/// bus provisions, the role being the name's last `_` token in lower case
/// (`SHELFSYNC_CHANGES` → `changes`).
pub fn names(settings: &Settings) -> Vec<(String, String)> {
    shelfsync_bus::stream_configs(&settings.nats, settings.topology())
        .into_iter()
        .map(|c| {
            let role = c.name.rsplit('_').next().unwrap_or_default().to_lowercase();
            (role, c.name)
        })
        .collect()
}

/// A stream's configuration and state, as of one `STREAM.INFO`.
#[derive(Debug, Clone, Serialize)]
pub struct StreamState {
    pub name: String,
    pub subjects: Vec<String>,
    pub retention: &'static str,
    /// Messages held now.
    pub messages: u64,
    /// Bytes held now.
    pub bytes: u64,
    pub first_seq: u64,
    /// Sequence of the last message ever stored: messages ever published,
    /// whatever was acked, aged out or deleted since.
    pub last_seq: u64,
    pub consumers: usize,
}

/// The stream `name`; one that does not exist is a [`CliError::NotFound`].
pub async fn open(
    js: &jetstream::Context,
    name: &str,
) -> anyhow::Result<jetstream::stream::Stream> {
    match js.get_stream(name).await {
        Ok(s) => Ok(s),
        Err(e) if is_not_found(&e) => Err(CliError::NotFound(format!(
            "stream {name} does not exist (has `shelfsync setup` run with these settings?)"
        ))
        .into()),
        Err(e) => Err(e).with_context(|| format!("cannot open stream {name}")),
    }
}

/// The stream's state, or `None` when it does not exist.
pub async fn state(js: &jetstream::Context, name: &str) -> anyhow::Result<Option<StreamState>> {
    let mut stream = match js.get_stream(name).await {
        Ok(s) => s,
        Err(e) if is_not_found(&e) => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot look up stream {name}")),
    };
    let info =
        stream.info().await.with_context(|| format!("cannot read the state of stream {name}"))?;
    Ok(Some(StreamState {
        name: name.to_string(),
        subjects: info.config.subjects.clone(),
        retention: match info.config.retention {
            RetentionPolicy::Limits => "limits",
            RetentionPolicy::Interest => "interest",
            RetentionPolicy::WorkQueue => "workqueue",
        },
        messages: info.state.messages,
        bytes: info.state.bytes,
        first_seq: info.state.first_sequence,
        last_seq: info.state.last_sequence,
        consumers: info.state.consumer_count,
    }))
}

/// True when JetStream says the stream does not exist.
pub fn is_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(
        e.kind(),
        GetStreamErrorKind::JetStream(err)
            if err.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
    )
}
