//! Harness for cross-service tests: real nats-server and redis-server on
//! loopback (from `shelfsync_testkit`), services running in-process or as
//! their real binaries, and helpers to publish commands and read the change
//! stream. By concern:
//!
//! - [`harness`]: the connection to the test's NATS and Redis, and the
//!   commands tests are made of;
//! - [`model`]: the serial model of storage and the churn workload the
//!   fault tests (tests/tests/faults_*.rs, docs/RELIABILITY.md) use;
//! - [`mirror`]: a ChangeFeed consumer mirroring storage;
//! - [`processes`]: services in this process ([`spawn`]), the binaries as
//!   child processes, signals;
//! - [`http`]: HTTP requests to a service and its metrics;
//! - [`otlp`]: an in-process OTLP receiver over TLS;
//! - [`outbox`]: storage's outbox at the store, committed directly;
//! - [`tls`]: test certificates;
//! - [`stack`]: servers, settings, a harness and storage started together,
//!   with an importer for the tests that go through ingest.
//!
//! Everything is re-exported here: a test says `use shelfsync_tests::*`.
#![forbid(unsafe_code)]

use std::time::Duration;

use shelfsync_settings::Settings;
use shelfsync_testkit::TestEnv;

pub mod harness;
pub mod http;
pub mod mirror;
pub mod model;
pub mod natsauth;
pub mod otlp;
pub mod outbox;
pub mod processes;
pub mod stack;
pub mod tls;

pub use harness::{Harness, count_by_key, decode_product, patch, product, publish_until_acked};
pub use http::{http_get, metric_value};
pub use mirror::{FeedMirror, RunningFeed, tail_from_start};
pub use model::{Churn, Observed, RecordId, SerialModel, observed};
pub use natsauth::{COMPOSE_NATS_CONF, Refusals};
pub use outbox::{commit_outbox, outbox_entries};
pub use processes::{
    InProcessStorage, Running, Shutdown, StorageProcess, cli, cli_ok, pid_with_arg, signal, spawn,
    spawn_with,
};
pub use shelfsync_proto::now_us;
pub use shelfsync_testkit::{eventually, settings_env};
pub use stack::{Importing, Stack, storage_settings};
pub use tls::{test_certificates, test_client_certificate};

/// How long a test waits for the pipeline to settle.
pub const SETTLE: Duration = Duration::from_secs(30);

/// Settings for one test: its own servers, prefix and namespace.
pub fn settings_for(env: &TestEnv) -> Settings {
    let mut s = env.settings();
    s.storage.partitions = 4;
    s.storage.retry_delay = Duration::from_millis(100);
    s.storage.ack_wait = Duration::from_secs(5);
    // Several storages run at once in tests: no fixed ports.
    s.storage.http_listen = "127.0.0.1:0".into();
    s.ingest.listen = "127.0.0.1:0".into();
    s
}
