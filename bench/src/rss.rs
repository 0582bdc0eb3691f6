//! Scenario 6: peak RSS of ingest importing a 100 MB and a 1 GB dump. The import runs in a
//! child process (the ingest library, as `shelfsync import` runs it) that reports its own
//! `VmHWM` before exiting; the parent samples `VmHWM` while it runs as a cross-check.
//!
//! The commands go to a stream of their own capped at 256 MB (oldest dropped): nothing consumes
//! them, and ingest's memory must not depend on a consumer keeping up.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use async_nats::jetstream::stream;
use shelfsync_bus::Subjects;
use shelfsync_cli::genfeed::{FeedSpec, write_feed};
use tokio::io::AsyncReadExt;

use crate::children::this_exe;
use crate::feeds::{base_spec, write};
use crate::measure;
use crate::report::{Report, RssRow};
use crate::world::World;
use shelfsync_testkit::settings_env;

pub async fn run(world: &World, report: &mut Report) -> anyhow::Result<()> {
    let settings = world.settings("br", 1);
    let subjects = Subjects::new("br");
    world
        .js
        .create_stream(stream::Config {
            name: subjects.cmd_stream(),
            subjects: vec![subjects.cmd_all(), subjects.rejects_all()],
            storage: stream::StorageType::File,
            max_bytes: 256 << 20,
            discard: stream::DiscardPolicy::Old,
            ..Default::default()
        })
        .await
        .context("creating the capped command stream")?;
    let bytes_per_item = calibrate(world);
    for &mb in &world.profile.rss_dumps_mb {
        let path = world.work.join(format!("dump-{mb}mb.json"));
        let items = (mb * 1_000_000 / bytes_per_item).max(1);
        let per_place = (items / u64::from(world.profile.places)).max(1) as u32;
        let spec = FeedSpec { items_per_place: per_place, ..base_spec(&world.profile) };
        let summary = write(spec, path.clone()).await?;
        let row = import_in_child(&settings, &path, summary.bytes).await;
        let _ = std::fs::remove_file(&path);
        let row = row?;
        eprintln!(
            "[bench] ingest of a {:.0} MB dump: peak RSS {:.1} MB, {:.0} items/s",
            row.dump_mb, row.peak_rss_mb, row.items_per_s
        );
        report.rss.push(row);
        world.purge(&subjects.cmd_stream()).await?;
    }
    Ok(())
}

/// Bytes per item of the generated feed (a 2000-item sample).
fn calibrate(world: &World) -> u64 {
    let spec = FeedSpec { places: 2, items_per_place: 1000, ..base_spec(&world.profile) };
    let bytes = write_feed(&spec, std::io::sink()).map_or(240 * 2000, |s| s.bytes);
    (bytes / 2000).max(1)
}

async fn import_in_child(
    settings: &shelfsync_settings::Settings,
    path: &std::path::Path,
    dump_bytes: u64,
) -> anyhow::Result<RssRow> {
    let mut child = tokio::process::Command::new(this_exe()?)
        .arg("child-import")
        .arg(path)
        .envs(settings_env(settings))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("spawning the import child")?;
    let pid = child.id().context("import child has no pid")?.to_string();
    let mut stdout = child.stdout.take().context("no stdout")?;
    let mut stderr = child.stderr.take().context("no stderr")?;
    let reader = tokio::spawn(async move {
        let (mut out, mut err) = (String::new(), String::new());
        let _ = tokio::join!(stdout.read_to_string(&mut out), stderr.read_to_string(&mut err));
        (out, err)
    });
    let started = Instant::now();
    let mut sampled_kb = 0;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if let Some(kb) = measure::status_kb(&pid, "VmHWM") {
            sampled_kb = sampled_kb.max(kb);
        }
        if started.elapsed() > Duration::from_secs(1800) {
            bail!("the import child ran for 30 minutes");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (out, err) = reader.await?;
    if !status.success() {
        bail!("the import child failed ({status}): {err}");
    }
    let line: serde_json::Value = serde_json::from_str(out.lines().last().unwrap_or_default())
        .with_context(|| format!("import child output: {out:?} {err}"))?;
    let num = |k: &str| line.get(k).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
    let secs = num("duration_ms") / 1e3;
    let peak_kb = num("vm_hwm_kb").max(sampled_kb as f64);
    Ok(RssRow {
        dump_mb: dump_bytes as f64 / 1e6,
        items: num("items") as u64,
        peak_rss_mb: peak_kb / 1024.0,
        rss_at_start_mb: num("rss_before_kb") / 1024.0,
        import_s: secs,
        items_per_s: num("items") / secs.max(1e-9),
        mb_per_s: num("bytes_in") / 1e6 / secs.max(1e-9),
        cpu_s: num("cpu_s"),
    })
}
