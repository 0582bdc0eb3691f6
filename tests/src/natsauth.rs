//! NATS with the deployment's own users and permissions: compose's
//! nats.conf turned into a test server's config, clients logged in as one
//! of its users, and the server's refusals (permission violations) seen
//! from the client.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use shelfsync_bus::Subjects;
use shelfsync_settings::Settings;
use shelfsync_testkit::{NatsServer, eventually};

/// The file every deployment's NATS users come from.
pub const COMPOSE_NATS_CONF: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../compose/nats/nats.conf");

/// `conf` (a nats.conf as compose ships it) from its `authorization` block
/// on — the users' permissions and accounts — for the test prefix `prefix`,
/// with each `$NATS_<USER>_PASSWORD` replaced by `password(user)`, and the
/// account's JetStream limit cut to what a test server has.
pub fn authorization(conf: &str, prefix: &str, password: impl Fn(&str) -> String) -> String {
    let start = conf.find("authorization {").expect("an authorization block");
    let stream_prefix = Subjects::new(prefix).cmd_stream().trim_end_matches("_CMD").to_string();
    let mut block = conf[start..]
        .replace("shelfsync.", &format!("{prefix}."))
        .replace("SHELFSYNC_", &format!("{stream_prefix}_"));
    while let Some(at) = block.find("$NATS_") {
        let end = at + block[at..].find("_PASSWORD").expect("$NATS_<USER>_PASSWORD") + 9;
        let user = block[at + 6..end - 9].to_lowercase();
        block.replace_range(at..end, &format!("\"{}\"", password(&user)));
    }
    // The account's JetStream limit must fit in the test server's (4 GB); the
    // streams of a test reserve 1 GiB (the command stream's default limit).
    block
        .lines()
        .map(|l| if l.trim_start().starts_with("max_file:") { "max_file: 3GiB" } else { l })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The password the tests give a service user of the deployment's config.
pub fn password(user: &str) -> String {
    format!("pw-{user}-s3cret")
}

/// `settings` logged in as `user` with `password`, receiving replies on
/// `_INBOX_<user>` (the only inboxes the user may subscribe to).
pub fn with_user(settings: &Settings, user: &str, password: &str) -> Settings {
    let mut s = settings.clone();
    s.nats.user = Some(user.into());
    s.nats.password = Some(password.into());
    s.nats.inbox_prefix = format!("_INBOX_{user}");
    s
}

/// `settings` as the service user `user`, with its test [`password`].
pub fn as_user(settings: &Settings, user: &str) -> Settings {
    with_user(settings, user, &password(user))
}

/// What the server told a client it refused (lower-cased).
pub type Refusals = Arc<Mutex<Vec<String>>>;

/// A client of `user` (replies on `_INBOX_<user>`) whose server errors are
/// kept.
pub async fn client_as(
    nats: &NatsServer,
    user: &str,
    password: &str,
) -> Result<(async_nats::Client, Refusals), async_nats::ConnectError> {
    let errors = Refusals::default();
    let sink = errors.clone();
    let client = async_nats::ConnectOptions::new()
        .user_and_password(user.into(), password.into())
        .custom_inbox_prefix(format!("_INBOX_{user}"))
        .max_reconnects(Some(1))
        .event_callback(move |event| {
            let sink = sink.clone();
            async move {
                if let async_nats::Event::ServerError(e) = event {
                    sink.lock().expect("lock").push(e.to_string().to_lowercase());
                }
            }
        })
        .connection_timeout(Duration::from_secs(2))
        .connect(nats.url())
        .await?;
    Ok((client, errors))
}

/// Waits until the server has refused `what` ("publish", "subscription") on
/// `subject`.
pub async fn refused(errors: &Refusals, what: &str, subject: &str) {
    let needle = format!("permissions violation for {what} to \"{}\"", subject.to_lowercase());
    eventually(Duration::from_secs(5), &format!("the server to refuse: {needle}"), || async {
        errors.lock().expect("lock").iter().any(|e| e.contains(&needle))
    })
    .await;
}
