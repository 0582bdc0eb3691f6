//! `[[partners]]`: who sends feeds, what fields each owns, where ingest
//! fetches a feed from, and how a partner may push one.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ingest::IngestSettings;
use crate::{SettingsError, invalid};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ImportKind {
    /// A whole dump: records of a place missing from it are swept afterwards.
    Full,
    /// A partial feed: never sweeps, never stamps generations.
    Delta,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum FeedFormat {
    /// Detected from the content (NDJSON when the first line is a whole item).
    #[default]
    Auto,
    Json,
    Ndjson,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PartnerSettings {
    pub name: String,
    pub brand_id: i64,
    pub kind: ImportKind,
    /// Product fields this partner's feed owns, by their names in the feed.
    #[serde(default = "all_fields")]
    pub fields: Vec<String>,
    /// File path, `file://` URL or `http(s)://` URL polled by the ingest service.
    #[serde(default)]
    pub source: Option<String>,
    #[serde(default, with = "humantime_serde")]
    pub poll_interval: Option<Duration>,
    #[serde(default)]
    pub format: FeedFormat,
    /// An owned field missing from an item is cleared (the partner owns it and
    /// no longer reports a value). Off: missing fields are left as they are.
    #[serde(default = "yes")]
    pub clear_missing: bool,
    /// A full import's sweep that would mark absent more than this share of
    /// a place's live records is held instead of applied (released with
    /// `shelfsync sweep --import ID`); so is one of a place in which no item
    /// was accepted, or that is missing from the dump.
    #[serde(default = "half")]
    pub sweep_max_fraction: f64,
    /// A file of tokens that may push this partner's feed
    /// (`POST /v1/partners/{name}/feed` with `Authorization: Bearer <token>`):
    /// one token a line, at least 16 bytes each; blank lines and lines
    /// starting with `#` are ignored. Several may be valid at once, for
    /// rotation. Ingest reads it at start (a bad file stops it) and again
    /// whenever its modification time, size or inode changes, so a mounted
    /// secret rotates with no restart; a file that cannot be read or parsed
    /// later keeps the last good tokens (and is logged once).
    #[serde(default)]
    pub push_tokens_file: Option<PathBuf>,
    /// The name of an environment variable holding push tokens, separated by
    /// commas or whitespace; read once at start (the variable must be set).
    /// With `push_tokens_file` too, both sets are valid. A partner with
    /// neither cannot be pushed to (403): tokens never come from the config
    /// file itself.
    #[serde(default)]
    pub push_tokens_env: Option<String>,
    /// Largest push body for this partner; unset: `ingest.max_push_bytes`.
    #[serde(default)]
    pub max_push_bytes: Option<u64>,
}

impl PartnerSettings {
    /// Whether the push endpoint can be used for this partner at all: some
    /// source of tokens is configured.
    pub fn push_enabled(&self) -> bool {
        self.push_tokens_file.is_some() || self.push_tokens_env.is_some()
    }

    /// The largest push body accepted for this partner.
    pub fn push_limit(&self, ingest: &IngestSettings) -> u64 {
        self.max_push_bytes.unwrap_or(ingest.max_push_bytes)
    }
}

fn half() -> f64 {
    0.5
}

impl Default for PartnerSettings {
    /// A full partner owning every field, with no source; `name` and
    /// `brand_id` are for the caller to set.
    fn default() -> Self {
        Self {
            name: String::new(),
            brand_id: 0,
            kind: ImportKind::Full,
            fields: all_fields(),
            source: None,
            poll_interval: None,
            format: FeedFormat::default(),
            clear_missing: true,
            sweep_max_fraction: half(),
            push_tokens_file: None,
            push_tokens_env: None,
            max_push_bytes: None,
        }
    }
}

fn all_fields() -> Vec<String> {
    ["title", "category", "price", "old_price", "currency", "stock", "images", "description"]
        .map(String::from)
        .to_vec()
}

fn yes() -> bool {
    true
}

const KNOWN_FIELDS: [&str; 8] =
    ["title", "category", "price", "old_price", "currency", "stock", "images", "description"];

/// Checks every partner and that no name is used twice.
pub(crate) fn validate(partners: &[PartnerSettings]) -> Result<(), SettingsError> {
    let mut names = HashSet::new();
    for (i, p) in partners.iter().enumerate() {
        let key = |k: &str| format!("partners[{i}].{k}");
        if p.name.is_empty()
            || !p.name.chars().all(|c| c.is_ascii_alphanumeric() || "_-".contains(c))
        {
            return Err(invalid(key("name"), "must be non-empty [A-Za-z0-9_-]"));
        }
        if !names.insert(p.name.as_str()) {
            return Err(invalid(key("name"), format!("partner `{}` is defined twice", p.name)));
        }
        if p.brand_id <= 0 {
            return Err(invalid(key("brand_id"), "must be positive"));
        }
        if p.fields.is_empty() {
            return Err(invalid(key("fields"), "a partner must own at least one field"));
        }
        for f in &p.fields {
            if !KNOWN_FIELDS.contains(&f.as_str()) {
                return Err(invalid(
                    key("fields"),
                    format!("unknown field `{f}` (known: {})", KNOWN_FIELDS.join(", ")),
                ));
            }
        }
        if p.poll_interval.is_some() && p.source.is_none() {
            return Err(invalid(key("poll_interval"), "set without a `source`"));
        }
        if !(0.0..=1.0).contains(&p.sweep_max_fraction) {
            return Err(invalid(key("sweep_max_fraction"), "must be between 0 and 1"));
        }
        if p.push_tokens_file.as_ref().is_some_and(|f| f.as_os_str().is_empty()) {
            return Err(invalid(key("push_tokens_file"), "must be a path"));
        }
        if let Some(var) = &p.push_tokens_env {
            let mut chars = var.chars();
            let ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !ok {
                return Err(invalid(
                    key("push_tokens_env"),
                    "must be the name of an environment variable ([A-Za-z_][A-Za-z0-9_]*)",
                ));
            }
        }
        if p.max_push_bytes == Some(0) {
            return Err(invalid(key("max_push_bytes"), "must be at least 1"));
        }
    }
    Ok(())
}
