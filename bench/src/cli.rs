//! The command line: one documented command, a `--quick` profile for CI, and hidden child roles.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

/// Measure shelfsync against its same-run floor and the naive way: re-imports, freshness,
/// keyframes, ingest memory, recommender latency, Redis memory per record.
#[derive(Debug, Parser)]
#[command(name = "shelfsync-bench", version)]
pub struct Cli {
    /// Small sizes (20k records, a 10 MB dump, short live runs) that finish in about a minute:
    /// what CI runs so that the harness cannot rot. Its numbers are not the targets' numbers.
    #[arg(long)]
    pub quick: bool,

    /// Where `bench.json` and `bench.md` are written.
    #[arg(long, default_value = "target/bench", value_name = "DIR")]
    pub out: PathBuf,

    /// Run only these scenarios (comma-separated). Scenarios that need loaded data load it.
    #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
    pub only: Vec<Scenario>,

    /// Records of the data set (100 places); default 1M, 20k with --quick.
    #[arg(long, value_name = "N")]
    pub records: Option<u64>,

    /// Measure this `shelfsync-storage` binary instead of the storage library compiled into
    /// this one (run as a child process either way).
    #[arg(long, value_name = "PATH")]
    pub storage_bin: Option<PathBuf>,

    /// Dumps and logs of the children (default: `<target dir>/bench-work/run-<pid>`, deleted at
    /// the end unless --keep-work).
    #[arg(long, value_name = "DIR")]
    pub work_dir: Option<PathBuf>,

    /// Keep the work dir (logs of the children) after the run.
    #[arg(long)]
    pub keep_work: bool,

    /// Servers that do not fsync what they acknowledge, as runs before durability were taken:
    /// Redis without AOF, JetStream's default sync, PostgreSQL with `synchronous_commit = off`.
    /// By default every server is durable.
    #[arg(long)]
    pub volatile: bool,

    /// NATS as the prod overlay runs it: a 3-node cluster (all on this machine), every stream
    /// with 3 replicas, JetStream's default sync (an ack means 2 of 3 nodes have the message).
    /// Redis stays durable unless --volatile. Meant for `--only live`.
    #[arg(long)]
    pub nats_cluster: bool,

    /// Skip the PostgreSQL peer of the re-import scenario (by default it runs with it, on a
    /// private cluster; Debian's `postgresql` is installed with apt-get when missing).
    #[arg(long)]
    pub no_postgres: bool,

    /// Connection counts the PostgreSQL peer tries on its first import; the fastest is kept
    /// for the rest. One count skips the trial.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "N,...",
        default_value = "1,2,4,8",
        value_parser = clap::value_parser!(u16).range(1..=64)
    )]
    pub postgres_connections: Vec<u16>,

    #[command(subcommand)]
    pub child: Option<ChildRole>,
}

/// The scenarios of the issue, by the names `--only` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    /// 1–3: initial import, identical re-import, 1% churn, price-only feed; floor, naive, the
    /// parse floor and the PostgreSQL peer.
    Reimport,
    /// 4: ingest publish → ChangeFeed consumer → recommender index, at a fixed offered rate.
    Freshness,
    /// 5: a keyframe of every record, idle and under live load.
    Keyframe,
    /// 6: ingest peak RSS on a 100 MB and a 1 GB dump (10 MB with --quick).
    Rss,
    /// 7: recommender top-N latency in-process and HTTP throughput.
    Recommender,
    /// 8: Redis memory per record.
    Memory,
    /// The live path's table: rates × {the kit's publisher, one command per message}, the
    /// ceiling, and the PostgreSQL peer of the live job (unless --no-postgres).
    Live,
}

/// Processes the harness starts from its own binary; settings come from `SHELFSYNC__*`
/// variables, as for the real services.
#[derive(Debug, Subcommand)]
pub enum ChildRole {
    /// The storage service (the library `shelfsync-storage`'s main runs).
    #[command(name = "child-storage", hide = true)]
    Storage,
    /// The floor: consume, batched read, generation write; no logic.
    #[command(name = "child-floor", hide = true)]
    Floor,
    /// The naive way: rewrite and republish every record.
    #[command(name = "child-naive", hide = true)]
    Naive,
    /// One import of a file (for its peak RSS); prints a JSON line.
    #[command(name = "child-import", hide = true)]
    Import { path: PathBuf },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_commands() {
        let cli = Cli::try_parse_from(["b", "--quick", "--out", "target/bench"]).expect("parse");
        assert!(cli.quick && cli.child.is_none());
        let cli = Cli::try_parse_from(["b", "--only", "reimport,rss"]).expect("parse");
        assert_eq!(cli.only, [Scenario::Reimport, Scenario::Rss]);
        let cli = Cli::try_parse_from(["b", "child-import", "/x.json"]).expect("parse");
        assert!(matches!(cli.child, Some(ChildRole::Import { .. })));
        assert!(Cli::try_parse_from(["b", "--only", "everything"]).is_err());
    }

    #[test]
    fn postgres_peer_flags() {
        let cli = Cli::try_parse_from(["b", "--quick"]).expect("parse");
        assert!(!cli.no_postgres && !cli.volatile);
        assert_eq!(cli.postgres_connections, [1, 2, 4, 8]);
        assert!(Cli::try_parse_from(["b", "--volatile"]).expect("parse").volatile);
        let cli = Cli::try_parse_from(["b", "--no-postgres", "--postgres-connections", "4"])
            .expect("parse");
        assert!(cli.no_postgres);
        assert_eq!(cli.postgres_connections, [4]);
        assert!(Cli::try_parse_from(["b", "--postgres-connections", "0"]).is_err());
    }
}
