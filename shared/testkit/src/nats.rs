//! A `nats-server` child with JetStream on loopback, its config, store and log in a temp dir.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::bins::nats_server_bin;
use crate::process::{self, Proc, Server};

/// A nats-server child process with JetStream on `127.0.0.1:<free port>`, killed on drop.
pub struct NatsServer {
    // Declared before `dir` so the process dies before its store is deleted.
    proc: Proc,
    port: u16,
    monitor_port: u16,
    /// Unique per server: the readiness probe checks it in INFO, so a foreign server that won
    /// a port race is never mistaken for ours.
    name: String,
    store_dir: PathBuf,
    dir: TempDir,
}

impl NatsServer {
    /// Starts a server with the default config and waits until JetStream is ready.
    pub async fn start() -> anyhow::Result<NatsServer> {
        Self::start_with_config("").await
    }

    /// Like [`NatsServer::start`], with `extra_conf` appended to the generated config (auth,
    /// limits, ...). It must not override `listen`, `http` or `server_name`.
    pub async fn start_with_config(extra_conf: &str) -> anyhow::Result<NatsServer> {
        let dir = tempfile::Builder::new().prefix("shelfsync-nats-").tempdir()?;
        let proc = Proc::new(nats_server_bin()?, dir.path().join("nats-server.log"));
        let name = format!("testkit_{:016x}", process::random_u64());
        let store_dir = dir.path().join("js");
        let server = NatsServer { proc, port: 0, monitor_port: 0, name, store_dir, dir };
        process::start_on_free_ports(server, |server| {
            [server.port, server.monitor_port] = process::free_ports()?;
            let conf_path = server.write_config(extra_conf)?;
            server.proc.set_args(vec!["-c".into(), conf_path.into()]);
            Ok(())
        })
        .await
    }

    /// `nats://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The unique `server_name` (how a JetStream cluster names its peers and leaders).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The process id while it runs (e.g. to read its CPU time in a bench).
    pub fn pid(&self) -> Option<u32> {
        self.proc.pid()
    }

    /// Whether the process is running (not killed, not exited).
    pub fn is_running(&mut self) -> bool {
        self.proc.is_running()
    }

    /// The HTTP monitoring endpoint (`/varz`, `/jsz`, `/healthz`, ...).
    pub fn monitor_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.monitor_port)
    }

    /// Rewrites the config with `extra_conf` (as [`NatsServer::start_with_config`]) and makes
    /// the running server reload it (SIGHUP): no restart, its connections stay.
    pub fn reload_with_config(&self, extra_conf: &str) -> anyhow::Result<()> {
        self.write_config(extra_conf)?;
        let pid = self.pid().context("nats-server is not running")?;
        process::signal(pid, "HUP")
    }

    /// JetStream's store dir; it survives [`NatsServer::kill`] and is reused by `restart`.
    pub fn store_dir(&self) -> &Path {
        &self.store_dir
    }

    /// The server's stdout/stderr, kept across restarts; print it when a test fails.
    pub fn log_path(&self) -> &Path {
        self.proc.log_path()
    }

    /// SIGKILL and wait: a crash, not a graceful shutdown, so fault tests see unflushed state.
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// Starts again on the same port with the same store, and waits until JetStream is ready.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.boot(false).await
    }

    fn write_config(&self, extra_conf: &str) -> anyhow::Result<PathBuf> {
        // max_payload stays at the server default (1MB) so batching code meets the real limit.
        let conf = format!(
            "server_name: \"{name}\"\nlisten: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor}\n\
             jetstream {{\n  store_dir: \"{store}\"\n  max_memory_store: 256MB\n  max_file_store: 4GB\n}}\n{extra_conf}\n",
            name = self.name,
            port = self.port,
            monitor = self.monitor_port,
            store = self.store_dir.display(),
        );
        let path = self.dir.path().join("nats-server.conf");
        std::fs::write(&path, conf).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }
}

impl Server for NatsServer {
    fn proc(&self) -> &Proc {
        &self.proc
    }

    async fn boot(&mut self, fresh_log: bool) -> anyhow::Result<()> {
        self.proc.spawn(fresh_log)?;
        let (port, monitor_port, name) = (self.port, self.monitor_port, self.name.clone());
        let what = format!("nats-server on port {port}");
        self.proc.wait_ready(&what, || probe(port, monitor_port, name.clone())).await
    }
}

/// Ready means: our server (by name) sends INFO advertising JetStream, and `/healthz` says ok,
/// which also covers JetStream having recovered its streams after a restart.
async fn probe(port: u16, monitor_port: u16, name: String) -> anyhow::Result<()> {
    let mut info = String::new();
    BufReader::new(TcpStream::connect(("127.0.0.1", port)).await?).read_line(&mut info).await?;
    if !info.starts_with("INFO ") || !info.contains(&format!("\"server_name\":\"{name}\"")) {
        bail!("unexpected greeting: {info:?}");
    }
    if !info.contains("\"jetstream\":true") {
        bail!("JetStream not enabled yet");
    }
    let mut http = TcpStream::connect(("127.0.0.1", monitor_port)).await?;
    http.write_all(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").await?;
    let mut response = String::new();
    http.read_to_string(&mut response).await?;
    if !response.lines().next().is_some_and(|status| status.contains(" 200 ")) {
        bail!("healthz not ok: {response:?}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn greeting(port: u16) -> anyhow::Result<String> {
        let mut info = String::new();
        BufReader::new(TcpStream::connect(("127.0.0.1", port)).await?).read_line(&mut info).await?;
        Ok(info)
    }

    #[tokio::test]
    async fn starts_with_jetstream_on_a_fresh_port() -> anyhow::Result<()> {
        let server = NatsServer::start().await?;
        assert_ne!(server.port(), 4222);
        assert_eq!(server.url(), format!("nats://127.0.0.1:{}", server.port()));
        assert!(greeting(server.port()).await?.contains("\"jetstream\":true"));
        assert!(server.log_path().is_file());
        Ok(())
    }

    #[tokio::test]
    async fn restarts_on_the_same_port_and_store() -> anyhow::Result<()> {
        let mut server = NatsServer::start().await?;
        let port = server.port();
        server.kill();
        assert!(greeting(port).await.is_err(), "killed server still accepts connections");
        server.restart().await?;
        assert_eq!(server.port(), port);
        assert!(greeting(port).await?.contains("\"jetstream\":true"));
        assert!(server.store_dir().join("jetstream").is_dir());
        Ok(())
    }

    #[tokio::test]
    async fn extra_config_is_applied() -> anyhow::Result<()> {
        let server = NatsServer::start_with_config("authorization { token: \"s3cret\" }").await?;
        assert!(greeting(server.port()).await?.contains("\"auth_required\":true"));
        Ok(())
    }

    #[tokio::test]
    async fn bad_config_fails_fast_with_the_log() {
        let err = NatsServer::start_with_config("this is { not valid").await.err();
        let msg = err.map(|e| format!("{e:#}")).unwrap_or_default();
        assert!(msg.contains("exited"), "{msg}");
    }
}
