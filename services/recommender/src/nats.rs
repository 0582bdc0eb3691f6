//! The NATS request/reply API: `TopRequest` → `TopReply` on
//! `<prefix>.recommend.top`, queue group `recommender` so that one replica
//! answers each request.
//!
//! A replica joins the queue group only once its index is bootstrapped (the
//! NATS counterpart of `/readyz`): requests go to replicas that can answer,
//! and a client sees "no responders" rather than a partial answer when none
//! can. It leaves the group first on shutdown.

use std::time::Duration;

use futures::StreamExt;
use prost::Message;
use shelfsync_proto::{TopReply, TopRequest};
use shelfsync_service::Drain;
use shelfsync_telemetry::chain;
use tracing::{error, info, warn};

use crate::metrics::{self, Transport};
use crate::query::Api;

pub const QUEUE_GROUP: &str = "recommender";

/// Serves `subject` until the drain starts.
pub async fn serve(api: Api, client: async_nats::Client, subject: String, drain: Drain) {
    while !api.ready() {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            _ = drain.started() => return,
        }
    }
    let mut sub = match client.queue_subscribe(subject.clone(), QUEUE_GROUP.into()).await {
        Ok(s) => s,
        Err(e) => {
            error!(error = %chain(&e), subject = %subject, "cannot subscribe to the query subject");
            return;
        }
    };
    info!(subject = %subject, queue = QUEUE_GROUP, "answering top-N requests");
    loop {
        let msg = tokio::select! {
            m = sub.next() => match m { Some(m) => m, None => break },
            _ = drain.started() => break,
        };
        let Some(reply_to) = msg.reply else { continue };
        // Answered inline: a query holds the read lock for microseconds.
        let reply = match TopRequest::decode(msg.payload.as_ref()) {
            Ok(req) => api.answer(req),
            Err(e) => {
                metrics::query(Transport::Nats);
                metrics::rejected();
                TopReply { items: Vec::new(), error: format!("not a TopRequest: {e}") }
            }
        };
        if let Err(e) = client.publish(reply_to, reply.encode_to_vec().into()).await {
            warn!(error = %chain(&e), "cannot send a top-N reply");
        }
    }
    let _ = sub.unsubscribe().await;
}
