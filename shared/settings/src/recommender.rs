//! `[recommender]`: the recommender's listener and top-N limits.

use serde::{Deserialize, Serialize};

use crate::{SettingsError, invalid};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RecommenderSettings {
    pub http_listen: String,
    pub default_top_n: usize,
    pub max_top_n: usize,
    /// Bearer tokens the HTTP read API asks for (`Authorization: Bearer
    /// <token>`; 401 without, 403 with another): a file, one token a line
    /// (re-read when it changes; removing it revokes them), and/or an
    /// environment variable naming them (read at start). Neither: the API
    /// is open (behind the network policies). `/healthz`, `/readyz` and
    /// `/metrics` stay open either way.
    pub read_tokens_file: Option<std::path::PathBuf>,
    pub read_tokens_env: Option<String>,
}

impl Default for RecommenderSettings {
    fn default() -> Self {
        Self {
            http_listen: "127.0.0.1:8084".into(),
            default_top_n: 10,
            max_top_n: 100,
            read_tokens_file: None,
            read_tokens_env: None,
        }
    }
}

impl RecommenderSettings {
    /// Checks what types alone cannot.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.default_top_n == 0 || self.default_top_n > self.max_top_n {
            return Err(invalid(
                "recommender.default_top_n",
                "must be between 1 and recommender.max_top_n",
            ));
        }
        Ok(())
    }
}
