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

impl ConfigArgs {
    /// Parses the command line of a binary whose only arguments are its
    /// settings files (`--help` says `about`, `--version` the workspace's).
    pub fn parse_for(name: &'static str, about: &'static str) -> ConfigArgs {
        use clap::{Args as _, FromArgMatches as _};
        // The struct's doc comment would be the about: set ours after.
        let command = ConfigArgs::augment_args(clap::Command::new(name))
            .about(about)
            .version(env!("CARGO_PKG_VERSION"));
        let matches = command.get_matches();
        ConfigArgs::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    }
}

/// The whole `main` of a service configured by its settings files alone:
/// parse the command line, [`start`], build the app with `build` and run
/// it until SIGTERM or SIGINT.
pub async fn main<A, F>(
    name: &'static str,
    about: &'static str,
    build: impl FnOnce(Settings) -> F,
) -> anyhow::Result<()>
where
    A: crate::Service,
    F: std::future::Future<Output = anyhow::Result<A>>,
{
    let args = ConfigArgs::parse_for(name, about);
    let (settings, _telemetry) = start(name, &args)?;
    build(settings).await?.run_until(crate::shutdown_signal()).await
}

/// Loads the settings and initialises telemetry for `service` (the binary's
/// name). Hold the guard until `main` returns: dropping it flushes the spans.
pub fn start(
    service: &str,
    args: &ConfigArgs,
) -> anyhow::Result<(Settings, shelfsync_telemetry::Guard)> {
    crate::without_huge_pages();
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
    fn a_bare_service_takes_its_config_files_and_nothing_else() {
        use clap::{Args as _, FromArgMatches as _};
        let command = ConfigArgs::augment_args(clap::Command::new("svc"));
        let matches =
            command.clone().try_get_matches_from(["svc", "--config", "a.toml"]).expect("parses");
        let args = ConfigArgs::from_arg_matches(&matches).expect("args");
        assert_eq!(args.config, [PathBuf::from("a.toml")]);
        assert!(command.try_get_matches_from(["svc", "--listen", "x"]).is_err());
    }

    #[test]
    fn config_files_repeat_in_order() {
        let args = Args::try_parse_from(["svc", "--config", "a.toml", "--config", "b.toml"])
            .expect("parses");
        assert_eq!(args.config.config, [PathBuf::from("a.toml"), PathBuf::from("b.toml")]);
    }
}
