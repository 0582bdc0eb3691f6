//! Just enough HTTP/1.1 for the harness: a GET returning JSON (storage's `/v1/stats`), and a
//! keep-alive load loop over N connections (recommender throughput) for when `wrk` is absent
//! — it is what CI has.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// `GET path` with `Connection: close`; the body parsed as JSON (non-2xx is an error).
pub async fn get_json(addr: SocketAddr, path: &str) -> anyhow::Result<serde_json::Value> {
    let mut conn = BufReader::new(TcpStream::connect(addr).await?);
    let req = format!("GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n");
    conn.get_mut().write_all(req.as_bytes()).await?;
    let (status, body) = read_response(&mut conn).await?;
    if !(200..300).contains(&status) {
        bail!("GET {path}: HTTP {status}: {}", String::from_utf8_lossy(&body));
    }
    serde_json::from_slice(&body).with_context(|| format!("GET {path}: not JSON"))
}

/// Reads one response: status and body (Content-Length or chunked).
async fn read_response(conn: &mut BufReader<TcpStream>) -> anyhow::Result<(u16, Vec<u8>)> {
    let mut line = String::new();
    if conn.read_line(&mut line).await? == 0 {
        bail!("connection closed before a response");
    }
    let status: u16 =
        line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).context("bad status line")?;
    let mut length = None;
    let mut chunked = false;
    loop {
        line.clear();
        if conn.read_line(&mut line).await? == 0 {
            bail!("connection closed in the headers");
        }
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                length = value.parse::<usize>().ok();
            } else if name.eq_ignore_ascii_case("transfer-encoding") && value.contains("chunked") {
                chunked = true;
            }
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            line.clear();
            conn.read_line(&mut line).await?;
            let size = usize::from_str_radix(line.trim(), 16).context("bad chunk size")?;
            let mut chunk = vec![0; size + 2];
            conn.read_exact(&mut chunk).await?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    } else if let Some(n) = length {
        body.resize(n, 0);
        conn.read_exact(&mut body).await?;
    } else {
        conn.read_to_end(&mut body).await?;
    }
    Ok((status, body))
}

/// What a load run saw.
#[derive(Debug, Default)]
pub struct LoadResult {
    pub requests: u64,
    pub errors: u64,
    pub elapsed: Duration,
    /// Latency of each successful request, milliseconds.
    pub latencies_ms: Vec<f64>,
}

/// `connections` keep-alive connections, each sending its next GET (paths taken round-robin)
/// as soon as the previous answer is read, for `run`.
pub async fn load(
    addr: SocketAddr,
    paths: Arc<Vec<String>>,
    connections: usize,
    run: Duration,
) -> anyhow::Result<LoadResult> {
    let started = Instant::now();
    let deadline = started + run;
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..connections {
        let paths = paths.clone();
        tasks.spawn(async move {
            let mut out = LoadResult::default();
            let mut conn = BufReader::new(TcpStream::connect(addr).await?);
            let mut i = c;
            while Instant::now() < deadline {
                let path = &paths[i % paths.len()];
                i += connections;
                let req = format!("GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n");
                let sent = Instant::now();
                conn.get_mut().write_all(req.as_bytes()).await?;
                let (status, _) = read_response(&mut conn).await?;
                if status == 200 {
                    out.requests += 1;
                    out.latencies_ms.push(sent.elapsed().as_secs_f64() * 1e3);
                } else {
                    out.errors += 1;
                }
            }
            anyhow::Ok(out)
        });
    }
    let mut total = LoadResult::default();
    while let Some(done) = tasks.join_next().await {
        let part = done??;
        total.requests += part.requests;
        total.errors += part.errors;
        total.latencies_ms.extend(part.latencies_ms);
    }
    total.elapsed = started.elapsed();
    Ok(total)
}
