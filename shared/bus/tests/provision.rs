//! Stream provisioning against a real nats-server: what each stream does
//! once it reaches its size limit.

use async_nats::jetstream::{self, stream::DiscardPolicy};
use shelfsync_bus::{BusError, Difference, Subjects, provision, stream_configs, verify};
use shelfsync_settings::Settings;
use shelfsync_testkit::{NatsServer, unique_name};

fn settings(prefix: &str) -> Settings {
    let mut s = Settings::default();
    s.nats.prefix = prefix.to_string();
    s.storage.partitions = 4;
    s
}

async fn connect(server: &NatsServer) -> anyhow::Result<jetstream::Context> {
    let client = async_nats::connect(format!("nats://127.0.0.1:{}", server.port())).await?;
    Ok(jetstream::new(client))
}

/// Publishes `count` messages of `size` bytes to `subject`; returns how many
/// JetStream acknowledged before the first refusal, and that refusal.
async fn publish_until_refused(
    js: &jetstream::Context,
    subject: &str,
    count: usize,
    size: usize,
) -> anyhow::Result<(usize, Option<String>)> {
    let payload = bytes::Bytes::from(vec![b'x'; size]);
    for i in 0..count {
        let ack = js.publish(subject.to_string(), payload.clone()).await?;
        if let Err(e) = ack.await {
            return Ok((i, Some(e.to_string())));
        }
    }
    Ok((count, None))
}

#[test]
fn every_stream_has_a_size_limit_and_a_discard_policy() {
    let mut s = settings("p");
    s.nats.cmd_max_bytes = 1 << 20;
    s.nats.changes_max_bytes = 2 << 20;
    s.nats.keyframes_max_bytes = 0;
    let by_name: std::collections::HashMap<String, (i64, DiscardPolicy)> =
        stream_configs(&s.nats, s.topology())
            .into_iter()
            .map(|c| (c.name, (c.max_bytes, c.discard)))
            .collect();
    let subjects = Subjects::new("p");
    assert_eq!(by_name[&subjects.cmd_stream()], (1 << 20, DiscardPolicy::New));
    assert_eq!(by_name[&subjects.changes_stream()], (2 << 20, DiscardPolicy::Old));
    // 0 in the settings is JetStream's "unlimited".
    assert_eq!(by_name[&subjects.keyframes_stream()], (-1, DiscardPolicy::New));
    assert_eq!(by_name[&subjects.aggregates_stream()].1, DiscardPolicy::Old);
    assert_eq!(by_name[&subjects.rejects_stream()].1, DiscardPolicy::Old);
    // The command stream is never unlimited unless asked for.
    let d = stream_configs(&Settings::default().nats, Settings::default().topology());
    assert_eq!(d[0].max_bytes, 1 << 30);
}

#[tokio::test]
async fn a_full_command_stream_refuses_new_commands_and_keeps_the_queued_ones() -> anyhow::Result<()>
{
    let server = NatsServer::start().await?;
    let js = connect(&server).await?;
    let mut s = settings(&unique_name());
    s.nats.cmd_max_bytes = 64 * 1024;
    provision(&js, &s.nats, s.topology()).await?;
    let subjects = Subjects::new(&s.nats.prefix);

    let (accepted, refused) =
        publish_until_refused(&js, &format!("{}.cmd.0", s.nats.prefix), 200, 1024).await?;
    let refused = refused.expect("200 KiB of commands went into a 64 KiB stream");
    assert!(accepted > 0 && accepted < 64, "{accepted} accepted");
    assert!(refused.to_lowercase().contains("maximum bytes"), "{refused}");
    // Nothing queued was dropped to make room.
    let info = js.get_stream(subjects.cmd_stream()).await?.info().await?.clone();
    assert_eq!(info.state.first_sequence, 1);
    assert_eq!(info.state.messages, accepted as u64);
    Ok(())
}

#[tokio::test]
async fn a_full_change_log_drops_its_oldest_messages() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let js = connect(&server).await?;
    let mut s = settings(&unique_name());
    s.nats.changes_max_bytes = 64 * 1024;
    provision(&js, &s.nats, s.topology()).await?;
    let subjects = Subjects::new(&s.nats.prefix);

    let subject = format!("{}.changes.7.42", s.nats.prefix);
    let (accepted, refused) = publish_until_refused(&js, &subject, 200, 1024).await?;
    assert_eq!((accepted, refused), (200, None), "a change log must never refuse storage");
    let info = js.get_stream(subjects.changes_stream()).await?.info().await?.clone();
    assert_eq!(info.state.last_sequence, 200);
    assert!(info.state.first_sequence > 1, "the oldest changes made room");
    assert!(info.state.bytes <= 64 * 1024);
    Ok(())
}

#[tokio::test]
async fn provisioning_again_applies_new_limits_to_existing_streams() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let js = connect(&server).await?;
    let mut s = settings(&unique_name());
    s.nats.cmd_max_bytes = 0;
    provision(&js, &s.nats, s.topology()).await?;
    let subjects = Subjects::new(&s.nats.prefix);
    let cmd = js.get_stream(subjects.cmd_stream()).await?.info().await?.config.clone();
    assert_eq!(cmd.max_bytes, -1);

    s.nats.cmd_max_bytes = 8 * 1024 * 1024;
    s.nats.rejects_max_bytes = 1024 * 1024;
    provision(&js, &s.nats, s.topology()).await?;
    let cmd = js.get_stream(subjects.cmd_stream()).await?.info().await?.config.clone();
    assert_eq!((cmd.max_bytes, cmd.discard), (8 * 1024 * 1024, DiscardPolicy::New));
    let rejects = js.get_stream(subjects.rejects_stream()).await?.info().await?.config.clone();
    assert_eq!((rejects.max_bytes, rejects.discard), (1024 * 1024, DiscardPolicy::Old));
    Ok(())
}

#[tokio::test]
async fn verify_names_every_difference_and_asks_for_setup() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let js = connect(&server).await?;
    let mut s = settings(&unique_name());
    // Nothing provisioned yet: every stream is missing.
    let err = verify(&js, &s.nats, s.topology()).await.expect_err("no streams");
    let BusError::Mismatch(found) = &err else { panic!("{err}") };
    assert_eq!(found.len(), 5, "{err}");
    assert!(found.iter().all(|d| matches!(d, Difference::Missing { .. })), "{err}");
    assert!(err.to_string().contains("shelfsync setup"), "{err}");

    provision(&js, &s.nats, s.topology()).await?;
    verify(&js, &s.nats, s.topology()).await?;

    // Settings that disagree with what setup wrote: each difference named.
    s.nats.cmd_max_bytes = 2 << 20;
    s.nats.duplicate_window = std::time::Duration::from_secs(7);
    s.storage.partitions = 8;
    let err = verify(&js, &s.nats, s.topology()).await.expect_err("differs");
    let text = err.to_string();
    let cmd = Subjects::new(&s.nats.prefix).cmd_stream();
    for part in [
        format!("stream {cmd}: max_bytes is 1073741824, the settings say 2097152"),
        format!(
            "stream {cmd}: partitions (metadata shelfsync.partitions) is 4, the settings say 8"
        ),
        "duplicate_window is 120s, the settings say 7s".to_string(),
        "run `shelfsync setup`".to_string(),
    ] {
        assert!(text.contains(&part), "{part:?} missing from: {text}");
    }
    // Verifying wrote nothing.
    let cmd_config = js.get_stream(&cmd).await?.info().await?.config.clone();
    assert_eq!(cmd_config.max_bytes, 1 << 30);
    Ok(())
}

/// The command stream refuses a message within `CMD_HEADROOM` of the
/// server's payload limit, so that a dead-lettered command message always
/// travels whole in its rejection; what producers send
/// (`command_bytes_limit`) goes through.
#[tokio::test]
async fn the_command_stream_leaves_room_under_the_payload_limit_for_its_dead_letters() {
    let server = NatsServer::start_with_config("max_payload: 131072").await.expect("nats");
    let js = connect(&server).await.expect("connect");
    let prefix = unique_name();
    let s = settings(&prefix);
    provision(&js, &s.nats, s.topology()).await.expect("provision");
    let subjects = Subjects::new(&prefix);
    let mut stream = js.get_stream(subjects.cmd_stream()).await.expect("CMD");
    let info = stream.info().await.expect("info");
    assert_eq!(info.config.max_message_size, shelfsync_bus::cmd_max_message_size(131_072));
    let subject = subjects.cmd(shelfsync_bus::Partition(0));
    let limit = shelfsync_bus::command_bytes_limit(131_072);
    assert_eq!(publish_until_refused(&js, &subject, 1, limit).await.unwrap().0, 1);
    let over = 131_072 - shelfsync_bus::CMD_HEADROOM + 1;
    let (stored, refusal) = publish_until_refused(&js, &subject, 1, over).await.unwrap();
    assert_eq!(stored, 0, "a message in the headroom is refused");
    assert!(refusal.is_some_and(|e| e.contains("maximum")), "refused for its size");
}
