//! One server child process (spawn, kill-on-drop, readiness polling) and the loopback ports it
//! listens on. Server-specific knowledge (configs, probes) stays in `nats` and `redis`.

use std::collections::hash_map::RandomState;
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};

/// How long a server gets to come up; generous for loaded CI machines and JetStream recovery.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// A single probe that hangs (half-open socket) must not eat the whole deadline.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Fresh-port attempts when another process grabbed the port between our probe and the bind.
pub(crate) const START_ATTEMPTS: usize = 3;

/// A server of this kit, as [`start_on_free_ports`] drives it.
pub(crate) trait Server {
    fn proc(&self) -> &Proc;

    /// Spawns the child (with a new log, or after the old one) and waits until it is ready.
    async fn boot(&mut self, fresh_log: bool) -> anyhow::Result<()>;
}

/// Boots `server` once `take_ports` gave it free ports and the command line for them; again
/// with fresh ones when another process took a port between the probe and the bind, up to
/// [`START_ATTEMPTS`] times. Any other failure is returned at once.
pub(crate) async fn start_on_free_ports<S: Server>(
    mut server: S,
    mut take_ports: impl FnMut(&mut S) -> anyhow::Result<()>,
) -> anyhow::Result<S> {
    for attempt in 1..=START_ATTEMPTS {
        take_ports(&mut server)?;
        match server.boot(true).await {
            Ok(()) => return Ok(server),
            Err(_) if attempt < START_ATTEMPTS && server.proc().port_was_taken() => {}
            Err(e) => return Err(e),
        }
    }
    unreachable!("the last attempt returns")
}

/// A server command line plus its running child, if any. Dropping it kills the child, so a
/// panicking test never leaks servers.
pub(crate) struct Proc {
    program: PathBuf,
    args: Vec<OsString>,
    log_path: PathBuf,
    child: Option<Child>,
}

impl Proc {
    pub(crate) fn new(program: PathBuf, log_path: PathBuf) -> Proc {
        Proc { program, args: Vec::new(), log_path, child: None }
    }

    pub(crate) fn set_args(&mut self, args: Vec<OsString>) {
        self.args = args;
    }

    pub(crate) fn log_path(&self) -> &Path {
        &self.log_path
    }

    pub(crate) fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Spawns the child with stdout/stderr appended to the log. A fresh start truncates the log
    /// so a failed attempt is diagnosed from its own output; a restart keeps the history.
    pub(crate) fn spawn(&mut self, fresh_log: bool) -> anyhow::Result<()> {
        self.kill();
        if fresh_log {
            File::create(&self.log_path)
                .with_context(|| format!("creating {}", self.log_path.display()))?;
        }
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .with_context(|| format!("opening {}", self.log_path.display()))?;
        let child = Command::new(&self.program)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawning {}", self.program.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL, then reap so the port and files are released before we return.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Errors mean it already exited; reaping below is all that is left to do.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Polls `probe` until it succeeds, the child exits, or the deadline passes. On failure the
    /// child is killed and the error carries the probe's last complaint and the log tail.
    pub(crate) async fn wait_ready<F, Fut>(
        &mut self,
        what: &str,
        mut probe: F,
    ) -> anyhow::Result<()>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = anyhow::Result<()>>,
    {
        let start = Instant::now();
        let mut last_err = None;
        while start.elapsed() < READY_TIMEOUT {
            let exited = match self.child.as_mut() {
                Some(child) => child.try_wait()?,
                None => bail!("{what} is not running"),
            };
            if let Some(status) = exited {
                self.child = None;
                bail!("{what} exited with {status} while starting; log:\n{}", self.log_tail());
            }
            match tokio::time::timeout(PROBE_TIMEOUT, probe()).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => last_err = Some(e),
                Err(_) => last_err = Some(anyhow::anyhow!("probe timed out")),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.kill();
        let last = last_err.map(|e| format!("{e:#}")).unwrap_or_default();
        bail!(
            "{what} not ready after {READY_TIMEOUT:?} (last probe: {last}); log:\n{}",
            self.log_tail()
        )
    }

    /// Whether the last attempt died because its port was taken, the one failure worth retrying.
    pub(crate) fn port_was_taken(&self) -> bool {
        std::fs::read_to_string(&self.log_path)
            .map(|log| log.to_ascii_lowercase().contains("address already in use"))
            .unwrap_or(false)
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `N` distinct free loopback ports. All listeners are held until every port is chosen, so no
/// two are the same; the race with other processes after the drop is accepted and covered by
/// [`START_ATTEMPTS`].
pub(crate) fn free_ports<const N: usize>() -> anyhow::Result<[u16; N]> {
    let list = free_port_list(N)?;
    let mut ports = [0; N];
    ports.copy_from_slice(&list);
    Ok(ports)
}

/// `n` distinct free loopback ports, as [`free_ports`] for a count known at run time.
pub(crate) fn free_port_list(n: usize) -> anyhow::Result<Vec<u16>> {
    let mut listeners = Vec::with_capacity(n);
    for _ in 0..n {
        listeners.push(bind_free()?);
    }
    listeners.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}

/// Servers' ports are chosen below the kernel's ephemeral range (`ip_local_port_range`): the
/// kernel hands out that range for port 0 and for the local end of every outgoing connection,
/// so a server killed and restarted on its own port (the fault tests) could find it taken by any
/// client's connection meanwhile (seen: `bind: address already in use` on a restart). Below it,
/// only another random pick can take it. Falls back to port 0 where the range starts too low.
fn bind_free() -> anyhow::Result<TcpListener> {
    const FLOOR: u16 = 10_000;
    let low = ephemeral_low();
    if low >= FLOOR + 1_000 {
        for _ in 0..256 {
            let port = FLOOR + (random_u64() % u64::from(low - FLOOR)) as u16;
            if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)) {
                return Ok(listener);
            }
        }
    }
    TcpListener::bind("127.0.0.1:0").context("binding a free loopback port")
}

/// The first port of the kernel's ephemeral range (Linux's default where it cannot be read).
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// Random enough for unique names: std's per-process random hash keys over pid, time and a
/// counter, which saves a dependency on `rand`.
pub(crate) fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    hasher.write_u128(nanos.as_nanos());
    hasher.finish()
}

/// Sends `signal` (`HUP`, `STOP`, `CONT`, `KILL`, ...) to the process `pid`.
pub fn signal(pid: u32, signal: &str) -> anyhow::Result<()> {
    let status = Command::new("kill").args([format!("-{signal}"), pid.to_string()]).status()?;
    anyhow::ensure!(status.success(), "kill -{signal} {pid}: {status}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_and_below_the_ephemeral_range() {
        let ports = free_port_list(20).expect("ports");
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), 20, "{ports:?}");
        if ephemeral_low() >= 11_000 {
            assert!(ports.iter().all(|&p| (10_000..ephemeral_low()).contains(&p)), "{ports:?}");
        }
    }

    #[tokio::test]
    async fn a_taken_port_fails_fast_and_is_flagged_for_retry() -> anyhow::Result<()> {
        let held = TcpListener::bind("127.0.0.1:0")?;
        let port = held.local_addr()?.port().to_string();
        let dir = tempfile::tempdir()?;
        let mut proc = Proc::new(crate::redis_server_bin()?, dir.path().join("redis.log"));
        proc.set_args(
            ["--port", &port, "--bind", "127.0.0.1", "--save", ""].map(OsString::from).into(),
        );
        proc.spawn(true)?;
        let started = Instant::now();
        let err = proc.wait_ready("redis", || async { anyhow::bail!("not ours") }).await;
        assert!(format!("{:#}", err.err().context("should fail")?).contains("exited"));
        assert!(started.elapsed() < READY_TIMEOUT, "should notice the exit, not time out");
        assert!(proc.port_was_taken());
        Ok(())
    }
}
