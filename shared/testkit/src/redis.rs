//! A `redis-server` child on loopback, its dir and log in a temp dir. Speaks just enough raw
//! RESP to tell when the server is ready, so this crate needs no Redis client.

use std::ffi::OsString;
use std::path::Path;

use anyhow::bail;
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::bins::redis_server_bin;
use crate::process::{self, Proc, Server};

/// A redis-server child on `127.0.0.1:<free port>`, no persistence by default, killed on drop.
pub struct RedisServer {
    // Declared before `dir` so the process dies before its dir is deleted.
    proc: Proc,
    port: u16,
    dir: TempDir,
}

impl RedisServer {
    /// Starts a server with `--save "" --appendonly no` and waits until it answers PING.
    pub async fn start() -> anyhow::Result<RedisServer> {
        Self::start_with_args(&[]).await
    }

    /// Like [`RedisServer::start`], with `args` after the defaults so they override them,
    /// e.g. `["--appendonly", "yes", "--appendfsync", "always"]`. They must not change the port.
    pub async fn start_with_args(args: &[&str]) -> anyhow::Result<RedisServer> {
        let dir = tempfile::Builder::new().prefix("shelfsync-redis-").tempdir()?;
        let proc = Proc::new(redis_server_bin()?, dir.path().join("redis.log"));
        let server = RedisServer { proc, port: 0, dir };
        process::start_on_free_ports(server, |server| {
            [server.port] = process::free_ports()?;
            let mut argv: Vec<OsString> =
                ["--port", &server.port.to_string(), "--bind", "127.0.0.1"]
                    .map(OsString::from)
                    .into();
            argv.extend([OsString::from("--dir"), server.dir.path().into()]);
            // An empty argument after --save disables RDB snapshots.
            argv.extend(
                ["--save", "", "--appendonly", "no", "--daemonize", "no"].map(OsString::from),
            );
            argv.extend([OsString::from("--logfile"), server.log_path().into()]);
            argv.extend(args.iter().map(OsString::from));
            server.proc.set_args(argv);
            Ok(())
        })
        .await
    }

    /// `redis://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The process id while it runs (e.g. to read its CPU time in a bench).
    pub fn pid(&self) -> Option<u32> {
        self.proc.pid()
    }

    /// Whether the process is running (not killed, not exited).
    pub fn is_running(&mut self) -> bool {
        self.proc.is_running()
    }

    /// The server's working dir (RDB/AOF files); it survives `kill` and is reused by `restart`.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server's log, kept across restarts; print it when a test fails.
    pub fn log_path(&self) -> &Path {
        self.proc.log_path()
    }

    /// SIGKILL and wait: a crash, so fault tests see exactly what reached the AOF.
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// Starts again with the same port, dir and args; waits until it answers and is not loading.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.boot(false).await
    }
}

impl Server for RedisServer {
    fn proc(&self) -> &Proc {
        &self.proc
    }

    async fn boot(&mut self, fresh_log: bool) -> anyhow::Result<()> {
        self.proc.spawn(fresh_log)?;
        let port = self.port;
        let pid = self.proc.pid().unwrap_or_default();
        self.proc.wait_ready(&format!("redis-server on port {port}"), || probe(port, pid)).await
    }
}

/// Ready means PING answers +PONG and INFO shows our pid (not a foreign server that won a port
/// race) with `loading:0` (an AOF or RDB replay has finished).
async fn probe(port: u16, pid: u32) -> anyhow::Result<()> {
    let mut conn = BufReader::new(TcpStream::connect(("127.0.0.1", port)).await?);
    conn.get_mut().write_all(b"*1\r\n$4\r\nPING\r\n*1\r\n$4\r\nINFO\r\n").await?;
    let pong = read_line(&mut conn).await?;
    if pong != "+PONG" {
        bail!("PING answered {pong:?}");
    }
    let header = read_line(&mut conn).await?;
    let Some(len) = header.strip_prefix('$').and_then(|n| n.parse::<usize>().ok()) else {
        bail!("INFO answered {header:?}");
    };
    let mut info = vec![0; len + 2];
    conn.read_exact(&mut info).await?;
    let info = String::from_utf8_lossy(&info);
    if !info.lines().any(|l| l == format!("process_id:{pid}")) {
        bail!("a different redis-server answers on port {port}");
    }
    if !info.lines().any(|l| l == "loading:0") {
        bail!("still loading");
    }
    Ok(())
}

async fn read_line(conn: &mut BufReader<TcpStream>) -> anyhow::Result<String> {
    let mut line = String::new();
    if conn.read_line(&mut line).await? == 0 {
        bail!("connection closed");
    }
    Ok(line.trim_end().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn ping(port: u16) -> anyhow::Result<String> {
        let mut conn = BufReader::new(TcpStream::connect(("127.0.0.1", port)).await?);
        conn.get_mut().write_all(b"PING\r\n").await?;
        read_line(&mut conn).await
    }

    #[tokio::test]
    async fn starts_and_answers_ping() -> anyhow::Result<()> {
        let server = RedisServer::start().await?;
        assert_ne!(server.port(), 6379);
        assert_eq!(server.url(), format!("redis://127.0.0.1:{}", server.port()));
        assert_eq!(ping(server.port()).await?, "+PONG");
        Ok(())
    }

    #[tokio::test]
    async fn restart_keeps_port_and_aof_data() -> anyhow::Result<()> {
        let mut server =
            RedisServer::start_with_args(&["--appendonly", "yes", "--appendfsync", "always"])
                .await?;
        let port = server.port();
        let mut conn = BufReader::new(TcpStream::connect(("127.0.0.1", port)).await?);
        conn.get_mut().write_all(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n").await?;
        assert_eq!(read_line(&mut conn).await?, "+OK");
        server.kill();
        assert!(ping(port).await.is_err(), "killed server still answers");
        server.restart().await?;
        let mut conn = BufReader::new(TcpStream::connect(("127.0.0.1", port)).await?);
        conn.get_mut().write_all(b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n").await?;
        assert_eq!(read_line(&mut conn).await?, "$1");
        assert_eq!(read_line(&mut conn).await?, "v");
        Ok(())
    }
}
