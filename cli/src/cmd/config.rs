//! `shelfsync config check`: load the settings exactly as the services do
//! (defaults, the `--config` files in order, then `NATS_URL`, `REDIS_URL`
//! and `SHELFSYNC__SECTION__KEY` variables), validate them, and print what
//! resolved — secrets redacted: a NATS password or token as `***`, the
//! password in a URL's userinfo as `***`. Files named by the settings
//! (credentials, certificates, push tokens) are printed as paths and not
//! read. Exit 2 with the reason when the settings are invalid.

use std::io::Write;
use std::path::PathBuf;

use shelfsync_settings::Settings;

use crate::CliError;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    action: Action,
}

#[derive(Debug, clap::Subcommand)]
enum Action {
    /// Load and validate the settings (the global --config files, then the
    /// environment) and print what resolved, secrets redacted.
    Check(CheckArgs),
}

#[derive(Debug, clap::Args)]
struct CheckArgs {
    /// How to print the resolved settings.
    #[arg(long, value_enum, default_value_t = Format::Toml)]
    format: Format,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Format {
    /// TOML, the shape of a settings file.
    Toml,
    /// JSON, pretty-printed.
    Json,
}

pub fn run(files: &[PathBuf], args: Args) -> anyhow::Result<()> {
    let Action::Check(args) = args.action;
    let settings = Settings::load_files(files)
        .map_err(|e| CliError::BadInput(format!("invalid settings: {e}")))?;
    let text = match args.format {
        Format::Toml => toml::to_string(&settings)?,
        Format::Json => serde_json::to_string_pretty(&settings)? + "\n",
    };
    std::io::stdout().lock().write_all(text.as_bytes())?;
    // Where it came from, on stderr: the files, and the names (never the
    // values) of the variables that override them.
    let vars: Vec<String> = std::env::vars()
        .map(|(k, _)| k)
        .filter(|k| k.starts_with("SHELFSYNC__") || k == "NATS_URL" || k == "REDIS_URL")
        .collect();
    let files: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    eprintln!(
        "settings are valid (files: {}; overridden by: {})",
        if files.is_empty() { "none, defaults".into() } else { files.join(", ") },
        if vars.is_empty() { "no variable".into() } else { vars.join(", ") }
    );
    Ok(())
}
