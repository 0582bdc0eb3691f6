//! The `shelfsync` binary against real `nats-server` and `redis-server`
//! processes (one pair per test, from `shelfsync_testkit`), configured only
//! through `SHELFSYNC__…` variables on the child process.

use std::process::{ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use prost::Message;
use serde_json::Value;
use shelfsync_bus::Subjects;
use shelfsync_proto::{
    Change, ChangeBatch, ChangeKind, Origin, Product, Record, RecordKey, Rejection, RejectionBatch,
    msg_type,
};
use shelfsync_testkit::TestEnv;
use tokio::process::{Child, Command};

const TIMEOUT: Duration = Duration::from_secs(30);

/// `shelfsync ARGS` wired to the test's servers and namespace, with nothing
/// inherited from the developer's environment.
fn shelfsync(env: &TestEnv, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_shelfsync"));
    cmd.args(args)
        .env_clear()
        .env("SHELFSYNC__NATS__URL", env.nats.url())
        .env("SHELFSYNC__NATS__PREFIX", &env.prefix)
        .env("SHELFSYNC__REDIS__URL", env.redis.url())
        .env("SHELFSYNC__REDIS__NAMESPACE", &env.namespace)
        .env("SHELFSYNC__STORAGE__PARTITIONS", "4")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

async fn run(env: &TestEnv, args: &[&str]) -> anyhow::Result<Output> {
    let out = tokio::time::timeout(TIMEOUT, shelfsync(env, args).output())
        .await
        .with_context(|| format!("shelfsync {args:?} did not finish in {TIMEOUT:?}"))??;
    Ok(out)
}

/// Runs and requires success; returns stdout.
async fn ok(env: &TestEnv, args: &[&str]) -> anyhow::Result<String> {
    let out = run(env, args).await?;
    anyhow::ensure!(
        out.status.success(),
        "shelfsync {args:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

async fn jetstream(env: &TestEnv) -> anyhow::Result<async_nats::jetstream::Context> {
    let client = async_nats::connect(env.nats.url()).await?;
    Ok(async_nats::jetstream::new(client))
}

fn record(key: &RecordKey, price: i64, updated_at: i64) -> Record {
    Record {
        key: Some(key.clone()),
        data: Product {
            title: Some("Red roses".into()),
            price: Some(price),
            stock: Some(0),
            ..Default::default()
        }
        .encode_to_vec(),
        created_at: 1_700_000_000_000_000,
        updated_at,
        ..Default::default()
    }
}

/// A ChangeBatch with one CREATED change of `key`, tagged with `command_seq`.
fn created(key: &RecordKey, command_seq: u64) -> ChangeBatch {
    ChangeBatch {
        changes: vec![Change {
            key: Some(key.clone()),
            before: None,
            after: Some(record(key, 349_000, 1_700_000_000_000_001)),
            kind: ChangeKind::Created as i32,
            changed_data_fields: vec![1, 3, 6],
            changed_state_fields: vec![],
            origin: Some(Origin {
                source: "flowers".into(),
                import_id: "imp-1".into(),
                published_at: 0,
            }),
        }],
        partition: 2,
        command_seq,
        ..Default::default()
    }
}

async fn publish(
    js: &async_nats::jetstream::Context,
    subject: String,
    msg_type: &str,
    payload: Vec<u8>,
) -> anyhow::Result<()> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(shelfsync_bus::TYPE_HEADER, msg_type);
    js.publish_with_headers(subject, headers, payload.into()).await?.await?;
    Ok(())
}

fn json_lines(stdout: &str) -> anyhow::Result<Vec<Value>> {
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).with_context(|| format!("not a JSON line: {l:?}")))
        .collect()
}

async fn wait(child: &mut Child, deadline: Instant) -> anyhow::Result<Option<ExitStatus>> {
    let left = deadline.saturating_duration_since(Instant::now());
    Ok(tokio::time::timeout(left, child.wait()).await.ok().transpose()?)
}

#[tokio::test]
async fn setup_is_idempotent_and_creates_the_three_streams() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let subjects = Subjects::new(&env.prefix);
    let first = ok(&env, &["setup"]).await?;
    let second = ok(&env, &["setup"]).await?;
    let js = jetstream(&env).await?;
    for name in [subjects.cmd_stream(), subjects.changes_stream(), subjects.rejects_stream()] {
        assert!(first.contains(&name), "{name} not in {first}");
        assert!(second.contains(&name), "{name} not in {second}");
        js.get_stream(&name).await.with_context(|| format!("stream {name} missing"))?;
    }
    Ok(())
}

#[tokio::test]
async fn stats_works_before_and_after_setup() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;

    let before: Value = serde_json::from_str(&ok(&env, &["stats", "--json"]).await?)?;
    assert!(before["streams"]["cmd"].is_null(), "{before:#}");
    assert_eq!(before["partitions"], 4);

    ok(&env, &["setup"]).await?;
    let after: Value = serde_json::from_str(&ok(&env, &["stats", "--json"]).await?)?;
    let subjects = Subjects::new(&env.prefix);
    assert_eq!(after["streams"]["cmd"]["name"], subjects.cmd_stream());
    assert_eq!(after["streams"]["changes"]["messages"], 0);
    assert_eq!(after["streams"]["rejects"]["last_seq"], 0);
    assert_eq!(after["storage_consumers"], serde_json::json!([]));
    assert_eq!(after["outbox"], serde_json::json!([]));
    assert_eq!(after["flow"]["command_messages_published"], 0);
    assert_eq!(after["flow"]["change_bytes_retained"], 0);

    let table = ok(&env, &["stats"]).await?;
    assert!(table.contains(&subjects.changes_stream()), "{table}");
    assert!(table.contains("CMD last_seq"), "{table}");
    Ok(())
}

#[tokio::test]
async fn get_of_a_missing_record_exits_1() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let out = run(&env, &["get", "7", "42", "sku-nope"]).await?;
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not found"), "{stderr}");
    assert!(out.stdout.is_empty());
    Ok(())
}

#[tokio::test]
async fn tail_prints_changes_and_rejects_as_json_lines() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    ok(&env, &["setup"]).await?;
    let js = jetstream(&env).await?;
    let subjects = Subjects::new(&env.prefix);

    // Brand 8 first, so that `--brand 7` has something to skip.
    let other = RecordKey::new(8, 1, "sku-x");
    let key = RecordKey::new(7, 42, "sku-1");
    for (k, seq) in [(&other, 10), (&key, 11)] {
        let batch = created(k, seq).encode_to_vec();
        publish(&js, subjects.changes(k.brand_id, k.place_id), msg_type::CHANGE_BATCH, batch)
            .await?;
    }

    let lines = json_lines(&ok(&env, &["tail", "--from-start", "--limit", "1"]).await?)?;
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["key"]["brand_id"], 8);

    let lines = json_lines(
        &ok(&env, &["tail", "--from-start", "--limit", "1", "--brand", "7", "--place", "42"])
            .await?,
    )?;
    assert_eq!(lines.len(), 1, "{lines:?}");
    let line = &lines[0];
    assert_eq!(line["kind"], "created");
    assert_eq!(line["key"]["product_id"], "sku-1");
    assert!(line["before"].is_null());
    assert_eq!(line["after"]["data"]["price"], 349_000);
    assert_eq!(line["after"]["data"]["stock"], 0);
    assert_eq!(line["changed_data_fields"], serde_json::json!(["title", "price", "stock"]));
    assert_eq!(line["origin"]["source"], "flowers");
    assert_eq!(line["command_seq"], 11);
    assert_eq!(line["partition"], 2);

    let rejects = RejectionBatch {
        rejections: vec![Rejection {
            reason: "conflict".into(),
            detail: "updated_at moved".into(),
            key: Some(key.clone()),
            ..Default::default()
        }],
    };
    publish(&js, subjects.rejects(7, 42), msg_type::REJECTION_BATCH, rejects.encode_to_vec())
        .await?;
    let lines =
        json_lines(&ok(&env, &["tail", "--rejects", "--from-start", "--limit", "1"]).await?)?;
    assert_eq!(lines[0]["reason"], "conflict");
    assert_eq!(lines[0]["key"]["product_id"], "sku-1");
    Ok(())
}

#[tokio::test]
async fn tail_without_from_start_prints_only_new_changes() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    ok(&env, &["setup"]).await?;
    let js = jetstream(&env).await?;
    let subject = Subjects::new(&env.prefix).changes(7, 42);
    let key = RecordKey::new(7, 42, "sku-1");
    let old = created(&key, 1).encode_to_vec();
    publish(&js, subject.clone(), msg_type::CHANGE_BATCH, old).await?;

    let mut tail = shelfsync(&env, &["tail", "--limit", "1"]).spawn()?;
    // The consumer starts at some point after spawn; publish new changes
    // until the tail has printed one and exited.
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        let new = created(&key, 2).encode_to_vec();
        publish(&js, subject.clone(), msg_type::CHANGE_BATCH, new).await?;
        if let Some(status) = wait(&mut tail, Instant::now() + Duration::from_millis(200)).await? {
            break status;
        }
        anyhow::ensure!(Instant::now() < deadline, "tail printed nothing in {TIMEOUT:?}");
    };
    let out = tail.wait_with_output().await?;
    assert!(status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = json_lines(&String::from_utf8(out.stdout)?)?;
    assert_eq!(lines.len(), 1);
    assert_eq!(
        lines[0]["command_seq"], 2,
        "the change published before the tail started was printed"
    );
    Ok(())
}

#[tokio::test]
async fn gen_feed_is_deterministic_and_needs_no_servers() -> anyhow::Result<()> {
    let gen_feed = |seed: &'static str| async move {
        Command::new(env!("CARGO_BIN_EXE_shelfsync"))
            .args(["gen-feed", "--places", "3", "--items", "20", "--format", "ndjson"])
            .args(["--seed", seed, "--churn", "0.2", "--churn-seed", "4"])
            .env_clear()
            .env("SHELFSYNC__NATS__URL", "nats://127.0.0.1:1")
            .kill_on_drop(true)
            .output()
            .await
    };
    let (a, b, c) = (gen_feed("1").await?, gen_feed("1").await?, gen_feed("2").await?);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert_eq!(a.stdout, b.stdout);
    assert_ne!(a.stdout, c.stdout);
    assert_eq!(json_lines(&String::from_utf8(a.stdout)?)?.len(), 60);
    let summary = String::from_utf8(a.stderr)?;
    assert!(summary.contains("60 items in 3 places"), "{summary}");
    Ok(())
}

#[tokio::test]
async fn import_runs_one_import_and_reports() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    ok(&env, &["setup"]).await?;
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("shelfsync.toml");
    std::fs::write(
        &config,
        "[[partners]]\nname = \"flowers\"\nbrand_id = 7\nkind = \"full\"\n\n\
         [[partners]]\nname = \"prices\"\nbrand_id = 7\nkind = \"delta\"\nfields = [\"price\", \"old_price\"]\n",
    )?;
    let config = config.to_str().context("utf-8 path")?;
    let feed = dir.path().join("feed.ndjson");
    let spec = shelfsync_cli::genfeed::FeedSpec {
        places: 2,
        items_per_place: 50,
        format: shelfsync_cli::genfeed::Format::Ndjson,
        ..Default::default()
    };
    shelfsync_cli::genfeed::write_feed(&spec, std::fs::File::create(&feed)?)?;
    let feed = feed.to_str().context("utf-8 path")?;

    let report: Value = serde_json::from_str(
        &ok(&env, &["import", "--config", config, "--partner", "flowers", feed, "--json"]).await?,
    )?;
    assert_eq!(report["status"], "completed", "{report:#}");
    assert_eq!(report["items"], 100);
    assert_eq!(report["rejected_total"], 0);
    let batches = report["batches"].as_u64().context("batches")?;
    assert!(batches >= 1);

    // The commands are on the CMD stream (no storage runs here to take them).
    let stats: Value = serde_json::from_str(&ok(&env, &["stats", "--json"]).await?)?;
    assert!(stats["flow"]["command_messages_published"].as_u64() >= Some(batches), "{stats:#}");

    // The human report, from a delta partner.
    let text = ok(&env, &["import", "--config", config, "--partner", "prices", feed]).await?;
    assert!(text.contains("completed"), "{text}");

    let unknown = run(&env, &["import", "--config", config, "--partner", "nope", feed]).await?;
    assert_eq!(unknown.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&unknown.stderr);
    assert!(stderr.contains("flowers, prices"), "{stderr}");

    let not_json = dir.path().join("feed.txt");
    std::fs::write(&not_json, "this is not a feed\n")?;
    let failed = run(
        &env,
        &[
            "import",
            "--config",
            config,
            "--partner",
            "flowers",
            not_json.to_str().context("utf-8")?,
            "--json",
        ],
    )
    .await?;
    assert_eq!(failed.status.code(), Some(1));
    let report: Value = serde_json::from_slice(&failed.stdout)?;
    assert_eq!(report["status"], "failed");
    assert!(String::from_utf8_lossy(&failed.stderr).contains("failed"));
    Ok(())
}

#[tokio::test]
async fn keyframe_gathers_replies_or_says_nobody_listens() -> anyhow::Result<()> {
    use shelfsync_proto::{KeyframeReply, KeyframeRequest};

    let env = TestEnv::start().await?;
    let nobody = run(&env, &["keyframe", "--timeout", "10s"]).await?;
    assert_eq!(nobody.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&nobody.stderr);
    assert!(stderr.contains("no storage replica"), "{stderr}");

    // A stand-in for the storage replica: answers one request.
    let client = async_nats::connect(env.nats.url()).await?;
    let mut requests = client.subscribe(Subjects::new(&env.prefix).ctl_keyframe()).await?;
    client.flush().await?;
    let responder = tokio::spawn(async move {
        use futures::StreamExt;
        let msg = requests.next().await.context("no request")?;
        let req = KeyframeRequest::decode(msg.payload.as_ref())?;
        let reply = KeyframeReply {
            keyframe_id: req.keyframe_id.clone(),
            places: 1,
            records: (req.brand_id * 100 + req.place_id) as u64,
            ..Default::default()
        };
        client
            .publish(msg.reply.context("no reply subject")?, reply.encode_to_vec().into())
            .await?;
        client.flush().await?;
        anyhow::Ok(req)
    });
    let out =
        ok(&env, &["keyframe", "--brand", "7", "--place", "42", "--id", "kf-1", "--json"]).await?;
    let req = responder.await??;
    assert_eq!((req.brand_id, req.place_id, req.keyframe_id.as_str()), (7, 42, "kf-1"));
    let lines = json_lines(&out)?;
    assert_eq!(lines.len(), 1, "{out}");
    assert_eq!(lines[0]["keyframe_id"], "kf-1");
    assert_eq!(lines[0]["records"], 742);
    assert!(lines[0]["error"].is_null());
    Ok(())
}
