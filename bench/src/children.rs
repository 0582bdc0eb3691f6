//! The processes under test, each a child of the harness so that its CPU time is its own:
//! storage (the library compiled into this binary, run by `child-storage` exactly as
//! `shelfsync-storage`'s `main` runs it — or a given binary), the floor and the naive loop.
//! Killed on drop.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use shelfsync_bus::Subjects;
use shelfsync_settings::Settings;

use crate::reference::{RefKind, stats_subject};
use crate::world::{World, free_port};
use crate::{http, measure};
use shelfsync_testkit::settings_env;

pub struct ChildProc {
    child: std::process::Child,
    name: String,
    log: PathBuf,
}

impl ChildProc {
    /// Runs `program args` with `env` added, stdout and stderr to `log`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[&str],
        env: &[(String, String)],
        log: &Path,
    ) -> anyhow::Result<ChildProc> {
        let file =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("spawning {} ({})", name, program.display()))?;
        Ok(ChildProc { child, name: name.into(), log: log.to_path_buf() })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn cpu_seconds(&self) -> f64 {
        measure::cpu_seconds(self.pid()).unwrap_or(0.0)
    }

    /// An error with the log's tail if the child has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(20)..].join("\n");
            bail!("{} exited ({status}); log {}:\n{tail}", self.name, self.log.display());
        }
        Ok(())
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// This binary, to start child roles from.
pub fn this_exe() -> anyhow::Result<PathBuf> {
    std::env::current_exe().context("locating this executable")
}

/// A system a re-import is measured on.
pub struct Target {
    pub kind: TargetKind,
    pub settings: Settings,
    pub proc: std::sync::Mutex<ChildProc>,
}

pub enum TargetKind {
    Storage { http: SocketAddr },
    Reference(RefKind),
}

impl Target {
    /// Starts storage under `prefix` (Redis db 0) and waits until it serves HTTP.
    pub async fn start_storage(
        world: &World,
        prefix: &str,
        bin: Option<&Path>,
    ) -> anyhow::Result<Target> {
        let mut settings = world.settings(prefix, 0);
        let port = free_port()?;
        settings.storage.http_listen = format!("127.0.0.1:{port}");
        world.provision(&settings).await?;
        let exe = this_exe()?;
        let (program, args): (&Path, &[&str]) = match bin {
            Some(b) => (b, &[]),
            None => (&exe, &["child-storage"]),
        };
        let log = world.work.join("storage.log");
        let mut proc = ChildProc::spawn("storage", program, args, &settings_env(&settings), &log)?;
        let http: SocketAddr = ([127, 0, 0, 1], port).into();
        let started = Instant::now();
        while http::get_json(http, "/v1/stats").await.is_err() {
            proc.check_alive()?;
            if started.elapsed() > Duration::from_secs(30) {
                bail!("storage did not serve HTTP on {http} within 30 s; see {}", log.display());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Target { kind: TargetKind::Storage { http }, settings, proc: proc.into() })
    }

    /// Starts the floor or the naive loop under `prefix` (Redis db 1) and waits until it answers.
    pub async fn start_reference(
        world: &World,
        prefix: &str,
        kind: RefKind,
    ) -> anyhow::Result<Target> {
        let settings = world.settings(prefix, 1);
        world.provision(&settings).await?;
        let role = match kind {
            RefKind::Floor => "child-floor",
            RefKind::Naive => "child-naive",
        };
        let log = world.work.join(format!("{}.log", kind.name()));
        let mut proc =
            ChildProc::spawn(kind.name(), &this_exe()?, &[role], &settings_env(&settings), &log)?;
        let started = Instant::now();
        while reference_stats(world, prefix).await.is_err() {
            proc.check_alive()?;
            if started.elapsed() > Duration::from_secs(30) {
                bail!("{} did not answer within 30 s; see {}", kind.name(), log.display());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Target { kind: TargetKind::Reference(kind), settings, proc: proc.into() })
    }

    pub fn name(&self) -> &'static str {
        match self.kind {
            TargetKind::Storage { .. } => "shelfsync",
            TargetKind::Reference(k) => k.name(),
        }
    }

    pub fn prefix(&self) -> &str {
        &self.settings.nats.prefix
    }

    pub fn subjects(&self) -> Subjects {
        Subjects::new(self.prefix())
    }

    pub fn cpu_seconds(&self) -> f64 {
        self.proc.lock().map_or(0.0, |p| p.cpu_seconds())
    }

    pub fn check_alive(&self) -> anyhow::Result<()> {
        match self.proc.lock() {
            Ok(mut p) => p.check_alive(),
            Err(_) => Ok(()),
        }
    }

    /// The system's counters: storage's `/v1/stats`, or the reference loop's own.
    pub async fn stats(&self, world: &World) -> anyhow::Result<serde_json::Value> {
        match self.kind {
            TargetKind::Storage { http } => http::get_json(http, "/v1/stats").await,
            TargetKind::Reference(_) => reference_stats(world, self.prefix()).await,
        }
    }

    /// Waits until everything queued for this system is applied: the command stream is empty
    /// (storage, like the references, purges only what it applied), then, for storage, checks
    /// the outboxes too.
    pub async fn wait_settled(&self, world: &World, timeout: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        let check_every = Duration::from_secs(2);
        let mut last_check = Instant::now();
        let name = self.subjects().cmd_stream();
        let mut stream = world.js.get_stream(&name).await?;
        loop {
            if stream.info().await?.state.messages == 0 {
                break;
            }
            if last_check.elapsed() > check_every {
                self.check_alive()?;
                last_check = Instant::now();
            }
            if started.elapsed() > timeout {
                bail!("{} still holds messages after {timeout:?}", name);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if matches!(self.kind, TargetKind::Storage { .. }) {
            let store = shelfsync_storage::client::Store::connect(&self.settings.redis).await?;
            for p in 0..self.settings.storage.partitions {
                let deadline = Instant::now() + Duration::from_secs(30);
                while store.outbox_len(shelfsync_bus::Partition(p)).await? > 0 {
                    if Instant::now() > deadline {
                        bail!("the outbox of partition {p} did not drain");
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        Ok(())
    }
}

/// The counters a reference loop answers on `<prefix>.bench.stats`.
async fn reference_stats(world: &World, prefix: &str) -> anyhow::Result<serde_json::Value> {
    let subject = stats_subject(prefix);
    let reply = tokio::time::timeout(
        Duration::from_secs(5),
        world.client.request(subject, bytes::Bytes::new()),
    )
    .await
    .context("stats request timed out")??;
    Ok(serde_json::from_slice(&reply.payload)?)
}
