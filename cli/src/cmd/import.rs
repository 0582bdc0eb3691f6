//! `shelfsync import --partner NAME FILE|URL|-`: one import with the
//! partner's settings, run in this process by the ingest library. Progress
//! on stderr while stdout is a terminal; the report on stdout at the end,
//! also when the import failed (then the exit code is non-zero).
//!
//! A full import takes the partner's lease like the ingest service does:
//! while another full import of the partner runs (anywhere), it fails at
//! once naming that import, or with `--wait DURATION` waits for it (exit 4
//! when it still runs then). An unknown partner exits 3, NATS or Redis out
//! of reach 5, any failed import 1.

use std::io::IsTerminal;
use std::time::Duration;

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use shelfsync_ingest::{ImportConfig, ImportError, ImportReport, Importer, Progress, Source};
use shelfsync_settings::PartnerSettings;

use crate::{CliError, Context};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The partner, as named under [[partners]] in the settings.
    #[arg(long)]
    partner: String,
    /// The feed: a file, a file:// or http(s):// URL, or `-` for stdin.
    #[arg(value_name = "FILE|URL|-")]
    source: String,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// While another full import of the partner runs, wait up to this long
    /// for it to end (e.g. `10m`) instead of failing at once.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    wait: Option<Duration>,
}

pub async fn run(ctx: &Context, args: Args) -> anyhow::Result<()> {
    let partner = find_partner(&ctx.settings.partners, &args.partner)?;
    let source = if args.source == "-" {
        Source::Stream(Box::new(tokio::io::stdin()))
    } else {
        Source::parse(&args.source)
    };
    let importer = Importer::connect(ImportConfig::from(&*ctx.settings))
        .await
        .context(CliError::Unavailable(
            "cannot start the import: NATS or Redis out of reach".into(),
        ))?
        .with_lease_wait(args.wait.unwrap_or_default());

    let bar = progress_bar(&source);
    let on_progress = |p: &Progress| {
        bar.set_position(p.bytes_in);
        bar.set_message(format!(
            "{} items, {} rejected, {} batches",
            p.items, p.rejected, p.batches
        ));
    };
    let (report, result) = importer.run(partner, source, Some(&on_progress)).await;
    bar.finish_and_clear();

    print_report(&report, args.json)?;
    let failed = || format!("import of {} for partner {} failed", args.source, partner.name);
    match (result, args.wait) {
        (Ok(()), _) => Ok(()),
        (Err(e @ ImportError::Busy { .. }), Some(wait)) => {
            Err(anyhow::Error::new(e).context(CliError::Timeout(format!(
                "{}: still busy after waiting {}",
                failed(),
                humantime::format_duration(wait)
            ))))
        }
        (Err(e @ ImportError::Busy { .. }), None) => Err(anyhow::Error::new(e)
            .context(format!("{} (give --wait DURATION to wait for it)", failed()))),
        (Err(e), _) => Err(anyhow::Error::new(e).context(failed())),
    }
}

fn find_partner<'a>(
    partners: &'a [PartnerSettings],
    name: &str,
) -> anyhow::Result<&'a PartnerSettings> {
    if let Some(p) = partners.iter().find(|p| p.name == name) {
        return Ok(p);
    }
    if partners.is_empty() {
        return Err(CliError::NotFound(format!(
            "unknown partner `{name}`: no partners are configured (add a [[partners]] section to the settings file given with --config)"
        ))
        .into());
    }
    let names: Vec<&str> = partners.iter().map(|p| p.name.as_str()).collect();
    Err(CliError::NotFound(format!(
        "unknown partner `{name}`; configured partners: {}",
        names.join(", ")
    ))
    .into())
}

/// A byte bar when the size is known (a local file), a spinner otherwise;
/// drawn on stderr, and only when stdout is a terminal (piped output stays
/// clean and scripts see no escape codes).
fn progress_bar(source: &Source) -> ProgressBar {
    let total = match source {
        Source::File(path) => std::fs::metadata(path).ok().map(|m| m.len()),
        _ => None,
    };
    let bar = match total {
        Some(len) => ProgressBar::new(len).with_style(
            ProgressStyle::with_template(
                "{spinner} {bytes:>10}/{total_bytes} [{bar:30}] {bytes_per_sec:>12} eta {eta}  {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        ),
        None => ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("{spinner} {bytes:>10} read {bytes_per_sec:>12}  {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        ),
    };
    if std::io::stdout().is_terminal() {
        bar.set_draw_target(ProgressDrawTarget::stderr());
        bar.enable_steady_tick(Duration::from_millis(100));
    } else {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar
}

fn print_report(report: &ImportReport, json: bool) -> anyhow::Result<()> {
    use std::io::Write;
    let text = if json { serde_json::to_string_pretty(report)? } else { report.render() };
    writeln!(std::io::stdout().lock(), "{text}")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partner(name: &str) -> PartnerSettings {
        shelfsync_settings::Settings::from_toml(&format!(
            "[[partners]]\nname = \"{name}\"\nbrand_id = 7\nkind = \"full\""
        ))
        .expect("settings")
        .partners
        .remove(0)
    }

    #[test]
    fn unknown_partner_lists_the_configured_ones() {
        let partners = [partner("flowers"), partner("prices")];
        assert_eq!(find_partner(&partners, "prices").expect("found").name, "prices");
        let err = find_partner(&partners, "nope").expect_err("unknown").to_string();
        assert!(err.contains("`nope`") && err.contains("flowers, prices"), "{err}");
        let err = find_partner(&[], "nope").expect_err("none").to_string();
        assert!(err.contains("no partners are configured"), "{err}");
    }
}
