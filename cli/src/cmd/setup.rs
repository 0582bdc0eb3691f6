//! `shelfsync setup [--recreate-cmd]`: create the streams or bring them to
//! the configured shape (idempotent), then show what exists. The one writer
//! of stream configuration: the services only verify it at start
//! (`shelfsync_bus::verify`), so it runs as the NATS admin user.
//!
//! `--recreate-cmd` is the one-time upgrade of a command stream created by a
//! version before 0.2 (a work queue, acked message by message; the retention
//! of a stream cannot be changed in place): once storage has applied every
//! command it holds (the stream is empty), it is deleted and created again
//! with this version's shape. Storage then refuses its partitions (their
//! sequences counted in the old stream) until `shelfsync rebase`.

use std::time::Duration;

use anyhow::Context as _;

use super::streams;
use crate::Context;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Recreate the command stream (the upgrade from a work queue): only
    /// when it is empty, i.e. storage applied everything it held.
    #[arg(long)]
    recreate_cmd: bool,
    /// With --recreate-cmd: how long to wait for the stream to empty.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    wait: Duration,
}

pub async fn run(ctx: &Context, args: Args) -> anyhow::Result<()> {
    let js = ctx.jetstream().await?;
    if args.recreate_cmd {
        recreate_cmd(ctx, &js, args.wait).await?;
    }
    shelfsync_bus::provision(&js, &ctx.settings.nats, ctx.settings.topology())
        .await
        .context("cannot provision the streams")?;
    println!(
        "streams of prefix `{}` ({} command partitions):",
        ctx.settings.nats.prefix, ctx.settings.storage.partitions
    );
    for (_, name) in streams::names(&ctx.settings) {
        let Some(s) = streams::state(&js, &name).await? else {
            anyhow::bail!("stream {name} is missing right after provisioning");
        };
        println!(
            "  {:<24} {:<28} {:<9} {:>10} msgs {:>14} bytes",
            s.name,
            s.subjects.join(","),
            s.retention,
            s.messages,
            s.bytes
        );
    }
    Ok(())
}

/// Deletes the command stream once it is empty (waiting up to `wait`);
/// provisioning then creates it again.
async fn recreate_cmd(
    ctx: &Context,
    js: &async_nats::jetstream::Context,
    wait: Duration,
) -> anyhow::Result<()> {
    let name = ctx.subjects().cmd_stream();
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let Some(s) = streams::state(js, &name).await? else {
            println!("{name} does not exist: it is created");
            return Ok(());
        };
        if s.messages == 0 {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{name} still holds {} commands after {wait:?}: let storage apply them first \
             (`shelfsync stats`), then run this again",
            s.messages
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    js.delete_stream(&name).await.with_context(|| format!("cannot delete {name}"))?;
    println!(
        "{name} was empty and is created again; storage refuses its partitions until \
         `shelfsync rebase` (their sequences counted in the old stream)"
    );
    Ok(())
}
