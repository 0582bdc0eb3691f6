//! What every networked verb starts from: the loaded settings, and the
//! connections made on demand with errors that name the server and the
//! setting to fix. Owns no state beyond the settings.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use async_nats::jetstream;
use shelfsync_bus::Subjects;
use shelfsync_settings::{Settings, TelemetrySettings};
use shelfsync_storage::client::Store;

use crate::CliError;

/// Settings of the deployment a verb talks to.
pub struct Context {
    pub settings: Arc<Settings>,
    _telemetry: shelfsync_telemetry::Guard,
}

impl Context {
    /// Loads settings (defaults, `files` in order, environment) and installs logging
    /// on stderr. A CLI is quiet by default — warnings only — whatever
    /// level the shared config file sets for the services.
    pub fn load(files: &[PathBuf], verbose: u8) -> anyhow::Result<Context> {
        let settings = Settings::load_files(files)
            .context(CliError::BadInput("cannot load settings".into()))?;
        let telemetry = TelemetrySettings {
            log_level: match verbose {
                0 => "warn",
                1 => "info",
                _ => "debug",
            }
            .into(),
            ..settings.telemetry.clone()
        };
        let guard = shelfsync_telemetry::init("shelfsync-cli", &telemetry)?;
        Ok(Context { settings: Arc::new(settings), _telemetry: guard })
    }

    pub fn subjects(&self) -> Subjects {
        Subjects::new(&self.settings.nats.prefix)
    }

    /// A NATS connection; fails at once when NATS is down (no retry loop
    /// in front of an operator).
    pub async fn nats(&self) -> anyhow::Result<async_nats::Client> {
        let nats = &self.settings.nats;
        shelfsync_bus::connect(nats, "shelfsync-cli", false).await.with_context(|| {
            CliError::Unavailable(format!("is NATS running at {} (nats.url)?", nats.url_redacted()))
        })
    }

    /// A JetStream context on a fresh connection.
    pub async fn jetstream(&self) -> anyhow::Result<jetstream::Context> {
        Ok(shelfsync_bus::jetstream(self.nats().await?, &self.settings.nats))
    }

    /// The storage's Redis, read-only use.
    pub async fn store(&self) -> anyhow::Result<Store> {
        let redis = &self.settings.redis;
        Store::connect(redis).await.with_context(|| {
            CliError::Unavailable(format!(
                "is Redis running at {} (redis.url)?",
                redis.url_redacted()
            ))
        })
    }
}
