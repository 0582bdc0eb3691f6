//! Fault scenario 10 (docs/RELIABILITY.md): security.
//!
//! - NATS with the per-service users and subject permissions of
//!   `compose/nats/nats.conf` (read from the file, so the test follows the
//!   ops config): storage and consumers work under their own users, and a
//!   consumer's credentials can neither publish commands nor read other
//!   services' subjects or consumers. (`scripts/validate-deploy.sh` probes
//!   the same matrix subject by subject with a raw client.)
//! - Redis with an ACL user limited to storage's key namespace, and a
//!   password on the default user: storage works; a wrong password fails
//!   clearly without printing the password.
//! - TLS switched on by config (environment form, as a deployment sets it):
//!   the storage binary and a client over TLS to NATS; TLS to Redis is NOT
//!   DONE (settings keys exist, the connection does not apply them yet) and
//!   its test is the executable spec. `tls.rs` covers NATS TLS in-process.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use shelfsync_bus::Partition;
use shelfsync_feed::{ChangeFeed, FeedConfig};
use shelfsync_settings::Settings;
use shelfsync_testkit::{NatsServer, RedisServer, TestEnv, unique_name};
use shelfsync_tests::natsauth::{as_user, password};
use shelfsync_tests::*;

const BRAND: i64 = 7;

/// compose/nats/nats.conf's users and permissions for a test prefix.
fn authorization(prefix: &str) -> String {
    let conf = std::fs::read_to_string(COMPOSE_NATS_CONF).expect("compose/nats/nats.conf");
    natsauth::authorization(&conf, prefix, password)
}

/// A client of `user` whose server errors (permission violations) are kept.
async fn client_of(nats: &NatsServer, user: &str) -> (async_nats::Client, Refusals) {
    natsauth::client_as(nats, user, &password(user)).await.expect("login")
}

/// Servers whose NATS has the users of [`authorization`] under a fresh
/// prefix, and the settings on them before any user is picked.
async fn authorized_servers() -> (TestEnv, Settings) {
    let prefix = unique_name();
    let conf = authorization(&prefix);
    let (nats, redis) =
        tokio::try_join!(NatsServer::start_with_config(&conf), RedisServer::start())
            .expect("servers");
    let env = TestEnv { nats, redis, namespace: prefix.clone(), prefix };
    let base = storage_settings(&env);
    (env, base)
}

async fn violation(errors: &Refusals, what: &str, subject: &str) {
    natsauth::refused(errors, what, subject).await
}

#[tokio::test]
async fn consumer_credentials_cannot_publish_commands_or_read_other_services_subjects() {
    let (env, mut base) = authorized_servers().await;
    // Two records a second: a change can land while a keyframe goes out.
    base.storage.keyframe_rate = 2;
    base.nats.request_timeout = Duration::from_secs(2);
    // The operator creates the streams; every service runs as its own user.
    let h = Harness::connect(as_user(&base, "admin")).await.expect("admin sets up");
    let _storage =
        InProcessStorage::start(as_user(&base, "storage")).await.expect("storage as `storage`");
    h.send(vec![patch(BRAND, 1, "sku-1", &product("Roses", 100, 1), 0)]).await.expect("import");
    h.wait_settled().await;
    assert_eq!(h.changes().await.expect("changes").len(), 1, "storage works under its user");

    // Consumers work under theirs: the aggregator's durable feed, with its
    // keyframe bootstrap (request, direct gets) and its consumer.
    let agg_settings = as_user(&base, "aggregator");
    let agg_client = shelfsync_bus::connect(&agg_settings.nats, "aggregator", false)
        .await
        .expect("aggregator logs in");
    let mirror = FeedMirror::default();
    let feed = RunningFeed::start(
        "aggregator",
        ChangeFeed::new(agg_client, &agg_settings.nats, FeedConfig::new("aggregator")),
        mirror.clone(),
    );
    eventually(Duration::from_secs(30), "the aggregator's feed bootstrapped", || async {
        mirror.records.lock().expect("lock").len() == 1
    })
    .await;

    let cmd = h.subjects.cmd(Partition(0));
    let cmd_stream = h.subjects.cmd_stream();
    let changes_stream = h.subjects.changes_stream();
    // The validator's durable consumer, which no one else may read from.
    h.js.get_stream(&changes_stream)
        .await
        .expect("stream")
        .create_consumer(consumer::pull::Config {
            durable_name: Some("validator".into()),
            ..Default::default()
        })
        .await
        .expect("validator consumer");

    for user in ["aggregator", "recommender"] {
        let (client, errors) = client_of(&env.nats, user).await;
        let js =
            jetstream::ContextBuilder::new().timeout(Duration::from_secs(1)).build(client.clone());

        // Publishing a command: refused by the server; no ack, nothing stored.
        let sent = async { js.publish(cmd.clone(), "forged".into()).await?.await }.await;
        assert!(sent.is_err(), "{user} published a command");
        violation(&errors, "publish", &cmd).await;

        // Listening to commands or to every change: refused.
        let mut on_cmd = client.subscribe(h.subjects.cmd_all()).await.expect("local subscribe");
        violation(&errors, "subscription", &h.subjects.cmd_all()).await;
        let mut on_changes =
            client.subscribe(h.subjects.changes_all()).await.expect("local subscribe");
        violation(&errors, "subscription", &h.subjects.changes_all()).await;

        // Reading the command stream through a consumer of its own: refused.
        let theirs = js.get_stream(&cmd_stream).await;
        if let Ok(s) = theirs {
            let created = s
                .create_consumer(consumer::pull::Config {
                    durable_name: Some(format!("{user}-reads-commands")),
                    ..Default::default()
                })
                .await;
            assert!(created.is_err(), "{user} created a consumer on the command stream");
        }
        // Taking over the validator's consumer: refused.
        let stolen = async {
            let e = |e: &dyn std::fmt::Display| e.to_string();
            let s = js.get_stream(&changes_stream).await.map_err(|x| e(&x))?;
            let c: consumer::Consumer<consumer::pull::Config> =
                s.get_consumer("validator").await.map_err(|x| e(&x))?;
            let mut batch = c
                .fetch()
                .max_messages(1)
                .expires(Duration::from_millis(500))
                .messages()
                .await
                .map_err(|x| e(&x))?;
            Ok::<bool, String>(batch.next().await.transpose().map_err(|x| e(&x))?.is_some())
        }
        .await;
        assert!(!matches!(stolen, Ok(true)), "{user} read from the validator's consumer");

        // A change and a command go by: neither subscription sees them.
        h.send(vec![patch(BRAND, 1, "sku-1", &product("Roses", 100 + user.len() as i64, 1), 0)])
            .await
            .expect("import");
        h.wait_settled().await;
        let seen = tokio::time::timeout(Duration::from_millis(500), async {
            tokio::select! { m = on_cmd.next() => m, m = on_changes.next() => m }
        })
        .await;
        assert!(!matches!(seen, Ok(Some(_))), "{user} received {seen:?}");
    }
    let info = h.consumer_info(&changes_stream, "validator").await.expect("info");
    assert_eq!(info.delivered.stream_sequence, 0, "nobody pulled from the validator's consumer");
    assert_eq!(info.num_ack_pending, 0);
    let mut stream = h.js.get_stream(&cmd_stream).await.expect("stream");
    assert_eq!(stream.info().await.expect("info").state.last_sequence, 3, "only admin's commands");
    eventually(Duration::from_secs(30), "the aggregator's feed saw every change", || async {
        mirror.applied.lock().expect("lock").len() == 3
    })
    .await;

    // A drift repair works under the aggregator's permissions: it reloads
    // the keyframe (direct gets) and reads the place's changes since then
    // again (STREAM.MSG.GET on the change stream). The feed misses a change:
    // paused while it is stored, and it is deleted (as admin) before resuming.
    let paused = feed.stop().await;
    let before = h.changes_last_seq().await.expect("changes");
    h.send(vec![patch(BRAND, 1, "sku-2", &product("Tulips", 7, 1), 0)]).await.expect("import");
    h.wait_settled().await;
    let last = h.changes_last_seq().await.expect("changes");
    let stream = h.js.get_stream(&changes_stream).await.expect("stream");
    for seq in before + 1..=last {
        assert!(stream.delete_message(seq).await.expect("delete"), "deleted #{seq}");
    }
    let feed = RunningFeed::start("aggregator", paused, mirror.clone());
    // A change stored while the keyframe is out (paced): the repair must
    // read it again from the stream, since it is after the keyframe.
    let keyframe = tokio::spawn({
        let (client, subjects) = (h.client.clone(), h.subjects.clone());
        async move {
            shelfsync_bus::request_keyframe(&client, &subjects, None, 1, Duration::from_secs(30))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    h.send(vec![patch(BRAND, 1, "sku-3", &product("Lilies", 9, 1), 0)]).await.expect("import");
    keyframe.await.expect("task").expect("keyframe");
    eventually(Duration::from_secs(30), "a drift repaired as `aggregator`", || async {
        shelfsync_feed::FeedStatus::get(&feed.status.drift_repairs) == 1
            && mirror.records.lock().expect("lock").len() == 3
    })
    .await;
    drop(feed);
}

/// Redis with the default user behind a password and an ACL user for
/// storage, allowed only its namespace's keys.
async fn redis_with_acl(namespace: &str) -> RedisServer {
    let redis = RedisServer::start().await.expect("redis");
    let client = redis::Client::open(redis.url()).expect("client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("connect");
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("storage")
        .arg("on")
        .arg(format!(">{}", password("redis-storage")))
        .arg(format!("~{{{namespace}:*"))
        .arg("+@all")
        .arg("-@dangerous")
        .query_async(&mut conn)
        .await
        .expect("ACL SETUSER");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg(password("redis-admin"))
        .query_async(&mut conn)
        .await
        .expect("requirepass");
    redis
}

/// NATS, and Redis from [`redis_with_acl`] for a fresh prefix.
async fn servers_with_redis_acl() -> TestEnv {
    let prefix = unique_name();
    let (nats, redis) =
        tokio::try_join!(NatsServer::start(), async { Ok(redis_with_acl(&prefix).await) })
            .expect("servers");
    TestEnv { nats, redis, namespace: prefix.clone(), prefix }
}

fn redis_url(redis: &RedisServer, user: &str, pw: &str) -> String {
    format!("redis://{user}:{pw}@127.0.0.1:{}", redis.port())
}

#[tokio::test]
async fn storage_works_as_a_redis_acl_user_confined_to_its_namespace() {
    let env = servers_with_redis_acl().await;
    let mut settings = storage_settings(&env);
    settings.redis.url = redis_url(&env.redis, "storage", &password("redis-storage"));
    let h = Harness::connect(settings.clone()).await.expect("harness as the ACL user");
    let _storage =
        InProcessStorage::start(settings.clone()).await.expect("storage as the ACL user");
    h.send(vec![patch(BRAND, 1, "sku-1", &product("Roses", 100, 1), 0)]).await.expect("send");
    h.send(vec![shelfsync_proto::Command {
        key: Some(shelfsync_proto::RecordKey::new(BRAND, 1, "sku-1")),
        kind: shelfsync_proto::CommandKind::Delete as i32,
        ..Default::default()
    }])
    .await
    .expect("send");
    h.wait_settled().await;
    assert_eq!(h.changes().await.expect("changes").len(), 2);
    assert!(h.get(BRAND, 1, "sku-1").await.expect("get").expect("tombstone").deleted);
    let replies =
        shelfsync_bus::request_keyframe(&h.client, &h.subjects, None, 1, Duration::from_secs(30))
            .await
            .expect("keyframe");
    assert!(replies.first().is_some_and(|r| r.error.is_empty()), "{replies:?}");

    // The ACL confines the user to its namespace.
    let client = redis::Client::open(settings.redis.url.clone()).expect("client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("connect");
    let outside: redis::RedisResult<()> =
        redis::cmd("SET").arg("other:key").arg("x").query_async(&mut conn).await;
    let err = outside.expect_err("a key outside the namespace");
    assert!(err.to_string().to_uppercase().contains("NOPERM"), "{err}");
    // And an unauthenticated client gets nothing.
    let anon = redis::Client::open(env.redis.url()).expect("client");
    let refused: redis::RedisResult<()> = async {
        let mut c = anon.get_multiplexed_async_connection().await?;
        redis::cmd("GET").arg("x").query_async(&mut c).await
    }
    .await;
    assert!(refused.is_err(), "anonymous access");
}

#[tokio::test]
async fn a_wrong_redis_password_fails_storage_clearly_without_printing_it() {
    let env = servers_with_redis_acl().await;
    let mut settings = settings_for(&env);
    let wrong = "wrong-Pa55word";
    settings.redis.url = redis_url(&env.redis, "storage", wrong);
    let err = match shelfsync_storage::App::build(settings).await {
        Ok(_) => panic!("storage started with a wrong password"),
        Err(e) => format!("{e:#}"),
    };
    let lower = err.to_lowercase();
    assert!(lower.contains("wrongpass") || lower.contains("auth"), "a clear cause: {err}");
    assert!(!err.contains(wrong), "the password is printed: {err}");
}

// --- TLS ----------------------------------------------------------------
//
// NATS: `[nats] tls_required`, `tls_ca_file`, `tls_cert_file`/`tls_key_file`
// (mutual TLS), applied by `shelfsync_bus::connect`.
// Redis: `rediss://` URLs with `[redis] tls_ca_file`, `tls_cert_file`,
// `tls_key_file`, applied by `shelfsync_redis::RedisConn::connect`.
// The env names below follow the settings' SHELFSYNC__SECTION__KEY rule.

/// Settings from the environment-variable form (the form a deployment uses).
fn settings_from(env: &TestEnv, extra: &[(&str, String)]) -> anyhow::Result<Settings> {
    let mut vars = settings_env(&settings_for(env));
    vars.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
    Ok(Settings::load_from(None, &vars)?)
}

/// A harness and the storage binary on the settings `extra` switches to
/// TLS, and one command applied through them.
async fn one_command_over_tls(
    env: &TestEnv,
    extra: &[(&str, String)],
) -> (Harness, StorageProcess) {
    let settings = settings_from(env, extra).expect("TLS keys in the settings");
    let h = Harness::connect(settings.clone()).await.expect("harness over TLS");
    let vars: Vec<(&str, &str)> = extra.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let storage = StorageProcess::start(&settings, &vars).expect("storage over TLS");
    h.send(vec![patch(BRAND, 1, "sku-1", &product("Roses", 100, 1), 0)]).await.expect("send");
    h.wait_settled().await;
    (h, storage)
}

#[tokio::test]
async fn nats_over_tls_is_switched_on_by_config() {
    let (_certs, ca, cert, key) = test_certificates();
    let tls = format!(
        "tls {{\n  cert_file: \"{cert}\"\n  key_file: \"{key}\"\n  ca_file: \"{ca}\"\n}}\n"
    );
    let (nats, redis) = tokio::try_join!(NatsServer::start_with_config(&tls), RedisServer::start())
        .expect("servers");
    let env = TestEnv { nats, redis, namespace: unique_name(), prefix: unique_name() };
    let url = format!("tls://127.0.0.1:{}", env.nats.port());
    let extra = [
        ("SHELFSYNC__NATS__URL", url),
        ("SHELFSYNC__NATS__TLS_CA_FILE", ca.clone()),
        ("SHELFSYNC__NATS__TLS_REQUIRED", "true".into()),
    ];
    let (h, _storage) = one_command_over_tls(&env, &extra).await;
    assert_eq!(h.changes().await.expect("changes").len(), 1);
    // Without the CA the server's certificate is not trusted.
    let untrusted = settings_from(&env, &extra[..1]).expect("settings");
    assert!(shelfsync_bus::connect(&untrusted.nats, "no-ca", false).await.is_err());
}

#[tokio::test]
async fn redis_over_tls_is_switched_on_by_config() {
    let (_certs, ca, cert, key) = test_certificates();
    let tls_port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("port")
        .local_addr()
        .expect("addr")
        .port();
    let port = tls_port.to_string();
    let redis = RedisServer::start_with_args(&[
        "--tls-port",
        &port,
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
        "--tls-ca-cert-file",
        &ca,
        "--tls-auth-clients",
        "no",
    ])
    .await
    .expect("redis with a TLS port");
    let nats = NatsServer::start().await.expect("nats");
    let env = TestEnv { nats, redis, namespace: unique_name(), prefix: unique_name() };
    let extra = [
        ("SHELFSYNC__REDIS__URL", format!("rediss://127.0.0.1:{tls_port}")),
        ("SHELFSYNC__REDIS__TLS_CA_FILE", ca.clone()),
    ];
    let (h, _storage) = one_command_over_tls(&env, &extra).await;
    assert!(h.get(BRAND, 1, "sku-1").await.expect("get over TLS").is_some());
}

// --- Ingest's push endpoint ------------------------------------------------

const FLOWERS_TOKEN: &str = "flowers-push-0123456789abcdef";
const ROSES_TOKEN: &str = "roses-push-0123456789abcdef";

#[tokio::test]
async fn the_push_endpoint_publishes_nothing_without_the_partners_token() {
    let env = TestEnv::start().await.expect("servers");
    let dir = tempfile::tempdir().expect("dir");
    let tokens_file = |name: &str, token: &str| {
        let path = dir.path().join(format!("{name}.tokens"));
        std::fs::write(&path, format!("# {name}\n{token}\n")).expect("tokens file");
        path.display().to_string()
    };
    let (flowers, roses) =
        (tokens_file("flowers", FLOWERS_TOKEN), tokens_file("roses", ROSES_TOKEN));
    let mut settings = storage_settings(&env);
    // `closed` has no token source: push is disabled for it.
    settings.partners = Settings::from_toml(&format!(
        "[[partners]]\nname = \"flowers\"\nbrand_id = {BRAND}\nkind = \"full\"\npush_tokens_file = \"{flowers}\"\n\
         [[partners]]\nname = \"roses\"\nbrand_id = 8\nkind = \"full\"\npush_tokens_file = \"{roses}\"\n\
         [[partners]]\nname = \"closed\"\nbrand_id = 9\nkind = \"full\"\n"
    ))
    .expect("partners")
    .partners;
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let _storage = InProcessStorage::start(settings.clone()).await.expect("storage");
    let app = shelfsync_ingest::App::build(settings.clone()).await.expect("ingest");
    let base = format!("http://{}", app.local_addr());
    let ingest = spawn(app);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();

    // A full feed of one item: accepted, it would sweep the rest of place 1.
    let forged = format!(
        r#"{{"brand_id":{BRAND},"places":[{{"place_id":1,"items":[{{"id":"forged"}}]}}]}}"#
    );
    let push = |partner: &str, authorization: Option<&str>| {
        let mut request =
            http.post(format!("{base}/v1/partners/{partner}/feed")).body(forged.clone());
        if let Some(value) = authorization {
            request = request.header("authorization", value);
        }
        async move {
            let response = request.send().await.expect("push");
            let status = response.status().as_u16();
            let challenge = response
                .headers()
                .get("www-authenticate")
                .map(|v| v.to_str().expect("ASCII").to_string());
            let body: serde_json::Value =
                serde_json::from_slice(&response.bytes().await.expect("body")).expect("JSON");
            assert!(body["error"].is_string(), "a JSON error: {body}");
            (status, challenge, body["error"].as_str().unwrap_or_default().to_string())
        }
    };
    let bearer = |token: &str| format!("Bearer {token}");
    let realm = Some(r#"Bearer realm="shelfsync-ingest""#.to_string());

    let (status, challenge, _) = push("flowers", None).await;
    assert_eq!((status, challenge), (401, realm.clone()), "no credentials");
    let (status, challenge, _) =
        push("flowers", Some(&bearer("wrong-token-0123456789abcdef"))).await;
    assert_eq!((status, challenge), (401, realm.clone()), "a wrong token");
    let (status, challenge, error) = push("flowers", Some(&bearer(ROSES_TOKEN))).await;
    assert_eq!((status, challenge), (403, None), "another partner's token: {error}");
    for malformed in ["Basic Zmxvd2VyczpzM2NyZXQ=", "Bearer", FLOWERS_TOKEN] {
        let (status, challenge, _) = push("flowers", Some(malformed)).await;
        assert_eq!((status, challenge), (401, realm.clone()), "malformed: {malformed:?}");
    }
    // Unauthenticated, a partner that does not exist looks like one that does.
    let (status, _, error) = push("nobody", None).await;
    assert_eq!(status, 401, "{error}");
    assert!(!error.contains("nobody"), "{error}");
    let (status, _, _) = push("nobody", Some(&bearer(FLOWERS_TOKEN))).await;
    assert_eq!(status, 404, "an authenticated caller learns the partner does not exist");
    let (status, _, error) = push("closed", Some(&bearer(FLOWERS_TOKEN))).await;
    assert_eq!(status, 403);
    assert!(error.contains("push_tokens_file") && error.contains("push_tokens_env"), "{error}");

    let cmd_published = || async {
        let mut stream = h.js.get_stream(h.subjects.cmd_stream()).await.expect("stream");
        stream.info().await.expect("info").state.last_sequence
    };
    assert_eq!(cmd_published().await, 0, "refused pushes published no command");
    let metrics = http.get(format!("{base}/metrics")).send().await.expect("metrics");
    let metrics = metrics.text().await.expect("metrics text");
    let refused = |partner: &str, reason: &str| {
        let labels = format!("partner=\"{partner}\",reason=\"{reason}\"");
        metric_value(&metrics, "shelfsync_ingest_push_refused_total", &labels)
    };
    assert_eq!(refused("flowers", "missing_token"), Some(1.0), "{metrics}");
    assert_eq!(refused("flowers", "invalid_token"), Some(1.0));
    assert_eq!(refused("flowers", "other_partner"), Some(1.0));
    assert_eq!(refused("flowers", "malformed_header"), Some(3.0));
    assert_eq!(refused("unknown", "missing_token"), Some(1.0));
    assert_eq!(refused("unknown", "unknown_partner"), Some(1.0));
    assert_eq!(refused("closed", "push_disabled"), Some(1.0));

    // The partner's own token: accepted, and its changes are all there are.
    let feed = format!(
        r#"{{"brand_id":{BRAND},"places":[{{"place_id":1,"items":[{{"id":"a"}},{{"id":"b"}},{{"id":"c"}}]}}]}}"#
    );
    let response = http
        .post(format!("{base}/v1/partners/flowers/feed"))
        .bearer_auth(FLOWERS_TOKEN)
        .body(feed)
        .send()
        .await
        .expect("push");
    assert_eq!(response.status(), 200);
    let report: serde_json::Value =
        serde_json::from_slice(&response.bytes().await.expect("body")).expect("report");
    assert_eq!((report["items"].as_u64(), report["sweeps"].as_u64()), (Some(3), Some(1)));
    h.wait_settled().await;
    let published =
        report["batches"].as_u64().unwrap_or(0) + report["sweeps"].as_u64().unwrap_or(0);
    assert_eq!(cmd_published().await, published, "only the accepted push's messages");
    let mut changed: Vec<String> = h
        .changes()
        .await
        .expect("changes")
        .iter()
        .filter_map(|c| c.key.as_ref().map(|k| k.product_id.clone()))
        .collect();
    changed.sort();
    assert_eq!(changed, ["a", "b", "c"], "one change per accepted item, none from refused pushes");
    assert!(h.get(BRAND, 1, "forged").await.expect("get").is_none());
    ingest.stop().await.expect("ingest stops");
}

/// Storage's relay reads its change subjects back (scenario 5c) under the
/// `storage` user of compose/nats/nats.conf: killed between publishing an
/// outbox and trimming it, restarted past a one second dedup window, it
/// stores nothing twice and trips no permission.
#[tokio::test]
async fn storage_reads_its_subjects_back_under_its_own_permissions() {
    let (env, mut base) = authorized_servers().await;
    // Storage verifies the streams against its settings: setup writes the
    // same one second dedup window.
    base.nats.duplicate_window = Duration::from_secs(1);
    let h = Harness::connect(as_user(&base, "admin")).await.expect("admin sets up");
    for i in 0..5 {
        h.send(vec![patch(BRAND, 1, &format!("sku-{i}"), &product("Roses", 100, 1), 0)])
            .await
            .expect("send");
    }
    let storage = as_user(&base, "storage");
    let window = ("SHELFSYNC__NATS__DUPLICATE_WINDOW", "1s");
    let user = ("SHELFSYNC__NATS__USER", "storage");
    let pw = password("storage");
    let pass = ("SHELFSYNC__NATS__PASSWORD", pw.as_str());
    let inbox = ("SHELFSYNC__NATS__INBOX_PREFIX", "_INBOX_storage");
    let doomed_env = [window, user, pass, inbox, ("SHELFSYNC_FAILPOINT", "after_outbox_publish@1")];
    let mut doomed = StorageProcess::start(&storage, &doomed_env).expect("storage");
    assert!(!doomed.wait_exit(Duration::from_secs(30)).await.expect("aborts").success());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _storage =
        StorageProcess::start(&storage, &[window, user, pass, inbox]).expect("storage again");
    h.wait_settled().await;
    assert_eq!(h.changes().await.expect("changes").len(), 5, "each change once");
    let log = std::fs::read_to_string(env.nats.log_path()).expect("nats log");
    assert!(!log.contains("Violation"), "no permission violation: {log}");
}

// --- Least privilege: what each service must not do is refused -------------

/// A `js` whose API calls time out quickly (a refused one gets no answer).
fn quick_js(client: &async_nats::Client) -> jetstream::Context {
    jetstream::ContextBuilder::new().timeout(Duration::from_secs(1)).build(client.clone())
}

/// Each shipped NATS user (compose/nats/nats.conf), tried at what is not
/// its job: the server refuses every one.
#[tokio::test]
async fn nats_users_are_refused_what_is_not_their_job() {
    let (env, base) = authorized_servers().await;
    let h = Harness::connect(as_user(&base, "admin")).await.expect("admin sets up");
    let subjects = &h.subjects;
    let cmd0 = subjects.cmd(Partition(0));
    let sweep0 = subjects.cmd_for(Partition(0), true);
    let configs = shelfsync_bus::stream_configs(&base.nats, base.topology());

    // Storage and the aggregator may read the streams' configuration, and
    // change none of it: `shelfsync setup` (admin) is its one writer.
    for user in ["storage", "aggregator"] {
        let (client, errors) = client_of(&env.nats, user).await;
        let js = quick_js(&client);
        let mut wider = configs[0].clone();
        wider.max_bytes *= 2;
        assert!(js.update_stream(&wider).await.is_err(), "{user} updated a stream");
        violation(&errors, "publish", &format!("$JS.API.STREAM.UPDATE.{}", wider.name)).await;
        assert!(js.delete_stream(&configs[1].name).await.is_err(), "{user} deleted a stream");
        violation(&errors, "publish", &format!("$JS.API.STREAM.DELETE.{}", configs[1].name)).await;
        let info =
            js.get_stream(&configs[0].name).await.expect("stream info").cached_info().clone();
        assert_eq!(info.config.max_bytes, configs[0].max_bytes, "{user} changed nothing");
    }
    // Operator-only requests, sweeps, commands, changes: each by the wrong user.
    let refused: [(&str, String); 10] = [
        ("validator", sweep0.clone()),
        ("validator", subjects.ctl_rebase()),
        ("validator", subjects.read("sweeps")),
        ("aggregator", sweep0.clone()),
        ("aggregator", subjects.ctl_redrive()),
        ("recommender", subjects.ctl_rebase()),
        ("recommender", subjects.read("get")),
        ("ingest", format!("{}.changes.7.1", h.settings.nats.prefix)),
        ("ingest", subjects.ctl_rebase()),
        ("storage", cmd0.clone()),
    ];
    for (user, subject) in refused {
        let (client, errors) = client_of(&env.nats, user).await;
        client.publish(subject.clone(), "forged".into()).await.expect("local publish");
        client.flush().await.expect("flush");
        violation(&errors, "publish", &subject).await;
    }
    // Nobody listens on another service's inboxes, nor on the shared one.
    for (user, inbox) in [("recommender", "_INBOX_storage.>"), ("ingest", "_INBOX.>")] {
        let (client, errors) = client_of(&env.nats, user).await;
        let _sub = client.subscribe(inbox.to_string()).await.expect("local subscribe");
        violation(&errors, "subscription", inbox).await;
    }
    let mut stream = h.js.get_stream(h.subjects.cmd_stream()).await.expect("stream");
    assert_eq!(stream.info().await.expect("info").state.last_sequence, 0, "no command got in");
}

/// Storage and the aggregator verify the streams at start (their users may
/// not write them): on settings `shelfsync setup` did not apply, each
/// refuses to start with every difference named, and writes nothing.
#[tokio::test]
async fn services_refuse_to_start_on_streams_that_setup_did_not_shape() {
    let (_env, base) = authorized_servers().await;
    let h = Harness::connect(as_user(&base, "admin")).await.expect("admin sets up");
    let mut changed = base.clone();
    changed.nats.cmd_max_bytes = 2 << 30;
    changed.nats.changes_max_age = Duration::from_secs(3600);
    let storage = shelfsync_storage::App::build(as_user(&changed, "storage")).await;
    let aggregator = shelfsync_aggregator::App::build(as_user(&changed, "aggregator")).await;
    for (who, built) in [("storage", storage.err()), ("aggregator", aggregator.err())] {
        let error = format!("{:#}", built.unwrap_or_else(|| panic!("{who} started")));
        for part in
            ["max_bytes is 1073741824, the settings say 2147483648", "max_age", "shelfsync setup"]
        {
            assert!(error.contains(part), "{who}: {part:?} missing from {error}");
        }
    }
    let mut cmd = h.js.get_stream(h.subjects.cmd_stream()).await.expect("stream");
    assert_eq!(cmd.info().await.expect("info").config.max_bytes, 1 << 30, "nothing written");
    // With the settings setup applied, both start.
    let _storage = InProcessStorage::start(as_user(&base, "storage")).await.expect("storage");
}

/// compose/redis/users.acl rendered with `password(...)`s, as
/// `start-redis.sh` renders it: `(user, rules)`.
fn shipped_acl() -> Vec<(String, Vec<String>)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../compose/redis/users.acl");
    let text = std::fs::read_to_string(path).expect("compose/redis/users.acl");
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|line| {
            let mut words = line.split_whitespace().map(|w| {
                match w.strip_prefix(">${REDIS_").and_then(|v| v.strip_suffix("_PASSWORD}")) {
                    Some(user) => {
                        format!(">{}", password(&format!("redis-{}", user.to_lowercase())))
                    }
                    None => w.to_string(),
                }
            });
            assert_eq!(words.next().as_deref(), Some("user"), "{line}");
            let name = words.next().expect("a user name");
            (name, words.collect())
        })
        .collect()
}

/// A Redis with the shipped ACL users (the default user, off, last).
async fn redis_with_shipped_acl() -> RedisServer {
    let redis = RedisServer::start().await.expect("redis");
    let client = redis::Client::open(redis.url()).expect("client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("connect");
    let mut users = shipped_acl();
    users.sort_by_key(|(name, _)| name == "default");
    for (name, rules) in users {
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg(&name)
            .arg(rules)
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("ACL SETUSER {name}: {e}"));
    }
    redis
}

fn redis_user_url(redis: &RedisServer, user: &str) -> String {
    redis_url(redis, user, &password(&format!("redis-{user}")))
}

async fn redis_as(redis: &RedisServer, user: &str) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(redis_user_url(redis, user)).expect("client");
    client.get_multiplexed_async_connection().await.expect("log in")
}

async fn assert_noperm(conn: &mut redis::aio::MultiplexedConnection, who: &str, cmd: &[&str]) {
    let mut c = redis::cmd(cmd[0]);
    for a in &cmd[1..] {
        c.arg(*a);
    }
    let result: redis::RedisResult<redis::Value> = c.query_async(conn).await;
    let err = result.expect_err(&format!("{who} ran {cmd:?}"));
    assert!(err.to_string().to_uppercase().contains("NOPERM"), "{who} {cmd:?}: {err}");
}

/// Storage, ingest and the aggregator each run as their own Redis ACL user
/// of compose/redis/users.acl (namespace `ss`, as shipped), a full import
/// goes through, and each user is refused what is not its own.
#[tokio::test]
async fn each_service_works_as_its_redis_user_and_is_refused_the_rest() {
    let prefix = unique_name();
    let (nats, redis) =
        tokio::try_join!(NatsServer::start(), async { Ok(redis_with_shipped_acl().await) })
            .expect("servers");
    let env = TestEnv { nats, redis, namespace: "ss".into(), prefix };
    let mut base = storage_settings(&env);
    base.partners = Settings::from_toml(&format!(
        "[[partners]]\nname = \"flowers\"\nbrand_id = {BRAND}\nkind = \"full\"\n"
    ))
    .expect("partner")
    .partners;
    let as_redis = |user: &str| {
        let mut s = base.clone();
        s.redis.url = redis_user_url(&env.redis, user);
        s
    };
    let h = Harness::connect(as_redis("storage")).await.expect("harness (storage's keys)");
    let _storage = InProcessStorage::start(as_redis("storage")).await.expect("storage");
    let importer =
        shelfsync_ingest::Importer::connect((&as_redis("ingest")).into()).await.expect("ingest");
    let dir = tempfile::tempdir().expect("dir");
    let feed = dir.path().join("feed.json");
    let items: Vec<String> = (0..5)
        .map(|i| format!(r#"{{"id":"sku-{i}","price":100,"stock":1,"category":"c","title":"t"}}"#))
        .collect();
    std::fs::write(
        &feed,
        format!(
            r#"{{"brand_id":{BRAND},"places":[{{"place_id":1,"items":[{}]}}]}}"#,
            items.join(",")
        ),
    )
    .expect("feed");
    let partner = base.partner("flowers").expect("partner").clone();
    let report = importer
        .import(&partner, shelfsync_ingest::Source::File(feed), None)
        .await
        .expect("a full import as `ingest`");
    assert_eq!(report.items, 5);
    h.wait_settled().await;
    assert!(h.get(BRAND, 1, "sku-4").await.expect("get").is_some(), "storage applied it");
    let aggregator =
        shelfsync_aggregator::App::build(as_redis("aggregator")).await.expect("aggregator");
    let aggregated = aggregator.aggregator();
    let running = spawn(aggregator);
    eventually(Duration::from_secs(30), "the aggregator bootstrapped as its Redis user", || {
        let a = aggregated.clone();
        async move {
            a.store()
                .categories(shelfsync_proto::PlaceKey::new(BRAND, 1))
                .await
                .is_ok_and(|c| !c.is_empty())
        }
    })
    .await;
    running.stop().await.expect("aggregator stops");

    let record = "{ss:p0}:r:7:1";
    let outbox = "{ss:p0}:obx";
    for user in ["ingest", "storage", "aggregator", "cli", "reader", "exporter"] {
        let mut conn = redis_as(&env.redis, user).await;
        for dangerous in [
            &["FLUSHALL"][..],
            &["FLUSHDB"],
            &["CONFIG", "SET", "appendonly", "no"],
            &["KEYS", "*"],
        ] {
            assert_noperm(&mut conn, user, dangerous).await;
        }
        if user != "storage" {
            assert_noperm(&mut conn, user, &["XADD", outbox, "*", "forged", "x"]).await;
            assert_noperm(&mut conn, user, &["HSET", record, "sku-0", "forged"]).await;
        }
    }
    let mut ingest = redis_as(&env.redis, "ingest").await;
    assert_noperm(&mut ingest, "ingest", &["HGET", record, "sku-0"]).await;
    assert_noperm(&mut ingest, "ingest", &["DEL", outbox]).await;
    let mut storage = redis_as(&env.redis, "storage").await;
    assert_noperm(&mut storage, "storage", &["SET", "ss:ingest:flowers:etag", "x"]).await;
    let mut cli = redis_as(&env.redis, "cli").await;
    let depth: u64 = redis::cmd("XLEN").arg(outbox).query_async(&mut cli).await.expect("cli reads");
    assert_eq!(depth, 0);
    // The default user is off.
    let anon = redis::Client::open(env.redis.url()).expect("client");
    let refused: redis::RedisResult<()> = async {
        let mut c = anon.get_multiplexed_async_connection().await?;
        redis::cmd("GET").arg("x").query_async(&mut c).await
    }
    .await;
    assert!(refused.is_err(), "the default user answered");
}

/// The read APIs of storage, the aggregator and the recommender, with
/// tokens from a file: 401 without one, 403 with a wrong one, the data with
/// the right one; the probes and `/metrics` stay open. Removing the file
/// revokes its tokens.
#[tokio::test]
async fn the_read_apis_ask_for_a_bearer_token_when_configured() {
    const READ_TOKEN: &str = "read-api-0123456789abcdef";
    let env = TestEnv::start().await.expect("servers");
    let dir = tempfile::tempdir().expect("dir");
    let tokens = dir.path().join("read.tokens");
    std::fs::write(&tokens, format!("# readers\n{READ_TOKEN}\n")).expect("tokens");
    let mut settings = storage_settings(&env);
    settings.storage.read_tokens_file = Some(tokens.clone());
    settings.aggregator.read_tokens_file = Some(tokens.clone());
    settings.aggregator.http_listen = "127.0.0.1:0".into();
    settings.recommender.read_tokens_file = Some(tokens.clone());
    settings.recommender.http_listen = "127.0.0.1:0".into();
    let h = Harness::connect(settings.clone()).await.expect("harness");
    h.send(vec![patch(BRAND, 1, "sku-1", &product("Roses", 100, 1), 0)]).await.expect("send");
    let storage = shelfsync_storage::App::build(settings.clone()).await.expect("storage");
    let storage_addr = storage.http_addr();
    let storage = spawn(storage);
    h.wait_settled().await;
    let aggregator = shelfsync_aggregator::App::build(settings.clone()).await.expect("aggregator");
    let aggregator_addr = aggregator.http_addr();
    let aggregator = spawn(aggregator);
    let recommender =
        shelfsync_recommender::App::build(settings.clone()).await.expect("recommender");
    let recommender_addr = recommender.http_addr();
    let recommender = spawn(recommender);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let status = |url: String, token: Option<&'static str>| {
        let mut request = http.get(url);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        async move {
            let response = request.send().await.expect("request");
            let challenge = response
                .headers()
                .get("www-authenticate")
                .map(|v| v.to_str().expect("ascii").to_string());
            (response.status().as_u16(), challenge)
        }
    };
    let apis = [
        format!("http://{storage_addr}/v1/records/{BRAND}/1/sku-1"),
        format!("http://{aggregator_addr}/v1/places/{BRAND}/1/categories"),
        format!("http://{recommender_addr}/v1/top/{BRAND}/1"),
    ];
    eventually(Duration::from_secs(30), "every API answers the right token", || async {
        let mut ok = true;
        for url in &apis {
            ok &= status(url.clone(), Some(READ_TOKEN)).await.0 == 200;
        }
        ok
    })
    .await;
    for url in &apis {
        let (code, challenge) = status(url.clone(), None).await;
        assert_eq!(code, 401, "{url} without a token");
        assert!(challenge.is_some_and(|c| c.starts_with("Bearer realm=")), "{url}: a challenge");
        assert_eq!(status(url.clone(), Some("wrong-token-0123456789abcdef")).await.0, 403, "{url}");
    }
    let probes = [storage_addr, aggregator_addr, recommender_addr];
    eventually(Duration::from_secs(30), "every service ready, asked without a token", || async {
        let mut ok = true;
        for addr in probes {
            ok &= status(format!("http://{addr}/readyz"), None).await.0 == 200;
        }
        ok
    })
    .await;
    for addr in probes {
        for path in ["/healthz", "/readyz", "/metrics"] {
            assert_eq!(
                status(format!("http://{addr}{path}"), None).await.0,
                200,
                "{addr}{path} stays open"
            );
        }
    }
    // Removing the file revokes its tokens at once.
    std::fs::remove_file(&tokens).expect("remove");
    for url in &apis {
        assert_eq!(status(url.clone(), Some(READ_TOKEN)).await.0, 403, "{url} after revocation");
    }
    recommender.stop().await.expect("recommender stops");
    aggregator.stop().await.expect("aggregator stops");
    storage.stop().await.expect("storage stops");
}
