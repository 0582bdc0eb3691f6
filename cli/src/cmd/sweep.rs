//! `shelfsync sweep --import ID` and `shelfsync sweeps`: the sweeps storage
//! held instead of applying them (a full import whose evidence was too thin:
//! no item of a place accepted, a place missing from the dump, or more of a
//! place to mark absent than the partner's `sweep_max_fraction`).
//!
//! `sweeps` lists what is held (storage's read API, `<prefix>.read.sweeps`);
//! `sweeps show IMPORT_ID` shows what became of an import's sweeps, place
//! by place (held, applied, superseded, or not decided yet).
//! `sweep --import ID` releases the sweeps held for that import: for each, a
//! sweep with `release_held` on the place's command subject, which storage
//! applies only if it is still the one held for the place; then it waits
//! for the outcomes. It refuses when nothing of that import is held — it was
//! applied already, or a newer import of the partner superseded it (exit
//! 3), and exits 4 when storage did not decide them all in time.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use prost::Message;
use serde_json::json;
use shelfsync_bus::{Publisher, partition_of};
use shelfsync_proto::{CommandBatch, Sweep, SweepOutcome, SweepsReply, SweepsRequest, msg_type};

use super::rpc;
use crate::{CliError, Context};

/// `sweeps` alone lists what is held; `sweeps show` one import's outcomes.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct SweepsArgs {
    #[command(subcommand)]
    action: Option<SweepsAction>,
    #[command(flatten)]
    list: ListArgs,
}

#[derive(Debug, clap::Subcommand)]
enum SweepsAction {
    /// What became of an import's sweeps, place by place (held, applied,
    /// superseded, or not decided yet).
    Show(ShowArgs),
}

#[derive(Debug, clap::Args)]
struct ShowArgs {
    /// The import (its report names it).
    #[arg(value_name = "IMPORT_ID")]
    import_id: String,
    /// The import's brand (default: taken from the sweeps held for it).
    #[arg(long, value_name = "B")]
    brand: Option<i64>,
    /// The places to look at (default: those held for the import); needed
    /// for an import none of whose sweeps is held any more.
    #[arg(long = "place", value_name = "P")]
    places: Vec<i64>,
    /// Print JSON lines.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// Only the sweeps of this brand.
    #[arg(long, value_name = "B")]
    brand: Option<i64>,
    /// Print JSON lines.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
pub struct ReleaseArgs {
    /// The import whose held sweeps to apply (its report names it).
    #[arg(long = "import", value_name = "ID")]
    import_id: String,
    /// Only these places (default: every place held for the import).
    #[arg(long = "place", value_name = "P")]
    places: Vec<i64>,
    /// Show what would be applied, change nothing.
    #[arg(long)]
    dry_run: bool,
    /// How long to wait for storage to apply them.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Print JSON lines.
    #[arg(long)]
    json: bool,
}

async fn ask(
    client: &async_nats::Client,
    subject: String,
    req: &SweepsRequest,
) -> anyhow::Result<SweepsReply> {
    let msg = rpc::ask(client, subject, req.encode_to_vec()).await?;
    let reply = SweepsReply::decode(msg.payload.as_ref()).context("an undecodable SweepsReply")?;
    if !reply.error.is_empty() {
        return Err(rpc::refused(&reply.error));
    }
    Ok(reply)
}

/// Every sweep held now (of `brand` if not 0).
async fn held(
    ctx: &Context,
    client: &async_nats::Client,
    brand: i64,
) -> anyhow::Result<Vec<SweepOutcome>> {
    let req = SweepsRequest { brand_id: brand, ..Default::default() };
    Ok(ask(client, ctx.subjects().read("sweeps"), &req).await?.outcomes)
}

fn line(o: &SweepOutcome, json: bool) -> String {
    let s = o.sweep.clone().unwrap_or_default();
    if json {
        return json!({
            "import_id": s.import_id,
            "partner": s.source,
            "brand_id": s.brand_id,
            "place_id": s.place_id,
            "generation": s.generation,
            "status": o.status,
            "reason": o.reason,
            "accepted": s.guard.as_ref().map(|g| g.accepted),
            "live": o.live,
            "would_mark_absent": o.candidates,
            "marked_absent": o.marked_absent,
        })
        .to_string();
    }
    match o.status.as_str() {
        "held" => format!(
            "{} place {}/{}: held ({}), would mark {} of {} live records absent (partner {}, {} items accepted)",
            s.import_id,
            s.brand_id,
            s.place_id,
            o.reason,
            o.candidates,
            o.live,
            s.source,
            s.guard.as_ref().map_or(0, |g| g.accepted)
        ),
        "applied" => format!(
            "{} place {}/{}: applied, {} records marked absent",
            s.import_id, s.brand_id, s.place_id, o.marked_absent
        ),
        other => {
            format!("{} place {}/{}: {other} ({})", s.import_id, s.brand_id, s.place_id, o.reason)
        }
    }
}

pub async fn run(ctx: &Context, args: SweepsArgs) -> anyhow::Result<()> {
    match args.action {
        None => list(ctx, args.list).await,
        Some(SweepsAction::Show(show_args)) => show(ctx, show_args).await,
    }
}

async fn list(ctx: &Context, args: ListArgs) -> anyhow::Result<()> {
    let client = ctx.nats().await?;
    let held = held(ctx, &client, args.brand.unwrap_or(0)).await?;
    let mut out = std::io::stdout();
    if held.is_empty() && !args.json {
        writeln!(out, "no sweep is held")?;
    }
    for o in &held {
        writeln!(out, "{}", line(o, args.json))?;
    }
    Ok(())
}

pub async fn release(ctx: &Context, args: ReleaseArgs) -> anyhow::Result<()> {
    let client = ctx.nats().await?;
    let all = held(ctx, &client, 0).await?;
    let mine: Vec<SweepOutcome> = all
        .iter()
        .filter(|o| o.sweep.as_ref().is_some_and(|s| s.import_id == args.import_id))
        .filter(|o| {
            args.places.is_empty()
                || o.sweep.as_ref().is_some_and(|s| args.places.contains(&s.place_id))
        })
        .cloned()
        .collect();
    if mine.is_empty() {
        let others: Vec<String> = all
            .iter()
            .filter_map(|o| {
                o.sweep.as_ref().map(|s| format!("{} (place {})", s.import_id, s.place_id))
            })
            .collect();
        return Err(CliError::NotFound(format!(
            "no sweep of import {} is held: it was applied already, or a newer import of the \
             partner superseded it, or the id is wrong; held now: {}",
            args.import_id,
            if others.is_empty() { "none".to_string() } else { others.join(", ") }
        ))
        .into());
    }
    let mut out = std::io::stdout();
    if args.dry_run {
        for o in &mine {
            writeln!(out, "{}", line(o, args.json))?;
        }
        return Ok(());
    }
    let partitions = ctx.settings.storage.partitions;
    let subjects = ctx.subjects();
    let mut publisher = Publisher::new(ctx.jetstream().await?, 64);
    let mut brand = 0;
    let mut places = Vec::new();
    for o in &mine {
        let Some(held) = &o.sweep else { continue };
        brand = held.brand_id;
        places.push(held.place_id);
        let partition = partition_of(held.brand_id, held.place_id, partitions);
        let sweep = Sweep { guard: None, release_held: true, ..held.clone() };
        let batch =
            CommandBatch { partition: partition.0, sweeps: vec![sweep], ..Default::default() };
        let msg_id = format!("{}:release:{}:{}", held.import_id, held.brand_id, held.place_id);
        publisher
            .publish(
                subjects.cmd_sweep(partition),
                msg_id,
                msg_type::COMMAND_BATCH,
                None,
                batch.encode_to_vec().into(),
            )
            .await?;
    }
    publisher.flush().await.context("cannot publish the sweeps")?;
    // Wait until storage decided each again (applied, or refused if a newer
    // sweep got there first).
    let req =
        SweepsRequest { import_id: args.import_id.clone(), brand_id: brand, place_ids: places };
    let deadline = Instant::now() + args.timeout;
    loop {
        let reply = ask(&client, subjects.read("sweeps"), &req).await?;
        let waiting =
            reply.outcomes.iter().any(|o| o.status == "held") || !reply.pending.is_empty();
        if !waiting {
            for o in &reply.outcomes {
                writeln!(out, "{}", line(o, args.json))?;
            }
            let refused = reply.outcomes.iter().filter(|o| o.status != "applied").count();
            anyhow::ensure!(refused == 0, "{refused} sweeps were not applied (see above)");
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(CliError::Timeout(format!(
                "storage did not apply the sweeps within {} (they are queued; see `shelfsync \
                 sweeps show {}`)",
                humantime::format_duration(args.timeout),
                args.import_id
            ))
            .into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn show(ctx: &Context, args: ShowArgs) -> anyhow::Result<()> {
    let client = ctx.nats().await?;
    let (mut brand, mut places) = (args.brand, args.places.clone());
    if brand.is_none() || places.is_empty() {
        // What is held for the import tells its brand and places.
        let held = held(ctx, &client, brand.unwrap_or(0)).await?;
        let mine: Vec<&Sweep> = held
            .iter()
            .filter_map(|o| o.sweep.as_ref())
            .filter(|s| s.import_id == args.import_id)
            .collect();
        if mine.is_empty() {
            return Err(CliError::NotFound(format!(
                "no sweep of import {} is held now; to see what became of its sweeps, give \
                 --brand B and --place P (the places in its report)",
                args.import_id
            ))
            .into());
        }
        brand = brand.or(Some(mine[0].brand_id));
        if places.is_empty() {
            places = mine.iter().map(|s| s.place_id).collect();
        }
    }
    let brand = brand.unwrap_or_default();
    let req =
        SweepsRequest { import_id: args.import_id.clone(), brand_id: brand, place_ids: places };
    let reply = ask(&client, ctx.subjects().read("sweeps"), &req).await?;
    let mut out = std::io::stdout();
    for o in &reply.outcomes {
        writeln!(out, "{}", line(o, args.json))?;
    }
    for place in &reply.pending {
        let text = if args.json {
            json!({
                "import_id": args.import_id,
                "brand_id": brand,
                "place_id": place,
                "status": "pending",
            })
            .to_string()
        } else {
            format!(
                "{} place {brand}/{place}: not decided (queued, or this import swept no such place)",
                args.import_id
            )
        };
        writeln!(out, "{text}")?;
    }
    if reply.outcomes.is_empty() {
        return Err(CliError::NotFound(format!(
            "storage knows no sweep of import {} in these places of brand {brand}",
            args.import_id
        ))
        .into());
    }
    Ok(())
}
