//! What the harness reads from the machine: CPU time and peak RSS of processes (`/proc`), and
//! Redis' own counters (`INFO`). Linux only, read only.

use std::collections::HashMap;
use std::sync::OnceLock;

/// Clock ticks per second of `/proc/<pid>/stat` times (`getconf CLK_TCK`, 100 on Linux).
fn clock_ticks() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// The fields of `/proc/<pid>/stat` the harness uses.
#[derive(Debug, PartialEq)]
struct Stat {
    comm: String,
    ppid: u32,
    /// utime + stime, in clock ticks.
    cpu_ticks: u64,
}

/// `pid (comm) state ppid ... utime stime ...`; `comm` may hold spaces and parentheses, so the
/// fields are counted from the last `)`.
fn parse_stat(text: &str) -> Option<Stat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_string();
    let fields: Vec<&str> = text.get(close + 1..)?.split_whitespace().collect();
    // fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15.
    let ppid = fields.get(1)?.parse().ok()?;
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Stat { comm, ppid, cpu_ticks: utime + stime })
}

fn stat_of(pid: &str) -> Option<Stat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// User + system CPU seconds of a live process (all its threads).
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    Some(stat_of(&pid.to_string())?.cpu_ticks as f64 / clock_ticks())
}

/// User + system CPU seconds of this process so far.
pub fn self_cpu_seconds() -> f64 {
    stat_of("self").map_or(0.0, |s| s.cpu_ticks as f64 / clock_ticks())
}

/// A `kB` line of `/proc/<pid>/status`, e.g. `VmHWM` (peak RSS) or `VmRSS`.
pub fn status_kb(pid: &str, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_status_kb(&status, field)
}

fn parse_status_kb(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// User + system CPU seconds of a live process and of its live direct children: a PostgreSQL
/// postmaster and its backends and auxiliary processes.
pub fn family_cpu_seconds(pid: u32) -> Option<f64> {
    let own = stat_of(&pid.to_string())?.cpu_ticks;
    let children: u64 = std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            let pid_text = name.to_str()?;
            if !pid_text.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            stat_of(pid_text).filter(|s| s.ppid == pid).map(|s| s.cpu_ticks)
        })
        .sum();
    Some((own + children) as f64 / clock_ticks())
}

/// One `INFO` of Redis as key → value.
#[derive(Debug, Default, Clone)]
pub struct RedisInfo(HashMap<String, String>);

impl RedisInfo {
    pub fn parse(text: &str) -> RedisInfo {
        RedisInfo(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.to_string(), v.trim().to_string()))
                .collect(),
        )
    }

    pub async fn fetch(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<RedisInfo> {
        let text: String = redis::cmd("INFO").arg("everything").query_async(conn).await?;
        Ok(RedisInfo::parse(&text))
    }

    pub fn num(&self, key: &str) -> f64 {
        self.0.get(key).and_then(|v| v.parse().ok()).unwrap_or(0.0)
    }

    pub fn text(&self, key: &str) -> String {
        self.0.get(key).cloned().unwrap_or_default()
    }

    /// CPU seconds of the server (main thread and background threads, user + system).
    pub fn cpu_seconds(&self) -> f64 {
        self.num("used_cpu_user") + self.num("used_cpu_sys")
    }

    /// CPU seconds of the server's children that ended (AOF rewrites, snapshots).
    pub fn children_cpu_seconds(&self) -> f64 {
        self.num("used_cpu_user_children") + self.num("used_cpu_sys_children")
    }

    /// Keys modified (one per hash field, list element, ...): with snapshots off
    /// (`--save ""`) this counter only grows, so a delta counts Redis writes.
    pub fn writes(&self) -> f64 {
        self.num("rdb_changes_since_last_save")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_stat_with_awkward_names() {
        let line =
            "4242 (tokio (rt) x) S 17 4242 4242 0 -1 4194560 1 0 0 0 250 75 0 0 20 0 9 0 1 2 3";
        let stat = parse_stat(line).expect("parses");
        assert_eq!(stat, Stat { comm: "tokio (rt) x".into(), ppid: 17, cpu_ticks: 325 });
        assert!(parse_stat("garbage").is_none());
    }

    #[test]
    fn reads_this_process() {
        assert!(self_cpu_seconds() >= 0.0);
        assert!(status_kb("self", "VmHWM").is_some_and(|kb| kb > 0));
        assert_eq!(parse_status_kb("VmHWM:\t   5120 kB\nVmRSS:\t 100 kB\n", "VmRSS"), Some(100));
    }

    #[test]
    fn counts_the_cpu_of_live_children() -> anyhow::Result<()> {
        // A child that burns CPU until killed.
        let mut child =
            std::process::Command::new("sh").args(["-c", "while :; do :; done"]).spawn()?;
        let mut child_cpu = 0.0;
        for _ in 0..400 {
            child_cpu = cpu_seconds(child.id()).unwrap_or(0.0);
            if child_cpu >= 0.3 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(25));
        }
        let me = std::process::id();
        let family = family_cpu_seconds(me).expect("this process");
        let own = cpu_seconds(me).expect("this process");
        child.kill()?;
        child.wait()?;
        assert!(child_cpu >= 0.3, "the child burnt only {child_cpu} s");
        // Read after the child's figure, so the family holds at least that much of it.
        assert!(family - own >= child_cpu - 0.02, "family {family}, own {own}, child {child_cpu}");
        assert_eq!(family_cpu_seconds(u32::MAX), None);
        Ok(())
    }

    #[test]
    fn parses_redis_info() {
        let info = RedisInfo::parse(
            "# Memory\r\nused_memory:1024\r\nused_cpu_user:1.5\r\nused_cpu_sys:0.25\r\n\
             rdb_changes_since_last_save:77\r\nredis_version:7.0.15\r\n",
        );
        assert_eq!(info.num("used_memory"), 1024.0);
        assert_eq!(info.cpu_seconds(), 1.75);
        assert_eq!(info.writes(), 77.0);
        assert_eq!(info.text("redis_version"), "7.0.15");
        assert_eq!(info.num("missing"), 0.0);
    }
}
