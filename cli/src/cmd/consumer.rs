//! `shelfsync consumer add|remove|list`: a consumer team's least-privilege
//! NATS user, and what the team deploys with (crate::team has the design).
//!
//! `add` writes the user into the teams region of nats.conf (compose) and of
//! the NATS Helm values (Kubernetes), with a bcrypt hash of a fresh
//! password, and writes `compose/teams/<team>/` and `k8s/teams/<team>/`
//! below `--out`, the password only in their `nats.env`. NATS picks the
//! user up on a config reload, without a restart. Offline: it reads and
//! writes files, and needs no server.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use rand::Rng as _;

use crate::team::{self, Team, manifests};
use crate::{CliError, Context};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    action: Action,
}

#[derive(Debug, clap::Subcommand)]
enum Action {
    /// Create a team's NATS user (its consumers only), its Secret, the
    /// NetworkPolicies its pods need and a StatefulSet skeleton.
    Add(AddArgs),
    /// Remove a team's NATS user and its generated folders.
    Remove(RemoveArgs),
    /// The teams nats.conf holds.
    List(ListArgs),
}

/// Where the NATS configuration lives.
#[derive(Debug, clap::Args)]
struct ConfigFiles {
    /// The compose NATS config, edited in place (its teams region).
    #[arg(long, default_value = "compose/nats/nats.conf")]
    nats_conf: PathBuf,
    /// The NATS Helm chart's values, edited in place (its teams region).
    #[arg(long, default_value = "k8s/nats/values.yaml")]
    helm_values: PathBuf,
}

#[derive(Debug, clap::Args)]
struct AddArgs {
    /// The team: 2–24 lower-case letters and digits. Its consumers are
    /// named `<team>` (shared) and `<team>-<n>` (one per replica).
    name: String,
    /// How many replicas may each hold a consumer of their own
    /// (`<team>-0` … `<team>-<replicas-1>`).
    #[arg(long, default_value_t = 4)]
    replicas: u32,
    /// Also allow publishing commands (`<prefix>.cmd.*`: PATCHes and CAS
    /// PATCHes, as the validator sends; never sweeps).
    #[arg(long)]
    may_publish_commands: bool,
    /// The Kubernetes namespace of shelfsync (and of the team's pods).
    #[arg(long, default_value = "shelfsync")]
    namespace: String,
    /// Replace a team that exists: a new password (in nats.env; the other
    /// files, once written, are the team's and are kept).
    #[arg(long)]
    force: bool,
    /// Where compose/teams/<team>/ and k8s/teams/<team>/ are written.
    #[arg(long, default_value = ".")]
    out: PathBuf,
    #[command(flatten)]
    files: ConfigFiles,
}

#[derive(Debug, clap::Args)]
struct RemoveArgs {
    /// The team to remove.
    name: String,
    /// Where compose/teams/<team>/ and k8s/teams/<team>/ were written.
    #[arg(long, default_value = ".")]
    out: PathBuf,
    #[command(flatten)]
    files: ConfigFiles,
}

#[derive(Debug, clap::Args)]
struct ListArgs {
    /// JSON lines instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    files: ConfigFiles,
}

pub fn run(ctx: &Context, args: Args) -> anyhow::Result<()> {
    match args.action {
        Action::Add(a) => add(ctx, a),
        Action::Remove(a) => remove(a),
        Action::List(a) => list(a),
    }
}

/// How to make NATS read its config again, printed after a change.
const RELOAD: &str = "\
NATS picks the change up on a config reload (no restart, connections stay):
  compose:    docker compose -f compose/compose.yaml kill -s HUP nats
  Kubernetes: helm upgrade nats nats/nats ... -f k8s/nats/values.yaml (the chart's reloader
              signals nats-server; docs/DEPLOY.md, \"Consumer teams\")";

fn add(ctx: &Context, args: AddArgs) -> anyhow::Result<()> {
    let team = Team::new(&args.name, args.replicas, args.may_publish_commands)
        .map_err(CliError::BadInput)?;
    let (conf, values) = (read(&args.files.nats_conf)?, read(&args.files.helm_values)?);
    let exists = team::list(&conf).map_err(|e| bad_file(&args.files.nats_conf, e))?;
    if !args.force && exists.iter().any(|t| t.name == team.name) {
        return Err(CliError::BadInput(format!(
            "team {} exists; --force replaces it (and its password)",
            team.name
        ))
        .into());
    }
    let password = password();
    let hash = bcrypt::hash(&password, 11).context("cannot hash the password")?;
    let subjects = ctx.subjects();
    let conf = team::insert(&conf, &team.name, |i| team.nats_conf_entry(&subjects, &hash, i))
        .map_err(|e| bad_file(&args.files.nats_conf, e))?;
    let values = team::insert(&values, &team.name, |i| team.helm_values_entry(&subjects, &hash, i))
        .map_err(|e| bad_file(&args.files.helm_values, e))?;
    write_in_place(&args.files.nats_conf, &conf)?;
    write_in_place(&args.files.helm_values, &values)?;
    // The manifests are the team's to edit: an existing one is kept (a
    // second `add --force` only rotates the password in nats.env).
    let (mut written, mut kept) = (Vec::new(), Vec::new());
    for file in manifests::files(&team, &password, &args.namespace) {
        let path = args.out.join(&file.path);
        if !file.secret && path.exists() {
            kept.push(path);
            continue;
        }
        write_new(&path, &file.text, file.secret)?;
        written.push(path);
    }
    println!(
        "team {}: NATS user {} in {} and {}",
        team.name,
        team.name,
        args.files.nats_conf.display(),
        args.files.helm_values.display()
    );
    println!("  consumers: {}", team.consumer_names().join(", "));
    println!("  inbox prefix: {}", team.inbox_prefix());
    println!(
        "  commands: {}",
        if team.may_publish_commands { "may publish" } else { "may not publish" }
    );
    for path in &written {
        println!("  wrote {}", path.display());
    }
    for path in &kept {
        println!("  kept {} (it exists)", path.display());
    }
    println!("{RELOAD}");
    Ok(())
}

fn remove(args: RemoveArgs) -> anyhow::Result<()> {
    let mut found = false;
    for path in [&args.files.nats_conf, &args.files.helm_values] {
        let text = read(path)?;
        if let Some(without) = team::remove(&text, &args.name).map_err(|e| bad_file(path, e))? {
            write_in_place(path, &without)?;
            println!("removed team {} from {}", args.name, path.display());
            found = true;
        }
    }
    for dir in ["compose/teams", "k8s/teams"] {
        let dir = args.out.join(dir).join(&args.name);
        if dir.is_dir() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
            println!("removed {}", dir.display());
            found = true;
        }
    }
    if !found {
        return Err(CliError::NotFound(format!("team {}", args.name)).into());
    }
    println!("Its consumers stay on the stream until deleted (or their inactive threshold).");
    println!("{RELOAD}");
    Ok(())
}

fn list(args: ListArgs) -> anyhow::Result<()> {
    let conf = read(&args.files.nats_conf)?;
    let teams = team::list(&conf).map_err(|e| bad_file(&args.files.nats_conf, e))?;
    let values = read(&args.files.helm_values)?;
    let in_values = team::list(&values).map_err(|e| bad_file(&args.files.helm_values, e))?;
    if teams != in_values {
        eprintln!(
            "warning: {} and {} hold different teams",
            args.files.nats_conf.display(),
            args.files.helm_values.display()
        );
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        for t in &teams {
            writeln!(out, "{}", serde_json::to_string(t)?)?;
        }
        return Ok(());
    }
    writeln!(out, "{:<24} {:>8}  commands", "team", "replicas")?;
    for t in &teams {
        let commands = if t.may_publish_commands { "yes" } else { "no" };
        writeln!(out, "{:<24} {:>8}  {commands}", t.name, t.replicas)?;
    }
    Ok(())
}

/// 32 letters and digits, starting with a letter (nats-server reads an
/// environment value that starts with a digit as a number).
fn password() -> String {
    let mut rng = rand::rng();
    let first = rng.random_range(b'a'..=b'z') as char;
    let rest: String =
        (&mut rng).sample_iter(rand::distr::Alphanumeric).take(31).map(char::from).collect();
    format!("{first}{rest}")
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path)
        .with_context(|| CliError::BadInput(format!("cannot read {}", path.display())))
}

fn bad_file(path: &Path, e: String) -> CliError {
    CliError::BadInput(format!("{}: {e}", path.display()))
}

/// Rewrites `path` keeping its inode: compose mounts nats.conf as a single
/// file, and a bind mount keeps showing the old file after a rename.
fn write_in_place(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn write_new(path: &Path, text: &str, secret: bool) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let mut file = options.open(path).with_context(|| format!("writing {}", path.display()))?;
    file.write_all(text.as_bytes()).with_context(|| format!("writing {}", path.display()))
}
