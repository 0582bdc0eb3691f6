//! `shelfsync wait [--timeout 60s]`: returns once storage has applied every
//! queued command and published every change — the command stream (a work
//! queue) is empty and every partition's outbox is drained. For scripts
//! that import and then read.

use std::time::Duration;

use anyhow::Context as _;

use super::streams;
use crate::{CliError, Context};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Give up (exit 4) after this long.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

pub async fn run(ctx: &Context, args: Args) -> anyhow::Result<()> {
    let js = ctx.jetstream().await?;
    let store = ctx.store().await?;
    let subjects = ctx.subjects();
    let partitions = ctx.settings.storage.partitions;
    let deadline = tokio::time::Instant::now() + args.timeout;
    loop {
        let mut stream = streams::open(&js, &subjects.cmd_stream()).await?;
        let queued = stream.info().await.context("command stream info")?.state.messages;
        let mut outbox = 0;
        if queued == 0 {
            for p in 0..partitions {
                outbox +=
                    store.outbox_len(shelfsync_bus::Partition(p)).await.context("outbox depth")?;
            }
            if outbox == 0 {
                eprintln!("settled: no command queued, every outbox empty");
                return Ok(());
            }
        }
        if tokio::time::Instant::now() > deadline {
            return Err(CliError::Timeout(format!(
                "not settled after {}: {queued} command messages queued, {outbox} outbox entries \
                 (is shelfsync-storage running?)",
                humantime::format_duration(args.timeout)
            ))
            .into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
