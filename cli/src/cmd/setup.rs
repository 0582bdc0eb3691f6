//! `shelfsync setup`: create the streams or bring them to the configured
//! shape (idempotent), then show what exists. The one writer of stream
//! configuration: the services only verify it at start
//! (`shelfsync_bus::verify`), so it runs as the NATS admin user.

use anyhow::Context as _;

use super::streams;
use crate::Context;

#[derive(Debug, clap::Args)]
pub struct Args {}

pub async fn run(ctx: &Context, _args: Args) -> anyhow::Result<()> {
    let js = ctx.jetstream().await?;
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
