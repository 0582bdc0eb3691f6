//! A private PostgreSQL cluster for the peer: Debian's binaries (installed with apt-get when
//! missing, without letting the package start a system cluster), `initdb` into a dir under the
//! bench's work dir, `pg_ctl` on a free loopback port with no Unix socket, run as the `postgres`
//! user when the bench runs as root (the server refuses root). Stopped on drop, also when the
//! run fails, so it never outlives the bench. Servers it did not start (a system cluster on
//! 5432) are never touched: it speaks only to its own port.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// The superuser `initdb` creates; loopback connections are trusted.
pub const USER: &str = "bench";
/// The account the server runs as when the bench runs as root.
const SERVICE_USER: &str = "postgres";
/// Where Debian's packages put the server binaries, one dir per major version.
const DEBIAN_LIB: &str = "/usr/lib/postgresql";
/// Tries on a fresh port when the one picked is taken before the server binds it.
const START_ATTEMPTS: usize = 3;
/// `policy-rc.d` that refuses every service start (exit 101: action forbidden).
const POLICY_RC_D: &str = "/usr/sbin/policy-rc.d";

/// The dir holding `initdb` and `pg_ctl`: on `PATH`, else the newest `/usr/lib/postgresql/*/bin`,
/// else `/usr/local/bin`.
pub fn find_bin_dir() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut candidates: Vec<PathBuf> = std::env::split_paths(&path).collect();
    candidates.extend(debian_bin_dirs(Path::new(DEBIAN_LIB)));
    candidates.push(PathBuf::from("/usr/local/bin"));
    candidates.into_iter().find(|d| has_server_tools(d))
}

fn has_server_tools(dir: &Path) -> bool {
    dir.join("initdb").is_file() && dir.join("pg_ctl").is_file()
}

/// `<lib>/<major>/bin`, newest major first.
fn debian_bin_dirs(lib: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(lib) else { return Vec::new() };
    let mut versions: Vec<(u32, PathBuf)> = entries
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .collect();
    versions.sort_by_key(|v| std::cmp::Reverse(v.0));
    versions.into_iter().map(|(_, dir)| dir).collect()
}

/// Installs Debian's `postgresql` package, with a `policy-rc.d` in place while it installs so
/// that its maintainer scripts start no system cluster; as root directly, else through
/// `sudo -n` (never prompting). A second try follows `apt-get update`, for a stale package list.
fn install(root: bool) -> anyhow::Result<()> {
    eprintln!("[bench] postgres: initdb/pg_ctl not found; installing Debian's postgresql package");
    let guard = PolicyGuard::install(root)?;
    let mut outcome = run_all(&install_commands(root, false));
    if outcome.is_err() {
        outcome = run_all(&install_commands(root, true));
    }
    drop(guard);
    outcome.context("installing postgresql with apt-get (as root, or with passwordless sudo)")
}

/// The commands of one install try: `apt-get update` first when `update`.
fn install_commands(root: bool, update: bool) -> Vec<Vec<String>> {
    let mut commands = Vec::new();
    let apt = |args: &[&str]| {
        let mut c: Vec<String> = if root { Vec::new() } else { vec!["sudo".into(), "-n".into()] };
        c.extend(["env", "DEBIAN_FRONTEND=noninteractive", "apt-get"].map(String::from));
        c.extend(args.iter().map(|a| a.to_string()));
        c
    };
    if update {
        commands.push(apt(&["update", "-q"]));
    }
    commands.push(apt(&["install", "-y", "-q", "--no-install-recommends", "postgresql"]));
    commands
}

fn run_all(commands: &[Vec<String>]) -> anyhow::Result<()> {
    for argv in commands {
        let status = Command::new(&argv[0])
            .args(&argv[1..])
            .status()
            .with_context(|| format!("running {}", argv.join(" ")))?;
        if !status.success() {
            bail!("{} failed ({status})", argv.join(" "));
        }
    }
    Ok(())
}

/// A `policy-rc.d` forbidding service starts, removed on drop; one already there is left alone.
struct PolicyGuard {
    root: bool,
    created: bool,
}

impl PolicyGuard {
    fn install(root: bool) -> anyhow::Result<PolicyGuard> {
        if Path::new(POLICY_RC_D).exists() {
            return Ok(PolicyGuard { root, created: false });
        }
        let script =
            format!("printf '#!/bin/sh\\nexit 101\\n' > {POLICY_RC_D} && chmod 755 {POLICY_RC_D}");
        run_all(&[privileged(root, &["sh", "-c", &script])])
            .with_context(|| format!("writing {POLICY_RC_D}"))?;
        Ok(PolicyGuard { root, created: true })
    }
}

impl Drop for PolicyGuard {
    fn drop(&mut self) {
        if self.created
            && let Err(e) = run_all(&[privileged(self.root, &["rm", "-f", POLICY_RC_D])])
        {
            eprintln!("[bench] warning: could not remove {POLICY_RC_D}: {e:#}");
        }
    }
}

fn privileged(root: bool, argv: &[&str]) -> Vec<String> {
    let prefix: &[&str] = if root { &[] } else { &["sudo", "-n"] };
    prefix.iter().chain(argv).map(|s| s.to_string()).collect()
}

/// The effective uid from `/proc/self/status` (`Uid: real effective saved fs`).
fn effective_uid(status: &str) -> Option<u32> {
    status.lines().find_map(|l| l.strip_prefix("Uid:"))?.split_whitespace().nth(1)?.parse().ok()
}

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status").ok().as_deref().and_then(effective_uid) == Some(0)
}

/// The running cluster; `pg_ctl stop` on drop.
pub struct PgServer {
    bin: PathBuf,
    data: PathBuf,
    log: PathBuf,
    port: u16,
    /// Run the tools as [`SERVICE_USER`] (the bench is root).
    as_service_user: bool,
    durable: bool,
}

impl PgServer {
    /// Finds (or installs) the binaries, creates a cluster in `dir` and starts it; `durable`
    /// keeps the defaults, else commits do not wait for their WAL flush.
    pub fn start(dir: &Path, durable: bool) -> anyhow::Result<PgServer> {
        let root = running_as_root();
        let bin = match find_bin_dir() {
            Some(bin) => bin,
            None => {
                install(root)?;
                find_bin_dir().context("postgresql installed, but initdb/pg_ctl still not found")?
            }
        };
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut server = PgServer {
            bin,
            data: dir.join("data"),
            log: dir.join("postgres.log"),
            port: 0,
            as_service_user: root,
            durable,
        };
        if root {
            server.hand_over(dir)?;
        }
        server.initdb()?;
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            server.port = crate::world::free_port()?;
            match server.pg_ctl_start() {
                Ok(()) => return Ok(server),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no attempt made")))
    }

    /// libpq-style connection string of the cluster (TCP on loopback, trust auth).
    pub fn conninfo(&self) -> String {
        format!("host=127.0.0.1 port={} user={USER} dbname=postgres", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The postmaster's pid (first line of `postmaster.pid`).
    pub fn postmaster_pid(&self) -> Option<u32> {
        let text = std::fs::read_to_string(self.data.join("postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }

    /// Gives `dir` to the service user and checks that it can reach it (every parent must be
    /// traversable by others, which a work dir under `/root` is not).
    fn hand_over(&self, dir: &Path) -> anyhow::Result<()> {
        let owner = format!("{SERVICE_USER}:");
        self.run("chown", Command::new("chown").arg(&owner).arg(dir))?;
        let mut probe = self.tool_command(Path::new("test"));
        probe.arg("-w").arg(dir);
        self.run("probe", &mut probe).with_context(|| {
            format!(
                "user {SERVICE_USER} cannot write {}: its parent dirs must be traversable \
                 (choose another --work-dir, e.g. under /var/tmp)",
                dir.display()
            )
        })
    }

    fn initdb(&self) -> anyhow::Result<()> {
        let mut cmd = self.tool_command(&self.bin.join("initdb"));
        cmd.arg("-D").arg(&self.data);
        cmd.args(["-U", USER, "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"]);
        self.run("initdb", &mut cmd)
    }

    /// Writes the port into `postgresql.conf` (the last setting of a name wins) and starts.
    fn pg_ctl_start(&self) -> anyhow::Result<()> {
        use std::io::Write as _;
        let conf = self.data.join("postgresql.conf");
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&conf)
            .with_context(|| format!("opening {}", conf.display()))?;
        file.write_all(server_settings(self.port, self.durable).as_bytes())?;
        let mut cmd = self.tool_command(&self.bin.join("pg_ctl"));
        cmd.arg("-D").arg(&self.data).arg("-l").arg(&self.log);
        cmd.args(["-w", "-t", "60", "start"]);
        self.run("pg_ctl start", &mut cmd).with_context(|| {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            format!("postgres log:\n{}", lines[lines.len().saturating_sub(10)..].join("\n"))
        })
    }

    fn stop(&self) -> anyhow::Result<()> {
        let mut cmd = self.tool_command(&self.bin.join("pg_ctl"));
        cmd.arg("-D").arg(&self.data).args(["-m", "fast", "-w", "-t", "60", "stop"]);
        self.run("pg_ctl stop", &mut cmd)
    }

    /// `program` as the service user when the bench is root (`runuser` keeps no root
    /// privileges and needs no password), else as is.
    fn tool_command(&self, program: &Path) -> Command {
        if self.as_service_user {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", SERVICE_USER, "--"]).arg(program);
            cmd
        } else {
            Command::new(program)
        }
    }

    fn run(&self, what: &str, cmd: &mut Command) -> anyhow::Result<()> {
        let out = cmd.output().with_context(|| format!("running {what} ({cmd:?})"))?;
        if !out.status.success() {
            bail!(
                "{what} failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if self.postmaster_pid().is_some()
            && let Err(e) = self.stop()
        {
            eprintln!("[bench] warning: stopping the bench's postgres: {e:#}");
        }
    }
}

/// What the cluster's `postgresql.conf` gets on top of initdb's: its own loopback port and no
/// Unix socket (the system cluster's socket dir is not ours). Durable, durability stays at the
/// defaults (`fsync`, `synchronous_commit` on); volatile, commits return before their WAL is
/// flushed (the WAL writer flushes it within a few hundred ms), like JetStream's periodic sync.
fn server_settings(port: u16, durable: bool) -> String {
    let mut s = format!(
        "\n# shelfsync-bench\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = ''\n"
    );
    if !durable {
        s.push_str("synchronous_commit = off\n");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_effective_uid() {
        let status = "Name:\tbench\nUid:\t1000\t0\t0\t0\nGid:\t0\t0\t0\t0\n";
        assert_eq!(effective_uid(status), Some(0));
        assert_eq!(effective_uid("Uid:\t1000\t1000\t1000\t1000\n"), Some(1000));
        assert_eq!(effective_uid("Name: x\n"), None);
    }

    #[test]
    fn installs_through_sudo_only_when_not_root() {
        let as_root = install_commands(true, false);
        assert_eq!(as_root.len(), 1);
        assert_eq!(as_root[0][..3], ["env", "DEBIAN_FRONTEND=noninteractive", "apt-get"]);
        assert!(as_root[0].ends_with(&["postgresql".to_string()]));
        let as_user = install_commands(false, true);
        assert_eq!(as_user.len(), 2);
        assert!(as_user.iter().all(|c| c[..2] == ["sudo", "-n"]));
        assert!(as_user[0].contains(&"update".to_string()));
        assert_eq!(privileged(false, &["rm", "x"]), ["sudo", "-n", "rm", "x"]);
        assert_eq!(privileged(true, &["rm", "x"]), ["rm", "x"]);
    }

    #[test]
    fn finds_debian_versions_newest_first() -> anyhow::Result<()> {
        let lib = tempfile::tempdir()?;
        for v in ["13", "15", "9", "not-a-version"] {
            std::fs::create_dir_all(lib.path().join(v).join("bin"))?;
        }
        let dirs = debian_bin_dirs(lib.path());
        let names: Vec<String> =
            dirs.iter().map(|d| d.parent().unwrap_or(d).display().to_string()).collect();
        let want: Vec<String> =
            ["15", "13", "9"].iter().map(|v| lib.path().join(v).display().to_string()).collect();
        assert_eq!(names, want);
        assert!(!has_server_tools(&dirs[0]));
        std::fs::write(dirs[0].join("initdb"), "")?;
        std::fs::write(dirs[0].join("pg_ctl"), "")?;
        assert!(has_server_tools(&dirs[0]));
        Ok(())
    }

    #[test]
    fn settings_bind_loopback_without_a_socket() {
        let s = server_settings(54321, true);
        assert!(s.contains("port = 54321\n"));
        assert!(s.contains("listen_addresses = '127.0.0.1'"));
        assert!(s.contains("unix_socket_directories = ''"));
        // Durability is left at the defaults.
        assert!(!s.lines().any(|l| l.starts_with("fsync") || l.starts_with("synchronous_commit")));
        assert!(server_settings(54321, false).ends_with("\nsynchronous_commit = off\n"));
    }
}
