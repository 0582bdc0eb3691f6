//! One full import per partner at a time, across processes: the partner
//! lease in Redis taken by every full import, whether the `shelfsync import`
//! binary or the ingest service runs it. Two overlapping imports never
//! interleave on the CMD stream, a killed holder blocks the partner only
//! until its lease expires, and an import that loses its lease stops and
//! sweeps nothing. The lease's timing rules are unit-tested in
//! `services/ingest/src/lease.rs`.
//!
//! The CLI binary must be built first (`cargo build --bins -p shelfsync-cli`).

use std::process::Stdio;
use std::time::Duration;

use prost::Message;
use shelfsync_ingest::{App, ImportConfig, ImportError, ImportStatus, Importer, Source};
use shelfsync_proto::CommandBatch;
use shelfsync_settings::{ImportKind, PartnerSettings, Settings};
use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, Command};

const BRAND: i64 = 7;
const WAIT: Duration = Duration::from_secs(20);

fn flowers() -> PartnerSettings {
    let fields = shelfsync_proto::product_field::NAMES.map(String::from).to_vec();
    PartnerSettings {
        name: "flowers".into(),
        brand_id: BRAND,
        kind: ImportKind::Full,
        fields,
        // These tests are about imports not interleaving; the second feed
        // replaces most of the first, which the sweep guard would hold.
        sweep_max_fraction: 1.0,
        ..Default::default()
    }
}

struct Lab {
    _env: TestEnv,
    h: Harness,
    settings: Settings,
    dir: tempfile::TempDir,
    redis: redis::aio::MultiplexedConnection,
}

/// Servers, streams, and settings with small batches (an import publishes
/// early) and the given lease ttl.
async fn lab(ttl: Duration) -> Lab {
    let env = TestEnv::start().await.expect("servers");
    let mut settings = storage_settings(&env);
    settings.ingest.batch_size = 10;
    settings.ingest.import_lease_ttl = ttl;
    settings.partners = vec![flowers()];
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let client = redis::Client::open(env.redis.url()).expect("redis url");
    let redis = client.get_multiplexed_async_connection().await.expect("redis");
    let dir = tempfile::tempdir().expect("tmp");
    Lab { _env: env, h, settings, dir, redis }
}

/// A nested feed in two parts: the second closes it.
fn feed(prefix: &str, shared: usize, own: usize) -> (String, String) {
    let item = |id: String| format!(r#"{{"id":"{id}","title":"{prefix}","price":1}}"#);
    let mut items: Vec<String> = (0..shared).map(|i| item(format!("x-{i}"))).collect();
    items.extend((0..own).map(|i| item(format!("{prefix}-{i}"))));
    let half = items.len() * 3 / 4;
    let head = format!(
        "{{\"brand_id\":7,\"places\":[{{\"place_id\":1,\"items\":[\n{}",
        items[..half].join(",")
    );
    (head, format!(",{}]}}]}}\n", items[half..].join(",")))
}

impl Lab {
    fn lease_key(&self) -> String {
        format!("{{{}:ingest:flowers}}:lease", self.settings.redis.namespace)
    }

    async fn lease(&self) -> Option<String> {
        let mut redis = self.redis.clone();
        redis::cmd("GET").arg(self.lease_key()).query_async(&mut redis).await.expect("GET")
    }

    async fn set_lease(&self, value: Option<&str>) {
        let mut redis = self.redis.clone();
        let cmd = match value {
            Some(v) => {
                redis::cmd("SET").arg(self.lease_key()).arg(v).arg("PX").arg(60_000).to_owned()
            }
            None => redis::cmd("DEL").arg(self.lease_key()).to_owned(),
        };
        let _: () = cmd.query_async(&mut redis).await.expect("SET or DEL");
    }

    async fn importer(&self) -> Importer {
        Importer::connect(ImportConfig::from(&self.settings)).await.expect("importer")
    }

    /// `shelfsync import --partner flowers -`, fed on stdin by the test.
    fn cli_import(&self) -> Child {
        self.cli(&["-"]).spawn().expect("spawn shelfsync import")
    }

    /// `shelfsync import --partner flowers --json ARGS`.
    fn cli(&self, args: &[&str]) -> Command {
        let config = self.dir.path().join("shelfsync.toml");
        std::fs::write(
            &config,
            "[[partners]]\nname = \"flowers\"\nbrand_id = 7\nkind = \"full\"\n",
        )
        .expect("config");
        let bin = shelfsync_testkit::workspace_bin("shelfsync").expect("the shelfsync binary");
        let ttl = format!("{}ms", self.settings.ingest.import_lease_ttl.as_millis());
        let mut cmd = Command::new(bin);
        cmd.args(["import", "--config", config.to_str().expect("utf-8"), "--partner", "flowers"])
            .args(args)
            .arg("--json")
            .env_clear()
            .envs(settings_env(&self.settings))
            .env("SHELFSYNC__INGEST__BATCH_SIZE", self.settings.ingest.batch_size.to_string())
            .env("SHELFSYNC__INGEST__IMPORT_LEASE_TTL", ttl)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        cmd
    }

    /// The import id of every CMD message (and whether it is a sweep), in
    /// stream order; nothing consumes the stream until storage starts.
    async fn cmd_import_ids(&self) -> Vec<(String, bool)> {
        let mut stream = self.h.js.get_stream(self.h.subjects.cmd_stream()).await.expect("CMD");
        let last = stream.info().await.expect("info").state.last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            let m = stream.get_raw_message(seq).await.expect("a message");
            let plain = shelfsync_bus::encoding::decode(Some(&m.headers), &m.payload).expect("lz4");
            let b = CommandBatch::decode(plain).expect("a CommandBatch");
            let from_command = b.commands.first().and_then(|c| b.origin_of(c));
            let id = match (from_command, b.sweeps.first()) {
                (Some(origin), _) => origin.import_id.clone(),
                (None, Some(sweep)) => sweep.import_id.clone(),
                (None, None) => String::new(),
            };
            out.push((id, !b.sweeps.is_empty()));
        }
        out
    }

    /// Until the first import has published (it takes the lease before).
    async fn wait_for_commands(&self) {
        eventually(WAIT, "the first import to publish", || async {
            !self.cmd_import_ids().await.is_empty()
        })
        .await;
    }
}

#[tokio::test]
async fn a_cli_import_and_the_service_never_interleave_their_full_imports() {
    let t = lab(Duration::from_secs(30)).await;
    let (a_head, a_tail) = feed("a", 20, 400);
    let (b_head, b_tail) = feed("b", 20, 30);
    let b_path = t.dir.path().join("b.json");
    std::fs::write(&b_path, format!("{b_head}{b_tail}")).expect("feed b");

    // The CLI holds the lease and has published part of its feed.
    let mut cli = t.cli_import();
    let mut stdin = cli.stdin.take().expect("stdin");
    stdin.write_all(a_head.as_bytes()).await.expect("write");
    stdin.flush().await.expect("flush");
    t.wait_for_commands().await;
    let pid = cli.id().expect("running");

    // The service's importer is refused, naming the holder.
    let importer = t.importer().await;
    let err = importer
        .import(&flowers(), Source::File(b_path.clone()), None)
        .await
        .expect_err("another full import runs");
    let text = err.to_string();
    assert!(matches!(err, ImportError::Busy { .. }), "{err:?}");
    for part in
        ["another full import of `flowers`", &format!("pid {pid}"), "by shelfsync", "from stream"]
    {
        assert!(text.contains(part), "{text} lacks {part}");
    }
    assert!(importer.reports("flowers", 20).await.expect("reports").is_empty(), "not recorded");
    assert!(t.lease().await.is_some_and(|l| l.contains(&pid.to_string())), "the CLI's lease");

    // The service polls the partner's file meanwhile: every poll is skipped.
    let mut settings = t.settings.clone();
    settings.partners[0].source = Some(b_path.display().to_string());
    settings.partners[0].poll_interval = Some(Duration::from_millis(100));
    let app = App::build(settings).await.expect("ingest service");
    let service = spawn(app);
    // A negative cannot be waited for: several poll rounds while the CLI
    // holds the lease, on purpose.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let during = t.cmd_import_ids().await;
    assert!(during.iter().all(|(id, _)| id == &during[0].0), "only the CLI's import: {during:?}");

    // The CLI finishes; the next poll imports the file.
    stdin.write_all(a_tail.as_bytes()).await.expect("write");
    drop(stdin);
    let out = cli.wait_with_output().await.expect("the CLI exits");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let a: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a JSON report");
    assert_eq!(
        (a["status"].as_str(), a["items"].as_u64(), a["sweeps"].as_u64()),
        (Some("completed"), Some(420), Some(1))
    );
    let a_id = a["import_id"].as_str().expect("import id").to_string();
    eventually(WAIT, "the service to import the file", || async {
        let reports = importer.reports("flowers", 20).await.expect("reports");
        reports.iter().any(|r| r.import_id != a_id && r.status == ImportStatus::Completed)
    })
    .await;
    service.stop().await.expect("the service stops");
    let b = importer.reports("flowers", 20).await.expect("reports").remove(0);
    assert_eq!((b.items, b.sweeps), (50, 1));
    assert!(
        b.generation > a["generation"].as_i64().expect("generation"),
        "generations follow the lease"
    );
    assert!(t.lease().await.is_none(), "released");

    // On the CMD stream: every message of the CLI's import, its sweep last,
    // then every message of the service's.
    let ids = t.cmd_import_ids().await;
    let split = ids.iter().position(|(id, _)| id != &a_id).expect("the service's import");
    let (first, second) = ids.split_at(split);
    assert!(first.iter().all(|(id, _)| id == &a_id), "{ids:?}");
    assert!(second.iter().all(|(id, _)| id == &b.import_id), "no interleaving: {ids:?}");
    assert!(first.last().expect("a").1 && second.last().expect("b").1, "each ends with its sweep");

    // Applied in that order: the service's feed is the state.
    let _storage = InProcessStorage::start(t.settings.clone()).await.expect("storage");
    t.h.wait_settled().await;
    for (id, title, absent) in
        [("x-0", "b", false), ("b-29", "b", false), ("a-0", "a", true), ("a-399", "a", true)]
    {
        let r = t.h.get(BRAND, 1, id).await.expect("get").expect("stored");
        assert_eq!(
            (decode_product(&r.data).title.as_deref(), r.absent),
            (Some(title), absent),
            "{id}"
        );
    }
}

#[tokio::test]
async fn a_killed_holder_blocks_its_partner_until_the_lease_expires() {
    let t = lab(Duration::from_secs(2)).await;
    let (head, _) = feed("a", 0, 400);
    let mut cli = t.cli_import();
    let mut stdin = cli.stdin.take().expect("stdin");
    stdin.write_all(head.as_bytes()).await.expect("write");
    stdin.flush().await.expect("flush");
    t.wait_for_commands().await;
    let pid = cli.id().expect("running");
    cli.kill().await.expect("kill -9");

    // Its lease outlives it...
    let (b_head, b_tail) = feed("b", 0, 10);
    let path = t.dir.path().join("b.json");
    std::fs::write(&path, format!("{b_head}{b_tail}")).expect("feed");
    let importer = t.importer().await;
    let err =
        importer.import(&flowers(), Source::File(path.clone()), None).await.expect_err("held");
    assert!(
        matches!(&err, ImportError::Busy { holder, .. } if holder.contains(&format!("pid {pid}"))),
        "{err:?}"
    );
    // ... until its ttl: an import that waits gets it then.
    let importer = importer.with_lease_wait(WAIT);
    let r = importer.import(&flowers(), Source::File(path), None).await.expect("after the ttl");
    assert_eq!((r.items, r.sweeps), (10, 1));
    assert!(t.lease().await.is_none());
}

#[tokio::test]
async fn an_import_that_loses_its_lease_stops_and_sweeps_nothing() {
    // Taken over while the import waits for its feed: the renewal notices
    // and the import stops by itself, the feed still open.
    let t = lab(Duration::from_secs(2)).await;
    let (head, tail) = feed("a", 0, 400);
    let (mut writer, reader) = tokio::io::duplex(64 * 1024);
    let importer = t.importer().await;
    let running = tokio::spawn(async move {
        importer.import(&flowers(), Source::Stream(Box::new(reader)), None).await
    });
    writer.write_all(head.as_bytes()).await.expect("write");
    t.wait_for_commands().await;
    t.set_lease(Some("another import")).await;
    let result = tokio::time::timeout(WAIT, running).await.expect("stops by itself").expect("join");
    let err = result.expect_err("the lease was lost");
    assert!(matches!(err, ImportError::LeaseLost { .. }), "{err:?}");
    assert!(err.to_string().contains("swept nothing"), "{err}");
    assert_eq!(t.lease().await.as_deref(), Some("another import"), "not released: not ours");
    let _ = writer.write_all(tail.as_bytes()).await; // nobody reads it any more
    assert!(t.cmd_import_ids().await.iter().all(|(_, sweep)| !sweep), "no sweep");

    // Expired between the last renewal and the sweep: the check before the
    // sweep notices (a long ttl, so that no renewal comes first).
    let t = lab(Duration::from_secs(60)).await;
    let (mut writer, reader) = tokio::io::duplex(64 * 1024);
    let importer = t.importer().await;
    let running = tokio::spawn(async move {
        importer.run(&flowers(), Source::Stream(Box::new(reader)), None).await
    });
    writer.write_all(head.as_bytes()).await.expect("write");
    t.wait_for_commands().await;
    t.set_lease(None).await;
    writer.write_all(tail.as_bytes()).await.expect("write");
    drop(writer);
    let (report, result) = tokio::time::timeout(WAIT, running).await.expect("ends").expect("join");
    assert!(matches!(result, Err(ImportError::LeaseLost { .. })), "{result:?}");
    assert_eq!((report.status, report.items, report.sweeps), (ImportStatus::Failed, 400, 0));
    let ids = t.cmd_import_ids().await;
    assert!(ids.len() >= 40 && ids.iter().all(|(_, sweep)| !sweep), "commands, no sweep: {ids:?}");
}

#[tokio::test]
async fn the_cli_fails_at_once_naming_the_holder_unless_told_to_wait() {
    let t = lab(Duration::from_secs(30)).await;
    let (head, tail) = feed("a", 0, 10);
    let path = t.dir.path().join("a.json");
    std::fs::write(&path, format!("{head}{tail}")).expect("feed");
    let path = path.to_str().expect("utf-8");
    // Another replica's import holds the lease, for a little while yet.
    let other = r#"{"import_id":"flowers-1","host":"ingest-1","pid":7,"program":"shelfsync-ingest","source":"https://partner.example/feed.json","started":"2030-01-01T00:00:00Z","nonce":0}"#;
    let mut redis = t.redis.clone();
    let _: () = redis::cmd("SET")
        .arg(t.lease_key())
        .arg(other)
        .arg("PX")
        .arg(1500)
        .query_async(&mut redis)
        .await
        .expect("SET");

    let out = t.cli(&[path]).output().await.expect("runs");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for part in ["import flowers-1 by shelfsync-ingest (pid 7 on ingest-1)", "--wait DURATION"] {
        assert!(stderr.contains(part), "{stderr} lacks {part}");
    }
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the report");
    assert_eq!((report["status"].as_str(), report["items"].as_u64()), (Some("failed"), Some(0)));
    assert!(t.cmd_import_ids().await.is_empty(), "nothing published");

    let out = t.cli(&[path, "--wait", "20s"]).output().await.expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the report");
    assert_eq!(
        (report["status"].as_str(), report["items"].as_u64()),
        (Some("completed"), Some(10))
    );
}
