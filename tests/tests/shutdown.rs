//! Graceful shutdown of the real storage binary: SIGTERM in the middle of an
//! import makes it finish what it holds and exit 0 promptly; restarted, it
//! applies the rest, and every record has exactly one change — nothing lost,
//! nothing duplicated. Its HTTP port serves `/readyz` and `/metrics`.

use std::time::{Duration, Instant};

use shelfsync_ingest::{ImportConfig, Importer, Source};
use shelfsync_settings::{ImportKind, PartnerSettings, Settings};
use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;

const BRAND: i64 = 7;
const PLACES: i64 = 20;
const ITEMS: usize = 500;

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// The test settings with no keyframe schedule and storage's HTTP port on
/// a free one.
fn settings_with_http(env: &TestEnv) -> Settings {
    let mut settings = storage_settings(env);
    settings.storage.http_listen = format!("127.0.0.1:{}", free_port());
    settings
}

/// The storage binary, once `/readyz` says 200, and its HTTP address.
async fn start_ready(settings: &Settings) -> (StorageProcess, std::net::SocketAddr) {
    let addr: std::net::SocketAddr = settings.storage.http_listen.parse().expect("addr");
    let storage = StorageProcess::start(settings, &[]).expect("storage");
    eventually(SETTLE, "storage to be ready", || async {
        matches!(http_get(addr, "/readyz").await, Ok((200, _)))
    })
    .await;
    (storage, addr)
}

fn sigterm(storage: &StorageProcess) {
    let pid = storage.child.id().to_string();
    let kill = std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill");
    assert!(kill.success());
}

async fn messages(h: &Harness, stream: &str) -> u64 {
    match h.js.get_stream(stream).await {
        Ok(mut s) => s.info().await.map_or(0, |i| i.state.messages),
        Err(_) => 0,
    }
}

#[tokio::test]
async fn sigterm_mid_import_exits_zero_and_loses_or_duplicates_nothing() {
    let env = TestEnv::start().await.expect("servers");
    let mut settings = settings_with_http(&env);
    // Small command messages: many of them, so the signal lands mid-way.
    settings.ingest.batch_size = 20;
    let partner = PartnerSettings {
        name: "bulk".into(),
        brand_id: BRAND,
        kind: ImportKind::Delta,
        fields: vec!["title".into(), "price".into(), "stock".into()],
        ..Default::default()
    };
    settings.partners = vec![partner.clone()];
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let (mut storage, addr) = start_ready(&settings).await;
    let (code, _) = http_get(addr, "/healthz").await.expect("healthz");
    assert_eq!(code, 200);

    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("bulk.ndjson");
    let mut feed = String::new();
    for place in 1..=PLACES {
        for i in 0..ITEMS {
            feed.push_str(&format!(
                "{{\"brand_id\":{BRAND},\"place_id\":{place},\"id\":\"sku-{i}\",\"title\":\"T{i}\",\"price\":{},\"stock\":1}}\n",
                100 + i
            ));
        }
    }
    std::fs::write(&path, feed).expect("write feed");
    let importer = Importer::connect(ImportConfig::from(&settings)).await.expect("importer");
    let import =
        tokio::spawn(async move { importer.import(&partner, Source::File(path), None).await });

    // Storage has applied some of the import, not all of it.
    let changes_stream = h.subjects.changes_stream();
    eventually(SETTLE, "storage to start applying", || async {
        messages(&h, &changes_stream).await > 0
    })
    .await;
    // A batch's duration is recorded once its changes are relayed, so the
    // first changes can be in the stream a moment before it.
    eventually(SETTLE, "storage metrics with a batch duration", || async {
        matches!(http_get(addr, "/metrics").await, Ok((200, m))
            if m.contains("shelfsync_commands_applied_total")
                && m.contains("shelfsync_batch_seconds_bucket"))
    })
    .await;

    let signalled = Instant::now();
    sigterm(&storage);
    let status =
        storage.wait_exit(Duration::from_secs(10)).await.expect("storage exits on SIGTERM");
    assert!(status.success(), "storage exited with {status:?} after SIGTERM");
    let took = signalled.elapsed();
    let pending = messages(&h, &h.subjects.cmd_stream()).await;

    let report = import.await.expect("import task").expect("import");
    let total = PLACES as usize * ITEMS;
    assert_eq!(report.items, total as u64);

    // Restarted, storage applies the rest.
    let restarted = Instant::now();
    let _storage = StorageProcess::start(&settings, &[]).expect("storage again");
    h.wait_settled().await;
    let rest = restarted.elapsed();
    let changes = h.changes().await.expect("changes");
    let by_key = count_by_key(&changes);
    assert_eq!(by_key.len(), total, "records lost");
    let twice: Vec<_> = by_key.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        twice.is_empty(),
        "records with more than one change: {:?}",
        &twice[..twice.len().min(5)]
    );
    assert_eq!(changes.len(), total);
    eprintln!(
        "storage stopped {took:?} after SIGTERM with {pending} command messages left; \
         the restarted one applied them in {rest:?}"
    );
}

/// With NATS and Redis both gone, SIGTERM still stops storage: nothing can
/// be finished or flushed any more, and waiting for the servers would leave
/// a pod hanging until the kubelet's SIGKILL.
#[tokio::test]
async fn sigterm_with_both_servers_gone_still_exits() {
    let mut env = TestEnv::start().await.expect("servers");
    let settings = settings_with_http(&env);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let (mut storage, _) = start_ready(&settings).await;
    h.send(vec![patch(BRAND, 1, "a", &product("a", 1, 1), 0)]).await.expect("send");
    h.wait_settled().await;

    env.nats.kill();
    env.redis.kill();
    // Long enough for storage to notice both connections gone.
    tokio::time::sleep(Duration::from_secs(1)).await;
    sigterm(&storage);
    // The grace period for messages in hand (20 s) plus bounded closing
    // steps; far below a stuck process, which never exits.
    let status = storage.wait_exit(Duration::from_secs(60)).await.expect("storage exits");
    eprintln!("storage exited with {status:?} after SIGTERM with both servers gone");
}
