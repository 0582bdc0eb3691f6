//! Consumer teams (`shelfsync consumer add|remove|list`, docs/DEPLOY.md
//! "Consumer teams"): the CLI writes a team's user into compose's own
//! nats.conf (a copy), a real nats-server runs that file's users, and
//! reloads it — no restart — when a team is added or removed.
//!
//! The permission matrix of a team's user, each line tested here: it may
//! create, read, pull from, ack and delete its consumers (`<team>`,
//! `<team>-<n>`); it may not create one of another name, read the state of,
//! pull from, ack or delete another team's consumer, listen on another's
//! inbox, or publish commands unless added with `--may-publish-commands`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use shelfsync_bus::Partition;
use shelfsync_settings::Settings;
use shelfsync_testkit::{NatsServer, RedisServer, TestEnv, unique_name};
use shelfsync_tests::natsauth::{as_user, client_as, password, refused, with_user};
use shelfsync_tests::*;

/// A copy of the deployment's NATS configs that the CLI edits.
struct Configs {
    dir: tempfile::TempDir,
}

impl Configs {
    fn new() -> Configs {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::copy(COMPOSE_NATS_CONF, dir.path().join("nats.conf")).expect("nats.conf");
        let values = concat!(env!("CARGO_MANIFEST_DIR"), "/../k8s/nats/values.yaml");
        std::fs::copy(values, dir.path().join("values.yaml")).expect("values.yaml");
        Configs { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `shelfsync consumer <args>` on these files, output below `out/`.
    async fn consumer(&self, settings: &Settings, args: &[&str]) -> anyhow::Result<String> {
        let (conf, values, out) =
            (self.path("nats.conf"), self.path("values.yaml"), self.path("out"));
        let mut all: Vec<&str> = vec!["consumer"];
        all.extend_from_slice(args);
        all.extend([
            "--nats-conf",
            conf.to_str().unwrap(),
            "--helm-values",
            values.to_str().unwrap(),
        ]);
        if args[0] != "list" {
            all.extend(["--out", out.to_str().unwrap()]);
        }
        cli_ok(settings, &all).await
    }

    /// The test server's config: the users of the edited nats.conf.
    fn authorization(&self, prefix: &str) -> String {
        let conf = std::fs::read_to_string(self.path("nats.conf")).expect("nats.conf");
        natsauth::authorization(&conf, prefix, password)
    }

    /// NATS with the users of the edited nats.conf, and Redis.
    async fn servers(&self, prefix: &str) -> TestEnv {
        let conf = self.authorization(prefix);
        let (nats, redis) =
            tokio::try_join!(NatsServer::start_with_config(&conf), RedisServer::start())
                .expect("servers");
        TestEnv { nats, redis, namespace: prefix.to_string(), prefix: prefix.to_string() }
    }

    /// The team's password, from the `nats.env` the CLI wrote for k8s.
    fn team_password(&self, team: &str) -> String {
        let env = self.path("out").join("k8s/teams").join(team).join("nats.env");
        read_env(&env, "SHELFSYNC__NATS__PASSWORD")
    }
}

fn read_env(path: &Path, key: &str) -> String {
    let text = std::fs::read_to_string(path).expect("nats.env");
    text.lines().find_map(|l| l.strip_prefix(&format!("{key}="))).expect(key).to_string()
}

/// A request to a JetStream API subject the client may not publish on gets
/// no answer, and the server reports the violation.
async fn api_refused(client: &async_nats::Client, errors: &Refusals, subject: &str) {
    let asked = tokio::time::timeout(
        Duration::from_millis(500),
        client.request(subject.to_string(), "{}".into()),
    )
    .await;
    assert!(!matches!(asked, Ok(Ok(_))), "{subject} answered");
    refused(errors, "publish", subject).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_uses_its_own_consumers_and_cannot_touch_another_teams() {
    let prefix = unique_name();
    let configs = Configs::new();
    // The CLI's settings carry the deployment's prefix: its entries name
    // the test's subjects and streams.
    let mut cli_settings = Settings::default();
    cli_settings.nats.prefix = prefix.clone();
    let added = configs.consumer(&cli_settings, &["add", "alpha", "--replicas", "2"]).await;
    let added = added.expect("consumer add alpha");
    assert!(added.contains("alpha, alpha-0, alpha-1"), "{added}");
    for file in ["compose/teams/alpha/compose.yaml", "k8s/teams/alpha/statefulset.yaml"] {
        assert!(configs.path("out").join(file).is_file(), "{file} written");
    }
    let values = std::fs::read_to_string(configs.path("values.yaml")).expect("values");
    assert!(values.contains("- user: alpha"), "the Helm values hold the team");

    let env = configs.servers(&prefix).await;
    let base = storage_settings(&env);
    let h = Harness::connect(as_user(&base, "admin")).await.expect("admin sets up the streams");
    let changes = h.subjects.changes_stream();

    // Three changes on the stream, as storage publishes them.
    let (storage, _) =
        client_as(&env.nats, "storage", &password("storage")).await.expect("storage");
    let storage_js = jetstream::new(storage);
    for place in 1..=3 {
        storage_js
            .publish(h.subjects.changes(7, place), "change".into())
            .await
            .expect("publish")
            .await
            .expect("stored");
    }

    // Alpha reads through its replica consumer, with explicit acks.
    let alpha_pw = configs.team_password("alpha");
    let (alpha, alpha_errors) =
        client_as(&env.nats, "alpha", &alpha_pw).await.expect("alpha logs in");
    let alpha_js =
        jetstream::ContextBuilder::new().timeout(Duration::from_secs(2)).build(alpha.clone());
    let alpha_stream = alpha_js.get_stream(&changes).await.expect("alpha reads the stream's info");
    let consumer: consumer::PullConsumer = alpha_stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some("alpha-0".into()),
            filter_subject: h.subjects.changes_all(),
            ack_policy: consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .expect("alpha creates alpha-0");
    let mut batch = consumer.fetch().max_messages(2).messages().await.expect("alpha pulls");
    let first = batch.next().await.expect("a message").expect("message");
    first.double_ack().await.expect("alpha acks");
    let held = batch.next().await.expect("a second message").expect("message");
    let held_reply = held.reply.clone().expect("an ack subject").to_string();
    // Not a name of alpha's, a name beyond its replicas, another service's: refused.
    for name in ["alpha-2", "validator", "beta-0"] {
        let created = alpha_stream
            .create_consumer(consumer::pull::Config {
                durable_name: Some(name.into()),
                ..Default::default()
            })
            .await;
        assert!(created.is_err(), "alpha created {name}");
    }
    let cmd = h.subjects.cmd(Partition(0));
    assert!(
        async { alpha_js.publish(cmd.clone(), "forged".into()).await?.await }.await.is_err(),
        "alpha published a command"
    );
    refused(&alpha_errors, "publish", &cmd).await;

    // Beta, added while NATS runs: a reload, no restart.
    let (watcher, _) = client_as(&env.nats, "admin", &password("admin")).await.expect("admin");
    configs
        .consumer(&cli_settings, &["add", "beta", "--replicas", "1", "--may-publish-commands"])
        .await
        .expect("consumer add beta");
    let beta_pw = configs.team_password("beta");
    let reloaded = Instant::now();
    env.nats.reload_with_config(&configs.authorization(&prefix)).expect("reload");
    let (beta, beta_errors) = loop {
        match client_as(&env.nats, "beta", &beta_pw).await {
            Ok(logged_in) => break logged_in,
            Err(_) if reloaded.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("beta cannot log in 10 s after the reload: {e}"),
        }
    };
    eprintln!("beta logged in {:?} after the reload signal", reloaded.elapsed());
    assert_eq!(watcher.statistics().connects.load(std::sync::atomic::Ordering::Relaxed), 1);
    watcher.flush().await.expect("the admin connection survived the reload");
    let info = alpha_stream.clone().consumer_info("alpha-0").await;
    assert!(info.is_ok(), "alpha's connection survived the reload: {info:?}");

    // Beta may not read the state of, pull from, ack or delete alpha's consumer.
    let api = format!("$JS.API.CONSUMER.INFO.{changes}.alpha-0");
    api_refused(&beta, &beta_errors, &api).await;
    api_refused(&beta, &beta_errors, &format!("$JS.API.CONSUMER.MSG.NEXT.{changes}.alpha-0")).await;
    api_refused(&beta, &beta_errors, &format!("$JS.API.CONSUMER.DELETE.{changes}.alpha-0")).await;
    beta.publish(held_reply.clone(), "+ACK".into()).await.expect("local publish");
    beta.flush().await.expect("flush");
    refused(&beta_errors, "publish", &held_reply).await;
    let beta_js =
        jetstream::ContextBuilder::new().timeout(Duration::from_secs(2)).build(beta.clone());
    let beta_stream = beta_js.get_stream(&changes).await.expect("beta reads the stream's info");
    assert!(beta_stream.clone().delete_consumer("alpha-0").await.is_err(), "beta deleted alpha-0");
    let mut on_alpha_inbox = beta.subscribe("_INBOX_alpha.>").await.expect("local subscribe");
    refused(&beta_errors, "subscription", "_INBOX_alpha.>").await;
    let alpha_state =
        alpha_stream.clone().consumer_info("alpha-0").await.expect("alpha-0 is there");
    assert_eq!(alpha_state.num_ack_pending, 1, "the held message is still alpha's to ack");
    held.ack().await.expect("alpha acks what it holds");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), on_alpha_inbox.next()).await.is_err(),
        "beta heard alpha's replies"
    );

    // Beta uses its own consumer, and may publish commands.
    let beta_consumer: consumer::PullConsumer = beta_stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some("beta-0".into()),
            ..Default::default()
        })
        .await
        .expect("beta creates beta-0");
    let mut beta_batch = beta_consumer.fetch().max_messages(3).messages().await.expect("pull");
    let mut read = 0;
    while let Some(m) = beta_batch.next().await {
        m.expect("message").ack().await.expect("ack");
        read += 1;
    }
    assert_eq!(read, 3, "beta reads every change through its consumer");
    async { beta_js.publish(cmd.clone(), "a command".into()).await?.await }
        .await
        .expect("beta may publish commands");

    // The list, then alpha removed: after a reload alpha cannot log in.
    let listed = configs.consumer(&cli_settings, &["list", "--json"]).await.expect("list");
    let names: Vec<String> = listed
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")["name"].to_string())
        .collect();
    // The deployment's own team (picks) is listed too.
    assert!(names.ends_with(&["\"alpha\"".to_string(), "\"beta\"".to_string()]), "{names:?}");
    configs.consumer(&cli_settings, &["remove", "alpha"]).await.expect("consumer remove alpha");
    assert!(!configs.path("out").join("k8s/teams/alpha").exists(), "its folder is gone");
    env.nats.reload_with_config(&configs.authorization(&prefix)).expect("reload");
    eventually(Duration::from_secs(10), "alpha refused after its removal", || async {
        client_as(&env.nats, "alpha", &alpha_pw).await.is_err()
    })
    .await;
    let listed = configs.consumer(&cli_settings, &["list"]).await.expect("list");
    assert!(listed.contains("beta") && !listed.contains("alpha"), "{listed}");
}

#[tokio::test]
async fn the_cli_refuses_bad_names_and_existing_teams() {
    let configs = Configs::new();
    let settings = Settings::default();
    for bad in ["validator", "Alpha", "al-pha", "x"] {
        let err = configs.consumer(&settings, &["add", bad]).await.expect_err(bad);
        assert!(err.to_string().contains("team name"), "{bad}: {err}");
    }
    configs.consumer(&settings, &["add", "gamma"]).await.expect("add gamma");
    let again = configs.consumer(&settings, &["add", "gamma"]).await.expect_err("twice");
    assert!(again.to_string().contains("--force"), "{again}");
    configs.consumer(&settings, &["add", "gamma", "--force"]).await.expect("--force replaces");
    let conf = std::fs::read_to_string(configs.path("nats.conf")).expect("conf");
    assert_eq!(conf.matches("user: gamma").count(), 1, "replaced, not added twice");
    let missing = configs.consumer(&settings, &["remove", "delta"]).await.expect_err("no delta");
    assert!(missing.to_string().contains("not found") || missing.to_string().contains("delta"));
}

/// The picks template (the Rust kit's ChangeFeed) as replica 0 of the team
/// `picks`, under the user `shelfsync consumer add picks` creates: the
/// keyframe bootstrap (request, direct gets), its consumer `picks-0`, live
/// changes — everything the kit does is within the team's rights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picks_template_runs_under_its_team_user() {
    let prefix = unique_name();
    let configs = Configs::new();
    let mut cli_settings = Settings::default();
    cli_settings.nats.prefix = prefix.clone();
    // picks is a team of the shipped config already: --force gives it a password.
    let add = ["add", "picks", "--replicas", "2", "--force"];
    configs.consumer(&cli_settings, &add).await.expect("add picks");
    let env = configs.servers(&prefix).await;
    let base = storage_settings(&env);
    let h = Harness::connect(as_user(&base, "admin")).await.expect("admin sets up the streams");
    let _storage = InProcessStorage::start(as_user(&base, "storage")).await.expect("storage");
    h.send(vec![patch(7, 1, "sku-1", &discounted("Roses", 80, 100), 0)]).await.expect("import");
    h.wait_settled().await;

    let settings = with_user(&base, "picks", &configs.team_password("picks"));
    let (_, errors) =
        client_as(&env.nats, "picks", &configs.team_password("picks")).await.expect("login");
    let app = shelfsync_picks::App::build_replica(settings, "127.0.0.1:0", Some(1))
        .await
        .expect("picks builds");
    assert_eq!(app.consumer(), "picks-1");
    let (addr, picks) = (app.http_addr(), app.picks());
    let _running = spawn(app);
    eventually(Duration::from_secs(30), "picks bootstrapped under its team user", || async {
        http_get(addr, "/readyz").await.is_ok_and(|(s, _)| s == 200)
    })
    .await;
    h.send(vec![patch(7, 1, "sku-2", &discounted("Tulips", 50, 90), 1)]).await.expect("live");
    eventually(Duration::from_secs(20), "a live change reached picks", || async {
        picks.of_place(shelfsync_feed::PlaceKey::new(7, 1)).len() == 2
    })
    .await;
    assert!(errors.lock().expect("lock").is_empty(), "violations: {errors:?}");
}

/// The recommender's NATS user names its consumers one by one too: each
/// running instance takes the first free of `recommender-0` … `-31`, frees
/// it when it stops, and may not touch a team's consumer or any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recommenders_take_their_own_consumer_names_and_touch_no_team_consumer() {
    let prefix = unique_name();
    let configs = Configs::new();
    let env = configs.servers(&prefix).await;
    let mut base = storage_settings(&env);
    base.recommender.http_listen = "127.0.0.1:0".into();
    let h = Harness::connect(as_user(&base, "admin")).await.expect("admin sets up the streams");
    let _storage = InProcessStorage::start(as_user(&base, "storage")).await.expect("storage");
    h.send(vec![patch(7, 1, "sku-1", &discounted("Roses", 80, 100), 0)]).await.expect("import");
    h.wait_settled().await;
    let changes = h.subjects.changes_stream();
    let (admin, _) = client_as(&env.nats, "admin", &password("admin")).await.expect("admin");
    let stream = jetstream::new(admin).get_stream(&changes).await.expect("the change stream");
    let consumers = || {
        let stream = stream.clone();
        async move {
            let mut names: Vec<String> =
                stream.consumer_names().filter_map(|n| async { n.ok() }).collect().await;
            names.sort();
            names
        }
    };
    let base = &base;
    let start = move || async move {
        let app = shelfsync_recommender::App::build(as_user(base, "recommender"))
            .await
            .expect("recommender builds");
        let status = app.status();
        let running = spawn(app);
        eventually(Duration::from_secs(30), "a recommender bootstrapped", || async {
            status.is_bootstrapped()
        })
        .await;
        running
    };

    let first = start().await;
    let second = start().await;
    assert_eq!(consumers().await, ["recommender-0", "recommender-1"]);
    first.stop().await.expect("the first recommender stops");
    assert_eq!(consumers().await, ["recommender-1"], "a stopped instance frees its name");
    let third = start().await;
    assert_eq!(consumers().await, ["recommender-0", "recommender-1"], "the freed name is taken");

    // A team's consumer, or a name that is not one of the slots: refused.
    let (rec, rec_errors) =
        client_as(&env.nats, "recommender", &password("recommender")).await.expect("login");
    let filter = h.subjects.changes_all();
    for name in ["picks-0", "picks", "recommender-32", "recommender"] {
        for api in [
            format!("$JS.API.CONSUMER.CREATE.{changes}.{name}.{filter}"),
            format!("$JS.API.CONSUMER.INFO.{changes}.{name}"),
            format!("$JS.API.CONSUMER.MSG.NEXT.{changes}.{name}"),
            format!("$JS.API.CONSUMER.DELETE.{changes}.{name}"),
        ] {
            api_refused(&rec, &rec_errors, &api).await;
        }
    }
    second.stop().await.expect("stops");
    third.stop().await.expect("stops");
    assert!(consumers().await.is_empty(), "every instance freed its name");
}

/// A visible, in-stock offer priced below its old price.
fn discounted(title: &str, price: i64, old_price: i64) -> shelfsync_proto::Product {
    shelfsync_proto::Product { old_price: Some(old_price), ..product(title, price, 5) }
}
