//! `[telemetry]`: log level and format (tracing export is configured by
//! the standard `OTEL_*` variables, not here).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetrySettings {
    /// `tracing` env-filter directive; `RUST_LOG` wins when set.
    pub log_level: String,
    pub log_format: LogFormat,
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        Self { log_level: "info".into(), log_format: LogFormat::Text }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}
