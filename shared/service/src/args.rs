//! The command-line arguments every service takes for its settings, and the
//! start-up they lead to (settings loaded, telemetry initialised).

use std::path::PathBuf;

use shelfsync_settings::Settings;

/// The settings files of a service: flatten it into the binary's
/// `clap::Parser` (`#[command(flatten)] config: ConfigArgs`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ConfigArgs {
    /// TOML settings files, in order (repeat --config, or separate them with
    /// `:` in SHELFSYNC_CONFIG): a later file overrides an earlier one, and
    /// SHELFSYNC__SECTION__KEY variables override them all.
    #[arg(long, env = "SHELFSYNC_CONFIG", value_name = "FILE", value_delimiter = ':')]
    pub config: Vec<PathBuf>,
}

impl ConfigArgs {
    /// The settings the files and the environment make (validated).
    pub fn load(&self) -> Result<Settings, shelfsync_settings::SettingsError> {
        Settings::load_files(&self.config)
    }
}

/// Loads the settings and initialises telemetry for `service` (the binary's
/// name). Hold the guard until `main` returns: dropping it flushes the spans.
pub fn start(
    service: &str,
    args: &ConfigArgs,
) -> anyhow::Result<(Settings, shelfsync_telemetry::Guard)> {
    let settings = args.load()?;
    let telemetry = shelfsync_telemetry::init(service, &settings.telemetry)?;
    Ok((settings, telemetry))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Args {
        #[command(flatten)]
        config: ConfigArgs,
    }

    #[test]
    fn config_files_repeat_in_order() {
        let args = Args::try_parse_from(["svc", "--config", "a.toml", "--config", "b.toml"])
            .expect("parses");
        assert_eq!(args.config.config, [PathBuf::from("a.toml"), PathBuf::from("b.toml")]);
    }
}
