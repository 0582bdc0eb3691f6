//! The control subjects storage answers (protobuf request/reply, every
//! replica answering for its own partitions), each on one
//! [`serve_requests`] loop:
//!
//! - `<prefix>.ctl.keyframe`: keyframe the owned places, reply when done;
//! - `<prefix>.ctl.rebase`: refused partitions adopt the stream they found
//!   (or drop a half-applied message's step);
//! - `<prefix>.ctl.redrive`: outbox entries kept aside go back.

use std::future::Future;
use std::sync::Arc;

use futures::StreamExt;
use prost::Message;
use shelfsync_bus::{Partition, Subjects};
use shelfsync_proto::{
    KeyframeReply, KeyframeRequest, PlaceKey, RebaseReply, RebaseRequest, RedriveReply,
    RedriveRequest,
};
use shelfsync_service::Drain;
use shelfsync_telemetry::chain;
use tracing::{error, info, warn};

use crate::keyframe::{Keyframer, keyframe_id_at};
use crate::readiness::{PartitionHealth, Refusal};
use crate::store::Store;

/// Answers the requests of one control subject until `stop`: each request
/// with a reply subject is decoded and goes to `handle`, and what it answers
/// (if anything: a handler may reply later by itself) is published as the
/// reply; a request that does not decode is answered with `bad`. `what`
/// names the requests in logs.
async fn serve_requests<Req, Rep, Fut>(
    client: async_nats::Client,
    subject: String,
    what: &'static str,
    stop: Drain,
    bad: impl Fn(prost::DecodeError) -> Rep,
    mut handle: impl FnMut(Req, async_nats::Subject) -> Fut,
) where
    Req: Message + Default,
    Rep: Message,
    Fut: Future<Output = Option<Rep>>,
{
    let mut sub = match client.subscribe(subject).await {
        Ok(s) => s,
        Err(e) => {
            error!(error = %chain(&e), "cannot subscribe to {what} requests");
            return;
        }
    };
    loop {
        let msg = tokio::select! {
            m = sub.next() => match m { Some(m) => m, None => return },
            _ = stop.started() => return,
        };
        let Some(reply_to) = msg.reply.clone() else { continue };
        let reply = match Req::decode(msg.payload) {
            Ok(req) => handle(req, reply_to.clone()).await,
            Err(e) => Some(bad(e)),
        };
        let Some(reply) = reply else { continue };
        if let Err(e) = client.publish(reply_to, reply.encode_to_vec().into()).await {
            warn!(error = %chain(&e), "cannot reply to a {what} request");
        }
    }
}

/// Answers `KeyframeRequest`s on `<prefix>.ctl.keyframe`: every replica
/// keyframes the places it owns and replies when done.
pub(crate) async fn serve_keyframe_requests(
    client: async_nats::Client,
    subjects: Subjects,
    keyframer: Keyframer,
    stop: Drain,
) {
    let bad =
        |e| KeyframeReply { error: format!("bad KeyframeRequest: {e}"), ..Default::default() };
    let replier = client.clone();
    let handle = |req, reply_to| {
        let (keyframer, client) = (keyframer.clone(), replier.clone());
        async move {
            start_keyframe(&keyframer, client, req, reply_to).await;
            None
        }
    };
    serve_requests(client, subjects.ctl_keyframe(), "keyframe", stop, bad, handle).await;
}

/// Starts the keyframe a request asks for; the reply goes out when it is
/// done, while the next requests are served.
async fn start_keyframe(
    keyframer: &Keyframer,
    client: async_nats::Client,
    req: KeyframeRequest,
    reply_to: async_nats::Subject,
) {
    let id = if req.keyframe_id.is_empty() {
        keyframe_id_at(chrono::Utc::now().timestamp_micros())
    } else {
        req.keyframe_id.clone()
    };
    let place = (req.brand_id != 0 || req.place_id != 0)
        .then_some(PlaceKey::new(req.brand_id, req.place_id));
    let Some(done) = keyframer.start(id, place).await else { return };
    tokio::spawn(async move {
        match done.await {
            Ok(reply) => {
                if let Err(e) = client.publish(reply_to, reply.encode_to_vec().into()).await {
                    warn!(error = %chain(&e), "cannot reply to keyframe request");
                }
            }
            Err(_) => warn!("keyframe abandoned before completion"),
        }
    });
}

/// Answers `RebaseRequest`s on `<prefix>.ctl.rebase`: the partitions of
/// this replica refused because their command stream was replaced adopt the
/// stream they found, with the applied sequence asked; their workers resume
/// within a few seconds. Every replica replies.
pub(crate) async fn serve_rebase_requests(
    client: async_nats::Client,
    subjects: Subjects,
    store: Store,
    ready: Arc<PartitionHealth>,
    replica: u32,
    stop: Drain,
) {
    let bad =
        |e| RebaseReply { replica, error: format!("bad RebaseRequest: {e}"), ..Default::default() };
    let handle = |req: RebaseRequest, _| {
        let (store, ready) = (store.clone(), ready.clone());
        async move { Some(rebase_refused(&store, &ready, replica, &req).await) }
    };
    serve_requests(client, subjects.ctl_rebase(), "rebase", stop, bad, handle).await;
}

/// Re-bases the refused partitions `req` names (all when it names none).
async fn rebase_refused(
    store: &Store,
    ready: &PartitionHealth,
    replica: u32,
    req: &RebaseRequest,
) -> RebaseReply {
    let mut reply = RebaseReply { replica, ..Default::default() };
    for (p, why) in ready.refused() {
        if !req.partitions.is_empty() && !req.partitions.contains(&p) {
            reply.refused.push(p);
            continue;
        }
        let done = match &why {
            Refusal::StreamReplaced { found } => {
                store.rebase(Partition(p), found, req.applied_seq).await.map(|()| {
                    info!(partition = p, stream = %found, applied = req.applied_seq, "partition re-based by an operator");
                    true
                })
            }
            // Only when asked: what was left of the message is dropped.
            Refusal::StepGone { step } if req.drop_step => {
                store.drop_step(Partition(p), step).await.inspect(|&dropped| {
                    if dropped {
                        info!(partition = p, step, "half-applied message's step dropped by an operator");
                    }
                })
            }
            Refusal::StepGone { .. } => Ok(false),
        };
        match done {
            Ok(true) => reply.rebased.push(p),
            Ok(false) => reply.refused.push(p),
            Err(e) => {
                reply.error = format!("partition {p}: {e}");
                reply.refused.push(p);
            }
        }
    }
    reply
}

/// Answers `RedriveRequest`s on `<prefix>.ctl.redrive`: outbox entries of
/// this replica's partitions kept aside as unpublishable go back into their
/// outboxes; each partition's worker relays them with its next message (or
/// at its next start).
pub(crate) async fn serve_redrive_requests(
    client: async_nats::Client,
    subjects: Subjects,
    store: Store,
    replica: u32,
    owned: Vec<u32>,
    stop: Drain,
) {
    let bad = |e| RedriveReply {
        replica,
        error: format!("bad RedriveRequest: {e}"),
        ..Default::default()
    };
    let owned: Arc<[u32]> = owned.into();
    let handle = |req: RedriveRequest, _| {
        let (store, owned) = (store.clone(), owned.clone());
        async move { Some(redrive_owned(&store, &owned, replica, &req).await) }
    };
    serve_requests(client, subjects.ctl_redrive(), "redrive", stop, bad, handle).await;
}

/// Puts back the dead outbox entries `req` names, in the owned partitions it
/// names (all when it names none).
async fn redrive_owned(
    store: &Store,
    owned: &[u32],
    replica: u32,
    req: &RedriveRequest,
) -> RedriveReply {
    let mut reply = RedriveReply { replica, ..Default::default() };
    for &p in owned.iter().filter(|p| req.partitions.is_empty() || req.partitions.contains(p)) {
        match store.redrive(Partition(p), &req.msg_ids).await {
            Ok(n) => {
                if n > 0 {
                    info!(partition = p, entries = n, "outbox entries put back by an operator");
                }
                reply.redriven += n;
            }
            Err(e) => reply.error = format!("partition {p}: {e}"),
        }
    }
    reply
}
