//! Where settings come from, lowest first: defaults, the TOML files in
//! order, `NATS_URL` / `REDIS_URL`, then `SHELFSYNC__SECTION__KEY`.

use std::path::Path;

use crate::{Settings, SettingsError, invalid};

impl Settings {
    /// Loads defaults, then `file` (if any), then the process environment.
    pub fn load(file: Option<&Path>) -> Result<Self, SettingsError> {
        Self::load_files(file.as_slice())
    }

    /// Loads defaults, then each of `files` in order, then the process
    /// environment. A later file overrides what an earlier one sets, key by
    /// key, so a deployment can give each service a common file plus one of
    /// its own (`--config common.toml --config storage.toml`).
    pub fn load_files<P: AsRef<Path>>(files: &[P]) -> Result<Self, SettingsError> {
        let env: Vec<(String, String)> = std::env::vars().collect();
        Self::load_files_from(files, &env)
    }

    /// As [`Settings::load`], with the environment given explicitly (tests).
    pub fn load_from(file: Option<&Path>, env: &[(String, String)]) -> Result<Self, SettingsError> {
        Self::load_files_from(file.as_slice(), env)
    }

    /// As [`Settings::load_files`], with the environment given explicitly.
    pub fn load_files_from<P: AsRef<Path>>(
        files: &[P],
        env: &[(String, String)],
    ) -> Result<Self, SettingsError> {
        let mut builder = config::Config::builder();
        for path in files.iter().map(AsRef::as_ref) {
            if !path.exists() {
                return Err(invalid("--config", format!("file {} does not exist", path.display())));
            }
            builder = builder.add_source(config::File::from(path).format(config::FileFormat::Toml));
        }
        let get = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        if let Some(url) = get("NATS_URL") {
            builder = builder.set_override("nats.url", url)?;
        }
        if let Some(url) = get("REDIS_URL") {
            builder = builder.set_override("redis.url", url)?;
        }
        for (key, value) in env {
            let Some(path) = key.strip_prefix("SHELFSYNC__") else {
                continue;
            };
            builder = builder.set_override(env_key_path(path), parse_env_value(value))?;
        }
        let settings: Settings = builder.build()?.try_deserialize()?;
        settings.validate()?;
        Ok(settings)
    }

    /// Parses a TOML document on top of the defaults (no environment).
    pub fn from_toml(text: &str) -> Result<Self, SettingsError> {
        let settings: Settings = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Toml))
            .build()?
            .try_deserialize()?;
        settings.validate()?;
        Ok(settings)
    }
}

/// The settings path of a `SHELFSYNC__` variable (without the prefix):
/// sections and keys are separated by `__`, and a number is an index into an
/// array, so `PARTNERS__0__PUSH_TOKENS_ENV` sets `partners[0].push_tokens_env`
/// (the bracket form `PARTNERS[0]__…` works too).
pub(crate) fn env_key_path(name: &str) -> String {
    let mut path = String::new();
    for part in name.to_ascii_lowercase().split("__") {
        if !path.is_empty() && !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            path.push_str(&format!("[{part}]"));
        } else {
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(part);
        }
    }
    path
}

/// Environment values are strings; give numbers and booleans their type so
/// that `SHELFSYNC__STORAGE__PARTITIONS=16` deserializes into a `u32`.
fn parse_env_value(value: &str) -> config::Value {
    if let Ok(n) = value.parse::<i64>() {
        return n.into();
    }
    match value {
        "true" => true.into(),
        "false" => false.into(),
        _ => value.into(),
    }
}
