//! Requests to storage over core NATS, the two shapes the verbs use: one
//! question to any replica (the read API, a queue group), and one request
//! every replica answers (`ctl.*`). Failures come back as [`CliError`]s so
//! that the exit code says whether storage was away, slow or refused.

use std::io::Write as _;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::{Message, StatusCode};
use futures::StreamExt;

use crate::CliError;
use crate::error::request_failed;

/// Asks any storage replica on `subject` and returns its reply.
pub async fn ask(
    client: &async_nats::Client,
    subject: String,
    payload: Vec<u8>,
) -> anyhow::Result<Message> {
    let msg = client
        .request(subject.clone(), payload.into())
        .await
        .map_err(|e| request_failed(e, &subject, "storage replica"))?;
    if msg.status == Some(StatusCode::NO_RESPONDERS) {
        return Err(no_storage(&subject).into());
    }
    Ok(msg)
}

/// The `error` of a storage reply as a [`CliError`]: storage could not
/// reach Redis (unavailable), or it refused the request (bad input).
pub fn refused(error: &str) -> anyhow::Error {
    let message = format!("storage: {error}");
    if error.starts_with("storage unavailable") {
        CliError::Unavailable(message).into()
    } else {
        CliError::BadInput(message).into()
    }
}

fn no_storage(subject: &str) -> CliError {
    CliError::Unavailable(format!(
        "no storage replica is listening on {subject} (is storage running?)"
    ))
}

/// Sends one request every storage replica answers, and hands each reply
/// to `on_reply` as it comes, until `expected` replies came or `timeout`
/// passed. Returns how many came; fewer than `expected` is for the caller
/// to report (see [`missing_replies`]).
pub async fn gather(
    client: &async_nats::Client,
    subject: String,
    payload: Vec<u8>,
    expected: usize,
    timeout: Duration,
    mut on_reply: impl FnMut(Message) -> anyhow::Result<()>,
) -> anyhow::Result<usize> {
    let inbox = client.new_inbox();
    let mut replies =
        client.subscribe(inbox.clone()).await.context("cannot subscribe to the reply inbox")?;
    client
        .publish_with_reply(subject.clone(), inbox, payload.into())
        .await
        .with_context(|| format!("cannot publish the request on {subject}"))?;
    client.flush().await.context("cannot flush the request")?;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut got = 0;
    while got < expected {
        let msg = match tokio::time::timeout_at(deadline, replies.next()).await {
            Ok(Some(msg)) => msg,
            Ok(None) => {
                return Err(CliError::Unavailable(
                    "the NATS connection closed while waiting for replies".into(),
                )
                .into());
            }
            Err(_) => break,
        };
        if msg.status == Some(StatusCode::NO_RESPONDERS) {
            return Err(no_storage(&subject).into());
        }
        got += 1;
        on_reply(msg)?;
    }
    Ok(got)
}

/// A `ctl.*` request every storage replica answers: sends `request` on
/// `subject`, decodes each reply as `R` and hands it to `on_reply` as it
/// comes; an error (exit 4) when fewer than `storage.replicas` replied
/// within `timeout`. What a reply means is for `on_reply`.
pub async fn ask_every_replica<R: prost::Message + Default>(
    ctx: &crate::Context,
    subject: String,
    request: &impl prost::Message,
    timeout: Duration,
    mut on_reply: impl FnMut(R) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let client = ctx.nats().await?;
    let expected = ctx.settings.storage.replicas as usize;
    let name = std::any::type_name::<R>().rsplit("::").next().unwrap_or("reply");
    let got = gather(&client, subject, request.encode_to_vec(), expected, timeout, |msg| {
        let reply = R::decode(msg.payload.as_ref())
            .with_context(|| format!("a storage replica sent an undecodable {name}"))?;
        on_reply(reply)
    })
    .await?;
    if got < expected {
        return Err(missing_replies(got, expected, timeout));
    }
    Ok(())
}

/// [`ask_every_replica`], printing each reply on a line of stdout as it comes
/// (`render` of it); returns how many replies `failed`.
pub async fn print_every_reply<R: prost::Message + Default>(
    ctx: &crate::Context,
    subject: String,
    request: &impl prost::Message,
    timeout: Duration,
    failed: impl Fn(&R) -> bool,
    mut render: impl FnMut(&R) -> String,
) -> anyhow::Result<usize> {
    let mut out = std::io::stdout();
    let mut failures = 0;
    ask_every_replica(ctx, subject, request, timeout, |reply: R| {
        failures += usize::from(failed(&reply));
        writeln!(out, "{}", render(&reply))?;
        out.flush()?;
        Ok(())
    })
    .await?;
    Ok(failures)
}

/// The error when fewer replicas answered than `storage.replicas` says.
pub fn missing_replies(got: usize, expected: usize, timeout: Duration) -> anyhow::Error {
    CliError::Timeout(format!(
        "{got} of {expected} storage replicas answered within {} (storage.replicas = {expected})",
        humantime::format_duration(timeout)
    ))
    .into()
}
