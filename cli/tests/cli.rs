//! The `shelfsync` binary against real `nats-server` and `redis-server`
//! processes (one pair per test, from `shelfsync_testkit`), configured only
//! through `SHELFSYNC__…` variables on the child process. Verbs that talk to
//! storage get a real one, running in the test process
//! (`shelfsync_storage::App`) on the same servers and namespace.

use std::process::{ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use prost::Message;
use serde_json::Value;
use shelfsync_bus::{Subjects, partition_of};
use shelfsync_proto::{
    Change, ChangeBatch, ChangeKind, CommandBatch, CommandKind, Origin, Product, Record, RecordKey,
    Rejection, RejectionBatch, msg_type,
};
use shelfsync_service::Service as _;
use shelfsync_settings::Settings;
use shelfsync_testkit::{TestEnv, stdout_of_success};
use tokio::process::{Child, Command};
use tokio::sync::oneshot;

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
    run_env(env, args, &[]).await
}

/// As [`run`], with more variables set on the child process.
async fn run_env(env: &TestEnv, args: &[&str], vars: &[(&str, &str)]) -> anyhow::Result<Output> {
    let mut cmd = shelfsync(env, args);
    cmd.envs(vars.iter().copied());
    let out = tokio::time::timeout(TIMEOUT, cmd.output())
        .await
        .with_context(|| format!("shelfsync {args:?} did not finish in {TIMEOUT:?}"))??;
    Ok(out)
}

/// Runs and requires success; returns stdout.
async fn ok(env: &TestEnv, args: &[&str]) -> anyhow::Result<String> {
    stdout_of_success(args, run(env, args).await?)
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
            ..Default::default()
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

/// The settings `shelfsync()` hands the CLI, for a storage run by the test.
fn settings(env: &TestEnv) -> Settings {
    let mut s = env.settings();
    s.storage.partitions = 4;
    s.storage.retry_delay = Duration::from_millis(100);
    s.storage.ack_wait = Duration::from_secs(5);
    // Redriven outbox entries go out at the next purge tick.
    s.storage.purge_interval = Duration::from_millis(200);
    s.storage.keyframe_schedule = String::new();
    s.storage.http_listen = "127.0.0.1:0".into();
    s.telemetry.log_level = "warn".into();
    s
}

/// A storage running in the test process, stopped on drop.
struct Storage {
    _stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Drop for Storage {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts storage (it provisions the streams) and waits until its read
/// API answers.
async fn storage(env: &TestEnv) -> anyhow::Result<Storage> {
    let app = shelfsync_storage::App::build(settings(env)).await?;
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(app.run_until(async move {
        let _ = stopped.await;
    }));
    let client = async_nats::connect(env.nats.url()).await?;
    let subject = Subjects::new(&env.prefix).read("get");
    let probe = shelfsync_proto::ReadRequest {
        brand_id: 1,
        place_id: 1,
        product_ids: vec!["probe".into()],
        ..Default::default()
    }
    .encode_to_vec();
    let deadline = Instant::now() + TIMEOUT;
    while client.request(subject.clone(), probe.clone().into()).await.is_err() {
        anyhow::ensure!(Instant::now() < deadline, "storage's read API did not answer");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(Storage { _stop: stop, task })
}

/// A PATCH of `key` with a title and `price`, from a full import of
/// `generation`.
fn patch(key: &RecordKey, price: i64, generation: i64) -> shelfsync_proto::Command {
    shelfsync_proto::Command {
        key: Some(key.clone()),
        kind: CommandKind::Patch as i32,
        data: Product { title: Some("Tulips".into()), price: Some(price), ..Default::default() }
            .encode_to_vec(),
        generation,
        origin: Some(Origin {
            source: "flowers".into(),
            import_id: "imp-1".into(),
            published_at: 0,
        }),
        ..Default::default()
    }
}

/// Publishes `batch` on the command subject of (brand, place).
async fn send_commands(
    js: &async_nats::jetstream::Context,
    env: &TestEnv,
    brand: i64,
    place: i64,
    mut batch: CommandBatch,
) -> anyhow::Result<()> {
    let partition = partition_of(brand, place, 4);
    batch.partition = partition.0;
    let subject = Subjects::new(&env.prefix).cmd_for(partition, !batch.sweeps.is_empty());
    publish(js, subject, msg_type::COMMAND_BATCH, batch.encode_to_vec()).await
}

/// Runs `shelfsync ARGS` until `done` accepts its output, or fails at the
/// deadline with the last output.
async fn run_until(
    env: &TestEnv,
    args: &[&str],
    vars: &[(&str, &str)],
    done: impl Fn(&Output) -> bool,
) -> anyhow::Result<Output> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let out = run_env(env, args, vars).await?;
        if done(&out) {
            return Ok(out);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "shelfsync {args:?} never gave the expected output; last ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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

/// `consumers` reports what JetStream itself knows of each consumer: a
/// stalled one (created, never pulled) has every message pending and was
/// never delivered to; one that took a message and never acked it has it
/// ack-pending and redelivered; one that acked everything has nothing
/// pending and a last ack. Before `setup` there is nothing to list (exit 3).
#[tokio::test]
async fn consumers_shows_pending_redeliveries_and_last_activity_from_jetstream()
-> anyhow::Result<()> {
    use async_nats::jetstream::consumer::{AckPolicy, pull};
    use futures::StreamExt;

    let env = TestEnv::start().await?;
    let (c, e) = code(&run(&env, &["consumers"]).await?);
    assert_eq!(c, Some(3), "{e}");
    assert!(e.contains("shelfsync setup"), "{e}");

    ok(&env, &["setup"]).await?;
    let subjects = Subjects::new(&env.prefix);
    let js = jetstream(&env).await?;
    let key = RecordKey::new(7, 1, "rose");
    for seq in 1..=3 {
        let payload = created(&key, seq).encode_to_vec();
        publish(&js, subjects.changes(7, 1), msg_type::CHANGE_BATCH, payload).await?;
    }
    let changes = js.get_stream(subjects.changes_stream()).await?;
    let durable = |name: &str, ack_wait: Duration| pull::Config {
        durable_name: Some(name.into()),
        ack_policy: AckPolicy::Explicit,
        ack_wait,
        ..Default::default()
    };
    changes.create_consumer(durable("stalled", Duration::from_secs(30))).await?;
    // Takes one message, never acks it, and takes it again once it is due
    // (one in flight at most: the second pull waits for the redelivery).
    let slow = pull::Config { max_ack_pending: 1, ..durable("slow", Duration::from_secs(1)) };
    let slow = changes.create_consumer(slow).await?;
    for _ in 0..2 {
        let mut batch =
            slow.batch().max_messages(1).expires(Duration::from_secs(5)).messages().await?;
        batch.next().await.context("a message for `slow`")?.map_err(|e| anyhow::anyhow!(e))?;
    }
    let done = changes.create_consumer(durable("done", Duration::from_secs(30))).await?;
    let mut batch = done.fetch().max_messages(3).messages().await?;
    while let Some(msg) = batch.next().await {
        msg.map_err(|e| anyhow::anyhow!(e))?.double_ack().await.map_err(|e| anyhow::anyhow!(e))?;
    }

    let report: Value = serde_json::from_str(&ok(&env, &["consumers", "--json"]).await?)?;
    let by_name = |name: &str| -> anyhow::Result<Value> {
        let all = report["consumers"].as_array().context("consumers")?;
        all.iter()
            .find(|c| c["name"] == name)
            .cloned()
            .with_context(|| format!("{name}: {report:#}"))
    };
    let stalled = by_name("stalled")?;
    assert_eq!(stalled["stream"], subjects.changes_stream());
    assert_eq!(stalled["role"], "changes");
    assert_eq!(stalled["durable"], true);
    assert_eq!((&stalled["pending"], &stalled["ack_pending"]), (&3.into(), &0.into()));
    assert!(stalled["last_delivered"].is_null() && stalled["last_acked"].is_null(), "{stalled:#}");
    let slow = by_name("slow")?;
    assert_eq!(slow["pending"], 2, "{slow:#}");
    assert_eq!(slow["ack_pending"], 1, "{slow:#}");
    assert_eq!(slow["redelivered"], 1, "{slow:#}");
    assert_eq!(slow["delivered_seq"], 1, "{slow:#}");
    assert!(slow["last_delivered"].is_string() && slow["last_acked"].is_null(), "{slow:#}");
    let done = by_name("done")?;
    assert_eq!((&done["pending"], &done["ack_pending"]), (&0.into(), &0.into()), "{done:#}");
    assert_eq!(done["ack_floor_seq"], 3, "{done:#}");
    assert!(done["last_acked_ago_s"].as_f64().is_some_and(|s| s < 60.0), "{done:#}");
    // Storage's consumers of CMD are listed too when they exist; here none.
    assert_eq!(report["consumers"].as_array().map(Vec::len), Some(3), "{report:#}");

    let table = ok(&env, &["consumers"]).await?;
    let row = table.lines().find(|l| l.contains("stalled")).context(table.clone())?;
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells[..4], ["changes", "stalled", "3", "0"], "{table}");
    assert!(row.contains("never") && row.ends_with("durable"), "{table}");
    assert!(table.contains("ack pending") && table.contains("last acked"), "{table}");

    // One stream, by role or by name; a stream that is not one of ours is bad input.
    let only: Value = serde_json::from_str(
        &ok(&env, &["consumers", "--stream", &subjects.changes_stream(), "--json"]).await?,
    )?;
    assert_eq!(only["consumers"].as_array().map(Vec::len), Some(3), "{only:#}");
    let none: Value =
        serde_json::from_str(&ok(&env, &["consumers", "--stream", "cmd", "--json"]).await?)?;
    assert_eq!(none["consumers"].as_array().map(Vec::len), Some(0), "{none:#}");
    let (c, e) = code(&run(&env, &["consumers", "--stream", "nope"]).await?);
    assert_eq!(c, Some(2), "{e}");
    Ok(())
}

/// `--config` given twice, or `SHELFSYNC_CONFIG` with two files: the second
/// file overrides the first key by key.
#[tokio::test]
async fn config_files_layer_in_order_from_flags_and_from_shelfsync_config() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let dir = tempfile::tempdir()?;
    let common = dir.path().join("common.toml");
    let own = dir.path().join("own.toml");
    std::fs::write(&common, "[nats]\ncmd_max_bytes = 1048576\nrejects_max_bytes = 3145728\n")?;
    std::fs::write(&own, "[nats]\ncmd_max_bytes = 2097152\n")?;
    let (common, own) = (common.to_string_lossy(), own.to_string_lossy());
    let subjects = Subjects::new(&env.prefix);
    let js = jetstream(&env).await?;
    let limits = |name: String| {
        let js = js.clone();
        async move { anyhow::Ok(js.get_stream(name).await?.info().await?.config.max_bytes) }
    };

    ok(&env, &["--config", &common, "--config", &own, "setup"]).await?;
    assert_eq!(limits(subjects.cmd_stream()).await?, 2 << 20);
    assert_eq!(limits(subjects.rejects_stream()).await?, 3 << 20);

    // The other order, through the environment: the common file wins now.
    let out = tokio::time::timeout(
        TIMEOUT,
        shelfsync(&env, &["setup"]).env("SHELFSYNC_CONFIG", format!("{own}:{common}")).output(),
    )
    .await??;
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(limits(subjects.cmd_stream()).await?, 1 << 20);
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
    assert_eq!(unknown.status.code(), Some(3), "an unknown partner is not found");
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
    assert_eq!(nobody.status.code(), Some(5), "nobody listening is unavailable");
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

/// The `command_seq` of each line `shelfsync ARGS` prints.
async fn seqs(env: &TestEnv, args: &[&str]) -> anyhow::Result<Vec<Option<u64>>> {
    let lines = json_lines(&ok(env, args).await?)?;
    Ok(lines.iter().map(|l| l["command_seq"].as_u64()).collect())
}

/// `code` and stderr of a run, for assertion messages.
fn code(out: &Output) -> (Option<i32>, String) {
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Each kind of failure has its exit code, and `--help` lists them.
#[tokio::test]
async fn exit_codes_tell_failures_apart() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;

    let help = ok(&env, &["--help"]).await?;
    assert!(help.contains("Exit codes:"), "{help}");
    for line in ["0  success", "2  bad input", "3  not found", "4  timeout", "5  unavailable"] {
        assert!(help.contains(line), "{line:?} not in --help:\n{help}");
    }

    // 2: usage, and settings that do not validate.
    let (c, e) = code(&run(&env, &["tail", "--from-start", "--last", "3"]).await?);
    assert_eq!(c, Some(2), "{e}");
    let (c, e) = code(&run(&env, &["tail", "--since", "the day before"]).await?);
    assert_eq!(c, Some(2), "{e}");
    let (c, e) =
        code(&run_env(&env, &["stats"], &[("SHELFSYNC__STORAGE__PARTITIONS", "0")]).await?);
    assert_eq!(c, Some(2), "{e}");
    assert!(e.contains("storage.partitions"), "{e}");

    // 3: a stream that does not exist (no setup yet).
    let (c, e) = code(&run(&env, &["tail", "--from-start", "--limit", "1"]).await?);
    assert_eq!(c, Some(3), "{e}");
    assert!(e.contains("shelfsync setup"), "{e}");

    // 5: NATS not reachable; no storage listening.
    let away = [("SHELFSYNC__NATS__URL", "nats://127.0.0.1:1")];
    let (c, e) = code(&run_env(&env, &["stats"], &away).await?);
    assert_eq!(c, Some(5), "{e}");
    ok(&env, &["setup"]).await?;
    let (c, e) = code(&run(&env, &["sweeps"]).await?);
    assert_eq!(c, Some(5), "{e}");
    assert!(e.contains("no storage replica"), "{e}");

    // 4: a command queued and no storage to apply it.
    let js = jetstream(&env).await?;
    let key = RecordKey::new(7, 42, "sku-1");
    let batch = CommandBatch { commands: vec![patch(&key, 100, 0)], ..Default::default() };
    send_commands(&js, &env, 7, 42, batch).await?;
    let (c, e) = code(&run(&env, &["wait", "--timeout", "300ms"]).await?);
    assert_eq!(c, Some(4), "{e}");
    assert!(e.contains("not settled"), "{e}");
    Ok(())
}

/// Every verb and every argument explains itself in `--help`, and the
/// definition passes clap's own checks.
#[test]
fn every_verb_and_argument_has_help() {
    use clap::CommandFactory;

    fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
        for arg in cmd.get_arguments() {
            if arg.get_help().is_none() && arg.get_long_help().is_none() {
                missing.push(format!("{path} {}", arg.get_id()));
            }
        }
        for sub in cmd.get_subcommands() {
            let here = format!("{path} {}", sub.get_name());
            if sub.get_about().is_none() && sub.get_long_about().is_none() {
                missing.push(here.clone());
            }
            walk(sub, &here, missing);
        }
    }
    let cmd = shelfsync_cli::Cli::command();
    cmd.clone().debug_assert();
    let mut missing = Vec::new();
    walk(&cmd, "shelfsync", &mut missing);
    assert!(missing.is_empty(), "no help text: {missing:#?}");
    // The walk saw the verbs (not an empty command).
    for verb in ["tail", "dead-letters", "sweeps", "config", "completions"] {
        assert!(cmd.find_subcommand(verb).is_some(), "{verb}");
    }
}

#[tokio::test]
async fn completions_are_generated_for_each_shell() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    for (shell, marker) in [
        ("bash", "_shelfsync()"),
        ("zsh", "#compdef shelfsync"),
        ("fish", "complete -c shelfsync"),
        ("elvish", "shelfsync"),
        ("powershell", "Register-ArgumentCompleter"),
    ] {
        let script = ok(&env, &["completions", shell]).await?;
        assert!(script.contains(marker), "{shell}: {marker:?} missing");
        assert!(script.contains("dead-letters"), "{shell}: verbs missing");
    }
    let (c, e) = code(&run(&env, &["completions", "tcsh"]).await?);
    assert_eq!(c, Some(2), "{e}");
    Ok(())
}

/// `shelfsync` with nothing but `vars` in its environment (no test servers).
async fn bare(args: &[&str], vars: &[(&str, &str)]) -> anyhow::Result<Output> {
    let out = Command::new(env!("CARGO_BIN_EXE_shelfsync"))
        .args(args)
        .env_clear()
        .envs(vars.iter().copied())
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    Ok(tokio::time::timeout(TIMEOUT, out).await??)
}

#[tokio::test]
async fn config_check_prints_the_resolved_settings_with_secrets_redacted() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let common = dir.path().join("common.toml");
    let own = dir.path().join("own.toml");
    std::fs::write(
        &common,
        r#"
[nats]
url = "nats://admin:s3cret-pass@nats-a:4222,nats://nats-b:4222"
user = "admin"
password = "hunter2-nats"
credentials_file = "/run/secrets/admin.creds"
[redis]
url = "redis://:redis-pw-42@redis:6379/0"
[storage]
partitions = 8
[[partners]]
name = "flowers"
brand_id = 7
kind = "full"
push_tokens_file = "/run/secrets/flowers-tokens"
push_tokens_env = "FLOWERS_TOKENS"
"#,
    )?;
    std::fs::write(&own, "[nats]\ntoken = \"tok-abcdef\"\n[storage]\npartitions = 16\n")?;
    let (common, own) = (common.to_string_lossy(), own.to_string_lossy());
    let vars = [("SHELFSYNC__STORAGE__REPLICAS", "2")];
    let args = ["--config", &*common, "--config", &*own, "config", "check"];

    let out = bare(&args, &vars).await?;
    let text = String::from_utf8(out.stdout)?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for secret in ["s3cret", "hunter2", "tok-abc", "redis-pw"] {
        assert!(!text.contains(secret), "{secret} printed:\n{text}");
    }
    let t: toml::Table = toml::from_str(&text).with_context(|| format!("not TOML:\n{text}"))?;
    assert_eq!(t["nats"]["url"].as_str(), Some("nats://admin:***@nats-a:4222,nats://nats-b:4222"));
    assert_eq!(t["nats"]["user"].as_str(), Some("admin"));
    assert_eq!(t["nats"]["password"].as_str(), Some("***"));
    assert_eq!(t["nats"]["token"].as_str(), Some("***"));
    assert_eq!(t["nats"]["credentials_file"].as_str(), Some("/run/secrets/admin.creds"));
    assert_eq!(t["redis"]["url"].as_str(), Some("redis://:***@redis:6379/0"));
    // The later file and the environment win.
    assert_eq!(t["storage"]["partitions"].as_integer(), Some(16));
    assert_eq!(t["storage"]["replicas"].as_integer(), Some(2));
    assert_eq!(t["storage"]["ack_wait"].as_str(), Some("30s"));
    let partner = &t["partners"][0];
    assert_eq!(partner["push_tokens_file"].as_str(), Some("/run/secrets/flowers-tokens"));
    assert_eq!(partner["push_tokens_env"].as_str(), Some("FLOWERS_TOKENS"));
    let stderr = String::from_utf8(out.stderr)?;
    assert!(stderr.contains("SHELFSYNC__STORAGE__REPLICAS"), "{stderr}");
    // What it prints is a settings file that loads to the same settings.
    let resolved = dir.path().join("resolved.toml");
    std::fs::write(&resolved, &text)?;
    let again = bare(&["--config", &resolved.to_string_lossy(), "config", "check"], &[]).await?;
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(String::from_utf8(again.stdout)?, text);

    let out = bare(&[&args[..], &["--format", "json"]].concat(), &vars).await?;
    let j: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(j["nats"]["password"], "***");
    assert_eq!(j["redis"]["url"], "redis://:***@redis:6379/0");
    assert_eq!(j["storage"]["partitions"], 16);

    // Invalid: the reason, exit 2.
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[storage]\npartitions = 0\n")?;
    let out = bare(&["--config", &bad.to_string_lossy(), "config", "check"], &[]).await?;
    let (c, e) = code(&out);
    assert_eq!(c, Some(2), "{e}");
    assert!(e.contains("storage.partitions"), "{e}");
    assert!(out.stdout.is_empty());
    std::fs::write(&bad, "[nats]\nbogus = 1\n")?;
    let (c, e) = code(&bare(&["--config", &bad.to_string_lossy(), "config", "check"], &[]).await?);
    assert_eq!(c, Some(2), "{e}");
    assert!(e.contains("bogus"), "{e}");
    let (c, e) = code(&bare(&["--config", "/nonexistent.toml", "config", "check"], &[]).await?);
    assert_eq!(c, Some(2), "{e}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_reads_through_storage_and_exits_3_when_missing() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    ok(&env, &["setup"]).await?;
    let (c, e) = code(&run(&env, &["get", "7", "42", "sku-1"]).await?);
    assert_eq!(c, Some(5), "no storage runs: {e}");

    let _storage = storage(&env).await?;
    let js = jetstream(&env).await?;
    let key = RecordKey::new(7, 42, "sku-1");
    let batch = CommandBatch { commands: vec![patch(&key, 1990, 0)], ..Default::default() };
    send_commands(&js, &env, 7, 42, batch).await?;
    // No Redis for the CLI: the read goes through storage.
    let no_redis = [("SHELFSYNC__REDIS__URL", "redis://127.0.0.1:1")];
    let out =
        run_until(&env, &["get", "7", "42", "sku-1"], &no_redis, |o| o.status.success()).await?;
    let record: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(record["key"]["product_id"], "sku-1", "{record:#}");
    assert_eq!(record["key"]["brand_id"], 7);
    assert_eq!(record["data"]["price"], 1990);
    assert_eq!(record["data"]["title"], "Tulips");

    let out = run_env(&env, &["get", "7", "42", "sku-nope"], &no_redis).await?;
    let (c, e) = code(&out);
    assert_eq!(c, Some(3), "{e}");
    assert!(e.contains("not found"), "{e}");
    assert!(out.stdout.is_empty());
    Ok(())
}

#[tokio::test]
async fn tail_starts_where_asked_and_reads_every_stream() -> anyhow::Result<()> {
    use base64::Engine as _;
    use shelfsync_proto::{AggregateChange, CategoryFlip, KeyframeBatch, MasterCard};

    let env = TestEnv::start().await?;
    ok(&env, &["setup"]).await?;
    let js = jetstream(&env).await?;
    let subjects = Subjects::new(&env.prefix);
    let keys = [
        RecordKey::new(7, 42, "sku-1"),
        RecordKey::new(7, 42, "sku-2"),
        RecordKey::new(8, 1, "sku-x"),
        RecordKey::new(7, 42, "sku-3"),
    ];
    for (i, k) in keys.iter().enumerate() {
        let batch = created(k, i as u64 + 1).encode_to_vec();
        publish(&js, subjects.changes(k.brand_id, k.place_id), msg_type::CHANGE_BATCH, batch)
            .await?;
    }
    assert_eq!(seqs(&env, &["tail", "--start-seq", "2", "--limit", "1"]).await?, [Some(2)]);
    assert_eq!(
        seqs(&env, &["tail", "--last", "2", "--brand", "7", "--limit", "2"]).await?,
        [Some(2), Some(4)]
    );
    assert_eq!(seqs(&env, &["tail", "--last", "1", "--limit", "1"]).await?, [Some(4)]);
    assert_eq!(
        seqs(&env, &["tail", "--last", "10", "--brand", "8", "--limit", "1"]).await?,
        [Some(3)]
    );
    assert_eq!(seqs(&env, &["tail", "--since", "1h", "--limit", "1"]).await?, [Some(1)]);
    let stream = js.get_stream(subjects.changes_stream()).await?;
    let third = stream.get_raw_message(3).await?.time.unix_timestamp_nanos();
    let third = chrono::DateTime::from_timestamp_nanos(i64::try_from(third)?)
        .to_rfc3339_opts(chrono::SecondsFormat::Nanos, true);
    assert_eq!(seqs(&env, &["tail", "--since", &third, "--limit", "1"]).await?, [Some(3)]);
    assert_eq!(
        seqs(&env, &["tail", "--product", "sku-3", "--from-start", "--limit", "1"]).await?,
        [Some(4)]
    );

    let raw = ok(&env, &["tail", "--raw", "--from-start", "--limit", "2"]).await?;
    let lines: Vec<&str> = raw.lines().collect();
    assert_eq!(lines.len(), 2, "{raw}");
    let bytes = base64::engine::general_purpose::STANDARD.decode(lines[1])?;
    assert_eq!(ChangeBatch::decode(bytes.as_slice())?, created(&keys[1], 2));

    let keyframe = KeyframeBatch {
        keyframe_id: "kf-1".into(),
        brand_id: 7,
        place_id: 42,
        records: vec![record(&keys[0], 349_000, 1_700_000_000_000_001)],
        last: true,
        total: 1,
        digest: 99,
        ..Default::default()
    };
    publish(&js, subjects.keyframes(7, 42), msg_type::KEYFRAME_BATCH, keyframe.encode_to_vec())
        .await?;
    let lines =
        json_lines(&ok(&env, &["tail", "--keyframes", "--from-start", "--limit", "2"]).await?)?;
    assert_eq!(lines[0]["key"]["product_id"], "sku-1", "{lines:?}");
    assert_eq!(lines[0]["data"]["price"], 349_000);
    assert_eq!(lines[0]["keyframe_id"], "kf-1");
    assert_eq!(lines[1]["kind"], "keyframe_end");
    assert_eq!((lines[1]["total"].as_u64(), lines[1]["digest"].as_u64()), (Some(1), Some(99)));

    let card = AggregateChange {
        card: Some(MasterCard {
            region: "north".into(),
            product_id: "sku-1".into(),
            min_price: Some(1990),
            offers: 2,
            cheapest: Some(keys[0].clone()),
            currency: Some("EUR".into()),
        }),
        category: None,
        at: 1_700_000_000_000_000,
    };
    let flip = AggregateChange {
        card: None,
        category: Some(CategoryFlip {
            brand_id: 7,
            place_id: 42,
            category: "tulips".into(),
            non_empty: true,
        }),
        at: 1_700_000_000_000_001,
    };
    publish(
        &js,
        subjects.aggregates_card("north"),
        msg_type::AGGREGATE_CHANGE,
        card.encode_to_vec(),
    )
    .await?;
    let flip_subject = subjects.aggregates_category(7, 42);
    publish(&js, flip_subject, msg_type::AGGREGATE_CHANGE, flip.encode_to_vec()).await?;
    let lines =
        json_lines(&ok(&env, &["tail", "--aggregates", "--from-start", "--limit", "2"]).await?)?;
    assert_eq!(lines[0]["kind"], "card", "{lines:?}");
    assert_eq!(lines[0]["min_price"], 1990);
    assert_eq!(lines[0]["cheapest"]["place_id"], 42);
    assert_eq!(lines[1]["kind"], "category");
    assert_eq!(lines[1]["category"], "tulips");
    let lines = json_lines(
        &ok(&env, &["tail", "--aggregates", "--brand", "7", "--from-start", "--limit", "1"])
            .await?,
    )?;
    assert_eq!(lines[0]["kind"], "category", "{lines:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_sweeps_are_shown_then_applied() -> anyhow::Result<()> {
    use shelfsync_proto::{Sweep, SweepGuard};

    let env = TestEnv::start().await?;
    ok(&env, &["setup"]).await?;
    let _storage = storage(&env).await?;
    let js = jetstream(&env).await?;
    let commands = ["sku-1", "sku-2"].map(|id| patch(&RecordKey::new(7, 42, id), 100, 100));
    let batch = CommandBatch { commands: commands.to_vec(), ..Default::default() };
    send_commands(&js, &env, 7, 42, batch).await?;
    run_until(&env, &["get", "7", "42", "sku-2"], &[], |o| o.status.success()).await?;
    // A full import that accepted nothing in the place: held.
    let sweep = Sweep {
        brand_id: 7,
        place_id: 42,
        generation: 200,
        source: "flowers".into(),
        import_id: "imp-2".into(),
        guard: Some(SweepGuard { accepted: 0, max_fraction: 0.5, missing: false }),
        release_held: false,
    };
    send_commands(&js, &env, 7, 42, CommandBatch { sweeps: vec![sweep], ..Default::default() })
        .await?;
    let out = run_until(&env, &["sweeps", "--json"], &[], |o| !o.stdout.is_empty()).await?;
    let held = json_lines(&String::from_utf8(out.stdout)?)?;
    assert_eq!(held[0]["import_id"], "imp-2", "{held:?}");

    let shown = json_lines(&ok(&env, &["sweeps", "show", "imp-2", "--json"]).await?)?;
    assert_eq!(shown.len(), 1, "{shown:?}");
    assert_eq!(shown[0]["status"], "held");
    assert_eq!(shown[0]["reason"], "no_item_accepted");
    assert_eq!(
        (shown[0]["live"].as_u64(), shown[0]["would_mark_absent"].as_u64()),
        (Some(2), Some(2))
    );
    let (c, e) = code(&run(&env, &["sweeps", "show", "imp-nope"]).await?);
    assert_eq!(c, Some(3), "{e}");

    let applied = json_lines(&ok(&env, &["sweep", "--import", "imp-2", "--json"]).await?)?;
    assert_eq!(applied[0]["status"], "applied", "{applied:?}");
    // Nothing held any more: the places must be named.
    let (c, e) = code(&run(&env, &["sweeps", "show", "imp-2"]).await?);
    assert_eq!(c, Some(3), "{e}");
    assert!(e.contains("--place"), "{e}");
    let (c, e) = code(&run(&env, &["sweep", "--import", "imp-2"]).await?);
    assert_eq!(c, Some(3), "{e}");
    let shown = json_lines(
        &ok(&env, &["sweeps", "show", "imp-2", "--brand", "7", "--place", "42", "--json"]).await?,
    )?;
    assert_eq!(shown[0]["status"], "applied", "{shown:?}");
    assert_eq!(shown[0]["marked_absent"], 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_dead_letters_are_shown_and_redriven() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    ok(&env, &["setup"]).await?;
    let _storage = storage(&env).await?;
    let key = RecordKey::new(7, 42, "sku-1");
    let entry = shelfsync_proto::OutboxEntry {
        subject: Subjects::new(&env.prefix).changes(7, 42),
        msg_id: "chg:1:77:0".into(),
        payload: created(&key, 77).encode_to_vec().into(),
        msg_type: msg_type::CHANGE_BATCH.into(),
        ..Default::default()
    };
    let store = shelfsync_storage::client::Store::connect(&settings(&env).redis).await?;
    store.outbox_bury(shelfsync_bus::Partition(1), &entry).await?;

    let listed = json_lines(&ok(&env, &["dead-letters", "--json"]).await?)?;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        (listed[0]["msg_id"].as_str(), listed[0]["partition"].as_u64()),
        (Some("chg:1:77:0"), Some(1))
    );
    let shown: Value =
        serde_json::from_str(&ok(&env, &["dead-letters", "show", "chg:1:77:0"]).await?)?;
    assert_eq!(shown["payload"]["command_seq"], 77, "{shown:#}");
    assert_eq!(shown["payload"]["changes"][0]["key"]["product_id"], "sku-1");
    assert_eq!(shown["payload"]["changes"][0]["after"]["data"]["price"], 349_000);
    let (c, e) = code(&run(&env, &["dead-letters", "show", "chg:9:9:9"]).await?);
    assert_eq!(c, Some(3), "{e}");
    let (c, e) = code(&run(&env, &["dead-letters", "redrive", "chg:9:9:9"]).await?);
    assert_eq!(c, Some(3), "{e}");

    let replies =
        json_lines(&ok(&env, &["dead-letters", "redrive", "chg:1:77:0", "--json"]).await?)?;
    assert_eq!(replies.len(), 1, "one storage replica: {replies:?}");
    assert_eq!(replies[0]["redriven"], 1);
    // Storage relays it: the change is on the stream now.
    let lines = json_lines(&ok(&env, &["tail", "--from-start", "--limit", "1"]).await?)?;
    assert_eq!(lines[0]["command_seq"], 77, "{lines:?}");
    assert!(ok(&env, &["dead-letters", "--json"]).await?.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_lettered_commands_are_shown_and_published_again() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    ok(&env, &["setup"]).await?;
    let _storage = storage(&env).await?;
    let js = jetstream(&env).await?;
    let subjects = Subjects::new(&env.prefix);
    let partition = partition_of(7, 42, 4).0;
    let key = RecordKey::new(7, 42, "sku-9");
    let command =
        CommandBatch { partition, commands: vec![patch(&key, 700, 0)], ..Default::default() };
    // As storage dead-letters: a rejection with the whole message, and one
    // with a copy cut at 128 KiB.
    let mut seqs = Vec::new();
    for (n, raw) in [(99, command.encode_to_vec()), (100, vec![0xff; 128 * 1024])] {
        let rejection = Rejection {
            reason: "failed".into(),
            detail: "failed 5 times: Redis said no".into(),
            raw,
            ..Default::default()
        };
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(shelfsync_bus::TYPE_HEADER, msg_type::REJECTION_BATCH);
        headers
            .insert(async_nats::header::NATS_MESSAGE_ID, format!("rej:{partition}:{n}:0").as_str());
        let payload = RejectionBatch { rejections: vec![rejection] }.encode_to_vec();
        let ack =
            js.publish_with_headers(subjects.rejects(0, 0), headers, payload.into()).await?.await?;
        seqs.push(ack.sequence.to_string());
    }
    let (whole, cut) = (seqs[0].as_str(), seqs[1].as_str());

    let listed = json_lines(&ok(&env, &["dead-letters", "--commands", "--json"]).await?)?;
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(listed[0]["partition"], partition);
    assert_eq!((listed[0]["cut"].as_bool(), listed[1]["cut"].as_bool()), (Some(false), Some(true)));
    let shown: Value =
        serde_json::from_str(&ok(&env, &["dead-letters", "show", "--command", whole]).await?)?;
    assert_eq!(shown["command_batch"]["commands"][0]["key"]["product_id"], "sku-9", "{shown:#}");

    let (c, e) = code(&run(&env, &["dead-letters", "redrive", "--command", cut]).await?);
    assert_eq!(c, Some(1), "{e}");
    assert!(e.contains("cut copy"), "{e}");
    let (c, e) = code(&run(&env, &["dead-letters", "redrive", "--command", "999"]).await?);
    assert_eq!(c, Some(3), "{e}");

    let out =
        json_lines(&ok(&env, &["dead-letters", "redrive", "--command", whole, "--json"]).await?)?;
    assert_eq!(
        (out[0]["partition"].as_u64(), out[0]["duplicate"].as_bool()),
        (Some(u64::from(partition)), Some(false))
    );
    let found = run_until(&env, &["get", "7", "42", "sku-9"], &[], |o| o.status.success()).await?;
    let record: Value = serde_json::from_slice(&found.stdout)?;
    assert_eq!(record["data"]["price"], 700);
    // Given again: stored once.
    let again =
        json_lines(&ok(&env, &["dead-letters", "redrive", "--command", whole, "--json"]).await?)?;
    assert_eq!(again[0]["duplicate"], true, "{again:?}");

    // One storage dead-letters itself: its partition is found the same way.
    let garbage = vec![0xff; 8];
    let subject = subjects.cmd(shelfsync_bus::Partition(partition));
    publish(&js, subject, msg_type::COMMAND_BATCH, garbage.clone()).await?;
    let args = ["dead-letters", "--commands", "--json"];
    let out =
        run_until(&env, &args, &[], |o| o.stdout.iter().filter(|&&b| b == b'\n').count() == 3)
            .await?;
    let listed = json_lines(&String::from_utf8(out.stdout)?)?;
    assert_eq!(listed[2]["reason"], "undecodable", "{listed:?}");
    assert_eq!(listed[2]["partition"], partition);
    assert_eq!(
        (listed[2]["raw_bytes"].as_u64(), listed[2]["cut"].as_bool()),
        (Some(8), Some(false))
    );
    Ok(())
}
