//! What runs beside a test: services in this process (one [`spawn`] for
//! every `App`, storage included), the real binaries as child processes,
//! and signals to a process by its id.

use std::process::{Child, Command as Process, Stdio};
use std::time::Duration;

use anyhow::Context;
use shelfsync_service::Service;
use shelfsync_settings::Settings;
use tokio::sync::oneshot;

use crate::{SETTLE, settings_env};
use shelfsync_testkit::stdout_of_success;

/// A service `App` running in a task of this test until stopped.
/// Dropping it without [`Running::stop`] starts the same graceful stop,
/// without waiting for it.
pub struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

/// Runs `app` (built by the test: its addresses and handles taken first)
/// until [`Running::stop`].
pub fn spawn(app: impl Service) -> Running {
    spawn_with(|shutdown| app.run_until(shutdown))
}

/// As [`spawn`], for a service whose run takes its shutdown future by hand.
pub fn spawn_with<F>(run: impl FnOnce(Shutdown) -> F) -> Running
where
    F: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let (tx, rx) = oneshot::channel::<()>();
    let shutdown: Shutdown = Box::pin(async move {
        let _ = rx.await;
    });
    Running { stop: Some(tx), task: Some(tokio::spawn(run(shutdown))) }
}

/// What [`spawn_with`] hands the run: resolves when the test stops it.
pub type Shutdown = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

impl Running {
    /// Graceful stop, as on SIGTERM: returns what the service's run did.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match self.task.take() {
            Some(task) => task.await.context("the service task")?,
            None => Ok(()),
        }
    }

    /// True once the service's run has returned (on its own, or stopped).
    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Ends the task at once, as a crash would (nothing drained).
    pub fn abort(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A storage process running in this test process; dropped, it is
/// aborted (as a crash would end it).
pub struct InProcessStorage {
    running: Option<Running>,
    pub stats: std::sync::Arc<shelfsync_storage::Stats>,
    /// What its `/readyz` answers from (refused, held back, draining).
    pub ready: std::sync::Arc<shelfsync_storage::PartitionHealth>,
}

impl InProcessStorage {
    pub async fn start(settings: Settings) -> anyhow::Result<Self> {
        let app = shelfsync_storage::App::build(settings).await?;
        let (stats, ready) = (app.stats(), app.readiness());
        let running = spawn_with(|shutdown| app.run_until(shutdown));
        Ok(Self { running: Some(running), stats, ready })
    }

    /// Graceful stop, as on SIGTERM.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        match self.running.take() {
            Some(running) => running.stop().await,
            None => Ok(()),
        }
    }
}

impl Drop for InProcessStorage {
    fn drop(&mut self) {
        if let Some(running) = self.running.take() {
            running.abort();
        }
    }
}

/// The real `shelfsync-storage` binary, killed on drop.
pub struct StorageProcess {
    pub child: Child,
}

impl StorageProcess {
    /// Starts the binary with the test's settings in the environment, plus
    /// `extra` variables (e.g. `SHELFSYNC_FAILPOINT`).
    pub fn start(settings: &Settings, extra: &[(&str, &str)]) -> anyhow::Result<Self> {
        let bin = shelfsync_testkit::workspace_bin("shelfsync-storage")?;
        let mut cmd = Process::new(bin);
        cmd.envs(settings_env(settings))
            .envs(extra.iter().copied())
            // SHELFSYNC_TEST_STORAGE_LOG: more of the child's log (e.g. `info`).
            .env("RUST_LOG", std::env::var("SHELFSYNC_TEST_STORAGE_LOG").unwrap_or("warn".into()))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        let child = cmd.spawn().context("spawning shelfsync-storage")?;
        Ok(Self { child })
    }

    /// Waits for the process to exit on its own (e.g. at a failpoint).
    pub async fn wait_exit(
        &mut self,
        timeout: Duration,
    ) -> anyhow::Result<std::process::ExitStatus> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if tokio::time::Instant::now() > deadline {
                anyhow::bail!("storage did not exit within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for StorageProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs the `shelfsync` CLI binary with the test's settings in its
/// environment (nothing inherited) and returns what it printed.
pub async fn cli(settings: &Settings, args: &[&str]) -> anyhow::Result<std::process::Output> {
    let bin = shelfsync_testkit::workspace_bin("shelfsync")?;
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(args)
        .env_clear()
        .envs(settings_env(settings))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let out = tokio::time::timeout(SETTLE, cmd.output())
        .await
        .with_context(|| format!("shelfsync {args:?} did not finish"))??;
    Ok(out)
}

/// [`cli`], requiring success; returns stdout.
pub async fn cli_ok(settings: &Settings, args: &[&str]) -> anyhow::Result<String> {
    stdout_of_success(args, cli(settings, args).await?)
}

/// The pid of the running process whose command line contains `needle`
/// (e.g. a server's config path, unique to the test) — to signal exactly
/// that process.
pub fn pid_with_arg(needle: &str) -> Option<u32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        if String::from_utf8_lossy(&cmdline).contains(needle) {
            return Some(pid);
        }
    }
    None
}

/// Sends `signal` (e.g. `STOP`, `CONT`, `KILL`) to one process by its id.
pub fn signal(pid: u32, signal: &str) {
    shelfsync_testkit::signal(pid, signal).expect("kill");
}
