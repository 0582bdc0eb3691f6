//! NATS JetStream plumbing shared by every service (see docs/DESIGN.md,
//! Subjects and streams).
//!
//! - [`Subjects`]: every subject and stream name, derived from one prefix;
//! - [`Partition`] / [`partition_of`]: the stable command partitioning;
//! - [`connect`] and [`provision`]: connection and idempotent stream set-up
//!   (`shelfsync setup`, the one writer of stream configuration);
//!   [`verify`]: what every service does instead at start, read-only;
//! - [`Publisher`]: deduplicated publishing with a bounded number of
//!   in-flight acks, trace context injected into the headers;
//! - [`CommandBatcher`] (and [`EncodedBatcher`], for commands encoded where
//!   they are made): batching by count (≤ 1000) and bytes (< max payload);
//! - [`encoding`]: payloads sent compressed (`Shelfsync-Encoding: lz4`) and
//!   read either way;
//! - [`CommandPublisher`]: the command publisher every producer shares,
//!   coalescing commands per partition and flushes into atomic batches
//!   ([`atomic`]) so that each stored message and fsync carries many.
//!
//! It knows the wire types but no business rule, and never touches Redis.
#![forbid(unsafe_code)]

pub mod atomic;
mod batch;
mod commands;
pub mod digest;
pub mod encoding;
pub mod intake;
mod publish;
mod subjects;

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use shelfsync_settings::{NatsSettings, Topology};
use shelfsync_telemetry::chain;

pub use batch::{
    Batcher, CommandBatcher, EncodedBatch, EncodedBatcher, EncodedCommand, PartitionBatch,
    batch_overhead,
};
pub use commands::{
    CommandPublishError, CommandPublisher, CommandPublisherConfig, Counts as CommandCounts,
};
pub use publish::{Failure, PublishFailed, Publisher};
pub use subjects::{Partition, Subjects, partition_of, token};

/// W3C trace context and baggage in message headers (re-exported from
/// `shelfsync_telemetry`): [`Publisher`] injects it, consumers extract it.
pub mod trace {
    pub use shelfsync_telemetry::{
        BAGGAGE, Parts, TRACEPARENT, TRACESTATE, extract, extract_opt, from_parts, inject,
        inject_context, parts,
    };
}

/// Header carrying the protobuf message type of a payload.
pub const TYPE_HEADER: &str = "Shelfsync-Type";

/// Room kept under the server's max payload for headers and batch framing.
pub const PAYLOAD_HEADROOM: usize = 8 * 1024;

/// How far below the server's `max_payload` the command stream's largest
/// message stays (its `max_message_size`, set by [`provision`]): room for a
/// dead-lettered command message to travel whole, with its reason, in one
/// rejection on the REJECTS stream.
pub const CMD_HEADROOM: usize = 16 * 1024;

/// The largest command message payload a producer may send to a server of
/// `max_payload`: under the command stream's limit, with room for headers.
pub fn command_bytes_limit(max_payload: usize) -> usize {
    max_payload.saturating_sub(CMD_HEADROOM + PAYLOAD_HEADROOM).max(64 * 1024)
}

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("cannot connect to NATS at {url}: {source}")]
    Connect { url: String, source: async_nats::ConnectError },
    #[error("cannot read NATS credentials file {path}: {source}")]
    Credentials { path: String, source: std::io::Error },
    #[error("cannot provision stream {stream}: {detail}")]
    Provision { stream: String, detail: String },
    #[error("cannot read the configuration of stream {stream}: {detail}")]
    StreamInfo { stream: String, detail: String },
    #[error(
        "the streams do not have the shape the settings describe ({}); run `shelfsync setup` \
         (as the NATS admin user, with the same settings) to create or update them",
        .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    )]
    Mismatch(Vec<Difference>),
}

/// One way a stream differs from [`stream_configs`]: what [`verify`] finds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Difference {
    /// The stream does not exist.
    Missing { stream: String },
    /// A setting of the stream has another value than the settings give it.
    Field { stream: String, field: &'static str, have: String, want: String },
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Difference::Missing { stream } => write!(f, "stream {stream} does not exist"),
            Difference::Field { stream, field, have, want } => {
                write!(f, "stream {stream}: {field} is {have}, the settings say {want}")
            }
        }
    }
}

/// Connects with the configured URLs and credentials. `retry` keeps trying
/// on start-up (services); without it a down server is an immediate error
/// (CLI).
pub async fn connect(
    cfg: &NatsSettings,
    name: &str,
    retry: bool,
) -> Result<async_nats::Client, BusError> {
    let mut opts = async_nats::ConnectOptions::new()
        .name(name)
        .custom_inbox_prefix(&cfg.inbox_prefix)
        .request_timeout(Some(cfg.request_timeout))
        .connection_timeout(Duration::from_secs(5));
    if retry {
        opts = opts.retry_on_initial_connect();
    }
    if let Some(path) = &cfg.credentials_file {
        opts = opts
            .credentials_file(path)
            .await
            .map_err(|source| BusError::Credentials { path: path.clone(), source })?;
    }
    if let (Some(user), Some(password)) = (&cfg.user, &cfg.password) {
        opts = opts.user_and_password(user.clone(), password.clone());
    }
    if let Some(token) = &cfg.token {
        opts = opts.token(token.clone());
    }
    if cfg.tls_required || cfg.tls_ca_file.is_some() {
        opts = opts.require_tls(true);
    }
    if let Some(ca) = &cfg.tls_ca_file {
        opts = opts.add_root_certificates(ca.into());
    }
    if let (Some(cert), Some(key)) = (&cfg.tls_cert_file, &cfg.tls_key_file) {
        opts = opts.add_client_certificate(cert.into(), key.into());
    }
    let urls = cfg.urls();
    opts.connect(urls.as_slice())
        .await
        .map_err(|source| BusError::Connect { url: cfg.url_redacted(), source })
}

/// A JetStream context whose API calls time out as configured.
pub fn jetstream(client: async_nats::Client, cfg: &NatsSettings) -> jetstream::Context {
    jetstream::ContextBuilder::new().timeout(cfg.request_timeout).build(client)
}

/// A size limit of the settings (0: unlimited) as JetStream takes it.
fn max_bytes(limit: u64) -> i64 {
    if limit == 0 { -1 } else { i64::try_from(limit).unwrap_or(i64::MAX) }
}

/// The stream configurations the suite needs, in creation order.
///
/// CMD keeps every message until storage purges it, once applied (limits
/// retention, no age limit): a work queue would remove each message on its
/// ack, and a server that fsyncs every write pays an fsync per ack, where a
/// purge of many messages pays one.
///
/// What each stream does when it reaches its `max_bytes`: CMD refuses new
/// messages (`discard: new`): its messages are commands nobody applied yet,
/// so dropping the oldest would lose data silently, while a refused publish
/// is an error the publisher sees and retries. KEYFRAMES refuses too: a
/// keyframe that does not fit fails, and the complete ones before it stay
/// readable (dropping the oldest parts could cut the latest keyframe of a
/// place short). CHANGES, AGGREGATES and REJECTS are logs of what happened:
/// they drop their oldest messages (`discard: old`), as they do past their
/// age, so a full log never stops storage; a consumer that far behind is
/// repaired by the next keyframe.
pub fn stream_configs(n: &NatsSettings, topology: Topology) -> Vec<stream::Config> {
    let s = Subjects::new(&n.prefix);
    let base = |name: String, subjects: Vec<String>| stream::Config {
        name,
        subjects,
        storage: stream::StorageType::File,
        num_replicas: n.stream_replicas,
        duplicate_window: n.duplicate_window,
        discard: stream::DiscardPolicy::Old,
        ..Default::default()
    };
    vec![
        // Commands are work: the storage worker owning a partition applies
        // them in order and purges what it applied.
        stream::Config {
            retention: stream::RetentionPolicy::Limits,
            max_bytes: max_bytes(n.cmd_max_bytes),
            discard: stream::DiscardPolicy::New,
            description: Some("shelfsync commands, one subject per partition".into()),
            metadata: [(PARTITIONS_KEY.to_string(), topology.partitions.to_string())].into(),
            // Storage reads the messages queued behind the one delivered
            // with direct gets (next on the partition's subject).
            allow_direct: true,
            ..base(s.cmd_stream(), vec![s.cmd_all()])
        },
        stream::Config {
            retention: stream::RetentionPolicy::Limits,
            max_age: n.changes_max_age,
            max_bytes: max_bytes(n.changes_max_bytes),
            description: Some("shelfsync changes: record before and after".into()),
            ..base(s.changes_stream(), vec![s.changes_all()])
        },
        // Old keyframes are purged by storage once `keyframes_kept` newer
        // ones of the same place exist; max_age is a backstop.
        stream::Config {
            retention: stream::RetentionPolicy::Limits,
            max_age: n.changes_max_age,
            max_bytes: max_bytes(n.keyframes_max_bytes),
            discard: stream::DiscardPolicy::New,
            description: Some("shelfsync keyframes: consistent per-place snapshots".into()),
            // Consumers read a place's latest keyframe back with direct gets.
            allow_direct: true,
            ..base(s.keyframes_stream(), vec![s.keyframes_all()])
        },
        stream::Config {
            retention: stream::RetentionPolicy::Limits,
            max_age: n.changes_max_age,
            max_bytes: max_bytes(n.aggregates_max_bytes),
            description: Some("shelfsync aggregates: master cards and category flips".into()),
            ..base(s.aggregates_stream(), vec![s.aggregates_all()])
        },
        stream::Config {
            retention: stream::RetentionPolicy::Limits,
            max_age: n.changes_max_age,
            max_bytes: max_bytes(n.rejects_max_bytes),
            description: Some("shelfsync rejected commands and feed items, with reasons".into()),
            ..base(s.rejects_stream(), vec![s.rejects_all()])
        },
    ]
}

/// How long each step of [`close`] waits for the server.
pub const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Closes a service's connection at shutdown: what is buffered goes on the
/// wire (flush), then subscriptions are drained and the connection closed.
/// Each step waits at most [`CLOSE_WAIT`]: with the server gone both would
/// wait for it to come back, and the process would hang until SIGKILL.
pub async fn close(client: &async_nats::Client) {
    match tokio::time::timeout(CLOSE_WAIT, client.flush()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %chain(&e), "cannot flush the NATS connection"),
        Err(_) => tracing::warn!(wait = ?CLOSE_WAIT, "NATS flush timed out"),
    }
    match tokio::time::timeout(CLOSE_WAIT, client.drain()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %chain(&e), "cannot drain the NATS connection"),
        Err(_) => tracing::warn!(wait = ?CLOSE_WAIT, "NATS drain timed out"),
    }
}

/// Pull requests of [`pull_messages`] and of storage's intake: they expire after this ...
pub(crate) const PULL_EXPIRES: Duration = Duration::from_secs(10);
/// ... and the server sends an idle heartbeat this often; two missed ones
/// make the client pull again. The client's defaults (30 s, 15 s) left a
/// consumer idle for 20–30 s after the NATS server holding its request was
/// lost; with these it resumes within a few seconds.
pub(crate) const PULL_HEARTBEAT: Duration = Duration::from_secs(2);

/// The messages of a pull consumer, pulled with short-lived requests and
/// heartbeats, so that the loss of a NATS server stalls it only briefly.
pub async fn pull_messages(
    consumer: &jetstream::consumer::PullConsumer,
) -> Result<jetstream::consumer::pull::Stream, jetstream::consumer::StreamError> {
    consumer.stream().expires(PULL_EXPIRES).heartbeat(PULL_HEARTBEAT).messages().await
}

/// Creates the streams, or updates them to the configured shape. Safe to
/// run any number of times. The partition count is recorded in the command
/// stream's metadata and may not change once set: changing it would move
/// places between partitions while commands are queued.
pub async fn provision(
    js: &jetstream::Context,
    nats: &NatsSettings,
    topology: Topology,
) -> Result<(), BusError> {
    let max_payload = server_max_payload(&js.client()).await;
    for mut config in stream_configs(nats, topology) {
        if config.name == Subjects::new(&nats.prefix).cmd_stream() {
            config.max_message_size = max_payload.map_or(0, cmd_max_message_size);
        }
        let name = config.name.clone();
        let err = |detail: String| BusError::Provision { stream: name.clone(), detail };
        match js.get_stream(&name).await {
            Ok(mut existing) => {
                let info = existing.info().await.map_err(|e| err(e.to_string()))?;
                if info.config.retention != config.retention {
                    return Err(err(format!(
                        "the stream's retention is {:?}, this version needs {:?} (a command \
                         stream created by a version before 0.2 is a work queue): once storage \
                         has applied every command it holds, recreate it with `shelfsync setup \
                         --recreate-cmd`, then `shelfsync rebase` (docs/OPERATE.md, \
                         \"Upgrading the command stream\")",
                        info.config.retention, config.retention
                    )));
                }
                if let (Some(have), Some(want)) =
                    (info.config.metadata.get(PARTITIONS_KEY), config.metadata.get(PARTITIONS_KEY))
                    && have != want
                {
                    return Err(err(format!(
                        "the stream was created with {have} partitions, settings say {want}; \
                         the partition count is fixed"
                    )));
                }
                if max_payload.is_none() {
                    // The server's limit unknown: the one set before stays.
                    config.max_message_size = info.config.max_message_size;
                }
                js.update_stream(&config).await.map_err(|e| err(e.to_string()))?;
            }
            Err(_) => {
                js.create_stream(config.clone()).await.map_err(|e| err(e.to_string()))?;
            }
        }
    }
    Ok(())
}

/// The metadata key of the command stream that records its partition count.
const PARTITIONS_KEY: &str = "shelfsync.partitions";

/// Checks that every stream exists with the configuration `shelfsync setup`
/// gives it ([`stream_configs`]), reading it only: services verify the
/// streams at start instead of writing them, so that their NATS users need
/// no right to change a stream (only the admin user, which `setup` runs as,
/// has it). Every difference found is in the one error.
pub async fn verify(
    js: &jetstream::Context,
    nats: &NatsSettings,
    topology: Topology,
) -> Result<(), BusError> {
    let mut found = Vec::new();
    let cmd = Subjects::new(&nats.prefix).cmd_stream();
    for mut want in stream_configs(nats, topology) {
        let name = want.name.clone();
        // As `provision` sets it: below this server's max payload.
        if name == cmd {
            want.max_message_size =
                server_max_payload(&js.client()).await.map_or(0, cmd_max_message_size);
        }
        match js.get_stream(&name).await {
            Ok(mut stream) => {
                let info = stream.info().await.map_err(|e| BusError::StreamInfo {
                    stream: name.clone(),
                    detail: e.to_string(),
                })?;
                found.extend(differences(&info.config, &want));
            }
            Err(e)
                if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
            {
                found.push(Difference::Missing { stream: name });
            }
            Err(e) => return Err(BusError::StreamInfo { stream: name, detail: e.to_string() }),
        }
    }
    if found.is_empty() { Ok(()) } else { Err(BusError::Mismatch(found)) }
}

/// How an existing stream's configuration differs from the wanted one, in
/// what the suite relies on: subjects, retention, limits (bytes, age,
/// message size), storage,
/// replicas, discard policy, duplicate window, direct gets and the command
/// stream's partition count. What the server adds of its own (metadata
/// under `_nats.`, defaults of fields the suite leaves alone) is ignored.
pub fn differences(have: &stream::Config, want: &stream::Config) -> Vec<Difference> {
    let mut out = Vec::new();
    let name = want.name.clone();
    let mut push = |field: &'static str, have: String, want: String| {
        if have != want {
            out.push(Difference::Field { stream: name.clone(), field, have, want });
        }
    };
    let mut subjects = (have.subjects.clone(), want.subjects.clone());
    subjects.0.sort();
    subjects.1.sort();
    push("subjects", format!("{:?}", subjects.0), format!("{:?}", subjects.1));
    push("retention", format!("{:?}", have.retention), format!("{:?}", want.retention));
    push("storage", format!("{:?}", have.storage), format!("{:?}", want.storage));
    push("replicas", have.num_replicas.to_string(), want.num_replicas.to_string());
    push("discard", format!("{:?}", have.discard), format!("{:?}", want.discard));
    push("max_bytes", have.max_bytes.to_string(), want.max_bytes.to_string());
    push("max_age", format!("{:?}", have.max_age), format!("{:?}", want.max_age));
    // 0 (a config's default) and -1 (what the server answers) both mean unlimited.
    let size = |v: i32| if v <= 0 { "unlimited".to_string() } else { v.to_string() };
    push("max_message_size", size(have.max_message_size), size(want.max_message_size));
    // The server caps the duplicate window at max_age.
    let window = match want.max_age {
        age if !age.is_zero() && want.duplicate_window > age => age,
        _ => want.duplicate_window,
    };
    push("duplicate_window", format!("{:?}", have.duplicate_window), format!("{window:?}"));
    push("allow_direct", have.allow_direct.to_string(), want.allow_direct.to_string());
    if let Some(partitions) = want.metadata.get(PARTITIONS_KEY) {
        let had = have.metadata.get(PARTITIONS_KEY).map_or("none".into(), |p| p.clone());
        push("partitions (metadata shelfsync.partitions)", had, partitions.clone());
    }
    out
}

/// The server's `max_payload`, once the connection has its INFO (a client
/// that connects in the background may not have it yet: a flush waits for
/// the connection). `None`: still unknown.
pub async fn server_max_payload(client: &async_nats::Client) -> Option<usize> {
    if client.try_server_info().is_none() {
        let _ = tokio::time::timeout(Duration::from_secs(10), client.flush()).await;
    }
    client.try_server_info().map(|i| i.max_payload).filter(|&n| n > 0)
}

/// The command stream's largest message on a server of `max_payload`.
pub fn cmd_max_message_size(max_payload: usize) -> i32 {
    i32::try_from(max_payload.saturating_sub(CMD_HEADROOM)).unwrap_or(i32::MAX)
}

/// Asks storage for a keyframe now — of every place (`place = None`) or of
/// one — and waits for the replies of `replicas` storage replicas (one for a
/// single place). Returns the replies received before `timeout`.
pub async fn request_keyframe(
    client: &async_nats::Client,
    subjects: &Subjects,
    place: Option<shelfsync_proto::PlaceKey>,
    replicas: u32,
    timeout: Duration,
) -> Result<Vec<shelfsync_proto::KeyframeReply>, async_nats::Error> {
    use futures::StreamExt;
    use prost::Message;
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(inbox.clone()).await?;
    let (brand_id, place_id) = place.map_or((0, 0), |p| (p.brand_id, p.place_id));
    // Named here, so that every replica answering uses the same id.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64);
    let req =
        shelfsync_proto::KeyframeRequest { keyframe_id: format!("kf-{now}"), brand_id, place_id };
    client.publish_with_reply(subjects.ctl_keyframe(), inbox, req.encode_to_vec().into()).await?;
    client.flush().await?;
    let want = if place.is_some() { 1 } else { replicas.max(1) as usize };
    let mut replies = Vec::new();
    let deadline = tokio::time::Instant::now() + timeout;
    while replies.len() < want {
        match tokio::time::timeout_at(deadline, sub.next()).await {
            Ok(Some(msg)) => {
                replies.push(shelfsync_proto::KeyframeReply::decode(msg.payload.as_ref())?);
            }
            Ok(None) | Err(_) => break,
        }
    }
    Ok(replies)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configured_streams_have_no_differences_with_themselves() {
        let nats = NatsSettings::default();
        let topology =
            Topology { partitions: 4, storage_replicas: 1, tombstone_ttl: Duration::ZERO };
        for config in stream_configs(&nats, topology) {
            assert_eq!(differences(&config, &config), [], "{}", config.name);
        }
    }

    #[test]
    fn what_the_suite_relies_on_is_compared_and_server_metadata_ignored() {
        let nats = NatsSettings::default();
        let topology =
            Topology { partitions: 4, storage_replicas: 1, tombstone_ttl: Duration::ZERO };
        let want = stream_configs(&nats, topology).remove(0);
        let mut have = want.clone();
        have.metadata.insert("_nats.req.level".into(), "1".into());
        have.description = Some("edited by hand".into());
        assert_eq!(differences(&have, &want), []);
        have.subjects.push("elsewhere.>".into());
        have.retention = stream::RetentionPolicy::WorkQueue;
        have.discard = stream::DiscardPolicy::Old;
        have.num_replicas = 3;
        have.allow_direct = false;
        have.metadata.remove("shelfsync.partitions");
        let fields: Vec<&str> = differences(&have, &want)
            .iter()
            .map(|d| match d {
                Difference::Field { field, .. } => *field,
                Difference::Missing { .. } => "missing",
            })
            .collect();
        assert_eq!(
            fields,
            [
                "subjects",
                "retention",
                "replicas",
                "discard",
                "allow_direct",
                "partitions (metadata shelfsync.partitions)"
            ]
        );
    }
}
