//! `[aggregator]`: the aggregator's consumer, listener and the place →
//! region directory.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::{SettingsError, invalid};

/// A place of the region directory.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PlaceRegion {
    pub brand_id: i64,
    pub place_id: i64,
    pub region: String,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AggregatorSettings {
    pub consumer: String,
    pub http_listen: String,
    /// The place → region directory (reference data).
    pub places: Vec<PlaceRegion>,
    /// Region of places not in the directory; unset: such places are ignored.
    pub default_region: Option<String>,
    /// Bearer tokens the HTTP read API asks for (`Authorization: Bearer
    /// <token>`; 401 without, 403 with another): a file, one token a line
    /// (re-read when it changes; removing it revokes them), and/or an
    /// environment variable naming them (read at start). Neither: the API
    /// is open (behind the network policies). `/healthz`, `/readyz` and
    /// `/metrics` stay open either way.
    pub read_tokens_file: Option<std::path::PathBuf>,
    pub read_tokens_env: Option<String>,
}

impl Default for AggregatorSettings {
    fn default() -> Self {
        Self {
            consumer: "aggregator".into(),
            http_listen: "127.0.0.1:8083".into(),
            places: Vec::new(),
            default_region: Some("default".into()),
            read_tokens_file: None,
            read_tokens_env: None,
        }
    }
}

impl AggregatorSettings {
    /// The region of a place: the directory's, else the default one.
    pub fn region_of(&self, brand_id: i64, place_id: i64) -> Option<&str> {
        self.places
            .iter()
            .find(|p| p.brand_id == brand_id && p.place_id == place_id)
            .map(|p| p.region.as_str())
            .or(self.default_region.as_deref())
    }

    /// Checks what types alone cannot.
    pub fn validate(&self) -> Result<(), SettingsError> {
        let mut seen_places = HashSet::new();
        for (i, p) in self.places.iter().enumerate() {
            if p.region.is_empty() {
                return Err(invalid(format!("aggregator.places[{i}].region"), "must not be empty"));
            }
            if !seen_places.insert((p.brand_id, p.place_id)) {
                return Err(invalid(
                    format!("aggregator.places[{i}]"),
                    format!("place {}/{} is listed twice", p.brand_id, p.place_id),
                ));
            }
        }
        Ok(())
    }
}
